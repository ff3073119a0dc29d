"""Trace replay: the daemon's own policies, signals and prefetch scheduler under a timing model.

::

    routes [tokens, layers, top_k] ──▶ ActivationSignals.observe ──▶ EvictionPolicy ─┐
       │   set_lookahead (modelled accuracy per depth)                             ├─▶ SimTier ─▶ link model
       └── hints (precomputed per token) ──▶ set_hints ────────────────────────────┘   PrefetchScheduler.decide

The decision objects are the ones the daemon runs (``cache_daemon.decisions``, plus the
references of ``replay.policies`` that need the future); only the tier, its loads and
the clock are simulated. The tier's slots are global (not per layer): a budget of 25% holds a
quarter of all (layer, expert) blobs.

Timing model (``TimingModel``, every figure printed by ``bench.replay``): one link moving blobs
in chunks; a demand pre-empts prefetch at chunk boundaries; a load is usable no sooner than
``read_latency_s`` after its start and holds its slot and its room in flight until then (loads
in flight together overlap it: on fast storage a layer's misses cost about one read's latency,
not one read each), and a prefetch decision runs ``decision_lag_s`` after the change that asked
for it, on the state at its time (a demand starts at once); per layer, attention runs, the router
picks experts, resident experts compute first and the others as they arrive (reordered
execution); transfers overlap compute. A layer stalls until its experts are resident. Latency
per token is simulated time. Two named models: ``gpu`` (gpt-oss-20b bf16 over PCIe 4.0 x16 with
an A5000-class GPU, the default) and ``cpu-e2e`` (this project's development machine running
``bench.e2e``: its expert size, O_DIRECT read bandwidth and CPU compute per layer, measured).

Lookahead is modelled: each true expert of (token, layer l + d) is predicted with the accuracy
of depth d, a miss replaced by a plausible wrong expert (drawn by the request's recent use of the
layer's other experts). The trace has routing only, no hidden states, so router reuse itself
cannot be measured on it; the replay measures what the signals as a whole predict at each depth
(``RunStats.depth_recall``: the top-k of ``use_probability`` for layer l + d when layer l is seen),
and what the next-visit estimate alone predicts for a layer from its previous visit
(``RunStats.next_visit_recall``).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from cache_daemon.decisions.next_visit import NextVisitModel
from cache_daemon.decisions.policy import PolicyShape
from cache_daemon.decisions.scheduler import (
    PrefetchClass,
    PrefetchConfig,
    PrefetchQueue,
    PrefetchScheduler,
    QueuedLoad,
)
from cache_daemon.decisions.signals import ActivationSignals, Estimator, LayerPrediction, SignalsConfig
from expertcache.keys import ExpertKey
from replay.policies import REFERENCE_POLICIES, make_replay_policy

# -- timing models -----------------------------------------------------------------------------


def gpt_oss_20b_expert_bytes(hidden: int = 2880, intermediate: int = 2880, dtype_bytes: int = 2) -> int:
    """Bytes of one gpt-oss-20b expert in bf16: gate_up [2I, H] + bias [2I], down [H, I] + bias [H]."""
    params = 2 * intermediate * hidden + 2 * intermediate + hidden * intermediate + hidden
    return params * dtype_bytes


def gpt_oss_20b_attention_bytes(
    hidden: int = 2880, heads: int = 64, kv_heads: int = 8, head_dim: int = 64
) -> int:
    """Bytes of one layer's attention weights in bf16: q/k/v/o projections with biases."""
    q = heads * head_dim
    kv = kv_heads * head_dim
    params = hidden * (q + 2 * kv) + (q + 2 * kv) + q * hidden + hidden
    return params * 2


@dataclass(frozen=True)
class TimingModel:
    """Link and compute times of the replay (seconds and bytes)."""

    expert_bytes: int
    link_bytes_per_s: float
    chunk_bytes: int
    attention_s: float  # per layer before the router decides: attention, norms, router
    expert_s: float  # per routed expert's MLP at batch 1
    layer_overhead_s: float  # per layer after the experts: kernel launches, combine
    token_overhead_s: float  # per token: embedding, final norm, LM head
    top_k: int
    num_layers: int
    name: str = "gpu"
    notes: tuple[str, ...] = field(default=())
    # The least time from a load's start to its blob being usable, however idle the link: a
    # read's access latency and its bookkeeping, which loads in flight together overlap (the
    # link's rate alone charges a layer's misses one after another). 0: the link's rate only.
    read_latency_s: float = 0.0
    # From the change that asks for a prefetch decision (a layer's signals, a landed load) to the
    # decision, which then reads the state of its time: the daemon's hop to its decision thread and
    # the decision itself. A demand's load starts at once.
    decision_lag_s: float = 0.0

    @property
    def layer_s(self) -> float:
        return self.attention_s + self.top_k * self.expert_s + self.layer_overhead_s

    @property
    def all_resident_token_s(self) -> float:
        return self.num_layers * self.layer_s + self.token_overhead_s

    @property
    def transfer_s(self) -> float:
        return self.expert_bytes / self.link_bytes_per_s


