"""The prefetch scheduler: which experts to start loading ahead of demand, and in what order.

Pure decision code, shared by the daemon (its prefetch worker thread, over ``Residency``) and
the trace replay (over a simulated tier). It never performs I/O and never waits: ``decide``
looks at the ``TierState`` and the ``ActivationSignals`` and returns the loads to start.

::

    ActivationSignals ──┐                                   ┌── DEMAND       (compute waits: not ours)
    EvictionPolicy ─────┼─▶ decide(state) ─▶ [PrefetchStart] ┼── LAYER_AHEAD  (router of l+1 on l's state)
    TierState ──────────┘                                   └── EAMC         (EAMC match / next token)

Rules:
- priority classes: DEMAND (0) > LAYER_AHEAD (1) > EAMC (2); the tier reads demands first and a
  demand pre-empts prefetch I/O at chunk boundaries (the reader's priorities);
- at most ``max_inflight_bytes`` of loads in flight (``TierState.inflight_bytes`` plus what this
  call starts), so prefetch never hogs the link a demand needs;
- candidates: class LAYER_AHEAD from the layer-ahead prediction, class EAMC from the policy's
  ``prefetch_scores()`` within ``horizon_layers`` (a policy returning None speculates no further);
- a free slot is used first; otherwise a start names its ``victim`` (chosen by the policy among
  evictable keys) and is made only if the policy values the candidate above that victim
  (``keep_value``);
- never displace an expert that is pinned (the tier's ``evictable``), needed now (routed at the
  current position or demanded), or predicted by layer-ahead with a score at least the
  candidate's;
- stale predictions are dropped: layer-ahead for a passed layer, hints older than the TTL
  (``ActivationSignals`` does both);
- pre-emption: a demand short of slots asks ``cancel_candidates`` for queued prefetches (lowest
  priority first), cancels them and takes their slots; a dropped prefetch is never awaited.

Example: 2 free slots, blob 10 bytes, bound 30 bytes, 10 in flight, layer-ahead predicts experts
{3: .9, 5: .6} of the next layer (neither resident) → two starts, ``L1E3`` then ``L1E5``, class
LAYER_AHEAD, no victims; a third candidate would exceed the bound and waits for the next call.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Protocol

import numpy as np

from cache_daemon.policy.base import EvictionPolicy
from cache_daemon.signals import ActivationSignals
from expertcache.keys import ExpertKey

logger = logging.getLogger(__name__)


class PrefetchClass(IntEnum):
    """Priority class of a load; lower value = served first."""

    DEMAND = 0
    LAYER_AHEAD = 1
    EAMC = 2  # EAMC match or next-token guess from the request's history


@dataclass(frozen=True)
class PrefetchStart:
    """One load to begin: ``key`` into a free slot (``victim is None``) or in place of ``victim``."""

    key: ExpertKey
    cls: PrefetchClass
    score: float
    victim: ExpertKey | None


class TierState(Protocol):
    """What the scheduler needs to know about a tier (``Residency``; the replay's simulated tier)."""

    @property
    def free_slots(self) -> int:
        """Slots holding nothing (neither resident nor loading)."""
        ...

    @property
    def inflight_bytes(self) -> int:
        """Bytes of loads started and not finished (demand and prefetch)."""
        ...

    def is_resident(self, key: ExpertKey) -> bool: ...

    def is_loading(self, key: ExpertKey) -> bool: ...

    def evictable(self, key: ExpertKey) -> bool:
        """Resident, unpinned and not needed now: may be displaced."""
        ...


@dataclass(frozen=True)
class PrefetchConfig:
    """Tuning of the scheduler."""

    layer_ahead: bool = True
    """Prefetch the layer-ahead router's predictions (class LAYER_AHEAD)."""

    eamc: bool = True
    """Prefetch from the EAMC hints and the request's history (class EAMC)."""

    horizon_layers: int = field(default=2, metadata={"min": 1, "max": 1 << 16})
    """Class EAMC looks at most this many layers ahead of the position."""

    max_starts: int = field(default=64, metadata={"min": 1, "max": 1 << 20})
    """At most this many starts per ``decide`` call."""

    max_rejects: int = field(default=4, metadata={"min": 1, "max": 1 << 20})
    """A ``decide`` call stops after this many candidates lost to their victims (the
    candidates come best first, so the later ones rarely win; bounds the cost per call)."""

    def __post_init__(self) -> None:
        for name in ("horizon_layers", "max_starts", "max_rejects"):
            spec = self.__dataclass_fields__[name]
            value = getattr(self, name)
            lo, hi = spec.metadata["min"], spec.metadata["max"]
            if not (lo <= value <= hi):
                raise ValueError(f"PrefetchConfig.{name} must be in [{lo}, {hi}], got {value!r}")


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
        self._queued: dict[ExpertKey, tuple[PrefetchClass, float]] = {}  # started, not finished
        self._demanded: set[int] = set()  # entries demanded at _demand_step
        self._demand_step = signals.step
        self.started = 0
        self.cancelled = 0
        self._cand_cache: tuple[int, int, list[tuple[PrefetchClass, int, float]]] | None = None

    # -- notifications ---------------------------------------------------------------------------

    def set_policy(self, policy: EvictionPolicy) -> None:
        """A runtime policy switch: later decisions use ``policy``."""
        self.policy = policy

    def on_demand(self, key: ExpertKey) -> None:
        """``key`` is demanded now: it is never a victim, and a prefetch of it becomes a demand
        (no longer cancellable)."""
        self._sync_step()
        self._demanded.add(self.signals.entry_of(key))
        self._queued.pop(key, None)

    def on_done(self, key: ExpertKey) -> None:
        """A load of ``key`` finished (resident) or failed: it is no longer queued."""
        self._queued.pop(key, None)

    def on_dropped(self, key: ExpertKey) -> None:
        """A queued prefetch of ``key`` was cancelled (its slot went to a demand)."""
        if self._queued.pop(key, None) is not None:
            self.cancelled += 1

    def queued(self) -> dict[ExpertKey, tuple[PrefetchClass, float]]:
        """Prefetches started and not yet finished: key → (class, score)."""
        return dict(self._queued)

    # -- decisions -------------------------------------------------------------------------------

    def cancel_candidates(self, state: TierState) -> list[ExpertKey]:
        """Queued prefetches still loading that a demand may cancel, lowest priority first
        (class EAMC before LAYER_AHEAD, lower score first)."""
        items = [(k, c, s) for k, (c, s) in self._queued.items() if state.is_loading(k)]
        items.sort(key=lambda t: (-int(t[1]), t[2], t[0]))
        return [k for k, _c, _s in items]

    def protected_entries(self, below_score: float | None = None) -> set[int]:
        """Entries no prefetch may displace: routed now, demanded now, and layer-ahead
        predictions (those with score >= ``below_score`` when given)."""
        self._sync_step()
        out = set(int(e) for e in self.signals.needed) | self._demanded
        la = self.signals.layer_ahead_prediction()
        if la is not None:
            entries, scores, _layer = la
            for e, s in zip(entries.tolist(), scores.tolist(), strict=True):
                if below_score is None or s >= below_score:
                    out.add(int(e))
        return out

    def candidates(self) -> list[tuple[PrefetchClass, int, float]]:
        """``(class, entry, score)`` wanted in the tier, best first, before looking at the tier
        (recomputed only when the signals or the policy changed)."""
        sig = self.signals
        cached = self._cand_cache
        if cached is not None and cached[0] == sig.version and cached[1] == id(self.policy):
            return cached[2]
        out = self._candidates()
        self._cand_cache = (sig.version, id(self.policy), out)
        return out

    def _candidates(self) -> list[tuple[PrefetchClass, int, float]]:
        sig = self.signals
        out: list[tuple[PrefetchClass, int, float]] = []
        seen: set[int] = set()
        if self.config.layer_ahead:
            la = sig.layer_ahead_prediction()
            if la is not None:
                entries, scores, _layer = la
                for i in np.argsort(-scores, kind="stable"):
                    e = int(entries[i])
                    if e not in seen:
                        seen.add(e)
                        out.append((PrefetchClass.LAYER_AHEAD, e, float(scores[i])))
        if self.config.eamc:
            # The policy's own speculative strategy (moe-infinity: the paper's p * (1 - (i - l)/L);
            # activation-aware: soonest expected next use); None = the policy prefetches nothing
            # beyond layer-ahead.
            custom = self.policy.prefetch_scores()
            if custom is not None:
                score = np.asarray(custom, np.float64)
                horizon = self.policy.prefetch_horizon_layers or self.config.horizon_layers
                near = sig.layer_distance() <= horizon
                ok = np.flatnonzero(near & (score > 0.0))
                for e in ok[np.argsort(-score[ok], kind="stable")].tolist():
                    if e not in seen:
                        seen.add(e)
                        out.append((PrefetchClass.EAMC, e, float(score[e])))
        return out

    def decide(self, state: TierState) -> list[PrefetchStart]:
        """The loads to start now, in order; each is recorded as queued."""
        budget = self.max_inflight_bytes - int(state.inflight_bytes)
        room = min(budget // self.blob_bytes, self.config.max_starts)
        if room <= 0:
            return []
        sig = self.signals
        free = int(state.free_slots)
        starts: list[PrefetchStart] = []
        taken: set[ExpertKey] = set()  # victims already promised
        base_protected = self.protected_entries(below_score=None)
        rejects = 0
        for cls, entry, score in self.candidates():
            if len(starts) >= room or rejects >= self.config.max_rejects:
                break
            key = sig.key_of(entry)
            if state.is_resident(key) or state.is_loading(key) or key in self._queued:
                continue
            if entry in self._demanded:
                continue  # the demand path loads it
            victim: ExpertKey | None = None
            if free > 0:
                free -= 1
            else:
                protected = (
                    self.protected_entries(below_score=score)
                    if cls == PrefetchClass.LAYER_AHEAD
                    else base_protected
                )
                found = self.policy.choose_victims(
                    1,
                    lambda k, protected=protected: (
                        k not in taken and sig.entry_of(k) not in protected and state.evictable(k)
                    ),
                )
                if not found:
                    break  # nothing may be displaced: later candidates fare no better
                victim = found[0]
                # A prefetch must beat what it displaces, by the policy's own valuation (a wrong
                # layer-ahead guess costs the link a whole blob and evicts something useful).
                cand_value, victim_value = self.policy.keep_value([key, victim])
                if not cand_value > victim_value:
                    rejects += 1
                    continue  # the policy would rather keep the victim
                taken.add(victim)
            start = PrefetchStart(key, cls, score, victim)
            starts.append(start)
            self._queued[key] = (cls, score)
            self.started += 1
        return starts

    def _sync_step(self) -> None:
        step = self.signals.step
        if step != self._demand_step:
            self._demand_step = step
            self._demanded.clear()


__all__ = ["PrefetchClass", "PrefetchConfig", "PrefetchScheduler", "PrefetchStart", "TierState"]
