"""The route, compute and combine stages of a MoE layer's experts: tensor math, no daemon.

``compute_svc.experts.moe`` runs them around the acquire stage (pinned arena slots). Stages and
glossary: docs/compute.md."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from compute_svc.errors import FailedPrecondition


# -- route stage -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Routing:
    """The S = T·K (token, k) pairs grouped by expert: ``order`` lists the pair rows expert by
    expert (ascending expert ids, rows ascending within an expert); ``tokens`` their tokens."""

    num_tokens: int  # T
    top_k: int  # K
    experts: tuple[int, ...]  # distinct experts, ascending
    order: torch.Tensor  # [S] int64 pair rows grouped by expert, on the model's device
    tokens: torch.Tensor  # [S] int64 the token of each row of ``order`` (row // K)
    spans: dict[int, tuple[int, int]]  # expert -> (start, end) of its rows in ``order``
    weights: torch.Tensor  # [S] routing weight of each pair row (router dtype)

    @property
    def rows(self) -> dict[int, torch.Tensor]:
        """expert -> [n] int64 rows into the S pairs (views of ``order``)."""
        return {e: self.order[a:b] for e, (a, b) in self.spans.items()}

    def group(self, experts: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
        """The pair rows and tokens of ``experts`` (in that order) and each expert's (start, end)
        within them. The layer's whole expert set, or a run of it in ascending order, is a view."""
        spans = self.spans
        first, last = spans[experts[0]][0], spans[experts[-1]][1]
        bounds = []
        at = 0
        contiguous = True
        for e in experts:
            a, b = spans[e]
            contiguous = contiguous and a == first + at
            bounds.append((at, at + b - a))
            at += b - a
        if contiguous and last - first == at:
            return self.order[first:last], self.tokens[first:last], bounds
        pieces = [spans[e] for e in experts]
        return (
            torch.cat([self.order[a:b] for a, b in pieces]),
            torch.cat([self.tokens[a:b] for a, b in pieces]),
            bounds,
        )


