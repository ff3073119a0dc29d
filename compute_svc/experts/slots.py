"""A decode step's MoE layer on a GPU: the experts read from their arena slots by index.

One fixed sequence of calls whatever experts the layer routes to, so that it is captured once in
a CUDA graph and replayed; plain (unencoded) experts only. Design: docs/compute.md."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from expertcache.manifest import ExpertTensor

logger = logging.getLogger(__name__)

# Layers of at most this many tokens go through here (decode steps); larger ones copy too many
# experts' weights per pair and take the grouped path of compute_svc.experts.stages.
MAX_TOKENS = 16


def slotted_forward(
    module: torch.nn.Module,
    views: dict[str, torch.Tensor],
    x: torch.Tensor,
    index: torch.Tensor,
    weights: torch.Tensor,
    slot_of: torch.Tensor,
) -> torch.Tensor:
    """The experts module's math for x [T, H] routed to ``index`` [T, K] with ``weights`` [T, K],
    each expert read from arena slot ``slot_of[expert]``; ``views``: stored tensor name →
    [num_slots, *shape] view of the arena. Returns [T, H] in x's dtype."""
    tokens, top_k = index.shape
    slots = slot_of.index_select(0, index.reshape(-1))  # [S]
    first_name = "gate_up_proj" if module.has_gate else "up_proj"
    transposed = bool(module.is_transposed)
    # [S, H], row = token * K + k (repeat_interleave's values; an expand never waits for the device)
    xs = x.unsqueeze(1).expand(tokens, top_k, x.shape[-1]).reshape(tokens * top_k, x.shape[-1])
    first = _batched_linear(xs, views, first_name, slots, transposed, module.has_bias)  # [S, 2I]
    proj = module._apply_gate(first) if module.has_gate else module.act_fn(first)  # [S, I]
    out = _batched_linear(proj, views, "down_proj", slots, transposed, module.has_bias)  # [S, H]
    if getattr(module, "has_post_expert_norm", False):
        out = module.post_expert_norm(out)
    # [S, H] * [S, 1]: promotes like transformers (bf16 output x fp32 router weight -> fp32).
    out = out * weights.reshape(-1).unsqueeze(-1)
    return out.view(tokens, top_k, -1).sum(dim=1).to(x.dtype)


def _batched_linear(
    x: torch.Tensor,
    views: dict[str, torch.Tensor],
    name: str,
    slots: torch.Tensor,
    transposed: bool,
    bias: bool,
) -> torch.Tensor:
    """x [S, in] through each pair's expert tensor ``name`` (read from its slot), as transformers'
    batched_mm experts do it: [S, out, in] @ [S, in, 1], or [S, 1, in] @ [S, in, out] transposed."""
    weight = views[name].index_select(0, slots)
    if x.dtype != weight.dtype:
        x = x.to(weight.dtype)
    if transposed:
        out = torch.bmm(x.unsqueeze(1), weight).squeeze(1)
    else:
        out = torch.bmm(weight, x.unsqueeze(-1)).squeeze(-1)
    if bias:
        out.add_(views[name + "_bias"].index_select(0, slots))
    return out


class SlotExperts:
    """Decode-sized MoE layers over one arena through ``slotted_forward``, each (layer, token
    count) captured in a CUDA graph on its first use where the arena is on a GPU (``graphs``)."""

    @staticmethod
    def supports(slots: torch.Tensor, layouts: Sequence[ExpertTensor]) -> bool:
        return all(t.encoding == "plain" for t in layouts) and bool(layouts)

    def __init__(
        self, slots: torch.Tensor, layouts: Sequence[ExpertTensor], *, graphs: bool | None = None
    ) -> None:
        self.device = slots.device
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        # [num_slots, *shape] views of each stored tensor (plain: one part, the tensor itself).
        self.views: dict[str, torch.Tensor] = {}
        for t in layouts:
            for p in t.parts:
                raw = slots[:, p.offset : p.offset + p.nbytes]
                view = raw.view(getattr(torch, p.dtype)).unflatten(1, tuple(p.shape))
                # a transposed plain tensor: its [out, in] rows seen as the runtime [in, out]
                self.views[p.name] = view.transpose(1, 2) if t.transposed else view
        self._plans: dict[tuple[int, int], _Plan] = {}
        self._slot_host: dict[int, torch.Tensor] = {}  # layer -> [E] int64 (page-locked on a GPU)
        self.calls = 0  # layers computed
        self.captures = 0  # graphs captured
        self.capture_failed: str | None = None  # why graphs were given up, if they were

    def routed(
        self,
        module: torch.nn.Module,
        layer: int,
        host_index: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        hidden_states: torch.Tensor,
    ) -> SlotLayer:
        return SlotLayer(self, module, layer, host_index, top_k_index, top_k_weights, hidden_states)

    def slot_table(self, layer: int, num_experts: int) -> torch.Tensor:
        table = self._slot_host.get(layer)
        if table is None or table.shape[0] != num_experts:
            pin = self.device.type == "cuda"
            table = torch.zeros(num_experts, dtype=torch.int64, pin_memory=pin)
            self._slot_host[layer] = table
        return table

    def compute(
        self,
        module: torch.nn.Module,
        layer: int,
        x: torch.Tensor,
        index: torch.Tensor,
        weights: torch.Tensor,
        table: torch.Tensor,
    ) -> torch.Tensor:
        """``slotted_forward`` for this call, through the (layer, T) graph where graphs are on."""
        self.calls += 1
        if not self.graphs:
            return slotted_forward(module, self.views, x, index, weights, table.to(self.device))
        key = (layer, x.shape[0])
        plan = self._plans.get(key)
        if plan is None or not plan.fits(x, index, weights, table):
            plan = self._plans[key] = _Plan(self, module, x, index, weights, table)
        return plan.run(x, index, weights, table)


