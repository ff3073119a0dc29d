"""The prefetch scheduler (``PrefetchScheduler``): which experts to start loading ahead of demand,
and in what order. Pure decision code shared by the daemon's prefetcher and the trace replay:
``decide`` reads the ``TierState`` and the ``ActivationSignals`` and returns the loads to start,
never waiting. Its rules, with an example, are in ``docs/daemon.md``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, NamedTuple, Protocol

import numpy as np

from cache_daemon.decisions.policy.base import EvictionPolicy
from cache_daemon.decisions.signals import ActivationSignals
from expertcache.keys import ExpertKey

logger = logging.getLogger(__name__)

# The usefulness estimate of a lookahead depth starts as this many used prefetches (and forgets
# back towards it): a depth is tried before it is judged.
USEFULNESS_PRIOR_WEIGHT = 4.0

DEFAULT_INFLIGHT_BLOBS = 4
"""The daemon's bound on loads in flight when ``max_inflight_bytes`` is 0: this many blobs."""


class PrefetchClass(IntEnum):
    """Priority class of a load; lower value = served first."""

    DEMAND = 0
    LAYER_AHEAD = 1  # compute's lookahead, at any depth
    EAMC = 2  # the request's history or the predictor's EAMC hints


@dataclass(frozen=True)
class PrefetchStart:
    """One load to begin: ``key`` into a free slot (``victim is None``) or in place of ``victim``.
    ``depth``: the lookahead depth it came from (0 for class EAMC)."""

    key: ExpertKey
    cls: PrefetchClass
    score: float
    victim: ExpertKey | None
    depth: int = 0


@dataclass(eq=False)
class QueuedLoad:
    """One load in flight in a tier. ``cls`` DEMAND once a demand started or joined it; a
    prefetch keeps its ``score`` and ``depth`` (what a cancellation orders by). ``started``: the
    tier's I/O took it (a started read loses only its unissued chunks when cancelled)."""

    key: ExpertKey
    cls: PrefetchClass
    score: float = 0.0
    depth: int = 0
    prefetch: PrefetchClass | None = None  # the class it was started as, if a prefetch
    started: bool = False
    cancelled: bool = False
    handle: Any = None  # the tier's own I/O record (the daemon's load), opaque here

    def __post_init__(self) -> None:
        if self.prefetch is None and self.cls is not PrefetchClass.DEMAND:
            self.prefetch = self.cls


class PrefetchQueue:
    """Every load in flight of one tier, demand and prefetch: the one record of them, by key.

    The daemon's residency and the replay's simulated tier each keep one; the scheduler reads it
    (what is loading, the bytes in flight) and demands ask it what they may cancel."""

    def __init__(self, blob_bytes: int) -> None:
        if blob_bytes < 1:
            raise ValueError(f"blob_bytes must be >= 1, got {blob_bytes}")
        self.blob_bytes = blob_bytes
        self._loads: dict[ExpertKey, QueuedLoad] = {}

    def add(self, load: QueuedLoad) -> QueuedLoad:
        if load.key in self._loads:
            raise ValueError(f"{load.key} is already loading")
        self._loads[load.key] = load
        return load

    def get(self, key: ExpertKey) -> QueuedLoad | None:
        return self._loads.get(key)

    def remove(self, key: ExpertKey) -> QueuedLoad | None:
        """The load of ``key`` finished, failed or was dropped."""
        return self._loads.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._loads

    def __len__(self) -> int:
        return len(self._loads)

    def __iter__(self) -> Iterator[QueuedLoad]:
        return iter(list(self._loads.values()))

    @property
    def inflight_bytes(self) -> int:
        return len(self._loads) * self.blob_bytes

    def promote(self, key: ExpertKey) -> QueuedLoad | None:
        """A demand joined the load of ``key``: it is a demand load from now on (returns it, or
        None when the load was already one)."""
        load = self._loads.get(key)
        if load is None or load.cls is PrefetchClass.DEMAND:
            return None
        load.cls = PrefetchClass.DEMAND
        return load

    def prefetching(self) -> int:
        """Prefetch loads in flight that no demand has joined."""
        return sum(1 for ld in self._loads.values() if ld.cls is not PrefetchClass.DEMAND)

    def cancel_candidates(
        self, keep: set[ExpertKey] | frozenset[ExpertKey] = frozenset()
    ) -> list[QueuedLoad]:
        """Prefetch loads a demand may cancel (not joined by a demand, not cancelled, not in
        ``keep``): lowest class first (EAMC before LAYER_AHEAD), then deepest and lowest score,
        unstarted before started (an unstarted one frees its slot at once)."""
        items = [
            ld
            for ld in self._loads.values()
            if ld.cls is not PrefetchClass.DEMAND and not ld.cancelled and ld.key not in keep
        ]
        items.sort(key=lambda ld: (ld.started, -int(ld.cls), -ld.depth, ld.score, ld.key))
        return items


