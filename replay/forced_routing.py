"""Forced routing, a benchmark feature: experts chosen from a recorded trace instead of the router.

A random-weight checkpoint routes like no real model does (its routers are noise), so a cache
benchmark on one would measure the wrong access pattern. Started by ``python -m
replay.forced_compute --force-routing TRACE``, the compute process still runs the model's router
(its cost stays real) but then replaces ``top_k_index`` and ``top_k_weights`` with the trace's
``expert_ids`` / ``gate_weights``, so the experts fetched, cached and computed are those a real model used. Outputs are then not the
model's own: never use this for serving.

Which trace row a forward takes::

    trace request r (decode rows only: req_offsets[r] + decode_start[r] .. req_offsets[r + 1])
    forward 0 (prefill, P prompt tokens) ─▶ row 0 for every prompt token (the trace records no prefill)
    forward i (feeds generated token i-1) ─▶ row i, wrapping to row 0 past the request's last row
    trace layer j ─▶ the model's j-th MoE layer (manifest ``moe_layers[j]``)

Each new Generate takes the next trace request, starting at ``--force-routing-request N`` and
wrapping after the last one; requests batched together each follow their own trace request. The
trace's layers, experts and top-k must equal the model's; a mismatch stops the process at
start-up with both shapes named.

Installed as the compute runtime's routing override (``compute_svc.experts.moe.RoutingOverride``): the
service itself knows nothing of traces.

Lookahead under forced routing: the later layers' routers still run, but they predict what the
random routers would pick, which says nothing of the trace. Each prediction sent to the daemon
is therefore modelled: each of the trace's top-k experts of the predicted layer is kept with the
accuracy of its depth, ``layer_ahead_accuracy - (depth - 1) * accuracy_drop_per_depth`` (stated
parameters, seeded per request, step, layer and depth), and otherwise replaced by an expert
outside the trace's set, drawn with the same seed — the model of lookahead the trace replay uses
(``replay.simulator``), made concrete in a real process. The wrong picks are not the router's own
(a random router's picks are no better than a draw), so a forward's every prediction is known
before it runs (``step_lookahead``): decode layers that run natively in one span send them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from compute_svc.errors import InvalidArgument
from compute_svc.experts.layer_ahead import Prediction
from expertcache.layers import LayerMap
from expertcache.trace import RoutingTrace, TraceError, read_trace

logger = logging.getLogger(__name__)


def load_trace(path: str | Path) -> RoutingTrace:
    """Read ``path`` for forced routing (``expertcache.trace``); ``InvalidArgument`` names the file
    and what is wrong: forced routing also needs the router weights and some decode rows."""
    if not Path(path).exists():
        raise InvalidArgument(f"force_routing_path {str(path)!r} does not exist")
    try:
        trace = read_trace(path)
    except TraceError as exc:
        raise InvalidArgument(f"force_routing_path {str(path)!r}: {exc}") from None
    if not trace.has_gate_weights:
        raise InvalidArgument(
            f"routing trace {path} lacks gate_weights: forced routing needs the router weights"
        )
    if not any(trace.decode_rows(r)[1] > trace.decode_rows(r)[0] for r in range(trace.num_requests)):
        raise InvalidArgument(f"routing trace {path} has no decode rows")
    return trace


_MASK64 = (1 << 64) - 1


def _mix(x: int, v: int) -> int:
    """One field of ``uniform``'s splitmix64 hash (Python ints, masked to 64 bits)."""
    x = (x ^ (int(v) & _MASK64)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 31)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 29)


_START = 0x9E3779B97F4A7C15


def uniform(key: tuple[int, ...], k: int) -> float:
    """A uniform draw in [0, 1) fixed by ``key`` and ``k`` (splitmix64 over the fields): the
    modelled lookahead's coin for one expert, the same in every run, and cheap enough to draw
    at every MoE layer of every token (a seeded numpy generator costs ~20 us to make)."""
    x = _START
    for v in (*key, k):
        x = _mix(x, v)
    return (x >> 11) / float(1 << 53)