# ``precision`` -> (encoding, its parameters) of gpt-oss-20b's expert weights in the store.
EXPERT_PRECISIONS = {
    "bf16": ("plain", {}),
    "mxfp4": ("mxfp4", {}),  # as gpt-oss-20b ships its experts
    "fp8": ("fp8", {"block_size": (128, 128)}),  # as DeepSeek-V3 / Qwen3-FP8 ship theirs
}


def gpt_oss_20b_expert_tensors(precision: str, hidden: int = 2880, intermediate: int = 2880) -> list:
    """One gpt-oss-20b expert's tensors as the store encodes them at ``precision`` (biases bf16)."""
    from expertcache.encodings import get_encoding

    encoding, params = EXPERT_PRECISIONS[precision]
    tensors = []
    for name, shape in (("gate_up_proj", (hidden, 2 * intermediate)), ("down_proj", (intermediate, hidden))):
        tensors.append(get_encoding(encoding).plan(name, "bfloat16", shape, **params))  # runtime [in, out]
        tensors.append(get_encoding("plain").plan(f"{name}_bias", "bfloat16", (shape[1],)))
    return tensors


def gpu_timing(
    num_layers: int,
    top_k: int,
    *,
    link_gbps: float = 25.0,
    expert_mib: float | None = None,
    layer_compute_ms: float | None = None,
    chunk_mib: float = 4.0,
    precision: str = "mxfp4",
) -> TimingModel:
    """``gpu``: gpt-oss-20b, experts at ``precision`` (it ships MXFP4), on PCIe 4.0 x16 with an
    A5000-class GPU (768 GB/s GDDR6)."""
    if precision not in EXPERT_PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; known: {', '.join(EXPERT_PRECISIONS)}")
    hbm_bytes_per_s = 768e9 * 0.8  # decode GEMVs reach ~80% of peak memory bandwidth
    tensors = gpt_oss_20b_expert_tensors(precision)
    expert_bytes = sum(t.nbytes for t in tensors)  # encoded: what the link moves
    decoded_bytes = sum(t.decoded_nbytes for t in tensors)
    # Encoded experts are decoded into a bf16 scratch (read encoded, write bf16) before the GEMV
    # reads the bf16 weights: compute moves the encoded bytes plus twice the decoded ones.
    decode_bytes = 0 if expert_bytes == decoded_bytes else expert_bytes + decoded_bytes
    notes = [
        f"expert: gpt-oss-20b, hidden 2880, intermediate 2880: gate_up [5760, 2880] + bias [5760], "
        f"down [2880, 2880] + bias [2880]; experts {precision} "
        f"({', '.join(sorted({t.encoding for t in tensors}))}): {expert_bytes} bytes "
        f"({expert_bytes / 2**20:.2f} MiB) on the link, {decoded_bytes} bytes decoded (bf16)",
    ]
    if expert_mib is not None:
        expert_bytes = int(expert_mib * 2**20)
        notes.append(f"expert bytes overridden: {expert_bytes} bytes ({expert_mib} MiB)")
    attn_bytes = gpt_oss_20b_attention_bytes()
    attention_s = attn_bytes / hbm_bytes_per_s + 10e-6  # + router / norms / rope kernels
    expert_s = (decoded_bytes + decode_bytes) / hbm_bytes_per_s
    layer_overhead_s = 50e-6  # ~10 kernel launches at ~5 us each at batch 1
    lm_head_bytes = 201088 * 2880 * 2  # vocab x hidden bf16 (embedding lookup is one row)
    token_overhead_s = lm_head_bytes / hbm_bytes_per_s + 50e-6
    notes += [
        f"link: PCIe 4.0 x16 = 31.5 GB/s raw (16 GT/s x 16 lanes, 128b/130b); pinned host->device "
        f"copies of large blobs reach ~{link_gbps:g} GB/s effective (TLP/DMA overhead), used here",
        f"chunks of {chunk_mib:g} MiB: a demand pre-empts a prefetch at the next chunk boundary",
        "compute: A5000-class, 768 GB/s GDDR6 at 80% for batch-1 GEMVs (614 GB/s); "
        f"attention q/k/v/o + biases {attn_bytes} bytes -> {attention_s * 1e6:.1f} us incl. 10 us router/norms; "
        f"one expert {expert_s * 1e6:.1f} us (decode into bf16 scratch included: "
        f"{decode_bytes / 2**20:.1f} MiB); per-layer launch overhead {layer_overhead_s * 1e6:.0f} us; "
        f"per token LM head 201088 x 2880 bf16 + 50 us -> {token_overhead_s * 1e3:.2f} ms",
    ]
    timing = TimingModel(
        expert_bytes=expert_bytes,
        link_bytes_per_s=link_gbps * 1e9,
        chunk_bytes=int(chunk_mib * 2**20),
        attention_s=attention_s,
        expert_s=expert_s,
        layer_overhead_s=layer_overhead_s,
        token_overhead_s=token_overhead_s,
        top_k=top_k,
        num_layers=num_layers,
        name="gpu",
    )
    return _finish(timing, notes, layer_compute_ms)


