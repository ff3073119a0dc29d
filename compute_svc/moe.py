"""The MoE experts forward over the daemon's arena, plugged into transformers' ExpertsInterface.

transformers routes (router → ``top_k_index``/``top_k_weights``) and then calls the experts
module's forward, which dispatches on ``config._experts_implementation``. Registering
``"expertcache"`` there replaces only the expert math; attention, routers, shared experts and
everything else stay the model's own code. The forward runs in four stages::

    top_k_index [T,K] int64 ──route──▶ Routing (distinct experts, their rows of the T·K pairs)
                                          │  waves of ≤ num_slots experts
                                          ▼
                     acquire ──▶ ReadyExpert(expert, slot, source) in readiness order
                                          │  as each arrives (resident ones first)
                                          ▼
                     compute ──▶ ExpertOutput(rows, weighted [n,H]) from arena views
                                          │
                                          ▼
                     combine ──▶ [T·K,H] → view [T,K,H] → sum(dim=1) → [T,H]

then the wave's experts are released (unpinned) so the daemon may evict them. The math mirrors
transformers' ``batched_mm``/``grouped_mm`` experts forward (``integrations/moe.py``): same
projections, the module's own ``_apply_gate``/``act_fn``, optional biases and post-expert norm,
routing weights applied per (token, k) pair and a final reshape+sum over k, so the output equals
the plain model's.

Before the route stage, when set: forced routing (``compute_svc.forced_routing``, a benchmark
feature) replaces the router's choice by a trace's; after it, one-way signals go to the daemon
without a round trip: ``routed`` (this layer's distinct experts) and, from the next layer's router
on this layer's input, ``layer_ahead`` (``compute_svc.layer_ahead``). At prefill both name the
union over the prompt's tokens, at the position of its last token.

Glossary: T tokens in the call, K = top-k, H = hidden size, S = T·K (token, k) pairs; a *row*
is an index into the S pairs (row = token·K + k). Example: T=2, K=2, top_k_index=[[3,1],[1,6]]
→ experts (1, 3, 6); expert 1 owns rows [1, 2] (token 0 k=1, token 1 k=0).
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch
from transformers.integrations.moe import ExpertsInterface

from compute_svc.arena import Arena
from compute_svc.errors import FailedPrecondition
from expertcache.keys import ExpertKey
from expertcache.manifest import TensorLayout

if TYPE_CHECKING:
    from compute_svc.forced_routing import ForcedRouting
    from compute_svc.layer_ahead import LayerAheadPredictor

logger = logging.getLogger(__name__)

IMPLEMENTATION = "expertcache"  # the key in transformers' ExpertsInterface
LAYER_ATTR = "expertcache_layer"  # decoder layer index tagged on each experts module
RUNTIME_ATTR = "expertcache_runtime"  # the ExpertRuntime tagged on each experts module


# -- acquire stage: what the cache daemon hands out ----------------------------------------------
class Tier(enum.Enum):
    """Memory tier an expert was found in when it was asked for."""

    DEVICE = "device"
    HOST = "host"
    STORE = "store"
    UNKNOWN = "unknown"


class ReadyExpert(NamedTuple):
    """One expert resident in arena ``slot`` and pinned for this process."""

    expert: int
    slot: int
    source: Tier


class ExpertProvider(Protocol):
    """Hands out pinned arena slots (implemented by ``cache_client.DaemonClient``).

    ``acquire`` yields one ``ReadyExpert`` per requested expert in readiness order; the slot
    stays pinned until ``release``. Closing the iterator early drops every pin it holds.
    """

    def acquire(self, layer: int, experts: Sequence[int]) -> Iterator[ReadyExpert]: ...

    def release(self, layer: int, experts: Sequence[int]) -> None: ...


# Optional one-way provider methods (``cache_client.DaemonClient`` has them; a provider without
# them simply gets no signals): ``begin_request(request_id)``, ``end_request(request_id)``,
# ``routed(token, layer, experts)``, ``layer_ahead(token, layer, experts, scores)``.
_SIGNALS = ("begin_request", "end_request", "routed", "layer_ahead")


# -- route stage -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Routing:
    """Which (token, k) rows each distinct expert serves."""

    num_tokens: int  # T
    top_k: int  # K
    experts: tuple[int, ...]  # distinct experts, ascending
    rows: dict[int, torch.Tensor]  # expert -> [n] int64 rows into the S = T*K pairs
    weights: torch.Tensor  # [S] routing weight of each row (router dtype)


def route(top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> Routing:
    """Group the S = T*K (token, k) pairs by expert.

    ``top_k_index`` [T, K] int64, ``top_k_weights`` [T, K] float. One host sync (the
    ``tolist``) per call: the experts must be known on the host to ask the daemon anyway.
    """
    num_tokens, top_k = top_k_index.shape
    flat = top_k_index.reshape(-1)  # [S]
    order = torch.argsort(flat, stable=True)  # [S] rows grouped by expert, ascending
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    rows: dict[int, torch.Tensor] = {}
    start = 0
    for expert, count in zip(experts.tolist(), counts.tolist(), strict=True):
        rows[expert] = order[start : start + count]
        start += count
    return Routing(
        num_tokens=num_tokens,
        top_k=top_k,
        experts=tuple(rows),
        rows=rows,
        weights=top_k_weights.reshape(-1),
    )


def waves(experts: Sequence[int], num_slots: int) -> list[tuple[int, ...]]:
    """Split a layer's experts into groups that fit in the arena at once (≤ num_slots each)."""
    if num_slots < 1:
        raise FailedPrecondition("the cache daemon's arena has no slots: raise its device budget")
    return [tuple(experts[i : i + num_slots]) for i in range(0, len(experts), num_slots)]


