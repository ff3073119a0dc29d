"""Layer-ahead prediction: layer l+1's router applied to layer l's MoE input, one layer early.

::

    MoE layer l: hidden [T, H] ──router(l)──▶ top_k(l) ──▶ acquire / compute experts of l
                     │
                     └──router(l+1) (same [T, H]) ──▶ predicted top_k(l+1) + probabilities
                                                      ──▶ provider.layer_ahead(token, l+1, …)

The residual stream changes little from one layer to the next, so the next layer's router, fed
the current layer's MoE input, mostly picks what it will pick one layer later; the daemon gets
the whole of layer l's attention + experts time to fetch those experts. The cost is one
``[T, H] × [H, E]`` product per MoE layer (E = experts), no extra weights: the routers are
already resident with the dense model.

Finding the routers is generic, not a table per architecture: a MoE block holds the experts
module (``expertcache.model_structure.is_experts_module``) and, beside it, the router — the
sibling holding a ``weight`` of shape ``[num_experts, hidden]`` (gpt-oss adds ``bias``,
DeepSeek-V3 a buffer ``e_score_correction_bias``). The router is *called* (its own forward, no
hooks), so group-limited selection, score correction, softmax-before or after top-k all stay
the model's own code. Every transformers router returns ``(logits [T, E], weights [T, K],
indices [T, K])``; that contract is checked once at construction.

Prefill (T > 1): the prediction is the union over the prompt's tokens of their predicted
experts, each scored by its largest probability across tokens, highest first — every one of
them is needed at layer l+1 of the prefill. Decode (T = 1) predicts the token's top-k.

Glossary: "layer" is a decoder layer number (the manifest's ``moe_layers``); "next" is the next
MoE layer in that list (DeepSeek's dense first layers are skipped). Example: moe_layers
(1, 2, 3): the router of layer 2 runs inside layer 1; layer 3 predicts nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from compute_svc.errors import FailedPrecondition

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prediction:
    """Predicted experts of MoE layer ``layer`` with their router probabilities, highest first."""

    layer: int
    experts: tuple[int, ...]
    scores: tuple[float, ...]  # in [0, 1], same length as experts


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
    """Predicts each MoE layer's successor's experts from the current layer's MoE input.

    ``experts_modules``: ``(decoder layer, experts module)`` in layer order, as
    ``compute_svc.model_loader.LoadedModel.experts_modules``. Used from the generation thread.
    """

    def __init__(
        self, model: torch.nn.Module, experts_modules: Sequence[tuple[int, torch.nn.Module]]
    ) -> None:
        routers = [(layer, find_router(_parent(model, module), module)) for layer, module in experts_modules]
        # layer l -> (next MoE layer, its router)
        self._next: dict[int, tuple[int, torch.nn.Module]] = {
            layer: routers[i + 1] for i, (layer, _) in enumerate(routers[:-1])
        }
        for _, router in routers[:1]:
            self._check_contract(router)

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
        """MoE layers that predict their successor (all but the last)."""
        return tuple(self._next)

    def next_layer(self, layer: int) -> int | None:
        entry = self._next.get(layer)
        return None if entry is None else entry[0]

    def scores(self, layer: int, hidden_states: torch.Tensor) -> tuple[int, torch.Tensor] | None:
        """(next layer, probabilities [T, E] float32) of the next layer's router on ``hidden_states`` [T, H].

        Probabilities: the router's top-k weights renormalised to sum to 1 per token, zero
        elsewhere (the router's own notion of "chosen"); None for the last MoE layer.
        """
        entry = self._next.get(layer)
        if entry is None:
            return None
        next_layer, router = entry
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
        """The next MoE layer's expert scores for each request of a step, still on the device.

        ``hidden_states`` [T, H] holds the rows of every request; ``segments`` gives each
        request's ``(first row, rows)`` (default: one request, all rows). A request's score of an
        expert is its best router probability over the request's rows (a decode token: its top-k
        weights renormalised; a prefill chunk: the union over its tokens). None for the last MoE
        layer. Nothing here waits for the device: the caller brings ``scores`` to the host with
        whatever else it needs (one transfer per layer) and calls ``finish``.
        """
        out = self.scores(layer, hidden_states)
        if out is None:
            return None
        next_layer, probs = out  # [T, E] float32
        if segments is None or len(segments) == 1:
            return DevicePrediction(next_layer, probs.max(dim=0, keepdim=True).values)  # [1, E]
        owner = torch.empty(probs.shape[0], dtype=torch.long)
        for i, (start, rows) in enumerate(segments):
            owner[start : start + rows] = i
        owner = owner.to(probs.device).unsqueeze(1).expand_as(probs)  # [T, E]
        best = probs.new_zeros(len(segments), probs.shape[1])  # [B, E]
        return DevicePrediction(next_layer, best.scatter_reduce_(0, owner, probs, reduce="amax"))

    def predict(self, layer: int, hidden_states: torch.Tensor) -> Prediction | None:
        """The next MoE layer's experts for ``hidden_states`` [T, H] of one request (layer
        ``layer``'s MoE input). None for the last MoE layer. One host transfer; the generation
        hot path uses ``predict_device`` and packs it with the routing (``compute_svc.moe``)."""
        pending = self.predict_device(layer, hidden_states)
        if pending is None:
            return None
        return pending.finish(pending.scores.cpu().numpy())[0]


@dataclass(frozen=True)
class DevicePrediction:
    """Layer-ahead scores before their host transfer: ``scores`` [B, E] float32 on the device,
    one row per request of the step."""

    layer: int
    scores: torch.Tensor

    def finish(self, scores) -> list[Prediction]:
        """One ``Prediction`` per row of the host copy of ``scores`` ([B, E] array): the experts
        with a score above zero, best first (ties by expert number)."""
        out = []
        for row in scores:
            pairs = sorted(((e, float(p)) for e, p in enumerate(row.tolist()) if p > 0), key=lambda x: -x[1])
            out.append(
                Prediction(
                    layer=self.layer,
                    experts=tuple(e for e, _ in pairs),
                    scores=tuple(min(1.0, p) for _, p in pairs),
                )
            )
        return out


def accuracy(predicted: Sequence[int], actual: Sequence[int]) -> float:
    """Fraction of the ``actual`` top-k experts that ``predicted`` named (recall of the true set)."""
    actual_set = set(int(e) for e in actual)
    if not actual_set:
        return 1.0
    return len(actual_set & set(int(e) for e in predicted)) / len(actual_set)