class TierState(Protocol):
    """What the scheduler needs to know about a tier (the daemon's residency; ``SimTier``)."""

    @property
    def free_slots(self) -> int:
        """Slots holding nothing (neither resident nor loading)."""
        ...

    @property
    def queue(self) -> PrefetchQueue:
        """Loads in flight."""
        ...

    def is_resident(self, key: ExpertKey) -> bool: ...

    def evictable(self, key: ExpertKey) -> bool:
        """Resident, unpinned and not needed now: may be displaced."""
        ...


@dataclass(frozen=True)
class PrefetchConfig:
    """Tuning of the scheduler."""

    layer_ahead: bool = True
    """Prefetch compute's lookahead predictions (class LAYER_AHEAD)."""

    eamc: bool = True
    """Prefetch from the EAMC hints and the request's history (class EAMC)."""

    horizon_layers: int = field(default=2, metadata={"min": 1, "max": 1 << 16})
    """Class EAMC looks at most this many layers ahead of the position."""

    max_depth: int = field(default=8, metadata={"min": 1, "max": 1 << 16})
    """Lookahead predictions deeper than this are not prefetched (they still update the
    precision estimate of their depth)."""

    min_probability: float = field(default=0.7, metadata={"min": 0.0, "max": 1.0})
    """The one bar a prefetch must pass: an expert is prefetched only while the estimate that it
    will be used when its layer comes is at least this. For a lookahead guess that estimate is the
    precision measured for its depth (the whole depth is cut below the bar) and for its depth and
    prior bucket (``ActivationSignals.lookahead_confidence``); for class EAMC it is the policy's use
    probability at the expert's next visit (``EvictionPolicy.prefetch_scores``). A prefetch pays
    for its blob only if it is used often enough. It is one bar because the two classes trade the
    same experts: a lookahead guess cut by a higher bar alone came back as class EAMC through a bar
    left lower (6737 EAMC starts instead of about 600 end to end), and nothing changed.

    Live as the daemon's ``prefetch_min_probability``: a higher bar reads fewer bytes, a lower one
    hides more misses. Measured on the shared trace at 25% with lookahead (``bench.replay``,
    requests 64..69): 0.3 / 0.5 / 0.7 / 0.8 for lookahead load 1.995 / 1.975 / 1.762 / 1.741 x
    Belady's bytes at 25.66 / 25.64 / 25.75 / 25.76 ms per token with the learned next-visit model,
    and without lookahead 0.3 / 0.5 / 0.7 for class EAMC load 1.722 / 1.600 / 1.567 x at 27.6 /
    27.9 / 28.2 ms. End to end (``bench.e2e --baseline``, this 2-core machine, the disk the
    bottleneck): 0.85 read 6% fewer bytes than 0.7 (0.775 x LRU's, against 0.815-0.822) at 0.955 x
    the speed, and 0.95 8% fewer (0.756 x) at 0.916 x (each the geometric mean of a run in both
    start orders, ``--baseline-first``): a right guess saves only part of a read's wait, a wrong
    one costs a whole blob. No bar reads less than ours' eviction alone (0.752 x, prefetch off).
    0.7 favours speed."""

    min_usefulness: float = field(default=0.5, metadata={"min": 0.0, "max": 1.0})
    """A lookahead depth (and class EAMC, as depth 0) is prefetched only while at least this share
    of its prefetches are used before they are evicted (``usefulness``): a wasted one costs a blob
    of link time and a victim and saves nothing. Precision alone misses it: a right guess for a
    far layer is often evicted before its layer comes round."""

    usefulness_half_life: float = field(default=1024.0, metadata={"min": 1.0, "max": 1e9})
    """Half-life, in signal changes (``ActivationSignals.version``: about two per MoE layer per
    request), of each depth's usefulness counts: with no outcomes the estimate returns to its
    optimistic prior, so a depth that was cut off is tried again."""

    max_starts: int = field(default=64, metadata={"min": 1, "max": 1 << 20})
    """At most this many starts per ``decide`` call."""

    max_rejects: int = field(default=4, metadata={"min": 1, "max": 1 << 20})
    """A ``decide`` call stops after this many candidates lost to their victims (the
    candidates come best first, so the later ones rarely win; bounds the cost per call)."""

    def __post_init__(self) -> None:
        for name in (
            "horizon_layers",
            "max_depth",
            "min_probability",
            "min_usefulness",
            "usefulness_half_life",
            "max_starts",
            "max_rejects",
        ):
            spec = self.__dataclass_fields__[name]
            value = getattr(self, name)
            lo, hi = spec.metadata["min"], spec.metadata["max"]
            if not (lo <= value <= hi):
                raise ValueError(f"PrefetchConfig.{name} must be in [{lo}, {hi}], got {value!r}")