# Measured on the development machine (2 cores, NVMe behind a VM) for bench.e2e's default model:
# gpt-oss shape, 24 layers x 32 experts, top-4, hidden 512, expert intermediate 1280, bf16.
CPU_E2E_EXPERT_BYTES = 3 * 512 * 1280 * 2 + (2 * 1280 + 512) * 2  # gate_up + down + biases
CPU_E2E_READ_BYTES_PER_S = 0.70e9  # one O_DIRECT blob read at a time through the daemon's reader
CPU_E2E_ATTENTION_S = 0.90e-3  # per layer: attention, norms and router at batch 1, 1 torch thread
CPU_E2E_EXPERT_S = 0.55e-3  # per routed expert's MLP on arena views
CPU_E2E_LAYER_OVERHEAD_S = 0.35e-3  # per layer: the acquire/release calls, combine
CPU_E2E_TOKEN_OVERHEAD_S = 4.0e-3  # per token: embedding, LM head, sampling, gRPC per token


def cpu_e2e_timing(num_layers: int, top_k: int, *, chunk_mib: float = 1.0) -> TimingModel:
    """``cpu-e2e``: the machine-calibrated model, ``bench.e2e`` on this machine (no GPU: the link is
    the store's O_DIRECT reads, compute is one CPU thread). Its figures are the ``CPU_E2E_*``
    constants, each measured as its comment says; ``bench.e2e`` prints the replay's prediction
    under this model beside its measurement."""
    notes = [
        f"expert: bench.e2e's gpt-oss shape, hidden 512, intermediate 1280, bf16 = {CPU_E2E_EXPERT_BYTES} bytes "
        f"({CPU_E2E_EXPERT_BYTES / 2**20:.2f} MiB)",
        f"link: the store's O_DIRECT reads at {CPU_E2E_READ_BYTES_PER_S / 1e9:.2f} GB/s (measured, one blob at a time)",
        f"compute: one CPU thread, per layer attention+router {CPU_E2E_ATTENTION_S * 1e3:.2f} ms, one expert "
        f"{CPU_E2E_EXPERT_S * 1e3:.2f} ms, overhead {CPU_E2E_LAYER_OVERHEAD_S * 1e3:.2f} ms; per token "
        f"{CPU_E2E_TOKEN_OVERHEAD_S * 1e3:.1f} ms (measured)",
    ]
    timing = TimingModel(
        expert_bytes=CPU_E2E_EXPERT_BYTES,
        link_bytes_per_s=CPU_E2E_READ_BYTES_PER_S,
        chunk_bytes=int(chunk_mib * 2**20),
        attention_s=CPU_E2E_ATTENTION_S,
        expert_s=CPU_E2E_EXPERT_S,
        layer_overhead_s=CPU_E2E_LAYER_OVERHEAD_S,
        token_overhead_s=CPU_E2E_TOKEN_OVERHEAD_S,
        top_k=top_k,
        num_layers=num_layers,
        name="cpu-e2e",
    )
    return _finish(timing, notes, None)