class _Plan:
    """One (layer, token count)'s static inputs and output, and its graph once captured."""

    def __init__(self, owner: SlotExperts, module, x, index, weights, table) -> None:
        self.owner = owner
        self.module = module
        self.x = torch.empty_like(x)
        self.index = torch.empty_like(index, device=x.device)
        self.weights = torch.empty_like(weights, device=x.device)
        self.table = torch.zeros(table.shape, dtype=torch.int64, device=x.device)
        self.out: torch.Tensor | None = None
        self.graph = None

    def fits(self, x, index, weights, table) -> bool:
        return (
            self.x.shape == x.shape
            and self.x.dtype == x.dtype
            and self.index.shape == index.shape
            and self.weights.dtype == weights.dtype
            and self.table.shape == table.shape
        )

    def _load(self, x, index, weights, table) -> None:
        for static, given in ((self.x, x), (self.index, index), (self.weights, weights)):
            if static.data_ptr() != given.data_ptr():
                static.copy_(given, non_blocking=True)
        self.table.copy_(table, non_blocking=True)

    def _body(self) -> torch.Tensor:
        return slotted_forward(self.module, self.owner.views, self.x, self.index, self.weights, self.table)

    def run(self, x, index, weights, table) -> torch.Tensor:
        self._load(x, index, weights, table)
        if self.graph is not None:
            self.graph.replay()
            return self.out
        out = self._body()
        # Captured after this eager run (which warmed up the libraries' handles and workspaces).
        if self.owner.capture_failed is None:
            self._capture()
        return out

    def _capture(self) -> None:
        try:
            stream = torch.cuda.Stream(self.x.device)
            stream.wait_stream(torch.cuda.current_stream(self.x.device))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(stream):
                self._body()  # warm-up on the side stream, as torch.cuda.graphs asks
                with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                    self.out = self._body()
            torch.cuda.current_stream(self.x.device).wait_stream(stream)
        except Exception as exc:  # noqa: BLE001 - a capture failure means eager from now on
            self.owner.capture_failed = f"{type(exc).__name__}: {exc}"
            logger.warning(
                "expert layers run without CUDA graphs: capture failed (%s)", self.owner.capture_failed
            )
            self.graph = None
            return
        self.graph = graph
        self.owner.captures += 1


class SlotLayer:
    """One MoE layer's experts through ``SlotExperts``: ``run`` notes each batch's slots and,
    once every expert of the layer is pinned, queues the compute (before the runtime records
    the event its release waits for); ``result`` is the [T, H] output."""

    def __init__(self, owner, module, layer, host_index, top_k_index, top_k_weights, hidden_states) -> None:
        self._owner = owner
        self._module = module
        self._layer = layer
        self._index = top_k_index
        self._weights = top_k_weights
        self._hidden = hidden_states
        ids = host_index.reshape(-1).numpy()
        self.experts = tuple(sorted(set(ids.tolist())))
        self._table = owner.slot_table(layer, int(module.num_experts))
        self._slots = self._table.numpy()
        self._waiting = len(self.experts)
        self._out: torch.Tensor | None = None

    def run(self, slots: Sequence[int], experts: Sequence[int]) -> None:
        self._slots[np.asarray(experts, dtype=np.int64)] = np.asarray(slots, dtype=np.int64)
        self._waiting -= len(experts)
        if self._waiting == 0:
            self._out = self._owner.compute(
                self._module, self._layer, self._hidden, self._index, self._weights, self._table
            )

    def result(self) -> torch.Tensor:
        if self._out is None:
            raise RuntimeError(f"MoE layer {self._layer}: result asked before every expert was pinned")
        return self._out
