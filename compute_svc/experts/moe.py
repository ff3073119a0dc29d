"""The MoE experts forward over the daemon's arena, plugged into transformers' ExpertsInterface.

Registering ``"expertcache"`` there replaces only the expert math: the forward routes, acquires
pinned arena slots from the daemon (``ExpertProvider``), computes (``compute_svc.experts.stages``,
or the native ``fused``/``slots`` paths) and releases. Stages and signals: docs/compute.md."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol

import numpy as np
import torch
from transformers.integrations.moe import ExpertsInterface

from compute_svc.errors import ExpertCacheError, FailedPrecondition
from compute_svc.experts.arena import Arena
from compute_svc.experts.fused import (
    FusedExperts,
    FusedKernel,
    FusedLayer,
    RoutedLayer,
    decode_sized,
    storage_view,
)
from compute_svc.experts.slots import MAX_TOKENS as SLOT_MAX_TOKENS
from compute_svc.experts.slots import SlotExperts, SlotLayer
from compute_svc.experts.stages import Combiner, ExpertsPass, Routing, route, waves
from compute_svc.experts.weights import ExpertDecoder
from expertcache import native, telemetry
from expertcache.keys import ExpertKey
from expertcache.manifest import ExpertTensor
from expertcache.protocol import GATHER_BELOW_BYTES, TIER_OF_CHANNEL_CODE, Tier

if TYPE_CHECKING:
    from compute_svc.experts.layer_ahead import DevicePrediction, LayerAheadPredictor, Prediction

logger = logging.getLogger(__name__)

IMPLEMENTATION = "expertcache"  # the key in transformers' ExpertsInterface
LAYER_ATTR = "expertcache_layer"  # decoder layer index tagged on each experts module
RUNTIME_ATTR = "expertcache_runtime"  # the ExpertRuntime tagged on each experts module

SPAN_LOADING_WAIT_S = 0.02
"""How long a native span waits, in all, for the experts of a layer that are in flight (LOADING:
the daemon prefetched them) and none absent, before it demands the layer's misses
(``ExpertFfn.run_layers``' ``loading_wait_s``). Such a layer then stays in the span: no return to
Python, no demand for the daemon to admit; measured at the e2e shape (mxfp4, 25%), 38% of the
layers a span stopped at were of this kind (1,220 of 3,182), and their waits took 0.25 ms at the
median, 1.9 ms at p99. A load that has not landed by then waits behind something else: the demand
promotes it (its unissued chunks go first), and the wait can be interrupted there."""


# -- acquire stage: what the cache daemon hands out ----------------------------------------------
class ReadyExpert(NamedTuple):
    """One expert resident in arena ``slot`` and pinned for this process."""

    expert: int
    slot: int
    source: Tier


class ExpertProvider(Protocol):
    """Hands out pinned arena slots (implemented by ``compute_svc.daemon.client.DaemonClient``).

    ``acquire`` yields one ``ReadyExpert`` per requested expert in readiness order; the slot stays
    pinned until ``release``. A wait never goes beyond ``deadline`` (``time.monotonic()``).
    Closing the generator early drops every pin it holds. ``acquire_batches`` (same arguments)
    yields the same experts in batches of what became ready together (the resident ones first,
    then the loads as they land): the runtime computes a batch's experts together.

    The one-way signals to the daemon (``begin_step``, ``begin_request``, ``end_request``,
    ``routed``, ``layer_ahead``) do nothing here: a provider that subclasses this without them
    simply sends none. ``with_acquire=True``: an acquire follows at once, and the message may
    travel with it.

    Optional (looked up, not required): ``run_resident(layer, experts, run) -> bool``, a whole
    layer in one call where every expert is resident (see ``DaemonClient.run_resident``).
    """

    def acquire(
        self,
        layer: int,
        experts: Sequence[int],
        *,
        deadline: float | None = None,
        trace_context: dict[str, str] | None = None,
    ) -> Generator[ReadyExpert, None, None]: ...

    def release(self, layer: int, experts: Sequence[int]) -> None: ...

    def acquire_batches(
        self,
        layer: int,
        experts: Sequence[int],
        *,
        deadline: float | None = None,
        trace_context: dict[str, str] | None = None,
    ) -> Generator[list[ReadyExpert], None, None]:
        """By default each expert of ``acquire`` is a batch of its own; closing this generator
        closes ``acquire``'s (which drops its pins)."""
        it = self.acquire(layer, experts, deadline=deadline, trace_context=trace_context)
        try:
            for ready in it:
                yield [ready]
        finally:
            it.close()

    def begin_step(self) -> None:
        """A new step starts (a provider forgets an interrupt of an earlier one)."""

    def begin_request(self, request_id: str) -> None:
        """A request starts."""

    def end_request(self, request_id: str) -> None:
        """A request ended."""

    def routed(
        self, request_id: str, token: int, layer: int, experts: Sequence[int], *, with_acquire: bool = False
    ) -> None:
        """Layer ``layer`` of token ``token`` of ``request_id`` was routed to ``experts``."""

    def layer_ahead(
        self, request_id: str, token: int, predictions: Sequence[Prediction], *, with_acquire: bool = False
    ) -> None:
        """The experts the next layers of token ``token`` of ``request_id`` will likely need."""


# -- the runtime the experts modules are tagged with ---------------------------------------------
@dataclass(frozen=True)
class StepSegment:
    """One request's rows in a forward: ``rows`` tokens from row ``start``, at request positions
    ``position .. position + rows - 1``. ``step`` counts the request's generated tokens fed
    before (0 while its prompt is fed, i when feeding its generated token i - 1)."""

    request_id: str
    start: int
    rows: int
    position: int
    step: int

    @property
    def last_position(self) -> int:
        return self.position + self.rows - 1


class SpanSignals(NamedTuple):
    """What a span of natively run decode layers needs to tell the daemon each layer's route and
    lookahead itself (``DaemonClient.run_layer``): row r of the step is ``request_ids[r]``'s token
    at position ``tokens[r]``; ``ahead`` [layers * depth] is the layer predicted at depth d + 1
    from layer l (-1: none), depth 0 where nothing is predicted."""

    request_ids: tuple[str, ...]
    tokens: tuple[int, ...]
    top_k: int
    layers: int
    depth: int
    ahead: tuple[int, ...]


class RoutingOverride(Protocol):
    """Replaces the router's choice before the route stage (``ExpertRuntime.routing_override``).

    The service never makes one: a benchmark entry point installs it (``replay.forced_compute``
    takes the experts from a recorded trace). Called from the generation thread only; the router
    still runs, so its cost stays real.

    Optional (looked up): ``step_routing(segments, device, dtype)``, every MoE layer's routing of
    a one-token forward at once ((ids [L, 1, K], weights [L, 1, K]) as ``routing`` gives them
    layer by layer, or None), which ``ExpertRuntime.resident_layers`` takes; with layer-ahead on,
    also ``step_lookahead(segments, ahead, depth)``, what ``layer_ahead`` makes of every layer's
    predictions of such a forward at once (ids [L, depth, K] int64, scores [L, depth, K] float32,
    each prediction as ``layer_ahead`` returns it, for the layers ``ahead`` [L * depth] names; or
    None), without the router's own picks, which a span of native layers does not hand out."""

    def begin_request(self, request_id: str) -> object: ...

    def end_request(self, request_id: str) -> None: ...

    def routing(
        self,
        segments: Sequence[StepSegment],
        layer: int,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(top_k_index [T, K] int64, top_k_weights [T, K]) to use in decoder layer ``layer``, on
        the router's device and in its dtype; ``segments`` say whose rows are where."""
        ...

    def layer_ahead(self, segment: StepSegment, predicted: Prediction) -> Prediction:
        """What to send the daemon in place of the router's lookahead ``predicted``."""
        ...


@dataclass
class CacheCounters:
    """Expert cache activity since the last ``reset`` (one token, for the engine)."""

    hits: int = 0  # experts found in the device arena
    misses: int = 0  # experts fetched from host or store
    stall_s: float = 0.0  # time spent waiting for experts
    layers: int = 0  # MoE layer forwards
    host_transfers: int = 0  # device→host transfers (one per MoE layer: routing + lookahead)
    event_waits: int = 0  # waits for a wave's kernels before its slots are reused (waves only)
    layer_ahead_s: float = 0.0  # time spent predicting the next layer's experts
    by_tier: dict[Tier, int] = field(default_factory=dict)
    acquire_waits: list[float] = field(default_factory=list)  # seconds, one per acquire (wave)

    def record(self, source: Tier) -> None:
        if source is Tier.DEVICE:
            self.hits += 1
        else:
            self.misses += 1
        self.by_tier[source] = self.by_tier.get(source, 0) + 1


class ArenaReader:
    """How the runtime reads experts out of one arena: each slot's views (one layout in every
    slot: built once) and the native paths that apply to it. A new arena gets a new reader
    (``ExpertRuntime.remap``)."""

    def __init__(
        self, arena: Arena, layouts: tuple[ExpertTensor, ...], *, fused: bool, slotted: bool | None
    ) -> None:
        self.arena = arena
        self.layouts = layouts
        self.fused_enabled = fused
        self.slotted_enabled = slotted
        self.views = [arena.slot_views(slot, layouts) for slot in range(arena.num_slots)]
        # On a GPU the experts' kernels run asynchronously: a wave's slots may be released only
        # once its kernels are done (``ExpertRuntime._unreleased``).
        self.cuda = arena.device.type == "cuda"
        # Experts small enough that the calls around their GEMMs cost more than their copies:
        # a wave is then computed in one pass whatever the batches it arrives in.
        self.small_experts = arena.slot_bytes < GATHER_BELOW_BYTES
        # Decode-sized layers on a CPU arena: the native fused kernel reads the experts in place.
        self.fused = (
            FusedExperts(arena.slots, layouts) if fused and FusedExperts.supports(arena.slots) else None
        )
        # Decode-sized layers on a GPU arena: the experts read by slot index in one fixed sequence
        # of kernels, replayed as a CUDA graph (compute_svc.experts.slots). ``slotted``: None = on a
        # GPU only; True also on a CPU, without graphs (tests).
        wanted = self.cuda if slotted is None else slotted
        self.slotted = (
            SlotExperts(arena.slots, layouts)
            if wanted and SlotExperts.supports(arena.slots, layouts)
            else None
        )

    def remapped(self, arena: Arena) -> ArenaReader:
        """The same reader over ``arena`` (a restarted daemon's; same layout and device)."""
        return ArenaReader(arena, self.layouts, fused=self.fused_enabled, slotted=self.slotted_enabled)


class SpanStop(NamedTuple):
    """Where ``ResidentLayers.run_from`` stopped."""

    layer: int
    """The first layer whose experts did not run (its dense half did), or the number of layers
    when every layer ran; ``first`` when nothing ran."""
    attended: bool
    """Its dense half ran: ``ExpertRuntime.forward`` serves its experts. False when nothing ran
    (the provider does not take layers now: the caller runs them one by one)."""
    signalled: bool
    """The span already told the daemon that layer's signals (its route and lookahead):
    ``forward(..., signalled=True)``."""
    missed: bool
    """It stopped for an expert that was not resident (``forward(..., missed=True)``): with no
    demand of its own, or one whose wait did not end well (handed back: the layer's acquire adopts
    its pins and its demand, ``DaemonClient.acquire_batches``)."""


@dataclass
class _StepCounts:
    """What a step's native layers ran, counted at its end (``ExpertRuntime.count_resident``)."""

    layers: int = 0
    experts: int = 0
    waited: int = 0  # of the experts, the ones in flight a span waited for (misses)
    demanded: list[Tier] = field(default_factory=list)  # of the experts, those a span demanded: sources
    waits: list[float] = field(default_factory=list)  # each layer's wait for either
    lost_s: float = 0.0  # a span's wait in vain at the layer it stopped at


class ResidentLayers:
    """One CPU decode step's MoE layers through the fused kernel, the step's buffers bound once
    (``ExpertRuntime.resident_layers``): spans of layers in one call each (``run_from``), or one
    layer at a time (``run``), each through the provider's ``run_layer``. ``finish`` counts what
    ran."""

    def __init__(
        self,
        runtime: ExpertRuntime,
        run_layer: Callable[..., int],
        fused: FusedExperts,
        index: torch.Tensor,
        weights: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor,
        signals: tuple[SpanSignals, tuple[np.ndarray, np.ndarray] | None] | None = None,
    ) -> None:
        self._runtime = runtime
        self._run_layer = run_layer
        self._fused = fused
        # (what spans tell the daemon, the override's lookahead as given or None); None: nothing.
        self._signals = signals
        self._index, self._weights = index, weights  # [L, R, K]
        self._hidden, self._residual = hidden_states, residual
        # numpy views of the same memory: the routing of every layer as [L, R * K] rows
        self._ids = index.numpy().reshape(index.shape[0], -1)
        self._w = (weights.numpy() if weights.dtype == torch.float32 else storage_view(weights)).reshape(
            weights.shape[0], -1
        )
        self._kernel: tuple[FusedKernel, Callable | None] | None = None  # (a kernel, its call)
        # run_from's call (FusedExperts.layer_call with span), False where the step's layers
        # cannot span, None until ``spans`` asks.
        self._span: Callable | bool | None = None
        self._counts = _StepCounts()

    def run(self, module: torch.nn.Module, i: int, layer: int) -> bool:
        """Row ``i`` of the step's routing as decoder layer ``layer`` of ``module``: True when it
        ran (its result added into the residual); False when nothing was done (a miss, or the
        kernel does not take it: ``ExpertRuntime.forward`` serves it)."""
        kernel = self._fused.kernel(module, self._weights.dtype)
        if kernel is None:
            return False
        cached = self._kernel
        if cached is None or cached[0] is not kernel:
            cached = self._kernel = (kernel, self._bind(kernel))
        call = cached[1]
        if call is None:
            return False
        ids, weights = self._ids[i], self._w[i]
        ran = self._run_layer(
            layer, lambda table, num_experts, _: call(table, layer, num_experts, ids, weights)
        )
        if ran <= 0:
            return False
        self._ran(i, range(layer, layer + 1), ran)
        return True

    def spans(self, modules: Sequence[tuple[torch.nn.Module, int]]) -> bool:
        """Whether ``run_from`` may run this step's layers: ``modules`` (each decoder layer's
        experts module and its layer number, in order) share one fused kernel that takes the
        step, and layer ``i`` is MoE layer ``i``. Answered once per step."""
        if self._span is None:
            self._span = False
            kernels = [self._fused.kernel(m, self._weights.dtype) for m, _ in modules]
            kernel = kernels[0] if kernels else None
            if (
                kernel is not None
                and all(k is kernel for k in kernels)
                and all(at == i for i, (_, at) in enumerate(modules))
            ):
                call = self._bind(kernel, span=True)
                if call is not None:
                    self._span = call
        return self._span is not False

    def run_from(self, attention: object, first: int) -> SpanStop:
        """The step's layers from ``first`` on, each its dense half (``attention``, the step's
        begun ``DecodeAttention``) then its experts, in one native call without the GIL (where
        ``spans``), up to the first layer whose experts do not run (``SpanStop``). A layer with
        experts in flight and none absent waits for them (``SPAN_LOADING_WAIT_S``); one with an
        expert absent, or in flight past that wait, demands its misses and waits for them within
        the call, where the provider gives the span a ``native.SpanDemand``, and stops there
        where that wait does not end well (or there is none). The layers that ran are observed and
        counted as ``run`` does: the demanded experts as misses of their tiers."""
        call = self._span
        assert call, "run_from without spans"
        got: list = [first, 0, "", 0, [], 0.0]
        spec, given = self._signals if self._signals is not None else (None, None)
        wrote: list = [False]  # LayerSignals went with the call (a miss layer's then written)

        demanded: list = [None]  # the span's demands (native.SpanDemand), where it could post any

        def run(
            table: object,
            num_experts: int,
            layer_signals: native.LayerSignals | None,
            demand: native.SpanDemand | None = None,
        ) -> int:
            wrote[0] = layer_signals is not None
            demanded[0] = demand
            got[:] = call(
                attention, table, first, num_experts, self._ids, self._w, layer_signals,
                given if layer_signals is not None else None, SPAN_LOADING_WAIT_S, demand,
            )  # fmt: skip
            if got[2] == "stale":
                raise native.StaleClient(f"the daemon took this client's ledger back (layer {got[0]})")
            return -1 if got[2] == "taken" else got[1]

        self._run_layer(first, run, spec, demand=True, deadline=self._runtime.deadline)
        stop, ran, why, waited, waits, lost_s = got
        if stop > first:
            self._ran(first, range(first, stop), ran)
        counts = self._counts
        counts.waited += waited
        counts.waits.extend(waits)
        counts.lost_s += lost_s
        demand = demanded[0]
        if demand is not None:
            counts.demanded.extend(TIER_OF_CHANNEL_CODE.get(code, Tier.UNKNOWN) for code in demand.sources)
            counts.waits.extend(demand.waits)
        missed = why in ("miss", "demand")
        return SpanStop(stop, why != "", missed and wrote[0], missed)

    def _ran(self, row: int, layers: range, experts: int) -> None:
        """``layers`` ran from the step's routing rows ``row`` on (``experts`` experts in all):
        counted, and each handed to the routing observer with its row, in order."""
        self._counts.layers += len(layers)
        self._counts.experts += experts
        observer = self._runtime.routing_observer
        if observer is not None:
            for i, layer in enumerate(layers, start=row):
                observer(layer, self._index[i], self._weights[i])

    def _bind(self, kernel: FusedKernel, *, span: bool = False) -> Callable | None:
        """``kernel``'s run_layer (``span``: its run_layers) with this step's buffers, or None
        where it does not take them (``FusedExperts.layer_call``)."""
        return self._fused.layer_call(
            kernel,
            self._runtime.num_slots,
            self._index.shape[1],
            self._weights.dtype,
            self._hidden,
            self._residual,
            span=span,
        )

    def finish(self) -> None:
        """Count the layers that ran (once, at the end of the step's layers)."""
        counts = self._counts
        if counts.layers or counts.lost_s:
            self._runtime.count_resident(
                counts.layers,
                counts.experts,
                waited=counts.waited,
                demanded=counts.demanded,
                waits=counts.waits,
                lost_s=counts.lost_s,
            )
            self._counts = _StepCounts()


class ExpertRuntime:
    """Executes every MoE layer's experts from the daemon's arena.

    One per process, shared by all experts modules (tagged by ``attach``); used from the single
    scheduler worker thread only, so its counters need no lock.
    """

    def __init__(
        self,
        provider: ExpertProvider,
        arena: Arena,
        layouts: tuple[ExpertTensor, ...],
        *,
        fused: bool = True,
        slotted: bool | None = None,
    ) -> None:
        self.provider = provider
        self.counters = CacheCounters()
        # Stored parts → compute-dtype weights, at the last moment (encoded experts: MXFP4, FP8).
        self.decoder = ExpertDecoder(layouts, arena.device)
        self.reader = ArenaReader(arena, layouts, fused=fused, slotted=slotted)
        # On a GPU a wave records an event on the arena device's current stream and its release
        # waits in ``_unreleased`` until the next host transfer of that stream (the next MoE
        # layer's, or the step's token pick) has passed the event, so a MoE layer costs one host
        # synchronisation, not two.
        self._unreleased: list[tuple[int, tuple[int, ...], torch.cuda.Event | None]] = []
        # Host synchronisations, counted: one device→host transfer per MoE layer (routing and
        # layer-ahead together), and event waits (only between the waves of an oversized layer).
        self.host_transfers = 0
        self.event_waits = 0
        # Optional ``(layer, top_k_index [T, K] int64, top_k_weights [T, K])`` callback, called
        # once per MoE layer per forward: how generation captures each token's routing for the
        # predictor and the trace recorder (compute_svc.engine.activations.RoutingCapture).
        self.routing_observer: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None
        # Layer-ahead prediction (compute_svc.experts.layer_ahead) and a routing override installed
        # from outside the service (``RoutingOverride``); both off unless set.
        self.layer_ahead: LayerAheadPredictor | None = None
        self.routing_override: RoutingOverride | None = None
        # The requests of the running forward: which rows are whose, at which positions
        # (``begin_step``); signals, the routing override and routing capture are per request.
        self.segments: tuple[StepSegment, ...] = ()
        self.deadline: float | None = None
        # The step span's context while this step's MoE layers are traced (expertcache.telemetry:
        # set by the engine for a share trace_layer_ratio of the steps); None = no layer spans.
        self.trace_parent = None

    @property
    def arena(self) -> Arena:
        return self.reader.arena

    @property
    def num_slots(self) -> int:
        return self.reader.arena.num_slots

    def reset_counters(self) -> CacheCounters:
        """Return the counters since the last reset and start new ones."""
        counters, self.counters = self.counters, CacheCounters()
        return counters

    def begin_request(self, request_id: str) -> None:
        """A request starts: the routing override and the daemon are told."""
        if self.routing_override is not None:
            self.routing_override.begin_request(request_id)
        self.provider.begin_request(request_id)

    def end_request(self, request_id: str) -> None:
        if self.routing_override is not None:
            self.routing_override.end_request(request_id)
        self.provider.end_request(request_id)

    def begin_step(self, segments: Sequence[StepSegment], *, deadline: float | None = None) -> None:
        """The next forward holds ``segments``, in row order (one per request); its waits for
        experts end at ``deadline`` (``time.monotonic()``) at the latest."""
        self.segments = tuple(segments)
        self.deadline = deadline
        self.provider.begin_step()  # the provider forgets an interrupt of an earlier step

    def remap(self, arena: Arena) -> None:
        """Read experts from ``arena`` from now on (a restarted daemon's; same layout and device)."""
        if arena.device != self.arena.device:
            raise FailedPrecondition(
                f"the cache daemon's new arena is on {arena.device}, the model on {self.arena.device}: "
                "restart compute"
            )
        self._unreleased.clear()  # those pins went with the old daemon
        self.reader = self.reader.remapped(arena)

    def forward(
        self,
        module: torch.nn.Module,
        layer: int,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        *,
        residual: torch.Tensor | None = None,
        signalled: bool = False,
        missed: bool = False,
    ) -> torch.Tensor:
        """hidden_states [T, H], top_k_index [T, K] int64, top_k_weights [T, K] → [T, H]; with a
        ``residual`` [T, H] the result is added into it in place (in the native combine where the
        layer runs there) and the residual is returned. ``signalled``: the layer's route and
        lookahead were sent already (a native span that stopped at it, ``ResidentLayers.run_from``),
        so neither is made nor sent here. ``missed``: that span stopped for an expert that was not
        resident, so the layer goes straight to its acquire (trying to run it resident first would
        find the same miss, about 37 us of a layer's CPU at the e2e shape)."""
        self.counters.layers += 1
        if self.routing_override is not None:
            top_k_index, top_k_weights = self.routing_override.routing(
                self.segments, layer, top_k_index, top_k_weights
            )
        # Layer-ahead runs on the device before the transfer, so that its result travels with it;
        # on the host it is finished at once (no transfer to share).
        pending = None
        host_predictions = None
        if self.layer_ahead is not None and not signalled:
            started = time.perf_counter()
            segments = [(g.start, g.rows) for g in self.segments]
            if hidden_states.device.type == "cpu":
                host_predictions = self.layer_ahead.predict_host(layer, hidden_states, segments)
            else:
                pending = self.layer_ahead.predict_device(layer, hidden_states, segments)
            self.counters.layer_ahead_s += time.perf_counter() - started
        fetched = self._fetch(
            top_k_index, top_k_weights if self.routing_observer is not None else None, pending
        )
        if host_predictions is not None:
            fetched = dataclasses.replace(fetched, predictions=host_predictions)
        # That transfer waited for every kernel queued before it: the previous layer's experts too.
        self._release_unreleased()
        if self.routing_observer is not None:
            self.routing_observer(layer, fetched.index, fetched.weights)
        routed = self._routed_layer(
            module, layer, fetched.index, top_k_index, top_k_weights, hidden_states, residual
        )
        if routed is not None:  # a decode step's layer: route, compute and combine native
            experts, routing, combiner, fused = routed.experts, None, None, routed
        else:
            routing = route(top_k_index, top_k_weights, fetched.index.numpy())
            combiner = Combiner(routing, hidden_states)
            experts, fused = routing.experts, self._fused_layer(module, routing, hidden_states, combiner)
        if not signalled:
            self._send_signals(layer, experts, fetched)
        if not missed and self._ran_resident(layer, routed):
            return self._routed_result(routed, residual)
        layer_span = None
        if self.trace_parent is not None:
            layer_span = telemetry.tracer().start_span(
                "moe_layer",
                context=self.trace_parent,
                attributes={
                    "expertcache.layer": layer,
                    "expertcache.experts": len(experts),
                    "expertcache.tokens": hidden_states.shape[0],
                },
            )
        try:
            for i, wave in enumerate(waves(experts, self.num_slots)):
                if i:
                    # Waves exist because the slots are short: the next wave needs the last one's.
                    self._release_unreleased()
                self._run_wave(module, layer, wave, hidden_states, routing, combiner, layer_span, fused)
        finally:
            if layer_span is not None:
                layer_span.end()
        if routed is not None:
            return self._routed_result(routed, residual)
        return combiner.result() if residual is None else residual.add_(combiner.result())

    def resident_layers(
        self,
        index: torch.Tensor,
        weights: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor,
    ) -> ResidentLayers | None:
        """A CPU decode step's MoE layers, each in one native call where all its experts are
        resident, with the step's buffers bound once: ``index`` [L, R, K] int64 and ``weights``
        [L, R, K] are the routers' picks of every layer (the native dense half computes them
        before each layer runs), ``hidden_states`` [R, H] the experts' input and ``residual``
        [R, H] what their result is added into, the same tensors at every layer. None where
        ``resident_layer`` would never apply this step, or the routing override cannot give the
        step's routing at once; ``ResidentLayers.run`` says per layer."""
        way = self._resident_way(spans=True)
        if way is None:
            return None
        run_layer, fused = way
        override = self.routing_override
        if override is not None:
            step_routing = getattr(override, "step_routing", None)
            got = None if step_routing is None else step_routing(self.segments, index.device, weights.dtype)
            if got is None or got[0].shape != index.shape:
                return None
            index, weights = got
        signals = self._span_signals(index.shape[0], index.shape[-1])
        if self.layer_ahead is not None and signals is None:
            return None
        return ResidentLayers(self, run_layer, fused, index, weights, hidden_states, residual, signals)

    def _span_signals(
        self, layers: int, top_k: int
    ) -> tuple[SpanSignals, tuple[np.ndarray, np.ndarray] | None] | None:
        """What a span of this step's ``layers`` decode layers tells the daemon (``SpanSignals``)
        and the routing override's lookahead of them as given (None: the routers' own, computed
        natively); None where a span cannot tell it: a step whose requests are not one row each
        in row order, or layer-ahead under an override without ``step_lookahead``."""
        segments = self.segments
        if not segments or any(g.rows != 1 or g.start != r for r, g in enumerate(segments)):
            return None
        depth, ahead = 0, ()
        predictor = self.layer_ahead
        if predictor is not None:
            depth = predictor.depth
            ahead = predictor.table(layers)
        given = None
        if predictor is not None and self.routing_override is not None:
            step_lookahead = getattr(self.routing_override, "step_lookahead", None)
            given = None if step_lookahead is None else step_lookahead(segments, ahead, depth)
            if given is None:
                return None
        spec = SpanSignals(
            tuple(g.request_id for g in segments),
            tuple(g.last_position for g in segments),
            top_k,
            layers,
            depth,
            ahead,
        )
        return spec, given

    def resident_layer(
        self,
        module: torch.nn.Module,
        layer: int,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor,
    ) -> bool:
        """``forward(..., residual=residual)`` of a CPU decode step's layer in one native call, where
        every expert of it is resident and nothing else needs the layer: no layer-ahead, no trace,
        no signals the daemon wants (the provider's ``run_layer``). True when it ran (the result
        is added into ``residual``, counted as ``forward`` counts it); False when nothing was done
        (``forward`` serves the layer, which routes it again)."""
        way = self._resident_way(spans=False)
        if way is None:
            return False
        run_layer, fused = way
        if self.routing_override is not None:
            top_k_index, top_k_weights = self.routing_override.routing(
                self.segments, layer, top_k_index, top_k_weights
            )
        kernel = fused.kernel(module, top_k_weights.dtype)
        if kernel is None:
            return False
        run = fused.layer_runner(
            kernel, layer, self.num_slots, top_k_index, top_k_weights, hidden_states, residual
        )
        ran = 0 if run is None else run_layer(layer, run)
        if ran <= 0:
            return False
        self.count_resident(1, ran)
        if self.routing_observer is not None:
            self.routing_observer(layer, top_k_index, top_k_weights)
        return True

    def _resident_way(self, *, spans: bool) -> tuple[Callable, FusedExperts] | None:
        """(the provider's ``run_layer``, the fused kernels) where a layer may run through
        ``run_layer`` at all: a CPU arena's fused kernel, a provider that has it, and nothing
        else that needs the layer (a trace, pins of an earlier wave; layer-ahead, unless the
        layers run in ``spans``, which tell the daemon their lookahead natively)."""
        if (self.layer_ahead is not None and not spans) or self.trace_parent is not None or self._unreleased:
            return None
        run_layer = getattr(self.provider, "run_layer", None)
        fused = self.reader.fused
        if run_layer is None or fused is None:
            return None
        return run_layer, fused

    def count_resident(
        self,
        layers: int,
        experts: int,
        *,
        waited: int = 0,
        demanded: Sequence[Tier] = (),
        waits: Sequence[float] = (),
        lost_s: float = 0.0,
    ) -> None:
        """``layers`` MoE layers ran in one call each, ``experts`` experts in all: counted as
        ``forward`` counts such layers (one host "transfer" and one acquire per layer, a hit per
        expert resident when its layer came). ``waited`` of the experts were in flight then, and
        the span waited for them itself (``SPAN_LOADING_WAIT_S``): misses, of a tier compute was
        not told (``Tier.UNKNOWN``); ``demanded`` the sources of those the span demanded itself
        (misses, each of its tier); ``waits`` the waits of the layers of either (one each); ``lost_s``
        a span's wait in vain for the layer it stopped at. Every wait is stall time."""
        counters = self.counters
        counters.layers += layers
        self.host_transfers += layers
        counters.host_transfers += layers
        hits = experts - waited - len(demanded)
        counters.hits += hits
        counters.by_tier[Tier.DEVICE] = counters.by_tier.get(Tier.DEVICE, 0) + hits
        if waited:
            counters.misses += waited
            counters.by_tier[Tier.UNKNOWN] = counters.by_tier.get(Tier.UNKNOWN, 0) + waited
        for source in demanded:
            counters.record(source)
        counters.acquire_waits.extend([0.0] * (layers - len(waits)))
        counters.acquire_waits.extend(waits)
        counters.stall_s += sum(waits) + lost_s

    def _ran_resident(self, layer: int, routed: RoutedLayer | SlotLayer | None) -> bool:
        """The fused kernel's layer in one native call (pins, computes, unpins) where the provider
        can pin all its experts at once (``DaemonClient.run_resident``); untraced layers only."""
        if not isinstance(routed, RoutedLayer) or self.trace_parent is not None or self._unreleased:
            return False
        run_resident = getattr(self.provider, "run_resident", None)
        if run_resident is None or len(routed.experts) > self.num_slots:
            return False
        if not run_resident(layer, routed.experts, routed.run_resident):
            return False
        counters = self.counters
        for _ in routed.experts:
            counters.record(Tier.DEVICE)
        counters.acquire_waits.append(0.0)
        return True

    @staticmethod
    def _routed_result(routed: RoutedLayer | SlotLayer, residual: torch.Tensor | None) -> torch.Tensor:
        result = routed.result()
        if residual is not None and result is not residual:  # a slotted layer's result
            residual.add_(result)
            return residual
        return result

    def _routed_layer(
        self,
        module: torch.nn.Module,
        layer: int,
        index: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None = None,
    ) -> RoutedLayer | SlotLayer | None:
        """The layer through the fused kernel with its route and combine stages native (a
        decode step on a CPU arena), or by slot index in one fixed sequence of kernels (a decode
        step on a GPU arena whose experts fit in one wave), else None. ``index``: the routing on
        the host; ``top_k_index``: the same where the model runs."""
        reader = self.reader
        slotted = reader.slotted
        if slotted is not None and index.shape[0] <= SLOT_MAX_TOKENS:
            routed = slotted.routed(module, layer, index, top_k_index, top_k_weights, hidden_states)
            if len(routed.experts) <= self.num_slots:  # one wave: every expert pinned at once
                return routed
        fused = reader.fused
        if fused is None:
            return None
        kernel = fused.kernel(module, top_k_weights.dtype)
        if kernel is None:
            return None
        return fused.routed(kernel, index, top_k_weights, hidden_states, residual)

    def _fused_layer(
        self, module: torch.nn.Module, routing: Routing, hidden_states: torch.Tensor, combiner: Combiner
    ) -> FusedLayer | None:
        """The layer's inputs to the fused kernel when it runs this layer, else None."""
        fused = self.reader.fused
        if fused is None:
            return None
        kernel = fused.kernel(module, routing.weights.dtype)
        if kernel is None or not decode_sized(routing, kernel.max_rows):
            return None
        return fused.layer(kernel, routing, hidden_states, combiner)

    def end_step(self, *, failed: bool = False) -> None:
        """The step's forward is over (the token was picked, which waited for the device):
        release what the last MoE layers still pin. After a failed forward (``failed``) the pins
        may be gone with the daemon stream; releasing is then best effort."""
        try:
            self._release_unreleased()
        except ExpertCacheError:
            if not failed:
                raise
            logger.debug("releasing the pins of a failed forward", exc_info=True)
        finally:
            self._unreleased.clear()

    def _fetch(
        self, top_k_index: torch.Tensor, top_k_weights: torch.Tensor | None, pending: DevicePrediction | None
    ) -> _Fetched:
        """The one device→host transfer of a MoE layer: the routing (with its weights when they
        are observed) and the layer-ahead candidates, packed into one float64 tensor (expert ids
        are exact in float64)."""
        if pending is None and top_k_index.is_cpu:
            # Already on the host: nothing to transfer (one "transfer" per layer all the same).
            self.host_transfers += 1
            self.counters.host_transfers += 1
            index = top_k_index if top_k_index.dtype == torch.int64 else top_k_index.to(torch.int64)
            weights = top_k_weights.to(torch.float32) if top_k_weights is not None else None
            return _Fetched(index, weights, None)
        parts = [top_k_index.reshape(-1).to(torch.float64)]
        if top_k_weights is not None:
            parts.append(top_k_weights.reshape(-1).to(torch.float64))
        if pending is not None:
            parts.append(pending.scores.reshape(-1).to(torch.float64))
        host = (torch.cat(parts) if len(parts) > 1 else parts[0]).cpu().numpy()
        self.host_transfers += 1
        self.counters.host_transfers += 1
        shape = tuple(top_k_index.shape)
        n = top_k_index.numel()
        index = torch.from_numpy(host[:n].astype(np.int64)).view(shape)  # [T, K] int64, host
        at = n
        weights = None
        if top_k_weights is not None:
            weights = torch.from_numpy(host[at : at + n].astype(np.float32)).view(shape)  # [T, K] float32
            at += n
        predictions = None
        if pending is not None:
            predictions = pending.finish(host[at:].reshape(pending.scores.shape))
        return _Fetched(index, weights, predictions)

    def _release_unreleased(self) -> None:
        """Release the waves waiting for their kernels. After a host transfer on the arena's
        stream their events are complete and this costs nothing; otherwise (the next wave of
        the same layer needs the slots) it waits for them, one host sync."""
        while self._unreleased:
            layer, wave, event = self._unreleased[0]
            if event is not None and not event.query():
                event.synchronize()
                self.event_waits += 1
                self.counters.event_waits += 1
            self.provider.release(layer, wave)
            self._unreleased.pop(0)

    def _send_signals(self, layer: int, experts: tuple[int, ...], fetched: _Fetched) -> None:
        """Tell the daemon, per request of the step, what layer ``layer`` routed it to and, before
        the experts run, what the next layers will likely need (one prediction per lookahead
        depth, brought to the host with the routing in one transfer on a device). One-way messages, held for
        the layer's first acquire (``with_acquire``): they travel in its Acquire when it has
        misses, so the daemon takes one message and starts the demand loads first."""
        provider = self.provider
        if len(self.segments) == 1:
            seg = self.segments[0]
            provider.routed(seg.request_id, seg.last_position, layer, experts, with_acquire=True)
        else:
            index = fetched.index.reshape(-1, fetched.index.shape[-1])
            for seg in self.segments:
                experts = np.unique(index[seg.start : seg.start + seg.rows].numpy()).tolist()
                provider.routed(seg.request_id, seg.last_position, layer, tuple(experts), with_acquire=True)
        if fetched.predictions is None:
            return
        for seg, predictions in zip(self.segments, fetched.predictions, strict=True):
            if self.routing_override is not None:
                predictions = tuple(self.routing_override.layer_ahead(seg, p) for p in predictions)
            predictions = tuple(p for p in predictions if p.experts)
            if predictions:
                provider.layer_ahead(seg.request_id, seg.last_position, predictions, with_acquire=True)

    def _run_wave(
        self,
        module: torch.nn.Module,
        layer: int,
        wave: tuple[int, ...],
        hidden_states: torch.Tensor,
        routing: Routing | None,
        combiner: Combiner | None,
        layer_span=None,
        fused: FusedLayer | RoutedLayer | SlotLayer | None = None,
    ) -> None:
        acquire_span = None
        acquire = self.provider.acquire_batches
        reader = self.reader
        if layer_span is None:
            ready_iter = acquire(layer, wave, deadline=self.deadline)
        else:
            acquire_span = telemetry.tracer().start_span(
                "acquire",
                context=telemetry.context_of(layer_span),
                kind=telemetry.SpanKind.CLIENT,
                attributes={"expertcache.layer": layer, "expertcache.experts": list(wave)},
            )
            ready_iter = acquire(
                layer, wave, deadline=self.deadline, trace_context=telemetry.inject(acquire_span)
            )
        done = False
        wait_s = 0.0
        device_hits = 0
        decoder = self.decoder
        views = reader.views
        # Small experts: one pass over the whole wave (the first projection of each as it is
        # pinned, the rest once); large ones: a pass per batch, so that the whole of one batch's
        # compute overlaps the next one's copy.
        whole = (
            ExpertsPass(module, wave, hidden_states, routing)
            if reader.small_experts and fused is None
            else None
        )
        try:
            pending = set(wave)
            while True:
                waited = time.perf_counter()
                batch = next(ready_iter, None)
                wait_s += time.perf_counter() - waited
                if batch is None:
                    break
                for ready in batch:
                    if ready.expert not in pending:
                        raise FailedPrecondition(
                            f"cache daemon answered {ExpertKey(layer, ready.expert)}, which was not asked "
                            f"for or twice (wave {list(wave)})"
                        )
                    pending.discard(ready.expert)
                    self.counters.record(ready.source)
                    device_hits += ready.source is Tier.DEVICE
                # Reordered execution: run each batch as soon as it is pinned.
                if fused is not None:
                    fused.run([r.slot for r in batch], [r.expert for r in batch])
                    continue
                one = whole or ExpertsPass(module, [r.expert for r in batch], hidden_states, routing)
                for ready in batch:
                    one.up(ready.expert, lambda name, view=views[ready.slot]: decoder.param(name, view))
                if whole is None:
                    combiner.add(*one.finish())
            if pending:
                raise FailedPrecondition(
                    f"cache daemon finished the acquire of layer {layer} without experts {sorted(pending)}"
                )
            if whole is not None:
                combiner.add(*whole.finish())
            done = True
        finally:
            self.counters.stall_s += wait_s
            self.counters.acquire_waits.append(wait_s)
            if acquire_span is not None:
                acquire_span.set_attributes(
                    {
                        "expertcache.device_hits": device_hits,
                        "expertcache.misses": len(wave) - device_hits,
                        "expertcache.wait_s": wait_s,
                    }
                )
                acquire_span.end()
            if not done:
                # Closing the iterator drops the stream and with it every pin it holds.
                ready_iter.close()
        if reader.cuda:
            # The kernels reading the slots may still run: release after they are done.
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(reader.arena.device))
            self._unreleased.append((layer, wave, event))
        else:
            self.provider.release(layer, wave)


@dataclass(frozen=True)
class _Fetched:
    """What one MoE layer brought to the host: ``index`` [T, K] int64, ``weights`` [T, K] float32
    (when observed), the finished layer-ahead ``predictions``, one per segment (when asked)."""

    index: torch.Tensor
    weights: torch.Tensor | None
    predictions: list[tuple[Prediction, ...]] | None  # per segment, per depth


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
            "to an ExpertRuntime (compute_svc.experts.moe.attach)"
        )
    return runtime.forward(self, getattr(self, LAYER_ATTR), hidden_states, top_k_index, top_k_weights)


# Registered on import so that build_skeleton(config, experts_implementation="expertcache") passes
# transformers' check of valid implementations.
ExpertsInterface.register(IMPLEMENTATION, expertcache_experts_forward)
