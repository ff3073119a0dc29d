"""Lookahead: the routers of the next MoE layers applied to layer l's MoE input, d layers early.

The residual stream changes little from one layer to the next, so a later layer's router mostly
picks now what it will pick then, and the daemon gets that long to fetch. Design:
docs/compute.md."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from compute_svc.errors import FailedPrecondition

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prediction:
    """Predicted experts of MoE layer ``layer`` with their router probabilities, highest first,
    made ``depth`` MoE layers before it."""

    layer: int
    experts: tuple[int, ...]
    scores: tuple[float, ...]  # in [0, 1], same length as experts
    depth: int = 1


def find_router(block: torch.nn.Module, experts_module: torch.nn.Module) -> torch.nn.Module:
    """The router of the MoE ``block`` that holds ``experts_module``.

    It is the sibling of the experts module with a 2-D ``weight`` of ``[num_experts, hidden]``;
    ``FailedPrecondition`` names the block when there is none or more than one.
    """
    num_experts = int(experts_module.num_experts)
    candidates = []
    for name, child in block.named_children():
        if child is experts_module:
            continue
        weight = getattr(child, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[0] == num_experts:
            candidates.append((name, child))
    if len(candidates) != 1:
        found = [name for name, _ in candidates]
        raise FailedPrecondition(
            f"{type(block).__name__} has {len(candidates)} router candidates {found} (children with a "
            f"[{num_experts}, hidden] weight beside its experts): layer-ahead needs exactly one; "
            "pass --no-layer-ahead"
        )
    return candidates[0][1]


def _parent(model: torch.nn.Module, module: torch.nn.Module) -> torch.nn.Module:
    for _, candidate in model.named_modules():
        if any(child is module for child in candidate.children()):
            return candidate
    raise FailedPrecondition(f"{type(module).__name__} is not inside the model")


class LayerAheadPredictor:
    """Predicts the experts of the next ``depth`` MoE layers from the current layer's MoE input.

    ``experts_modules``: ``(decoder layer, experts module)`` in layer order, as
    ``compute_svc.engine.model_loader.LoadedModel.experts_modules``. Used from the generation thread.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        experts_modules: Sequence[tuple[int, torch.nn.Module]],
        *,
        depth: int = 1,
    ) -> None:
        if depth < 1:
            raise ValueError(f"lookahead depth must be >= 1, got {depth}")
        routers = [(layer, find_router(_parent(model, module), module)) for layer, module in experts_modules]
        self.depth = depth
        # layer l -> ((layer l + 1, its router), ..., (layer l + depth, its router)), fewer at the end
        self._ahead: dict[int, tuple[tuple[int, torch.nn.Module], ...]] = {
            layer: tuple(routers[i + 1 : i + 1 + depth]) for i, (layer, _) in enumerate(routers[:-1])
        }
        for _, router in routers[:1]:
            self._check_contract(router)
        self._tables: dict[int, tuple[int, ...]] = {}  # ``table``'s, by layers

    @staticmethod
    def _check_contract(router: torch.nn.Module) -> None:
        hidden = router.weight.shape[1]
        probe = torch.zeros(1, hidden, dtype=router.weight.dtype, device=router.weight.device)
        with torch.inference_mode():
            out = type(router).forward(router, probe)
        if not (
            isinstance(out, tuple)
            and len(out) == 3
            and out[2].dim() == 2
            and not out[2].is_floating_point()
            and out[1].shape == out[2].shape
        ):
            raise FailedPrecondition(
                f"{type(router).__name__}.forward does not return (logits, weights [T, K], indices [T, K]): "
                "layer-ahead cannot use it; pass --no-layer-ahead"
            )

    @property
    def layers(self) -> tuple[int, ...]:
        """MoE layers that predict their successors (all but the last)."""
        return tuple(self._ahead)

    def next_layer(self, layer: int) -> int | None:
        ahead = self._ahead.get(layer)
        return ahead[0][0] if ahead else None

    def ahead(self, layer: int) -> tuple[int, ...]:
        """The layers predicted inside ``layer``, depth 1 first."""
        return tuple(target for target, _ in self._ahead.get(layer, ()))

    def table(self, layers: int) -> tuple[int, ...]:
        """[layers * depth]: the layer predicted at depth d + 1 inside layer l (l < ``layers``), -1
        where none is (past the last MoE layer, or a layer that predicts nothing)."""
        got = self._tables.get(layers)
        if got is None:
            rows: list[int] = []
            for layer in range(layers):
                targets = list(self.ahead(layer))
                rows.extend(targets + [-1] * (self.depth - len(targets)))
            got = self._tables[layers] = tuple(rows)
        return got

    def scores(
        self, layer: int, hidden_states: torch.Tensor, depth: int = 1
    ) -> tuple[int, torch.Tensor] | None:
        """(layer ``depth`` ahead, probabilities [T, E] float32) of its router on ``hidden_states`` [T, H].

        Probabilities: the router's top-k weights renormalised to sum to 1 per token, zero
        elsewhere (the router's own notion of "chosen"); None past the last MoE layer.
        """
        ahead = self._ahead.get(layer, ())
        if not 1 <= depth <= len(ahead):
            return None
        next_layer, router = ahead[depth - 1]
        _, weights, indices = type(router).forward(router, hidden_states)  # [T, K], [T, K] int64
        weights = weights.float()
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-20)
        probs = torch.zeros(
            hidden_states.shape[0], router.weight.shape[0], dtype=torch.float32, device=weights.device
        )
        probs.scatter_(1, indices.long(), weights)
        return next_layer, probs

    def predict_device(
        self, layer: int, hidden_states: torch.Tensor, segments: Sequence[tuple[int, int]] | None = None
    ) -> DevicePrediction | None:
        """Every depth's expert scores for each request of a step, still on the device.

        ``hidden_states`` [T, H] holds the rows of every request; ``segments`` gives each request's
        ``(first row, rows)`` (default: one request, all rows). A request's score of an expert at
        a depth is its best router probability over the request's rows (a decode token: that
        router's top-k weights renormalised; a prompt chunk: the union over its tokens). None for
        the last MoE layer. Nothing here waits for the device: the caller brings ``scores`` of
        all depths and requests to the host together (one transfer) and calls ``finish``.
        """
        ahead = self._ahead.get(layer)
        if not ahead:
            return None
        owner = None
        if segments is not None and len(segments) > 1:
            rows = torch.empty(hidden_states.shape[0], dtype=torch.long)
            for i, (start, n) in enumerate(segments):
                rows[start : start + n] = i
            owner = rows.to(hidden_states.device)
        per_depth = []
        for depth in range(1, len(ahead) + 1):
            _, probs = self.scores(layer, hidden_states, depth)  # [T, E] float32
            if owner is None:
                per_depth.append(probs.max(dim=0, keepdim=True).values)  # [1, E]
            else:
                best = probs.new_zeros(len(segments), probs.shape[1])  # [B, E]
                per_depth.append(
                    best.scatter_reduce_(0, owner.unsqueeze(1).expand_as(probs), probs, reduce="amax")
                )
        return DevicePrediction(layers=tuple(target for target, _ in ahead), scores=torch.stack(per_depth))

    def predict_host(
        self, layer: int, hidden_states: torch.Tensor, segments: Sequence[tuple[int, int]] | None = None
    ) -> list[tuple[Prediction, ...]] | None:
        """``predict_device``'s predictions, finished, for ``hidden_states`` already on the host
        (a CPU device): each router's top-k straight into the predictions, with none of the
        device path's dense ``[D, B, E]`` scores or its packing for a transfer (a decode step
        pays this once per MoE layer). Same math: a request's score of an expert is its best
        renormalised router weight over the request's rows. None for the last MoE layer."""
        ahead = self._ahead.get(layer)
        if not ahead:
            return None
        rows = hidden_states.shape[0]
        spans = list(segments) if segments is not None else [(0, rows)]
        per_depth = []
        for next_layer, router in ahead:
            _, weights, indices = type(router).forward(router, hidden_states)  # [T, K], [T, K]
            w = weights.float().numpy()
            w = w / np.maximum(w.sum(axis=-1, keepdims=True), np.float32(1e-20))  # float32, as on a device
            per_depth.append((next_layer, w, indices.numpy()))
        out = []
        for start, n in spans:
            preds = []
            for depth, (next_layer, w, idx) in enumerate(per_depth, start=1):
                best: dict[int, float] = {}
                for e, p in zip(
                    idx[start : start + n].ravel().tolist(),
                    w[start : start + n].ravel().tolist(),
                    strict=True,
                ):
                    if p > best.get(e, 0.0):
                        best[e] = p
                pairs = sorted(best.items(), key=lambda x: (-x[1], x[0]))
                preds.append(
                    Prediction(
                        layer=next_layer,
                        experts=tuple(e for e, _ in pairs),
                        scores=tuple(min(1.0, p) for _, p in pairs),
                        depth=depth,
                    )
                )
            out.append(tuple(preds))
        return out

    def predict(self, layer: int, hidden_states: torch.Tensor) -> tuple[Prediction, ...]:
        """Every depth's prediction for ``hidden_states`` [T, H] of one request (layer ``layer``'s
        MoE input), depth 1 first; empty for the last MoE layer. One host transfer for all depths."""
        pending = self.predict_device(layer, hidden_states)
        if pending is None:
            return ()
        return pending.finish(pending.scores.cpu().numpy())[0]


