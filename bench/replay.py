"""Trace replay: the daemon's own policies and prefetch scheduler under a timing model.

::

    trace (npz) ──routes──▶ ActivationSignals.observe ──▶ EvictionPolicy ─┐
       │                     set_layer_ahead (modelled accuracy)          ├─▶ SimTier (TierState) ─▶ link model
       └─ earlier requests ─▶ Eamc + predict_request ─▶ set_hints ────────┘   PrefetchScheduler.decide

The objects are the ones the daemon runs (``cache_daemon.signals``, ``cache_daemon.policy``,
``cache_daemon.prefetch``); only the tier and the clock are simulated. The tier's slots are
global (not per layer): a budget of 25% holds a quarter of all (layer, expert) blobs.

Timing model (defaults, all printed): one link moving blobs in chunks; a demand pre-empts
prefetch at chunk boundaries; per layer, attention runs, the router picks experts, resident
experts compute first and the others as they arrive (reordered execution); transfers overlap
compute. A layer stalls until its experts are resident. Latency per token is simulated time.

Usage: ``python -m bench.replay [--trace PATH] [--requests N|all] [--budgets 0.1,0.25,0.5]
[--policies lru,lfu,...] [--layer-ahead-accuracy 0.9] [--link-gbps 25] [--expert-mib ...]
[--layer-compute-ms ...]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
from tqdm import tqdm

from cache_daemon.policy import ONLINE_POLICIES, REPLAY_ONLY_POLICIES, FutureUses, PolicyShape, make_policy
from cache_daemon.prefetch import PrefetchClass, PrefetchConfig, PrefetchScheduler
from cache_daemon.signals import ActivationSignals, SignalsConfig
from expertcache.keys import ExpertKey
from expertcache.trace import RoutingTrace, TraceError, read_trace

logger = logging.getLogger(__name__)

DEFAULT_TRACE = (
    Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "gpt-oss-20b_decode_703req.npz"
)
RESULTS_DIR = Path(__file__).resolve().parent / "results"
ALL_POLICIES = (*ONLINE_POLICIES, *REPLAY_ONLY_POLICIES)
GOAL_BUDGET = 0.25
GOAL_BYTES_RATIO = 1.3  # activation-aware bytes / Belady bytes
GOAL_FLOOR_RATIO = 1.3  # activation-aware latency / floor


# -- timing model ------------------------------------------------------------------------------


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
    notes: tuple[str, ...] = field(default=())

    @property
    def layer_s(self) -> float:
        return self.attention_s + self.top_k * self.expert_s + self.layer_overhead_s

    @property
    def all_resident_token_s(self) -> float:
        return self.num_layers * self.layer_s + self.token_overhead_s

    @property
    def transfer_s(self) -> float:
        return self.expert_bytes / self.link_bytes_per_s


def default_timing(
    num_layers: int,
    top_k: int,
    *,
    link_gbps: float = 25.0,
    expert_mib: float | None = None,
    layer_compute_ms: float | None = None,
    chunk_mib: float = 4.0,
) -> TimingModel:
    """gpt-oss-20b in bf16 on PCIe 4.0 x16 with an A5000-class GPU (768 GB/s GDDR6)."""
    hbm_bytes_per_s = 768e9 * 0.8  # decode GEMVs reach ~80% of peak memory bandwidth
    expert_bytes = gpt_oss_20b_expert_bytes()
    notes = [
        f"expert: gpt-oss-20b bf16, hidden 2880, intermediate 2880: gate_up [5760, 2880] + bias [5760], "
        f"down [2880, 2880] + bias [2880] = {expert_bytes} bytes ({expert_bytes / 2**20:.2f} MiB)",
    ]
    if expert_mib is not None:
        expert_bytes = int(expert_mib * 2**20)
        notes.append(f"expert bytes overridden: {expert_bytes} bytes ({expert_mib} MiB)")
    attn_bytes = gpt_oss_20b_attention_bytes()
    attention_s = attn_bytes / hbm_bytes_per_s + 10e-6  # + router / norms / rope kernels
    expert_s = gpt_oss_20b_expert_bytes() / hbm_bytes_per_s
    layer_overhead_s = 50e-6  # ~10 kernel launches at ~5 us each at batch 1
    lm_head_bytes = 201088 * 2880 * 2  # vocab x hidden bf16 (embedding lookup is one row)
    token_overhead_s = lm_head_bytes / hbm_bytes_per_s + 50e-6
    notes += [
        f"link: PCIe 4.0 x16 = 31.5 GB/s raw (16 GT/s x 16 lanes, 128b/130b); pinned host->device "
        f"copies of large blobs reach ~{link_gbps:g} GB/s effective (TLP/DMA overhead), used here",
        f"chunks of {chunk_mib:g} MiB: a demand pre-empts a prefetch at the next chunk boundary",
        "compute: A5000-class, 768 GB/s GDDR6 at 80% for batch-1 GEMVs (614 GB/s); "
        f"attention q/k/v/o + biases {attn_bytes} bytes -> {attention_s * 1e6:.1f} us incl. 10 us router/norms; "
        f"one expert {expert_s * 1e6:.1f} us; per-layer launch overhead {layer_overhead_s * 1e6:.0f} us; "
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
    )
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


# -- the trace ---------------------------------------------------------------------------------


def load_trace(path: Path) -> RoutingTrace:
    """The decode rows of the trace at ``path`` (``expertcache.trace``); prefill is batched and
    has another cost model."""
    try:
        return read_trace(path).decode_only()
    except TraceError as exc:
        raise SystemExit(f"{exc} (make bench-replay TRACE=path)") from None


# -- hints from the predictor's own code ---------------------------------------------------------


class HintSource:
    """The hints the daemon would receive: predictor_svc's Eamc (embedded store) and its request
    predictor, warmed only by requests before the one replayed."""

    def __init__(self, trace: RoutingTrace, *, capacity: int = 512, top_n: int | None = None) -> None:
        from predictor_svc.config import PredictorConfig
        from predictor_svc.eam import EamShape, add_token, new_eam
        from predictor_svc.eamc import Eamc
        from predictor_svc.predict import PredictionConfig, predict_request
        from predictor_svc.service import HINT_SOURCE, top_hints
        from predictor_svc.store.embedded import EmbeddedStore

        pcfg = PredictorConfig()
        self._shape = EamShape(trace.num_layers, trace.num_experts, trace.top_k)
        self._eamc = Eamc(EmbeddedStore(), "replay", self._shape, capacity)
        self._config = PredictionConfig(top_n=pcfg.match_top_n)
        self._top_n = top_n or pcfg.hint_top_n
        self._min_score = pcfg.min_score
        self._source = HINT_SOURCE
        self._predict_request = predict_request
        self._top_hints = top_hints
        self._new_eam = new_eam
        self._add_token = add_token
        self.inserted = 0
        self.notes = (
            f"hints: predictor_svc Eamc (embedded store, capacity {capacity}) + predict_request "
            f"(= RequestPredictor, source {HINT_SOURCE!r}, match_top_n {pcfg.match_top_n}); per token "
            f"the top {self._top_n} per layer with score >= {self._min_score}, available from the "
            "token's first layer; the EAMC holds only requests before the replayed one"
        )

    def insert(self, experts: np.ndarray) -> None:
        """A finished request's routing ``experts`` int [T, L, K] joins the EAMC."""
        eam = self._new_eam(self._shape)
        for row in experts:
            self._add_token(eam, row)
        self._eamc.insert(eam, len(experts))
        self.inserted += 1

    def request_hints(self, experts: np.ndarray) -> list[list[tuple[int, int, float]]]:
        """Per token of a request (int [T, L, K]) the hints known before that token."""
        scores = self._predict_request(self._eamc, self._shape, self._config, experts)[self._source]
        out = []
        for t in range(len(experts)):
            layers = self._top_hints(scores[t], self._top_n, self._min_score)
            out.append([(h.layer, h.expert, h.score) for hs in layers.values() for h in hs])
        return out


