"""Comparing an offloaded forward with transformers' own on the same device, routing included.

Two forwards of the same MoE checkpoint can disagree for two reasons: a real fault, or a router
that flips between two experts whose scores are tied to within rounding, after which every later
token differs (another summation order on a GPU is enough). ``compare_with_routing`` tells them
apart: it records the experts every layer of both forwards routed each token to (a pre-hook on
transformers' experts modules, ``routing_observer`` on ours); where the routing agrees the logits
must too; where it does not, each flip must be a near-tie of transformers' router, and ours,
forced to transformers' routing, must then give transformers' logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compute_svc.experts.moe import ExpertRuntime
from expertcache.model_structure import is_experts_module


@dataclass
class Comparison:
    routing_agrees: bool
    flips: list[tuple[int, int]]  # (MoE layer, token) where the routing differs
    max_tie_gap: float  # the largest relative gap of the flipped experts' scores (0 when none)
    got: torch.Tensor  # ours' logits
    want: torch.Tensor  # transformers' logits
    forced: torch.Tensor | None  # ours' logits with transformers' routing forced (when it differs)


def capture_transformers_routing(model: torch.nn.Module, input_ids: torch.Tensor):
    """transformers' logits and, per experts module in layer order, (hidden [T, H], top_k_index
    [T, K], top_k_weights [T, K], router) of one forward; ``router`` is the linear layer beside
    the experts module whose weight is [num_experts, H] (its scores decide the routing)."""
    routing: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.nn.Module | None]] = []
    handles = []
    modules = dict(model.named_modules())
    for path, module in modules.items():
        if not is_experts_module(module):
            continue
        parent = modules[path.rsplit(".", 1)[0]]
        router = next(
            (
                child
                for child in parent.children()
                if child is not module
                and isinstance(getattr(child, "weight", None), torch.Tensor)
                and child.weight.dim() == 2
                and child.weight.shape[0] == int(module.num_experts)
            ),
            None,
        )

        def hook(_module, args, kwargs, router=router):
            values = list(args) + [
                kwargs[k] for k in ("hidden_states", "top_k_index", "top_k_weights") if k in kwargs
            ]
            hidden, index, weights = values[:3]
            routing.append(
                (hidden.detach().clone(), index.detach().clone(), weights.detach().clone(), router)
            )

        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            logits = model(input_ids=input_ids).logits[0]
    finally:
        for handle in handles:
            handle.remove()
    return logits, routing


def compare_with_routing(
    engine, plain: torch.nn.Module, prompt: list[int], device: torch.device
) -> Comparison:
    """Ours (``engine``, a GenerationEngine) against ``plain`` (transformers, on ``device``)."""
    want, theirs = capture_transformers_routing(plain, torch.tensor([prompt], device=device))
    runtime: ExpertRuntime = engine.runtime
    ours: list[tuple[int, torch.Tensor]] = []
    runtime.routing_observer = lambda layer, index, weights: ours.append((layer, index.clone()))
    try:
        got = engine.forward_logits(prompt)
    finally:
        runtime.routing_observer = None
    assert len(ours) == len(theirs), f"{len(ours)} MoE layers routed by ours, {len(theirs)} by transformers"
    flips = []
    gaps = [0.0]
    for j, ((_, mine), (hidden, index, _weights, router)) in enumerate(zip(ours, theirs, strict=True)):
        mine = mine.to(index.device).sort(dim=-1).values
        other = index.sort(dim=-1).values
        for token in torch.nonzero((mine != other).any(dim=-1)).flatten().tolist():
            flips.append((j, token))
            gaps.append(tie_gap(router, hidden[token], index.shape[-1]))
    forced = None
    if flips:
        forced = forced_forward(engine, prompt, [(index, weights) for _, index, weights, _ in theirs])
    return Comparison(not flips, flips, max(gaps), got, want, forced)


def tie_gap(router: torch.nn.Module | None, hidden: torch.Tensor, top_k: int) -> float:
    """The relative gap between the k-th and (k+1)-th router logit for one token's hidden state
    (near 0: a tie that rounding decides); inf when the router cannot be read."""
    if router is None:
        return float("inf")
    bias = getattr(router, "bias", None)
    with torch.no_grad():
        logits = torch.nn.functional.linear(
            hidden.float(), router.weight.float(), bias.float() if isinstance(bias, torch.Tensor) else None
        )
    top = logits.topk(top_k + 1).values
    return float((top[-2] - top[-1]).abs() / top[-2].abs().clamp_min(1e-6))


def forced_forward(
    engine, prompt: list[int], routing: list[tuple[torch.Tensor, torch.Tensor]]
) -> torch.Tensor:
    """Ours' logits with each MoE layer's (top_k_index, top_k_weights) replaced by ``routing``'s."""
    runtime: ExpertRuntime = engine.runtime
    original = ExpertRuntime.forward.__get__(runtime)  # the runtime's own, whatever wraps it now
    saved = runtime.__dict__.get("forward")
    layers = iter(routing)

    def forward(module, layer, hidden_states, top_k_index, top_k_weights):
        index, weights = next(layers)
        return original(module, layer, hidden_states, index.to(top_k_index.device), weights.to(top_k_weights))

    runtime.forward = forward
    try:
        return engine.forward_logits(prompt)
    finally:
        if saved is None:
            del runtime.forward
        else:
            runtime.forward = saved