def uniform_many(prefix: tuple[int, ...], fields: np.ndarray) -> np.ndarray:
    """``uniform`` of many draws at once, each ``uniform((*prefix, *fields[i, :-1]), fields[i, -1])``
    exactly: ``prefix`` holds the key fields all share, ``fields`` [N, F] the rest of each key
    followed by its ``k`` (non-negative integers). [N] float64; the same splitmix64, in wrapping
    uint64 arithmetic."""
    x = _START
    for v in prefix:
        x = _mix(x, v)
    cols = np.asarray(fields).astype(np.uint64, copy=False)
    state = np.full(cols.shape[0], x, dtype=np.uint64)
    m1, m2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
    with np.errstate(over="ignore"):
        for v in cols.T:
            state = (state ^ v) * m1
            state = (state ^ (state >> np.uint64(31))) * m2
            state ^= state >> np.uint64(29)
    return (state >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def modelled_accuracy(layer_ahead_accuracy: float, drop_per_depth: float, depth: int) -> float:
    """The modelled accuracy of a lookahead prediction ``depth`` (>= 1) MoE layers ahead:
    ``layer_ahead_accuracy - (depth - 1) * drop_per_depth``, at least 0."""
    return max(0.0, layer_ahead_accuracy - (depth - 1) * drop_per_depth)


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
        accuracy_drop_per_depth: float = 0.0,
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
        if not 0.0 <= accuracy_drop_per_depth <= 1.0:
            raise InvalidArgument(
                f"force_routing_accuracy_drop_per_depth {accuracy_drop_per_depth} is out of range [0, 1]"
            )
        self.trace = trace
        self._layers = LayerMap(tuple(moe_layers))  # trace layers are MoE layer indices
        self._moe_rows = self._layers.ranks()  # decoder layer -> its MoE index (-1: dense)
        self._next_request = first_request
        self._live: dict[str, _Replay] = {}  # request id -> its trace request
        self.layer_ahead_accuracy = layer_ahead_accuracy
        self.accuracy_drop_per_depth = accuracy_drop_per_depth
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
        return self.trace.expert_ids[self.row(request_id, step), self._layers.moe_index(layer)].astype(
            np.int64
        )

    def routing(
        self, segments: Sequence, layer: int, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The trace's (top_k_index [T, K] int64, top_k_weights [T, K]) in place of the router's.

        ``segments`` (``compute_svc.experts.moe.StepSegment``) say whose rows are where: every token of
        one request's rows gets that request's trace row of its forward (several tokens only
        while its prompt is fed, see the module doc); weights keep the router's dtype and device.
        """
        j = self._layers.moe_index(layer)
        device, dtype = top_k_weights.device, top_k_weights.dtype
        k = top_k_index.shape[-1]
        if len(segments) == 1:  # one request (a decode step or a prompt chunk): its row for every token
            index, weights = self._forward_rows(segments[0], device, dtype)
            if top_k_index.shape[0] == 1:  # a decode step: the row as [1, K], one view each
                return index[j : j + 1], weights[j : j + 1]
            shape = tuple(top_k_index.shape)
            return index[j].expand(shape), weights[j].expand(shape)
        parts_i, parts_w = [], []
        for seg in segments:
            index, weights = self._tensors(seg.request_id, device, dtype)
            at = self.row(seg.request_id, seg.step) - self._live[seg.request_id].start
            parts_i.append(index[at, j].expand(seg.rows, k))
            parts_w.append(weights[at, j].expand(seg.rows, k))
        return torch.cat(parts_i), torch.cat(parts_w)

    def step_routing(
        self, segments: Sequence, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A one-token forward's routing of every MoE layer at once, as ``routing`` gives it layer
        by layer: (expert ids [L, 1, K] int64, weights [L, 1, K] of ``dtype``), views; None
        unless ``segments`` is one request's one row (a decode step of one request)."""
        if len(segments) != 1 or segments[0].rows != 1:
            return None
        index, weights = self._forward_rows(segments[0], device, dtype)
        return index.unsqueeze(1), weights.unsqueeze(1)

    def _forward_rows(
        self, seg, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The trace row of ``seg``'s forward for every MoE layer (ids [L, K], weights [L, K]),
        looked up at its first layer and kept for the others."""
        replay = self._live.get(seg.request_id)
        rows = None if replay is None else replay.step_rows
        if rows is None or rows[0] != (seg.step, device, dtype):
            index, weights = self._tensors(seg.request_id, device, dtype)
            replay = self._live[seg.request_id]
            at = self.row(seg.request_id, seg.step) - replay.start
            rows = replay.step_rows = ((seg.step, device, dtype), index[at], weights[at])
        return rows[1], rows[2]

    def _tensors(
        self, request_id: str, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The request's trace rows as (expert ids [rows, layers, K] int64, weights [rows, layers, K]
        of ``dtype``) on ``device``, made once per request: a forward's routing is then a view,
        with no host-to-device copy per layer."""
        self.request_of(request_id)
        replay = self._live[request_id]
        cached = replay.tensors
        if cached is None or cached[0].device != device or cached[1].dtype != dtype:
            rows = slice(replay.start, replay.end)
            index = torch.from_numpy(self.trace.expert_ids[rows].astype(np.int64)).to(device)
            weights = torch.from_numpy(self.trace.gate_weights[rows].astype(np.float32)).to(
                device=device, dtype=dtype
            )
            cached = replay.tensors = (index, weights)
        return cached

    def accuracy(self, depth: int) -> float:
        """The modelled accuracy of a prediction made ``depth`` MoE layers ahead."""
        return modelled_accuracy(self.layer_ahead_accuracy, self.accuracy_drop_per_depth, depth)

    def layer_ahead(self, segment, predicted: Prediction) -> Prediction:
        """The modelled prediction of ``segment``'s request for ``predicted.layer`` at its depth
        (see the module doc); the router's own picks play no part."""
        experts, scores = self._modelled(segment, predicted.layer, predicted.depth)
        return Prediction(layer=predicted.layer, experts=experts, scores=scores, depth=predicted.depth)

    def step_lookahead(
        self, segments: Sequence, ahead: Sequence[int], depth: int
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """``layer_ahead``'s predictions of a one-token forward's every layer at once: for the
        layers ``ahead`` [L * depth] names (-1: none), ids [L, depth, K] int64 and scores [L,
        depth, K] float32, each as ``layer_ahead`` gives it; None unless ``segments`` is one
        request's one row (as ``step_routing``)."""
        if len(segments) != 1 or segments[0].rows != 1 or depth < 1 or len(ahead) % depth:
            return None
        layers, k = len(ahead) // depth, self.trace.expert_ids.shape[-1]
        ids = np.zeros((layers * depth, k), dtype=np.int64)
        scores = np.zeros((layers * depth, k), dtype=np.float32)
        targets = np.asarray(ahead, dtype=np.int64)
        for d in range(1, depth + 1):
            at = np.arange(d - 1, len(targets), depth)
            at = at[targets[at] >= 0]
            if len(at):
                step_ids, step_scores = self._step_predictions(segments[0], d)
                rows = self._moe_rows[targets[at]]
                if (rows < 0).any():
                    bad = int(targets[at][rows < 0][0])
                    raise InvalidArgument(f"step_lookahead names layer {bad}, which is not a MoE layer")
                ids[at], scores[at] = step_ids[rows], step_scores[rows]
        return ids.reshape(layers, depth, k), scores.reshape(layers, depth, k)

    def _modelled(self, segment, layer: int, depth: int) -> tuple[tuple[int, ...], tuple[float, ...]]:
        """(experts, scores) of the modelled prediction for ``layer`` at ``depth``, best first."""
        ids, scores = self._step_predictions(segment, depth)
        row = self._layers.moe_index(layer)
        return tuple(ids[row].tolist()), tuple(scores[row].tolist())

    def _step_predictions(self, segment, depth: int) -> tuple[np.ndarray, np.ndarray]:
        """The modelled predictions at ``depth`` of every MoE layer (in MoE order) for ``segment``'s
        forward, drawn at once on first use and kept for the forward's other layers: a step's
        lookahead (``step_lookahead``) and each layer's (``layer_ahead``) read the same draws."""
        self.request_of(segment.request_id)
        replay = self._live[segment.request_id]
        if replay.predicted_step != segment.step:
            replay.predicted_step, replay.predicted = segment.step, {}
        got = replay.predicted.get(depth)
        if got is None:
            moe = np.asarray(self._layers.moe_layers, dtype=np.int64)
            got = replay.predicted[depth] = self._modelled_many(segment, moe, np.full(moe.shape, depth))
        return got

    def _modelled_many(
        self, segment, layers: np.ndarray, depths: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """The modelled predictions for ``layers[i]`` at ``depths[i]`` ([N] each) of ``segment``'s
        forward, at once: (experts [N, K] int64, scores [N, K] float64), each row best first.

        Per row (the model of the module doc): each of the trace's top-k experts is kept when its
        coin ``uniform(key, k)`` is below its depth's accuracy, and otherwise replaced by the
        expert at ``int(uniform(key, K + k) * n)`` among the ``n`` not yet taken outside the trace's
        set (kept when none is), in k order; scores are the trace's weights clamped to [0, 1];
        the row is ordered by score, stable. ``key`` = (seed, trace request, step, layer, depth).
        """
        row = self.row(segment.request_id, segment.step)
        j = self._moe_rows[layers]
        truth = self.trace.expert_ids[row, j].astype(np.int64)  # [N, K]
        weights = self.trace.gate_weights[row, j].astype(np.float64)
        n, k = truth.shape
        accuracy = np.array([self.accuracy(int(d)) for d in depths.tolist()])
        fields = np.empty((n, 2 * k, 3), dtype=np.uint64)
        fields[:, :, 0] = layers.astype(np.uint64)[:, None]
        fields[:, :, 1] = depths.astype(np.uint64)[:, None]
        fields[:, :, 2] = np.arange(2 * k, dtype=np.uint64)
        prefix = (self._seed, self.request_of(segment.request_id), segment.step)
        draws = uniform_many(prefix, fields.reshape(-1, 3)).reshape(n, 2 * k)
        experts = truth.copy()
        others = np.ones((n, self.trace.num_experts), dtype=bool)  # not in the trace's set, not taken
        np.put_along_axis(others, truth, False, axis=1)
        rows = np.arange(n)
        for i in range(k):
            left = others.sum(axis=1)
            wrong = (draws[:, i] >= accuracy) & (left > 0)
            if not wrong.any():
                continue
            at = (draws[:, k + i] * left).astype(np.int64)  # < left: the draw is below 1
            picked = np.argmax(others & (np.cumsum(others, axis=1) == (at + 1)[:, None]), axis=1)
            experts[wrong, i] = picked[wrong]
            others[rows[wrong], picked[wrong]] = False
        kept = np.where(weights > 0.0, weights, 0.0)
        scores = np.where(kept < 1.0, kept, 1.0)
        order = np.argsort(-scores, axis=1, kind="stable")
        return np.take_along_axis(experts, order, axis=1), np.take_along_axis(scores, order, axis=1)


@dataclass
class _Replay:
    """A request's trace request and its decode rows [start, end)."""

    request: int
    start: int
    end: int
    wrapped: bool = False
    tensors: tuple[torch.Tensor, torch.Tensor] | None = None  # see ForcedRouting._tensors
    # ((step, device, dtype), expert ids [layers, K], weights [layers, K]): the trace row of the
    # forward being run (ForcedRouting.routing), views of ``tensors``
    step_rows: tuple | None = None
    # ForcedRouting._step_predictions' draws of forward ``predicted_step``, by depth
    predicted_step: int = -1
    predicted: dict = field(default_factory=dict)