# -- the simulated tier --------------------------------------------------------------------------


@dataclass
class _Load:
    entry: int
    remaining: int
    seq: int
    cls: PrefetchClass
    prefetch: bool  # started as a prefetch (a demand may have joined it since)


class SimTier:
    """A tier of ``capacity`` global slots: implements ``TierState`` for ``PrefetchScheduler``."""

    def __init__(self, capacity: int, num_entries: int, num_experts: int, blob_bytes: int) -> None:
        self.capacity = capacity
        self.num_experts = num_experts
        self.blob_bytes = blob_bytes
        self.resident = np.zeros(num_entries, bool)
        self.n_resident = 0
        self.loading: dict[int, _Load] = {}
        self.pinned: set[int] = set()

    def _e(self, key: ExpertKey) -> int:
        return key.entry(self.num_experts)

    @property
    def free_slots(self) -> int:
        return self.capacity - self.n_resident - len(self.loading)

    @property
    def inflight_bytes(self) -> int:
        return len(self.loading) * self.blob_bytes

    def is_resident(self, key: ExpertKey) -> bool:
        return bool(self.resident[self._e(key)])

    def is_loading(self, key: ExpertKey) -> bool:
        return self._e(key) in self.loading

    def evictable(self, key: ExpertKey) -> bool:
        e = self._e(key)
        return bool(self.resident[e]) and e not in self.pinned


