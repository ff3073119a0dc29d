"""Forced routing, a benchmark feature: experts chosen from a recorded trace instead of the router.

A random-weight checkpoint routes like no real model does (its routers are noise), so a cache
benchmark on one would measure the wrong access pattern. With ``--force-routing TRACE`` the
compute process still runs the model's router (its cost stays real) but then replaces
``top_k_index`` and ``top_k_weights`` with the trace's ``expert_ids`` / ``gate_weights``, so the
experts fetched, cached and computed are those a real model used. Outputs are then not the
model's own: never use this for serving.

Which trace row a forward takes::

    trace request r (decode rows only: req_offsets[r] + decode_start[r] .. req_offsets[r + 1])
    forward 0 (prefill, P prompt tokens) ─▶ row 0 for every prompt token (the trace records no prefill)
    forward i (feeds generated token i-1) ─▶ row i, wrapping to row 0 past the request's last row
    trace layer j ─▶ the model's j-th MoE layer (manifest ``moe_layers[j]``)

Each new Generate takes the next trace request, starting at ``--force-routing-request N`` and
wrapping after the last one; requests batched together each follow their own trace request. The trace's layers, experts and top-k must equal the model's; a
mismatch stops the process at start-up with both shapes named.

Layer-ahead under forced routing: the next layer's router still runs, but it predicts what the
random router would pick, which says nothing of the trace. The prediction sent to the daemon is
therefore modelled: each of the trace's top-k experts of the next layer is kept with probability
``layer_ahead_accuracy`` (a stated parameter, seeded per request, step and layer) and otherwise
replaced by the router's highest-scored expert outside the trace's set — the same model of
layer-ahead the trace replay uses (DESIGN §7), made concrete in a real process.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from compute_svc.errors import InvalidArgument
from compute_svc.layer_ahead import Prediction

logger = logging.getLogger(__name__)

_KEYS = ("expert_ids", "gate_weights", "req_offsets")


@dataclass(frozen=True)
class RoutingTrace:
    """A routing trace in the shared format (``/work/shared/traces/README.md``)."""

    path: str
    expert_ids: np.ndarray  # [rows, layers, top_k] int8/int16
    gate_weights: np.ndarray  # [rows, layers, top_k] float16/float32
    req_offsets: np.ndarray  # [requests + 1] int64
    decode_start: np.ndarray  # [requests] int32: first decode row within each request
    num_experts: int

    @property
    def num_layers(self) -> int:
        return int(self.expert_ids.shape[1])

    @property
    def top_k(self) -> int:
        return int(self.expert_ids.shape[2])

    @property
    def num_requests(self) -> int:
        return len(self.req_offsets) - 1

    def decode_rows(self, request: int) -> tuple[int, int]:
        """[start, end) rows of ``request``'s decode tokens."""
        start = int(self.req_offsets[request]) + int(self.decode_start[request])
        return start, int(self.req_offsets[request + 1])

    def shape_text(self) -> str:
        return f"{self.num_layers} MoE layers x {self.num_experts} experts, top-{self.top_k}"


def load_trace(path: str | Path) -> RoutingTrace:
    """Read ``path`` (.npz, no pickles); ``InvalidArgument`` names the file and what is wrong."""
    path = Path(path)
    try:
        z = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise InvalidArgument(f"force_routing_path {str(path)!r} does not exist") from None
    except (OSError, ValueError) as exc:
        raise InvalidArgument(
            f"force_routing_path {str(path)!r} is not a routing trace (.npz): {exc}"
        ) from None
    with z:
        missing = [k for k in _KEYS if k not in z.files]
        if missing:
            raise InvalidArgument(f"routing trace {path} lacks {missing} (has {sorted(z.files)})")
        expert_ids = z["expert_ids"]
        gate_weights = z["gate_weights"]
        offsets = z["req_offsets"].astype(np.int64)
        requests = len(offsets) - 1
        decode_start = (
            z["decode_start"].astype(np.int64) if "decode_start" in z.files else np.zeros(requests, np.int64)
        )
        meta = json.loads(str(z["meta_json"])) if "meta_json" in z.files else {}
    if expert_ids.ndim != 3 or gate_weights.shape != expert_ids.shape:
        raise InvalidArgument(
            f"routing trace {path}: expert_ids {expert_ids.shape} and gate_weights {gate_weights.shape} "
            "must both be [tokens, layers, top_k]"
        )
    if requests < 1 or offsets[0] != 0 or offsets[-1] != len(expert_ids) or np.any(np.diff(offsets) < 0):
        raise InvalidArgument(f"routing trace {path}: req_offsets do not split its {len(expert_ids)} rows")
    num_experts = int(meta.get("num_experts", int(expert_ids.max()) + 1 if expert_ids.size else 0))
    trace = RoutingTrace(str(path), expert_ids, gate_weights, offsets, decode_start, num_experts)
    if not any(trace.decode_rows(r)[1] > trace.decode_rows(r)[0] for r in range(requests)):
        raise InvalidArgument(f"routing trace {path} has no decode rows")
    return trace