class Candidate(NamedTuple):
    """An expert the scheduler would like in the tier; ordered by (deadline, -confidence, -score,
    entry): ``confidence`` is its use probability at that visit, ``score`` the router's
    probability (lookahead) or the policy's score (EAMC), which orders experts of equal
    confidence. A candidate list names each entry once, so ``cls`` and ``depth`` never decide the
    order. A tuple: a decision sorts dozens of them per routed layer, compared in C."""

    deadline: int  # MoE layers until its layer is visited
    neg_confidence: float
    neg_score: float
    entry: int
    cls: PrefetchClass
    depth: int = 0

    @property
    def confidence(self) -> float:
        return -self.neg_confidence

    @property
    def score(self) -> float:
        return -self.neg_score


class PrefetchScheduler:
    """Chooses prefetches for one tier; not thread-safe (the caller holds its lock)."""

    def __init__(
        self,
        signals: ActivationSignals,
        policy: EvictionPolicy,
        *,
        blob_bytes: int,
        max_inflight_bytes: int,
        config: PrefetchConfig | None = None,
    ) -> None:
        if blob_bytes < 1:
            raise ValueError(f"blob_bytes must be >= 1, got {blob_bytes}")
        if max_inflight_bytes < 0:
            raise ValueError(f"max_inflight_bytes must be >= 0, got {max_inflight_bytes}")
        self.signals = signals
        self.policy = policy
        self.blob_bytes = blob_bytes
        self.max_inflight_bytes = max_inflight_bytes
        self.config = config or PrefetchConfig()
        self._demanded: set[int] = set()  # entries demanded at _demand_step
        self._demand_step = signals.step
        self._cand_cache: tuple[int, int, PrefetchConfig, list[Candidate]] | None = None
        # The last decide went through every candidate and lost none to its victim: each was
        # resident, loading, demanded, of a depth not useful enough, or started.
        self.settled = False
        # depth -> [used, outcomes, signals version of the last decay]: prefetch outcomes, decayed
        self._outcomes: dict[int, list[float]] = {}

    # -- notifications ---------------------------------------------------------------------------

    def set_policy(self, policy: EvictionPolicy) -> None:
        """A runtime policy switch: later decisions use ``policy``."""
        self.policy = policy

    def on_demand(self, key: ExpertKey) -> None:
        """``key`` is demanded now: it is never a victim (the tier promotes a load of it)."""
        self._sync_step()
        self._demanded.add(self.signals.entry_of(key))

    def record_outcome(self, depth: int, used: bool) -> None:
        """A prefetch of lookahead ``depth`` (0: class EAMC) was used (acquired, joined or pinned
        by compute) or evicted unused. The tier reports each once."""
        acc = self._decayed(depth)
        acc[0] += 1.0 if used else 0.0
        acc[1] += 1.0

    def usefulness(self, depth: int) -> float:
        """Share of ``depth``'s recent prefetches (0: class EAMC) that were used, with an optimistic
        prior worth ``USEFULNESS_PRIOR_WEIGHT`` outcomes (1.0 before any)."""
        used, outcomes, _ = self._decayed(depth)
        return (used + USEFULNESS_PRIOR_WEIGHT) / (outcomes + USEFULNESS_PRIOR_WEIGHT)

    def _decayed(self, depth: int) -> list[float]:
        version = self.signals.version
        acc = self._outcomes.setdefault(depth, [0.0, 0.0, float(version)])
        if acc[2] != version:
            f = 0.5 ** ((version - acc[2]) / self.config.usefulness_half_life)
            acc[0] *= f
            acc[1] *= f
            acc[2] = float(version)
        return acc

    # -- decisions -------------------------------------------------------------------------------

    def depth_enabled(self, depth: int) -> bool:
        """Whether lookahead at ``depth`` is prefetched: within ``max_depth`` and measured precise
        enough to pay for its bytes."""
        return depth <= self.config.max_depth and self.signals.precision(depth) >= self.config.min_probability

    def candidates(self) -> list[Candidate]:
        """What the scheduler would like in the tier, best first, before looking at the tier
        (recomputed only when the signals, the policy or the config changed)."""
        sig = self.signals
        cached = self._cand_cache
        key = (sig.version, id(self.policy), self.config)
        if cached is not None and cached[:3] == key:
            return cached[3]
        out = self._candidates()
        self._cand_cache = (*key, out)
        return out

    def _candidates(self) -> list[Candidate]:
        sig = self.signals
        p = sig.use_probability()
        seen: set[int] = set()
        out: list[Candidate] = []
        if self.config.layer_ahead:
            bar = self.config.min_probability
            for (layer, depth, entries, scores), conf in zip(
                sig.lookahead(), sig.lookahead_confidence(), strict=True
            ):
                if not self.depth_enabled(depth):
                    continue
                deadline = sig.layer_distance_of(layer)
                for e, sc, c in zip(entries.tolist(), scores.tolist(), conf.tolist(), strict=True):
                    if c < bar:
                        continue  # guesses like this one (depth, prior bucket) are mostly wrong
                    if e not in seen:
                        seen.add(e)
                        out.append(
                            Candidate(deadline, -float(p[e]), -sc, e, PrefetchClass.LAYER_AHEAD, depth)
                        )
        eamc: list[Candidate] = []
        if self.config.eamc:
            # The policy's own speculative strategy (moe-infinity: the paper's p * (1 - (i - l)/L);
            # activation-aware: likely enough to be used at the next visit); None = the policy
            # prefetches nothing beyond lookahead.
            custom = self.policy.prefetch_scores(self.config.min_probability)
            if custom is not None:
                score = np.asarray(custom, np.float64)
                horizon = self.policy.prefetch_horizon_layers or self.config.horizon_layers
                dist = sig.layer_distance()
                ok = np.flatnonzero((dist <= horizon) & (score > 0.0))
                if self.policy.prefetch_order == "score":
                    ok = ok[np.argsort(-score[ok], kind="stable")]
                # Whole columns to Python at once: dozens of candidates a decision.
                for e, d, pe, se in zip(
                    ok.tolist(), dist[ok].tolist(), p[ok].tolist(), score[ok].tolist(), strict=True
                ):
                    if e not in seen:
                        seen.add(e)
                        eamc.append(Candidate(d, -pe, -se, e, PrefetchClass.EAMC))
        if self.policy.prefetch_order == "score":
            out.sort()
            return out + eamc  # the policy's order for its own candidates
        out.extend(eamc)
        out.sort()
        return out

    def protected_entries(self, deadline: int | None = None) -> set[int]:
        """Entries no prefetch may displace: routed now, demanded now, and the lookahead
        predictions (of an enabled depth) for layers at most ``deadline`` away (all when None)."""
        self._sync_step()
        sig = self.signals
        out = set(sig.needed.tolist()) | self._demanded
        for layer, depth, entries, _scores in sig.lookahead():
            if not self.depth_enabled(depth):
                continue
            if deadline is None or sig.layer_distance_of(layer) <= deadline:
                out.update(entries.tolist())
        return out

    def decide(self, state: TierState) -> list[PrefetchStart]:
        """The loads to start now, in order; the tier records each in its queue when it starts it.
        Sets ``settled``: whether this call went through every candidate and lost none to its
        victim (then more room in flight alone would start nothing more)."""
        self.settled = False
        queue = state.queue
        budget = self.max_inflight_bytes - queue.inflight_bytes
        room = min(budget // self.blob_bytes, self.config.max_starts)
        if room <= 0:
            return []
        sig = self.signals
        free = int(state.free_slots)
        starts: list[PrefetchStart] = []
        taken: set[ExpertKey] = set()  # victims already promised
        protected: dict[int, set[int]] = {}
        rejects = 0
        useful: dict[int, float] = {}  # depth -> usefulness, read once per call
        min_useful = self.config.min_usefulness
        self._sync_step()
        for cand in self.candidates():
            if len(starts) >= room or rejects >= self.config.max_rejects:
                break
            entry = cand.entry
            key = sig.key_of(entry)
            if key in queue or state.is_resident(key) or entry in self._demanded:
                continue  # loading, resident, or the demand path loads it
            u = useful.get(cand.depth)
            if u is None:
                u = useful[cand.depth] = self.usefulness(cand.depth)
            if u < min_useful:
                continue  # this depth's (or class EAMC's) prefetches are mostly evicted unused
            victim: ExpertKey | None = None
            if free > 0:
                free -= 1
            else:
                prot = protected.get(cand.deadline)
                if prot is None:
                    prot = protected[cand.deadline] = self.protected_entries(cand.deadline)
                found = self.policy.choose_victims(
                    1,
                    lambda k, prot=prot: (
                        k not in taken and sig.entry_of(k) not in prot and state.evictable(k)
                    ),
                )
                if not found:
                    break  # nothing may be displaced: later candidates fare no better
                victim = found[0]
                # A prefetch must beat what it displaces, by the policy's own valuation (a wrong
                # guess costs the link a whole blob and evicts something useful).
                cand_value, victim_value = self.policy.keep_value([key, victim])
                if not cand_value > victim_value:
                    rejects += 1
                    continue  # the policy would rather keep the victim
                taken.add(victim)
            starts.append(PrefetchStart(key, cand.cls, cand.score, victim, cand.depth))
        else:
            self.settled = not rejects
        return starts

    def _sync_step(self) -> None:
        step = self.signals.step
        if step != self._demand_step:
            self._demand_step = step
            self._demanded.clear()


__all__ = [
    "DEFAULT_INFLIGHT_BLOBS",
    "Candidate",
    "PrefetchClass",
    "PrefetchConfig",
    "PrefetchQueue",
    "PrefetchScheduler",
    "PrefetchStart",
    "QueuedLoad",
    "TierState",
]