# -- one simulation ------------------------------------------------------------------------------


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
            "stall_ms_per_token": self.stall_s / t * 1e3,
            "latency_ms_per_token": self.time_s / t * 1e3,
            "wall_s": self.wall_s,
        }


class Simulation:
    """One policy × budget × layer-ahead run over the chosen requests (cache warm across them)."""

    def __init__(
        self,
        trace: RoutingTrace,
        timing: TimingModel,
        policy: str,
        budget: float,
        *,
        requests: range,
        layer_ahead_accuracy: float | None,
        hints: dict[int, list[list[tuple[int, int, float]]]] | None,
        signals_config: SignalsConfig | None = None,
        prefetch_config: PrefetchConfig | None = None,
        max_inflight_bytes: int | None = None,
        policy_kwargs: dict | None = None,
        seed: int = 0,
    ) -> None:
        L, E = trace.num_layers, trace.num_experts
        self.trace = trace
        self.timing = timing
        self.requests = requests
        self.hints = hints
        self.accuracy = layer_ahead_accuracy
        self.rng = np.random.default_rng(seed)
        self.L, self.E, self.K = L, E, trace.top_k
        n = L * E
        slots = max(int(round(budget * n)), self.K + 1)
        self.signals = ActivationSignals(L, E, config=signals_config)
        lo, hi = int(trace.req_offsets[requests.start]), int(trace.req_offsets[requests.stop])
        self.routes = trace.expert_ids[lo:hi]
        self.weights = trace.gate_weights[lo:hi]
        replay_only = policy in REPLAY_ONLY_POLICIES
        future = FutureUses(self.routes, E) if replay_only else None
        shape = PolicyShape(L, E)
        if replay_only:
            self.policy = make_policy(policy, shape, self.signals, future=future)
        elif policy_kwargs:
            from cache_daemon.policy import POLICIES

            self.policy = POLICIES[policy](shape, self.signals, **policy_kwargs)
        else:
            self.policy = make_policy(policy, shape, self.signals)
        pcfg = prefetch_config or PrefetchConfig()
        if replay_only:
            # The bytes floor: Belady's MIN is the optimum of *demand* fetching; the oracle row
            # measures eviction with perfect next-token knowledge, also without speculation.
            pcfg = replace(pcfg, layer_ahead=False, eamc=False)
        elif layer_ahead_accuracy is None:
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
        self.stats = RunStats(policy, budget, slots, layer_ahead_accuracy is not None)
        self.link_t = 0.0
        self.seq = 0
        self.prefetched_unused: set[int] = set()

    # link -------------------------------------------------------------------------------------

    def _next_load(self) -> _Load | None:
        best = None
        for ld in self.tier.loading.values():
            k = (int(ld.cls), ld.seq)
            if best is None or k < best[0]:
                best = (k, ld)
        return None if best is None else best[1]

    def _chunk(self) -> int | None:
        """Move one chunk of the highest-priority load; returns the entry if it completed."""
        ld = self._next_load()
        if ld is None:
            return None
        c = min(self.timing.chunk_bytes, ld.remaining)
        self.link_t += c / self.timing.link_bytes_per_s
        ld.remaining -= c
        self.stats.bytes_loaded += c
        if ld.remaining > 0:
            return -1
        del self.tier.loading[ld.entry]
        self.tier.resident[ld.entry] = True
        self.tier.n_resident += 1
        key = self.signals.key_of(ld.entry)
        self.policy.on_insert(key)
        self.sched.on_done(key)
        self.stats.loads += 1
        if ld.prefetch and ld.cls != PrefetchClass.DEMAND:
            self.prefetched_unused.add(ld.entry)
        self._prefetch()
        return ld.entry

    def _advance(self, until: float) -> None:
        """Run the link up to ``until`` (a chunk in progress finishes past it)."""
        while self.link_t < until:
            if not self.tier.loading:
                self.link_t = until
                return
            self._chunk()

    def _wait_for(self, entry: int, now: float) -> float:
        """Time at which ``entry`` is resident (running the link as needed)."""
        self._advance(now)
        while entry in self.tier.loading:
            self._chunk()
        return max(self.link_t, now)

    # tier -------------------------------------------------------------------------------------

    def _evict(self, entry: int) -> None:
        assert self.tier.resident[entry] and entry not in self.tier.pinned, "evicting a pinned expert"
        self.tier.resident[entry] = False
        self.tier.n_resident -= 1
        self.policy.on_remove(self.signals.key_of(entry))
        self.prefetched_unused.discard(entry)

    def _start(self, entry: int, cls: PrefetchClass) -> None:
        self.seq += 1
        self.tier.loading[entry] = _Load(
            entry, self.timing.expert_bytes, self.seq, cls, cls != PrefetchClass.DEMAND
        )

    def _prefetch(self) -> None:
        for s in self.sched.decide(self.tier):
            if s.victim is not None:
                self._evict(self.signals.entry_of(s.victim))
            e = self.signals.entry_of(s.key)
            self._start(e, s.cls)
            self.stats.prefetches += 1

    def _demand(self, entry: int) -> None:
        key = self.signals.key_of(entry)
        self.sched.on_demand(key)
        ld = self.tier.loading.get(entry)
        if ld is not None:
            ld.cls = PrefetchClass.DEMAND  # joins the load at demand priority
            self.stats.late_prefetch_hits += 1
            self.stats.prefetches_used += 1
            return
        if self.tier.free_slots <= 0:
            victims = self.policy.choose_victims(1, self.tier.evictable)
            if victims:
                self._evict(self.signals.entry_of(victims[0]))
            else:
                cands = self.sched.cancel_candidates(self.tier)
                if not cands:
                    raise RuntimeError("no slot for a demand: budget below top_k")
                victim = self.signals.entry_of(cands[0])
                del self.tier.loading[victim]
                self.sched.on_dropped(cands[0])
                self.stats.prefetches_cancelled += 1
        self._start(entry, PrefetchClass.DEMAND)

    def _layer_ahead(self, g: int, layer: int) -> None:
        """Model compute's layer-ahead router: each true expert of (token g, layer) is predicted
        with probability ``accuracy``; a miss is replaced by a plausible wrong expert (drawn by
        the request's recent use of that layer's other experts)."""
        true = self.routes[g, layer].astype(np.int64)
        w = self.weights[g, layer]
        keep = self.rng.random(len(true)) < self.accuracy
        experts = true.copy()
        if not keep.all():
            base = layer * self.E
            p = self.signals.history[base : base + self.E].astype(np.float64) + 1e-3
            p[true] = 0.0
            wrong = self.rng.choice(self.E, size=int((~keep).sum()), replace=False, p=p / p.sum())
            experts[~keep] = wrong
        self.signals.set_layer_ahead(layer, experts, w, g)

    # main loop --------------------------------------------------------------------------------

    def run(self, progress: tqdm | None = None) -> RunStats:
        wall = time.perf_counter()
        t = self.timing
        now = 0.0
        offs = self.trace.req_offsets
        base = int(offs[self.requests.start])
        st = self.stats
        for r in self.requests:
            lo, hi = int(offs[r]) - base, int(offs[r + 1]) - base
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
                    self.signals.observe(layer, experts, g)
                    self.tier.pinned = set(entries)
                    if self.accuracy is not None and layer + 1 < self.L:
                        self._layer_ahead(g, layer + 1)
                    ready = []
                    for e in entries:
                        st.accesses += 1
                        if self.tier.resident[e]:
                            st.hits += 1
                            self.policy.on_access(self.signals.key_of(e))
                            if e in self.prefetched_unused:
                                self.prefetched_unused.discard(e)
                                st.prefetches_used += 1
                            ready.append((0.0, e))
                        else:
                            self._demand(e)
                    self._prefetch()
                    # Reordered execution: resident experts first, the rest as they arrive.
                    finish = now
                    for e in entries:
                        if e in self.tier.loading or not self.tier.resident[e]:
                            arrive = self._wait_for(e, now)
                            self.policy.on_access(self.signals.key_of(e))
                            self.prefetched_unused.discard(e)
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