# -- compute stage -----------------------------------------------------------------------------
@dataclass(frozen=True)
class ExpertOutput:
    """One expert's contribution: weighted outputs for its rows."""

    expert: int
    rows: torch.Tensor  # [n] int64 rows into the S pairs
    weighted: torch.Tensor  # [n, H] expert(x) * routing weight


def _linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, is_transposed: bool
) -> torch.Tensor:
    """x [n, in] with weight [out, in] (or [in, out] when transposed) → [n, out], like ``_batched_linear``."""
    # Like grouped_mm, the input is brought to the weight's dtype (autocast-style mixes).
    x = x.to(weight.dtype)
    out = x @ weight if is_transposed else x @ weight.transpose(0, 1)
    if bias is not None:
        out.add_(bias)
    return out


def compute_expert(
    module: torch.nn.Module,
    expert: int,
    weights: dict[str, torch.Tensor],
    hidden_states: torch.Tensor,
    routing: Routing,
) -> ExpertOutput:
    """Run ``expert`` on its rows with the experts ``module``'s own math and arena ``weights``.

    ``weights`` maps the module's parameter names to this expert's tensors (``gate_up_proj``
    [2I, H] or [H, 2I] when transposed, ``down_proj`` [H, I] / [I, H], optional ``*_bias``).
    """
    rows = routing.rows[expert]  # [n]
    x = hidden_states[rows // routing.top_k]  # [n, H]
    has_bias = bool(module.has_bias)
    transposed = bool(module.is_transposed)
    if module.has_gate:
        proj = _linear(
            x, weights["gate_up_proj"], weights.get("gate_up_proj_bias") if has_bias else None, transposed
        )
        proj = module._apply_gate(proj)  # [n, I]
    else:
        proj = _linear(x, weights["up_proj"], weights.get("up_proj_bias") if has_bias else None, transposed)
        proj = module.act_fn(proj)  # [n, I]
    out = _linear(proj, weights["down_proj"], weights.get("down_proj_bias") if has_bias else None, transposed)
    if getattr(module, "has_post_expert_norm", False):
        out = module.post_expert_norm(out)
    # [n, H] * [n, 1]: promotes like transformers (bf16 output x fp32 router weight → fp32).
    return ExpertOutput(expert=expert, rows=rows, weighted=out * routing.weights[rows].unsqueeze(-1))


# -- combine stage -----------------------------------------------------------------------------
class Combiner:
    """Collects ExpertOutputs into the [S, H] pair buffer and reduces it over k."""

    def __init__(self, routing: Routing, hidden_states: torch.Tensor) -> None:
        self._routing = routing
        self._hidden = hidden_states  # [T, H]
        self._pairs: torch.Tensor | None = None  # [S, H], dtype of the first weighted output

    def add(self, output: ExpertOutput) -> None:
        if self._pairs is None:
            s = self._routing.num_tokens * self._routing.top_k
            self._pairs = output.weighted.new_zeros(s, self._hidden.shape[-1])
        self._pairs[output.rows] = output.weighted.to(self._pairs.dtype)

    def result(self) -> torch.Tensor:
        """[T, H] in the hidden states' dtype: sum over k in the same order as transformers."""
        if self._pairs is None:
            return torch.zeros_like(self._hidden)
        t, k = self._routing.num_tokens, self._routing.top_k
        return self._pairs.view(t, k, -1).sum(dim=1).to(self._hidden.dtype)


# -- the runtime the experts modules are tagged with ---------------------------------------------
@dataclass
class CacheCounters:
    """Expert cache activity since the last ``reset`` (one token, for the engine)."""

    hits: int = 0  # experts found in the device arena
    misses: int = 0  # experts fetched from host or store
    stall_s: float = 0.0  # time spent waiting for experts
    layer_ahead_s: float = 0.0  # time spent predicting the next layer's experts
    by_tier: dict[Tier, int] = field(default_factory=dict)

    def record(self, source: Tier) -> None:
        if source is Tier.DEVICE:
            self.hits += 1
        else:
            self.misses += 1
        self.by_tier[source] = self.by_tier.get(source, 0) + 1


class ExpertRuntime:
    """Executes every MoE layer's experts from the daemon's arena.

    One per process, shared by all experts modules (tagged by ``attach``); used from the single
    scheduler worker thread only, so its counters need no lock.
    """

    def __init__(self, provider: ExpertProvider, arena: Arena, layouts: tuple[TensorLayout, ...]) -> None:
        self.provider = provider
        self.arena = arena
        self.layouts = layouts
        self.counters = CacheCounters()
        # Views are fixed per slot (same layout in every slot): build them once.
        self._slot_views = [arena.slot_views(slot, layouts) for slot in range(arena.num_slots)]
        self._sync = torch.cuda.synchronize if arena.device.type == "cuda" else None
        # Optional ``(layer, top_k_index [T, K] int64, top_k_weights [T, K])`` callback, called
        # once per MoE layer per forward: how generation captures each token's routing for the
        # predictor and the trace recorder (compute_svc.activations.RoutingCapture).
        self.routing_observer: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None
        # Layer-ahead prediction (compute_svc.layer_ahead) and forced routing from a trace
        # (compute_svc.forced_routing, a benchmark feature); both off unless set.
        self.layer_ahead: LayerAheadPredictor | None = None
        self.forced: ForcedRouting | None = None
        # Where the running forward is in its request: ``step`` counts forwards (0 = prefill),
        # ``position`` is the request position of the forward's last token (what signals name).
        self.step = 0
        self.position = 0
        self.request_id = ""  # of the running Generate, as the daemon is told
        self._signals = {name: getattr(provider, name, None) for name in _SIGNALS}

    @property
    def num_slots(self) -> int:
        return self.arena.num_slots

    def reset_counters(self) -> CacheCounters:
        """Return the counters since the last reset and start new ones."""
        counters, self.counters = self.counters, CacheCounters()
        return counters

    def begin_request(self, request_id: str) -> None:
        """A Generate starts: forced routing moves to its next trace request, the daemon is told."""
        self.step = self.position = 0
        self.request_id = request_id
        if self.forced is not None:
            self.forced.begin_request()
        if self._signals["begin_request"] is not None:
            self._signals["begin_request"](request_id)

    def end_request(self, request_id: str) -> None:
        if self._signals["end_request"] is not None:
            self._signals["end_request"](request_id)

    def begin_step(self, step: int, position: int) -> None:
        """The next forward is the request's ``step``-th; its last token sits at ``position``."""
        self.step, self.position = step, position

    def forward(
        self,
        module: torch.nn.Module,
        layer: int,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        """hidden_states [T, H], top_k_index [T, K] int64, top_k_weights [T, K] → [T, H]."""
        if self.forced is not None:
            top_k_index, top_k_weights = self.forced.routing(self.step, layer, top_k_index, top_k_weights)
        if self.routing_observer is not None:
            self.routing_observer(layer, top_k_index, top_k_weights)
        routing = route(top_k_index, top_k_weights)
        self._send_signals(layer, hidden_states, routing)
        combiner = Combiner(routing, hidden_states)
        for wave in waves(routing.experts, self.num_slots):
            self._run_wave(module, layer, wave, hidden_states, routing, combiner)
        return combiner.result()

    def _send_signals(self, layer: int, hidden_states: torch.Tensor, routing: Routing) -> None:
        """Tell the daemon what layer ``layer`` routed to and, before its experts run, what the
        next layers will likely need (one prediction per lookahead depth, all brought to the
        host in one transfer). One-way messages: no round trip on the step."""
        routed = self._signals["routed"]
        if routed is not None:
            routed(self.position, layer, routing.experts)
        send = self._signals["layer_ahead"]
        if self.layer_ahead is None or send is None:
            return
        started = time.perf_counter()
        predictions = self.layer_ahead.predict(layer, hidden_states)
        if self.forced is not None:
            predictions = tuple(self.forced.layer_ahead(self.step, p) for p in predictions)
        self.counters.layer_ahead_s += time.perf_counter() - started
        predictions = tuple(p for p in predictions if p.experts)
        if predictions:
            send(self.position, predictions)

    def _run_wave(
        self,
        module: torch.nn.Module,
        layer: int,
        wave: tuple[int, ...],
        hidden_states: torch.Tensor,
        routing: Routing,
        combiner: Combiner,
    ) -> None:
        ready_iter = self.provider.acquire(layer, wave)
        done = False
        try:
            pending = set(wave)
            while True:
                waited = time.perf_counter()
                ready = next(ready_iter, None)
                self.counters.stall_s += time.perf_counter() - waited
                if ready is None:
                    break
                if ready.expert not in pending:
                    raise FailedPrecondition(
                        f"cache daemon answered {ExpertKey(layer, ready.expert)}, which was not asked for "
                        f"(wave {list(wave)})"
                    )
                pending.discard(ready.expert)
                self.counters.record(ready.source)
                # Reordered execution: run each expert as soon as it is pinned.
                combiner.add(
                    compute_expert(module, ready.expert, self._slot_views[ready.slot], hidden_states, routing)
                )
            if pending:
                raise FailedPrecondition(
                    f"cache daemon finished the acquire of layer {layer} without experts {sorted(pending)}"
                )
            done = True
        finally:
            if not done:
                # Closing the iterator drops the stream and with it every pin it holds.
                close = getattr(ready_iter, "close", None)
                if close is not None:
                    close()
        if self._sync is not None:
            # Kernels reading the slots are asynchronous: they must finish before the daemon is
            # allowed to overwrite the slots.
            self._sync()
        self.provider.release(layer, wave)


def attach(
    model: torch.nn.Module, sites: Sequence[tuple[int, torch.nn.Module]], runtime: ExpertRuntime
) -> None:
    """Tag each ``(layer, experts module)`` so the registered forward finds its layer and runtime."""
    for layer, module in sites:
        setattr(module, LAYER_ATTR, layer)
        setattr(module, RUNTIME_ATTR, runtime)


def expertcache_experts_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """The ``"expertcache"`` entry of transformers' ExpertsInterface (``self`` is the experts module)."""
    runtime = getattr(self, RUNTIME_ATTR, None)
    if runtime is None:
        raise FailedPrecondition(
            f"{type(self).__name__} uses experts_implementation={IMPLEMENTATION!r} but was never attached "
            "to an ExpertRuntime (compute_svc.moe.attach)"
        )
    return runtime.forward(self, getattr(self, LAYER_ATTR), hidden_states, top_k_index, top_k_weights)


# Registered on import so that build_skeleton(config, experts_implementation="expertcache") passes
# transformers' check of valid implementations.
ExpertsInterface.register(IMPLEMENTATION, expertcache_experts_forward)