def route(
    top_k_index: torch.Tensor, top_k_weights: torch.Tensor, host_index: np.ndarray | None = None
) -> Routing:
    """Group the S = T*K (token, k) pairs by expert.

    ``top_k_index`` [T, K] int64, ``top_k_weights`` [T, K] float, on the model's device;
    ``host_index`` the same indices already on the host ([S] or [T, K] integers), as the runtime
    fetches them (its one device→host transfer per layer). Without it they are fetched here. The
    experts and their row counts are found on the host (the experts must be known there to ask
    the daemon anyway); the row order is built where the model runs: on the CPU from the host
    copy (no copy back), on a GPU by a stable sort there, so nothing is copied host→device.
    """
    num_tokens, top_k = top_k_index.shape
    if host_index is None:
        host_index = top_k_index.reshape(-1).cpu().numpy()
    flat = np.asarray(host_index).reshape(-1).astype(np.int64, copy=False)  # [S]
    order_np = np.argsort(flat, kind="stable")
    spans = _spans(flat[order_np])
    if top_k_index.device.type == "cpu":
        order = torch.from_numpy(order_np)
        tokens = torch.from_numpy(order_np // top_k)
    else:
        order = torch.sort(top_k_index.reshape(-1), stable=True).indices
        tokens = torch.div(order, top_k, rounding_mode="floor")
    return Routing(
        num_tokens=num_tokens,
        top_k=top_k,
        experts=tuple(spans),
        order=order,
        tokens=tokens,
        spans=spans,
        weights=top_k_weights.reshape(-1),
    )


def _spans(grouped: np.ndarray) -> dict[int, tuple[int, int]]:
    """expert -> (start, end) of its run in ``grouped`` (expert ids, sorted ascending)."""
    if grouped.size > 64:  # a prompt chunk or a large batch: vectorised
        starts = np.flatnonzero(np.r_[True, grouped[1:] != grouped[:-1]])
        ends = np.r_[starts[1:], grouped.size]
        return {
            int(grouped[a]): (int(a), int(b)) for a, b in zip(starts.tolist(), ends.tolist(), strict=True)
        }
    ids = grouped.tolist()  # a decode step: a few pairs, faster in Python
    spans = {}
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[start]:
            spans[ids[start]] = (start, i)
            start = i
    return spans


def waves(experts: Sequence[int], num_slots: int) -> list[tuple[int, ...]]:
    """Split a layer's experts into groups that fit in the arena at once (≤ num_slots each)."""
    if num_slots < 1:
        raise FailedPrecondition("the cache daemon's arena has no slots: raise its device budget")
    return [tuple(experts[i : i + num_slots]) for i in range(0, len(experts), num_slots)]


# -- compute stage -----------------------------------------------------------------------------
class ExpertsPass:
    """The experts module's math over a set of experts (a wave, or a batch of one), in two halves.

    ``up(expert, param)`` runs the expert's first projection (``gate_up_proj``, or ``up_proj``) on
    its rows, into one buffer for every row of the set, as soon as the expert is pinned;
    ``finish()`` then runs the activation over every row at once, each expert's ``down_proj``,
    the optional post-expert norm and the routing weights, and hands back (rows [n] into the S
    pairs, weighted outputs [n, H]). Like grouped_mm's groups: a GEMM per expert on its rows, then
    ``out.add_(bias)`` (``_grouped_linear``); the input is brought to the weight's dtype. The calls
    that are not GEMMs run once per set, however the experts arrived. ``param(name)`` is the
    expert's tensor (``gate_up_proj`` [2I, H] or [H, 2I] when transposed, ``down_proj`` [H, I] /
    [I, H], optional ``*_bias``); each is used before the next is asked for (decoded weights share
    a scratch buffer per tensor)."""

    def __init__(
        self, module: torch.nn.Module, experts: Sequence[int], hidden_states: torch.Tensor, routing: Routing
    ) -> None:
        self.module = module
        self.rows, tokens, self.bounds = routing.group(experts)
        self.x = hidden_states.index_select(0, tokens)  # [n, H]
        self.routing = routing
        self.index = {e: i for i, e in enumerate(experts)}
        self.has_bias = bool(module.has_bias)
        self.transposed = bool(module.is_transposed)
        self.first_name = "gate_up_proj" if module.has_gate else "up_proj"
        self.first: torch.Tensor | None = None  # [n, 2I] (or [n, I]) first projection
        self.params: list[Callable[[str], torch.Tensor] | None] = [None] * len(experts)

    def _linear(self, out: torch.Tensor | None, x: torch.Tensor, i: int, name: str) -> torch.Tensor:
        """Expert i's projection ``name`` of its rows of ``x`` into its rows of ``out`` (made on
        the first call); returns ``out``."""
        weight = self.params[i](name)
        a, b = self.bounds[i]
        whole = len(self.bounds) == 1
        xi = x if whole else x[a:b]
        if xi.dtype != weight.dtype:
            xi = xi.to(weight.dtype)
        w = weight if self.transposed else weight.t()
        if whole:
            out = torch.mm(xi, w)
            rows = out
        else:
            if out is None:
                out = torch.empty(x.shape[0], w.shape[1], dtype=weight.dtype, device=x.device)
            rows = out[a:b]
            torch.mm(xi, w, out=rows)
        if self.has_bias:
            rows.add_(self.params[i](name + "_bias"))
        return out

    def up(self, expert: int, param: Callable[[str], torch.Tensor]) -> None:
        i = self.index[expert]
        self.params[i] = param
        self.first = self._linear(self.first, self.x, i, self.first_name)

    def finish(self) -> tuple[torch.Tensor, torch.Tensor]:
        module = self.module
        assert self.first is not None and all(p is not None for p in self.params), "an expert never came up"
        proj = module._apply_gate(self.first) if module.has_gate else module.act_fn(self.first)  # [n, I]
        out = None
        for i in range(len(self.bounds)):
            out = self._linear(out, proj, i, "down_proj")  # [n, H]
        if getattr(module, "has_post_expert_norm", False):
            out = module.post_expert_norm(out)
        # [n, H] * [n, 1]: promotes like transformers (bf16 output x fp32 router weight → fp32).
        return self.rows, out * self.routing.weights.index_select(0, self.rows).unsqueeze(-1)


# -- combine stage -----------------------------------------------------------------------------
class Combiner:
    """Collects the weighted outputs into the [S, H] pair buffer and reduces it over k."""

    def __init__(self, routing: Routing, hidden_states: torch.Tensor) -> None:
        self._routing = routing
        self._hidden = hidden_states  # [T, H]
        self._pairs: torch.Tensor | None = None  # [S, H], dtype of the first weighted output

    def add(self, rows: torch.Tensor, weighted: torch.Tensor) -> None:
        """``weighted`` [n, H] are the outputs of pair rows ``rows`` [n]."""
        if self._pairs is None:
            s = self._routing.num_tokens * self._routing.top_k
            # Every pair row belongs to one expert, and every expert is computed: no zero fill.
            self._pairs = weighted.new_empty(s, self._hidden.shape[-1])
        self._pairs.index_copy_(0, rows, weighted.to(self._pairs.dtype))

    def float_pairs(self) -> np.ndarray:
        """The [S, H] pair buffer as float32, for a writer that fills rows in place (the fused
        kernel); a buffer an earlier batch made in another dtype is converted once."""
        if self._pairs is None:
            s = self._routing.num_tokens * self._routing.top_k
            self._pairs = self._hidden.new_empty(s, self._hidden.shape[-1], dtype=torch.float32)
        elif self._pairs.dtype != torch.float32:
            self._pairs = self._pairs.float()
        return self._pairs.numpy()

    def result(self) -> torch.Tensor:
        """[T, H] in the hidden states' dtype: sum over k in the same order as transformers."""
        if self._pairs is None:
            return torch.zeros_like(self._hidden)
        t, k = self._routing.num_tokens, self._routing.top_k
        return self._pairs.view(t, k, -1).sum(dim=1).to(self._hidden.dtype)