# -- the benchmark -------------------------------------------------------------------------------


def floor_ms(timing: TimingModel, belady_bytes_per_token: float) -> float:
    """The physical limit per token: max(all-resident compute, Belady bytes / link bandwidth)."""
    return max(timing.all_resident_token_s, belady_bytes_per_token / timing.link_bytes_per_s) * 1e3


def evaluate_goals(rows: list[dict], timing: TimingModel, budget: float = GOAL_BUDGET) -> list[dict]:
    """PASS/FAIL of the issue's goals at ``budget``, per layer-ahead setting."""
    out = []
    for la in (False, True):
        sel = {r["policy"]: r for r in rows if r["budget"] == budget and r["layer_ahead"] == la}
        if "activation-aware" not in sel or "belady" not in sel:
            continue
        aa, bel = sel["activation-aware"], sel["belady"]
        fl = floor_ms(timing, bel["bytes_per_token"])
        bytes_ratio = aa["bytes_per_token"] / bel["bytes_per_token"]
        floor_ratio = aa["latency_ms_per_token"] / fl
        goals = [
            ("bytes <= 1.3 x Belady", bytes_ratio, bytes_ratio <= GOAL_BYTES_RATIO),
            ("latency <= 1.3 x floor", floor_ratio, floor_ratio <= GOAL_FLOOR_RATIO),
        ]
        for other in ("lru", "lfu", "moe-infinity"):
            if other in sel:
                ratio = aa["latency_ms_per_token"] / sel[other]["latency_ms_per_token"]
                goals.append((f"faster than {other}", ratio, ratio < 1.0))
        for name, value, ok in goals:
            out.append({"layer_ahead": la, "goal": name, "value": value, "pass": bool(ok)})
    return out