def _finish(timing: TimingModel, notes: list[str], layer_compute_ms: float | None) -> TimingModel:
    if layer_compute_ms is not None:
        f = layer_compute_ms * 1e-3 / timing.layer_s
        timing = replace(
            timing,
            attention_s=timing.attention_s * f,
            expert_s=timing.expert_s * f,
            layer_overhead_s=timing.layer_overhead_s * f,
        )
        notes.append(f"per-layer compute overridden to {layer_compute_ms} ms (parts scaled)")
    notes.append(
        f"per layer all-resident {timing.layer_s * 1e3:.3f} ms; per token all-resident "
        f"{timing.all_resident_token_s * 1e3:.2f} ms; one expert over the link {timing.transfer_s * 1e3:.3f} ms"
    )
    return replace(timing, notes=tuple(notes))


TIMING_MODELS: dict[str, Callable[..., TimingModel]] = {"gpu": gpu_timing, "cpu-e2e": cpu_e2e_timing}
"""Named timing models, picked by ``bench.replay --timing`` (``make bench-replay TIMING=...``)."""


def timing_model(name: str, num_layers: int, top_k: int, **overrides) -> TimingModel:
    """The named model; ``ValueError`` listing the names for an unknown one."""
    try:
        make = TIMING_MODELS[name]
    except KeyError:
        raise ValueError(f"unknown timing model {name!r}; known: {', '.join(TIMING_MODELS)}") from None
    return make(num_layers, top_k, **overrides)


def floor_ms(timing: TimingModel, belady_bytes_per_token: float) -> float:
    """The physical limit per token: max(all-resident compute, Belady bytes / link bandwidth)."""
    return max(timing.all_resident_token_s, belady_bytes_per_token / timing.link_bytes_per_s) * 1e3


# -- the simulated tier --------------------------------------------------------------------------


@dataclass(eq=False)
class SimLoad(QueuedLoad):
    """A load on the simulated link: bytes still to move and its issue order."""

    entry: int = 0
    remaining: int = 0
    seq: int = 0
    issued: float = 0.0  # simulated time of its start (``read_latency_s`` counts from it)
    ready_at: float | None = None  # moved, usable then: still in flight (its slot, its room) until


class SimTier:
    """A tier of ``capacity`` global slots: the ``TierState`` the replay gives the scheduler."""

    def __init__(self, capacity: int, num_entries: int, num_experts: int, blob_bytes: int) -> None:
        self.capacity = capacity
        self.num_experts = num_experts
        self.blob_bytes = blob_bytes
        self.resident = np.zeros(num_entries, bool)
        self.n_resident = 0
        self.queue = PrefetchQueue(blob_bytes)
        self.pinned: set[int] = set()

    def _e(self, key: ExpertKey) -> int:
        return key.entry(self.num_experts)

    @property
    def free_slots(self) -> int:
        return self.capacity - self.n_resident - len(self.queue)

    def is_resident(self, key: ExpertKey) -> bool:
        return bool(self.resident[self._e(key)])

    def evictable(self, key: ExpertKey) -> bool:
        e = self._e(key)
        return bool(self.resident[e]) and e not in self.pinned


# -- one simulation ------------------------------------------------------------------------------

MAX_REPORTED_DEPTH = 4