class ForcedRouting:
    """Replaces the router's choice by the trace's, per (request, forward of the request, MoE layer).

    Used from the generation thread only. ``begin_request`` gives a request the next trace request.
    """

    def __init__(
        self,
        trace: RoutingTrace,
        moe_layers: Sequence[int],
        num_experts: int,
        top_k: int,
        *,
        first_request: int = 0,
        layer_ahead_accuracy: float = 1.0,
        seed: int = 0,
    ) -> None:
        model_shape = f"{len(moe_layers)} MoE layers x {num_experts} experts, top-{top_k}"
        if (trace.num_layers, trace.num_experts, trace.top_k) != (len(moe_layers), num_experts, top_k):
            raise InvalidArgument(
                f"routing trace {trace.path} has {trace.shape_text()} but the model has {model_shape}: "
                "forced routing needs a trace of the same shape"
            )
        if not 0 <= first_request < trace.num_requests:
            raise InvalidArgument(
                f"force_routing_request {first_request} is out of range [0, {trace.num_requests}) "
                f"for trace {trace.path}"
            )
        if not 0.0 <= layer_ahead_accuracy <= 1.0:
            raise InvalidArgument(
                f"force_routing_layer_ahead_accuracy {layer_ahead_accuracy} is out of range [0, 1]"
            )
        self.trace = trace
        self._layer_index = {layer: j for j, layer in enumerate(moe_layers)}
        self._next_request = first_request
        self._live: dict[str, _Replay] = {}  # request id -> its trace request
        self.layer_ahead_accuracy = layer_ahead_accuracy
        self._seed = seed

    def begin_request(self, request_id: str) -> int:
        """Give ``request_id`` the next trace request with decode rows (wrapping); its index."""
        for _ in range(self.trace.num_requests):
            request = self._next_request
            self._next_request = (request + 1) % self.trace.num_requests
            start, end = self.trace.decode_rows(request)
            if end > start:
                self._live[request_id] = _Replay(request, start, end)
                logger.debug(
                    "forced routing: %s replays trace request %d (%d decode rows)",
                    request_id,
                    request,
                    end - start,
                )
                return request
        raise AssertionError("load_trace guarantees decode rows")  # pragma: no cover

    def end_request(self, request_id: str) -> None:
        self._live.pop(request_id, None)

    def request_of(self, request_id: str) -> int:
        """The trace request ``request_id`` replays (given one on first use)."""
        if request_id not in self._live:
            self.begin_request(request_id)
        return self._live[request_id].request

    def row(self, request_id: str, step: int) -> int:
        """Trace row of forward ``step`` of ``request_id`` (wrapping past its request's end)."""
        self.request_of(request_id)
        replay = self._live[request_id]
        span = replay.end - replay.start
        if step >= span and not replay.wrapped:
            replay.wrapped = True
            logger.info(
                "forced routing: request %d of %s has %d decode rows; forward %d wraps to its first row",
                replay.request,
                self.trace.path,
                span,
                step,
            )
        return replay.start + step % span

    def experts(self, request_id: str, step: int, layer: int) -> np.ndarray:
        """[top_k] int64 experts of decoder layer ``layer`` at forward ``step`` of ``request_id``."""
        return self.trace.expert_ids[self.row(request_id, step), self._layer_index[layer]].astype(np.int64)

    def routing(
        self, segments: Sequence, layer: int, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The trace's (top_k_index [T, K] int64, top_k_weights [T, K]) in place of the router's.

        ``segments`` (``compute_svc.moe.StepSegment``) say whose rows are where: every token of
        one request's rows gets that request's trace row of its forward (several tokens only
        while its prompt is fed, see the module doc); weights keep the router's dtype and device.
        """
        j = self._layer_index[layer]
        index = np.empty(tuple(top_k_index.shape), dtype=np.int64)
        weights = np.empty(tuple(top_k_index.shape), dtype=np.float32)
        for seg in segments:
            row = self.row(seg.request_id, seg.step)
            index[seg.start : seg.start + seg.rows] = self.trace.expert_ids[row, j]
            weights[seg.start : seg.start + seg.rows] = self.trace.gate_weights[row, j]
        return (
            torch.from_numpy(index).to(top_k_index.device),
            torch.from_numpy(weights).to(device=top_k_weights.device, dtype=top_k_weights.dtype),
        )

    def layer_ahead(self, segment, predicted: Prediction) -> Prediction:
        """The modelled layer-ahead prediction of ``segment``'s request for ``predicted.layer``
        (see the module doc)."""
        row, j = self.row(segment.request_id, segment.step), self._layer_index[predicted.layer]
        truth = self.trace.expert_ids[row, j].astype(np.int64)
        truth_weights = self.trace.gate_weights[row, j].astype(np.float32)
        request = self.request_of(segment.request_id)
        rng = np.random.default_rng((self._seed, request, segment.step, predicted.layer))
        keep = rng.random(len(truth)) < self.layer_ahead_accuracy
        truth_set = set(truth.tolist())
        router_scores = dict(zip(predicted.experts, predicted.scores, strict=True))
        # The router's own picks outside the trace's set, best first, then any other expert.
        substitutes = [e for e in predicted.experts if e not in truth_set]
        substitutes += [
            e for e in range(self.trace.num_experts) if e not in truth_set and e not in substitutes
        ]
        experts: list[int] = []
        scores: list[float] = []
        for expert, weight, kept in zip(truth.tolist(), truth_weights.tolist(), keep.tolist(), strict=True):
            if kept:
                experts.append(expert)
                scores.append(min(1.0, max(0.0, weight)))
            else:
                sub = substitutes.pop(0)
                experts.append(sub)
                scores.append(min(1.0, max(0.0, router_scores.get(sub, weight))))
        order = sorted(range(len(experts)), key=lambda i: -scores[i])
        return Prediction(
            layer=predicted.layer,
            experts=tuple(experts[i] for i in order),
            scores=tuple(scores[i] for i in order),
        )


@dataclass
class _Replay:
    """A request's trace request and its decode rows [start, end)."""

    request: int
    start: int
    end: int
    wrapped: bool = False