def write_png(rows: list[dict], path: Path, budgets: list[float], policies: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), sharey=True)
    width = 0.8 / max(len(policies), 1)
    for ax, la in zip(axes, (False, True), strict=True):
        for i, pol in enumerate(policies):
            vals = []
            for b in budgets:
                r = [x for x in rows if x["policy"] == pol and x["budget"] == b and x["layer_ahead"] == la]
                vals.append(r[0]["latency_ms_per_token"] if r else math.nan)
            ax.bar(np.arange(len(budgets)) + (i - (len(policies) - 1) / 2) * width, vals, width, label=pol)
        for j, b in enumerate(budgets):
            fl = [x["floor_ms_per_token"] for x in rows if x["budget"] == b and x["layer_ahead"] == la]
            if fl:
                ax.hlines(
                    fl[0], j - 0.45, j + 0.45, colors="k", linestyles="--", label="floor" if j == 0 else None
                )
        ax.set_xticks(np.arange(len(budgets)), [f"{b:.0%}" for b in budgets])
        ax.set_xlabel("budget (share of all experts)")
        ax.set_title("with layer-ahead" if la else "without layer-ahead")
    axes[0].set_ylabel("simulated latency per token (ms)")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.replay", description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument(
        "--requests", default="6", help="requests replayed (default 6: a few minutes here), or 'all'"
    )
    ap.add_argument(
        "--first-request",
        type=int,
        default=None,
        help="first replayed request; the EAMC is warmed with the requests before it "
        "(default 64, or half the requests of a smaller trace; 0 with --requests all)",
    )
    ap.add_argument("--budgets", default="0.1,0.25,0.5")
    ap.add_argument("--policies", default=",".join(ALL_POLICIES))
    ap.add_argument("--layer-ahead-accuracy", type=float, default=0.9)
    ap.add_argument("--link-gbps", type=float, default=25.0)
    ap.add_argument("--expert-mib", type=float, default=None)
    ap.add_argument("--layer-compute-ms", type=float, default=None)
    ap.add_argument("--chunk-mib", type=float, default=4.0)
    ap.add_argument(
        "--max-inflight-experts",
        type=int,
        default=None,
        help="bytes-in-flight bound in experts (default 1: a prefetch starts only on an idle link; 1, 2, 4, 8 tried on requests 32..35, 1 best at every budget)",
    )
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    ap.add_argument("--no-progress", action="store_true")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    trace = load_trace(args.trace)
    if args.first_request is None:
        first = 0 if args.requests == "all" else min(64, trace.num_requests // 2)
    else:
        first = args.first_request
    if not 0 <= first < trace.num_requests:
        raise SystemExit(f"--first-request {first} outside 0..{trace.num_requests - 1}")
    if args.requests == "all":
        last = trace.num_requests
    else:
        try:
            n = int(args.requests)
        except ValueError:
            raise SystemExit(f"--requests must be an int or 'all', got {args.requests!r}") from None
        if n < 1:
            raise SystemExit(f"--requests must be >= 1, got {n}")
        last = min(first + n, trace.num_requests)
    requests = range(first, last)
    budgets = [float(b) for b in args.budgets.split(",") if b]
    for b in budgets:
        if not 0.0 < b <= 1.0:
            raise SystemExit(f"budget {b} outside (0, 1]")
    policies = [p for p in args.policies.split(",") if p]
    unknown = [p for p in policies if p not in ALL_POLICIES]
    if unknown:
        raise SystemExit(f"unknown policies {unknown}; valid: {', '.join(ALL_POLICIES)}")
    if "belady" not in policies:
        policies.append("belady")  # the floor needs it
    acc = args.layer_ahead_accuracy
    if not 0.0 <= acc <= 1.0:
        raise SystemExit(f"--layer-ahead-accuracy must be in [0, 1], got {acc}")
    timing = default_timing(
        trace.num_layers,
        trace.top_k,
        link_gbps=args.link_gbps,
        expert_mib=args.expert_mib,
        layer_compute_ms=args.layer_compute_ms,
        chunk_mib=args.chunk_mib,
    )
    if args.max_inflight_experts is not None and args.max_inflight_experts < 1:
        raise SystemExit(f"--max-inflight-experts must be >= 1, got {args.max_inflight_experts}")
    max_inflight = (args.max_inflight_experts or 1) * timing.expert_bytes
    tokens = int(trace.req_offsets[last] - trace.req_offsets[first])

    hints_src = HintSource(trace)
    for r in range(first):
        hints_src.insert(trace.expert_ids[trace.req_offsets[r] : trace.req_offsets[r + 1]])
    hints: dict[int, list] = {}
    for r in requests:
        rows_r = trace.expert_ids[trace.req_offsets[r] : trace.req_offsets[r + 1]]
        hints[r] = hints_src.request_hints(rows_r)
        hints_src.insert(rows_r)

    print(f"trace {trace.path}: {trace.num_layers} layers x {trace.num_experts} experts, top-{trace.top_k}")
    print(
        f"replaying requests {first}..{last - 1} ({len(requests)} requests, {tokens} tokens) in file order, "
        f"cache warm across requests; EAMC warmed with requests 0..{first - 1}"
    )
    print("timing model:")
    for note in timing.notes:
        print(f"  - {note}")
    print(
        f"  - bytes in flight bounded at {max_inflight // timing.expert_bytes} experts "
        f"({max_inflight / 2**20:.0f} MiB); budgets are global slots over all (layer, expert) pairs"
    )
    print(
        f"  - layer-ahead modelled at accuracy {acc}: each true expert of (token, l+1) predicted with "
        "that probability, misses replaced by wrong experts drawn by the request's recent use"
    )
    print(f"  - {hints_src.notes}")
    print("  - belady: demand fetching only (the offline optimum of bytes), same row in both settings")
    print(
        "  - oracle-next-token: a reference, not a goal: activation-aware eviction told the exact routing of "
        "the next token (no online predictor has it), demand fetching only, same row in both settings"
    )

    runs = [
        (p, b, la)
        for b in budgets
        for p in policies
        for la in ((False,) if p in REPLAY_ONLY_POLICIES else (False, True))
    ]
    rows: list[dict] = []
    bar = None if args.no_progress else tqdm(total=tokens * len(runs), unit="tok", desc="replay")
    for p, b, la in runs:
        sim = Simulation(
            trace,
            timing,
            p,
            b,
            requests=requests,
            layer_ahead_accuracy=acc if la else None,
            hints=hints,
            max_inflight_bytes=max_inflight,
        )
        st = sim.run(bar)
        row = st.summary(timing)
        rows.append(row)
        if p in REPLAY_ONLY_POLICIES:
            rows.append({**row, "layer_ahead": True})
    if bar is not None:
        bar.close()
    for row in rows:
        bel = next(x for x in rows if x["policy"] == "belady" and x["budget"] == row["budget"])
        fl = floor_ms(timing, bel["bytes_per_token"])
        row["floor_ms_per_token"] = fl
        row["bytes_vs_belady"] = row["bytes_per_token"] / bel["bytes_per_token"]
        row["latency_vs_floor"] = row["latency_ms_per_token"] / fl
    goals = evaluate_goals(rows, timing)

    hdr = (
        f"{'budget':>6} {'policy':<17} {'LA':<3} {'hit':>6} {'MiB/tok':>8} {'xBelady':>7} "
        f"{'stall ms':>9} {'lat ms':>8} {'floor':>7} {'xfloor':>6} {'pf acc':>6}"
    )
    print(hdr)
    for row in sorted(rows, key=lambda x: (x["budget"], x["layer_ahead"], ALL_POLICIES.index(x["policy"]))):
        print(
            f"{row['budget']:>6.0%} {row['policy']:<17} {'y' if row['layer_ahead'] else 'n':<3} "
            f"{row['hit_rate']:>6.3f} {row['bytes_per_token'] / 2**20:>8.1f} {row['bytes_vs_belady']:>7.3f} "
            f"{row['stall_ms_per_token']:>9.2f} {row['latency_ms_per_token']:>8.2f} "
            f"{row['floor_ms_per_token']:>7.2f} {row['latency_vs_floor']:>6.3f} {row['prefetch_accuracy']:>6.3f}"
        )
    print(f"goals at {GOAL_BUDGET:.0%} (activation-aware):")
    for g in goals:
        print(
            f"  {'with' if g['layer_ahead'] else 'without'} layer-ahead: {g['goal']:<24} "
            f"{g['value']:.3f}  {'PASS' if g['pass'] else 'FAIL'}"
        )
    reference = next(
        (
            r
            for r in rows
            if r["policy"] == "oracle-next-token" and r["budget"] == GOAL_BUDGET and not r["layer_ahead"]
        ),
        None,
    )
    if reference is not None:
        print(
            f"reference at {GOAL_BUDGET:.0%}: oracle-next-token (the exact routing of the next token, which no online "
            f"predictor has) loads {reference['bytes_vs_belady']:.3f} x Belady's bytes, latency "
            f"{reference['latency_vs_floor']:.3f} x the floor"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "trace": trace.path,
        "requests": [first, last],
        "tokens": tokens,
        "layers": trace.num_layers,
        "experts": trace.num_experts,
        "top_k": trace.top_k,
        "timing": {k: v for k, v in asdict(timing).items()},
        "max_inflight_bytes": max_inflight,
        "layer_ahead_accuracy": acc,
        "signals_config": asdict(SignalsConfig()),
        "prefetch_config": asdict(PrefetchConfig()),
        "rows": rows,
        "goals": goals,
    }
    (args.out / "replay.json").write_text(json.dumps(result, indent=2))
    write_png(rows, args.out / "replay.png", budgets, [p for p in ALL_POLICIES if p in policies])
    print(f"wrote {args.out / 'replay.json'} and {args.out / 'replay.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