@dataclass
class RunStats:
    policy: str
    budget: float
    slots: int
    layer_ahead: bool
    tokens: int = 0
    accesses: int = 0
    hits: int = 0
    late_prefetch_hits: int = 0  # demanded while its prefetch was still loading
    bytes_loaded: int = 0
    loads: int = 0
    prefetches: int = 0
    prefetches_used: int = 0
    prefetches_cancelled: int = 0
    stall_s: float = 0.0
    time_s: float = 0.0
    wall_s: float = 0.0
    # Per class ("layer_ahead" / "eamc"): prefetches started and used before eviction.
    started_by_class: dict[str, int] = field(default_factory=dict)
    used_by_class: dict[str, int] = field(default_factory=dict)
    # Per lookahead depth: prefetches started and used.
    started_by_depth: dict[int, int] = field(default_factory=dict)
    used_by_depth: dict[int, int] = field(default_factory=dict)
    # Per depth d: [routed experts found in the top-k of use_probability for layer l + d when layer
    # l was seen, routed experts] (the signals' own prediction, everything they know).
    depth_recall: dict[int, list[int]] = field(default_factory=dict)
    # [routed experts found in the top-k of the request's next-visit estimate (before lookahead)
    # for the layer, made at its previous visit; routed experts]: the learned model's or the
    # transitions' own recall.
    next_visit_recall: list[int] = field(default_factory=lambda: [0, 0])

    def summary(self, timing: TimingModel) -> dict:
        t = max(self.tokens, 1)
        return {
            "policy": self.policy,
            "budget": self.budget,
            "slots": self.slots,
            "layer_ahead": self.layer_ahead,
            "tokens": self.tokens,
            "hit_rate": self.hits / max(self.accesses, 1),
            "late_prefetch_hit_rate": self.late_prefetch_hits / max(self.accesses, 1),
            "loads_per_token": self.loads / t,
            "bytes_per_token": self.bytes_loaded / t,
            "prefetches_per_token": self.prefetches / t,
            "prefetch_accuracy": self.prefetches_used / max(self.prefetches, 1),
            "prefetches_cancelled": self.prefetches_cancelled,
            "prefetch_by_class": {
                k: {"started": v, "used": self.used_by_class.get(k, 0)}
                for k, v in self.started_by_class.items()
            },
            "prefetch_by_depth": {
                str(k): {"started": v, "used": self.used_by_depth.get(k, 0)}
                for k, v in sorted(self.started_by_depth.items())
            },
            "depth_recall": {str(d): h / max(n, 1) for d, (h, n) in sorted(self.depth_recall.items())},
            "next_visit_recall": self.next_visit_recall[0] / max(self.next_visit_recall[1], 1),
            "stall_ms_per_token": self.stall_s / t * 1e3,
            "latency_ms_per_token": self.time_s / t * 1e3,
            "wall_s": self.wall_s,
        }


_CLASS_NAME = {PrefetchClass.LAYER_AHEAD: "layer_ahead", PrefetchClass.EAMC: "eamc"}