@dataclass(frozen=True)
class DevicePrediction:
    """The lookahead of one MoE layer before its host transfer: ``scores`` [D, B, E] float32 on the
    device, depth by depth (``layers[d - 1]`` is depth d's layer), one row per request of the step."""

    layers: tuple[int, ...]
    scores: torch.Tensor

    def finish(self, scores) -> list[tuple[Prediction, ...]]:
        """Per request, its prediction at every depth (depth 1 first), from the host copy of
        ``scores`` ([D, B, E] array): the experts scored above zero, best first (ties by expert)."""
        depths, requests, _ = scores.shape
        out = []
        for b in range(requests):
            preds = []
            for d in range(depths):
                pairs = sorted(
                    ((e, float(p)) for e, p in enumerate(scores[d, b].tolist()) if p > 0), key=lambda x: -x[1]
                )
                preds.append(
                    Prediction(
                        layer=self.layers[d],
                        experts=tuple(e for e, _ in pairs),
                        scores=tuple(min(1.0, p) for _, p in pairs),
                        depth=d + 1,
                    )
                )
            out.append(tuple(preds))
        return out


def accuracy(predicted: Sequence[int], actual: Sequence[int]) -> float:
    """Fraction of the ``actual`` top-k experts that ``predicted`` named (recall of the true set)."""
    actual_set = set(int(e) for e in actual)
    if not actual_set:
        return 1.0
    return len(actual_set & set(int(e) for e in predicted)) / len(actual_set)