class Simulation:
    """One policy × budget × lookahead run over a stretch of requests (cache warm across them).

    ``routes`` int [tokens, layers, top_k] and ``weights`` float [tokens, layers, top_k] hold the
    replayed tokens; ``offsets`` [requests + 1] split them into requests (from 0).
    ``lookahead_accuracy``: the modelled accuracy of each depth (index d - 1), None for none.
    ``hints``: per request (index into ``offsets``) per token the ``(layer, expert, score)``
    hints known before it, or None for none.
    """

    def __init__(
        self,
        routes: np.ndarray,
        weights: np.ndarray,
        offsets: np.ndarray,
        num_experts: int,
        timing: TimingModel,
        policy: str,
        budget: float,
        *,
        lookahead_accuracy: tuple[float, ...] | None,
        hints: dict[int, list[list[tuple[int, int, float]]]] | None = None,
        signals_config: SignalsConfig | None = None,
        prefetch_config: PrefetchConfig | None = None,
        max_inflight_bytes: int | None = None,
        policy_kwargs: dict | None = None,
        estimator: Estimator | None = None,
        next_visit_model: NextVisitModel | None = None,
        seed: int = 0,
    ) -> None:
        tokens, L, K = routes.shape
        E = num_experts
        self.timing = timing
        self.routes = routes
        self.weights = weights
        self.offsets = np.asarray(offsets, np.int64)
        self.hints = hints
        self.accuracy = tuple(lookahead_accuracy) if lookahead_accuracy else ()
        for a in self.accuracy:
            if not 0.0 <= a <= 1.0:
                raise ValueError(f"lookahead accuracy {a} outside [0, 1]")
        self.rng = np.random.default_rng(seed)
        self.L, self.E, self.K = L, E, K
        n = L * E
        slots = max(int(round(budget * n)), K + 1)
        self.signals = ActivationSignals(
            L, E, config=signals_config, estimator=estimator, next_visit_model=next_visit_model
        )
        self.policy = make_replay_policy(
            policy, PolicyShape(L, E), self.signals, routes, **(policy_kwargs or {})
        )
        pcfg = prefetch_config or PrefetchConfig()
        if policy in REFERENCE_POLICIES:
            # The bytes floor: Belady's MIN is the optimum of *demand* fetching; the oracle row
            # measures eviction with perfect next-token knowledge, also without speculation.
            pcfg = replace(pcfg, layer_ahead=False, eamc=False)
        elif not self.accuracy:
            pcfg = replace(pcfg, layer_ahead=False)
        self.tier = SimTier(slots, n, E, timing.expert_bytes)
        inflight = max_inflight_bytes if max_inflight_bytes is not None else timing.expert_bytes
        self.sched = PrefetchScheduler(
            self.signals,
            self.policy,
            blob_bytes=timing.expert_bytes,
            max_inflight_bytes=inflight,
            config=pcfg,
        )
        self.stats = RunStats(policy, budget, slots, bool(self.accuracy))
        self.link_t = 0.0
        self.issue_t = 0.0  # the simulated time at which a load started now is started
        # Per entry, when its last load became usable (its link transfer and ``read_latency_s``
        # after its start, whichever is later): a use before then waits.
        self.ready_t = np.zeros(n, np.float64)
        # Loads whose bytes have moved but whose latency has not passed: (usable at, seq, load).
        # They stay in the queue until then, holding their slot and their room in flight.
        self._landing: list[tuple[float, int, SimLoad]] = []
        self.seq = 0
        self._decide_at: float | None = None  # when the pending (lagged) decision runs
        self.prefetched_unused: dict[int, tuple[PrefetchClass, int]] = {}  # entry -> (class, depth)

    # link -------------------------------------------------------------------------------------

    def _next_load(self) -> SimLoad | None:
        best = None
        for ld in self.tier.queue:
            assert isinstance(ld, SimLoad)
            if ld.ready_at is not None:
                continue  # moved: waiting out its latency
            k = (int(ld.cls), ld.seq)
            if best is None or k < best[0]:
                best = (k, ld)
        return None if best is None else best[1]

    def _chunk(self) -> int | None:
        """Move one chunk of the highest-priority load; returns the entry if it completed (-1 when
        a chunk moved but its load is not usable yet, None when nothing is left to move)."""
        self._land_until(self.link_t)
        self._decide_until(self.link_t)
        ld = self._next_load()
        if ld is None:
            return None
        ld.started = True
        c = min(self.timing.chunk_bytes, ld.remaining)
        self.link_t += c / self.timing.link_bytes_per_s
        ld.remaining -= c
        self.stats.bytes_loaded += c
        if ld.remaining > 0:
            return -1
        usable = ld.issued + self.timing.read_latency_s
        if usable > self.link_t:
            ld.ready_at = usable
            heapq.heappush(self._landing, (usable, ld.seq, ld))
            return -1
        self._land(ld, self.link_t)
        return ld.entry

    def _land(self, ld: SimLoad, t: float) -> None:
        """``ld`` is usable at ``t``: resident, and what it frees is decided on then."""
        self.tier.queue.remove(ld.key)
        self.tier.resident[ld.entry] = True
        self.tier.n_resident += 1
        self.ready_t[ld.entry] = t
        self.policy.on_insert(ld.key)
        self.stats.loads += 1
        if ld.prefetch is not None and ld.cls != PrefetchClass.DEMAND:
            self.prefetched_unused[ld.entry] = (ld.prefetch, ld.depth)
        issue_t, self.issue_t = self.issue_t, max(self.issue_t, t)
        self._prefetch()  # decided as the load lands
        self.issue_t = issue_t

    def _land_until(self, until: float) -> None:
        """Land the moved loads whose latency has passed by ``until`` (in time order)."""
        while self._landing and self._landing[0][0] <= until:
            t, _seq, ld = heapq.heappop(self._landing)
            if self.tier.queue.get(ld.key) is ld:  # not cancelled meanwhile
                self._land(ld, t)

    def _advance(self, until: float) -> None:
        """Run the link up to ``until`` (a chunk in progress finishes past it), landing the loads
        usable by then and running the decision due by then (at its time: the link first runs up
        to it)."""
        while True:
            step = until if self._decide_at is None else min(until, self._decide_at)
            while self.link_t < step:
                if self._chunk() is None:
                    self.link_t = step
                    break
            self._land_until(step)
            if not self._decide_until(step) or step >= until:
                break
        self._land_until(until)

    def _wait_for(self, entry: int, now: float) -> float:
        """Time at which ``entry`` is resident (running the link as needed)."""
        self._advance(now)
        key = self.signals.key_of(entry)
        while (ld := self.tier.queue.get(key)) is not None:
            assert isinstance(ld, SimLoad)
            if ld.ready_at is not None:
                self._advance(ld.ready_at)  # the link moves others meanwhile
            else:
                self._chunk()
        return max(now, float(self.ready_t[entry]))

    # tier -------------------------------------------------------------------------------------

    def _evict(self, entry: int) -> None:
        assert self.tier.resident[entry] and entry not in self.tier.pinned, "evicting a pinned expert"
        self.tier.resident[entry] = False
        self.tier.n_resident -= 1
        self.policy.on_remove(self.signals.key_of(entry))
        wasted = self.prefetched_unused.pop(entry, None)
        if wasted is not None:
            self.sched.record_outcome(wasted[1], used=False)

    def _start(self, key: ExpertKey, cls: PrefetchClass, score: float = 0.0, depth: int = 0) -> None:
        issued = self.issue_t
        self.seq += 1
        entry = key.entry(self.E)
        self.tier.queue.add(
            SimLoad(
                key,
                cls,
                score,
                depth,
                entry=entry,
                remaining=self.timing.expert_bytes,
                seq=self.seq,
                issued=issued,
            )
        )

    def _used(self, entry: int) -> None:
        got = self.prefetched_unused.pop(entry, None)
        if got is not None:
            self._count_used(*got)

    def _count_used(self, cls: PrefetchClass, depth: int) -> None:
        self.sched.record_outcome(depth, used=True)
        st = self.stats
        st.prefetches_used += 1
        name = _CLASS_NAME[cls]
        st.used_by_class[name] = st.used_by_class.get(name, 0) + 1
        if depth:
            st.used_by_depth[depth] = st.used_by_depth.get(depth, 0) + 1

    def _prefetch(self) -> None:
        """Something the scheduler reads changed at ``issue_t``: decide now, or with a decision
        lag at ``issue_t + decision_lag_s``, on the state then (one decision answers every change
        before it, as the daemon's worker does; what was demanded meanwhile is not prefetched)."""
        lag = self.timing.decision_lag_s
        if lag <= 0:
            self._decide()
            return
        at = self.issue_t + lag
        self._decide_at = at if self._decide_at is None else min(self._decide_at, at)

    def _decide_until(self, until: float) -> bool:
        """Run the decision due by ``until``, if any (its loads start at its time)."""
        at = self._decide_at
        if at is None or at > until:
            return False
        self._decide_at = None
        issue_t, self.issue_t = self.issue_t, at
        self._decide()
        self.issue_t = issue_t
        return True

    def _decide(self) -> None:
        st = self.stats
        for s in self.sched.decide(self.tier):
            if s.victim is not None:
                self._evict(s.victim.entry(self.E))
            self._start(s.key, s.cls, s.score, s.depth)
            st.prefetches += 1
            name = _CLASS_NAME[s.cls]
            st.started_by_class[name] = st.started_by_class.get(name, 0) + 1
            if s.depth:
                st.started_by_depth[s.depth] = st.started_by_depth.get(s.depth, 0) + 1

    def _demand(self, entry: int) -> None:
        key = self.signals.key_of(entry)
        self.sched.on_demand(key)
        ld = self.tier.queue.get(key)
        if ld is not None:
            if self.tier.queue.promote(key) is not None:  # joins the load at demand priority
                self.stats.late_prefetch_hits += 1
                if ld.prefetch is not None:
                    self._count_used(ld.prefetch, ld.depth)
            return
        if self.tier.free_slots <= 0:
            victims = self.policy.choose_victims(1, self.tier.evictable)
            if victims:
                self._evict(victims[0].entry(self.E))
            else:
                cands = self.tier.queue.cancel_candidates()
                if not cands:
                    raise RuntimeError("no slot for a demand: budget below top_k")
                self.tier.queue.remove(cands[0].key)
                self.stats.prefetches_cancelled += 1
        self._start(key, PrefetchClass.DEMAND)

    def _lookahead(self, g: int, layer: int) -> None:
        """Model compute's lookahead at layer ``layer`` of token ``g``: for each depth d, each true
        expert of (g, layer + d) is predicted with that depth's accuracy; a miss is replaced by a
        plausible wrong expert (drawn by the request's recent use of that layer's other experts)."""
        preds = []
        for d, acc in enumerate(self.accuracy, start=1):
            target = layer + d
            if target >= self.L:
                break
            true = self.routes[g, target].astype(np.int64)
            w = self.weights[g, target]
            keep = self.rng.random(len(true)) < acc
            experts = true.copy()
            if not keep.all():
                base = target * self.E
                p = self.signals.history[base : base + self.E].astype(np.float64) + 1e-3
                p[true] = 0.0
                wrong = self.rng.choice(self.E, size=int((~keep).sum()), replace=False, p=p / p.sum())
                experts[~keep] = wrong
            preds.append(LayerPrediction(target, d, experts, np.asarray(w, np.float32)))
        if preds:
            self.signals.set_lookahead(preds, g)

    def _measure_next_visit(self, g: int, layer: int, first: bool) -> None:
        """Recall of the request's next-visit estimate for ``layer`` (before lookahead), made at
        the layer's previous visit, against its routing at token ``g`` (not on a request's first
        token: nothing was estimated from the request yet)."""
        if first:
            return
        E, K = self.E, self.K
        row = self.signals.request_next_probabilities()[-1][layer * E : (layer + 1) * E]
        top = np.argpartition(-row, K - 1)[:K]
        self.stats.next_visit_recall[0] += len(set(top.tolist()) & set(self.routes[g, layer].tolist()))
        self.stats.next_visit_recall[1] += K

    def _measure_depths(self, g: int, layer: int) -> None:
        """Recall of the signals' own top-k for the next layers of this token (all they know)."""
        p = self.signals.use_probability()
        E, K = self.E, self.K
        for d in range(1, MAX_REPORTED_DEPTH + 1):
            target = layer + d
            if target >= self.L:
                break
            row = p[target * E : (target + 1) * E]
            top = np.argpartition(-row, K - 1)[:K]
            hits = len(set(top.tolist()) & set(self.routes[g, target].tolist()))
            acc = self.stats.depth_recall.setdefault(d, [0, 0])
            acc[0] += hits
            acc[1] += K

    # main loop --------------------------------------------------------------------------------

    def run(self, progress=None, *, measure_depths: bool = False) -> RunStats:
        """Replay every request; ``measure_depths`` also fills ``RunStats.depth_recall``."""
        wall = time.perf_counter()
        t = self.timing
        now = 0.0
        st = self.stats
        for r in range(len(self.offsets) - 1):
            lo, hi = int(self.offsets[r]), int(self.offsets[r + 1])
            rid = str(r)
            self.signals.begin_request(rid)
            req_hints = self.hints.get(r) if self.hints is not None else None
            for g in range(lo, hi):
                if req_hints is not None:
                    self.signals.set_hints(req_hints[g - lo], g, layers=range(self.L))
                token_start = now
                for layer in range(self.L):
                    layer_start = now
                    now += t.attention_s
                    self._advance(now)
                    experts = self.routes[g, layer]
                    entries = [layer * self.E + int(x) for x in experts]
                    self.issue_t = now  # the layer's demands and decisions start their loads now
                    if measure_depths:
                        self._measure_next_visit(g, layer, g == lo)
                    self.signals.observe(layer, experts, g)
                    self.tier.pinned = set(entries)
                    if self.accuracy:
                        self._lookahead(g, layer)
                    if measure_depths:
                        self._measure_depths(g, layer)
                    ready = []
                    for e in entries:
                        st.accesses += 1
                        if self.tier.resident[e]:
                            st.hits += 1
                            self.policy.on_access(self.signals.key_of(e))
                            self._used(e)
                            ready.append((float(self.ready_t[e]), e))  # in the past unless just landed
                        else:
                            self._demand(e)
                    self._prefetch()
                    # Reordered execution: resident experts first, the rest as they arrive.
                    finish = now
                    for e in entries:
                        if not self.tier.resident[e]:
                            arrive = self._wait_for(e, now)
                            self.policy.on_access(self.signals.key_of(e))
                            self.prefetched_unused.pop(e, None)
                            ready.append((arrive, e))
                    ready.sort()
                    for arrive, _e in ready:
                        finish = max(finish, arrive) + t.expert_s
                    now = finish + t.layer_overhead_s
                    st.stall_s += (now - layer_start) - t.layer_s
                    self._advance(now)
                    self.tier.pinned = set()
                now += t.token_overhead_s
                self._advance(now)
                st.tokens += 1
                st.time_s += now - token_start
                if progress is not None:
                    progress.update(1)
            self.signals.end_request(rid)
        st.wall_s = time.perf_counter() - wall
        return st


__all__ = [
    "TIMING_MODELS",
    "RunStats",
    "SimTier",
    "Simulation",
    "TimingModel",
    "cpu_e2e_timing",
    "floor_ms",
    "EXPERT_PRECISIONS",
    "gpt_oss_20b_expert_bytes",
    "gpt_oss_20b_expert_tensors",
    "gpu_timing",
    "timing_model",
]
