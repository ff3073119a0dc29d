"""Live switches (``LiveSwitches``): the device budget, the eviction policy, prefetch and the
next-visit model, changed at runtime (``CacheDaemon.reconfigure``) without losing a resident
expert or a pin. The policy has one holder, the prefetch scheduler, so a switch is one assignment.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from cache_daemon.decisions.policy import EvictionPolicy
from cache_daemon.decisions.scheduler import DEFAULT_INFLIGHT_BLOBS, PrefetchConfig
from cache_daemon.decisions.signals import ActivationSignals
from cache_daemon.residency.clients import Recency
from cache_daemon.residency.prefetcher import Prefetcher
from cache_daemon.residency.slots import Slots
from expertcache.native import SlotTable, TableState

logger = logging.getLogger(__name__)


@dataclass(eq=False, repr=False)
class LiveSwitches:
    """Runtime changes of the residency's settings, each in one hold of the lock (``cond``)."""

    _cond: threading.Condition
    _table: SlotTable
    _slots: Slots
    _recency: Recency
    _prefetcher: Prefetcher
    _signals: ActivationSignals
    blob_bytes: int

    def _sync_recency(self) -> None:
        """Feed the policy compute's table hits since the last sync (under the lock)."""
        self._recency.sync(self._prefetcher.scheduler.policy, self._prefetcher.used)

    def set_slot_limit(self, limit: int) -> int:
        """Change how many of the arena's slots the cache may fill (the live device budget).

        Shrinking evicts the experts the policy ranks last until the rest fits; a pinned or
        loading expert is never evicted under its reader: its slot is reclaimed by later
        admissions once it is released. Growing lets more stay resident. Every expert that
        still fits stays. Returns how many were evicted now."""
        slots = self._slots
        if not 1 <= limit <= slots.num_slots:
            raise ValueError(f"slot limit must be in [1, {slots.num_slots}], got {limit}")
        evicted = 0
        with self._cond:
            slots.limit = limit
            self._sync_recency()
            excess = slots.used - limit
            if excess > 0:
                for victim in self._prefetcher.policy.choose_victims(excess, slots.evictable):
                    if slots.try_evict(victim):
                        self._prefetcher.evicted(victim)
                        evicted += 1
            self._cond.notify_all()
            self._prefetcher.kick()
        return evicted

    def set_policy(self, policy: EvictionPolicy) -> None:
        """Switch the device tier's eviction policy at runtime, losing nothing.

        ``policy`` (fresh, over the tier's signals) is seeded with every resident expert, in the
        old policy's eviction order (best victim first = oldest), so each stays resident and
        ranked; pins are the tier's, untouched; loads in flight complete and are inserted into
        the new policy when they do."""
        if policy.signals not in (None, self._signals):
            raise ValueError(f"policy {policy.name!r} reads other ActivationSignals than this tier's")
        with self._cond:
            self._sync_recency()  # the old policy's order is complete before it is read
            resident = [key for key, state in self._slots.occupied().values() if state is TableState.RESIDENT]
            old = self._prefetcher.policy
            order = old.choose_victims(len(resident), lambda k: True)
            ranked = set(order)
            seed = order + [key for key in resident if key not in ranked]
            policy.seed(key for key in seed if self._slots.is_resident(key))
            self._prefetcher.scheduler.set_policy(policy)
            self.update_signals_wanted()
            self._prefetcher.kick()
        logger.info("eviction policy %s -> %s (%d resident experts kept)", old.name, policy.name, len(seed))

    def configure_prefetch(
        self, *, enabled: bool, max_inflight_bytes: int, config: PrefetchConfig | None = None
    ) -> None:
        """Turn prefetch on/off and retune it at runtime (loads already started complete)."""
        if max_inflight_bytes < 0:
            raise ValueError(f"max_inflight_bytes must be >= 0, got {max_inflight_bytes}")
        with self._cond:
            self._prefetcher.enabled = enabled
            scheduler = self._prefetcher.scheduler
            scheduler.max_inflight_bytes = max_inflight_bytes or DEFAULT_INFLIGHT_BLOBS * self.blob_bytes
            if config is not None:
                scheduler.config = config
            self.update_signals_wanted()
            self._prefetcher.kick()

    def set_next_visit_model(self, model) -> None:
        """Swap the signals' learned next-visit model (None: the routing transitions) at runtime
        (``ActivationSignals.set_next_visit_model``; ``ValueError`` for a model of another shape,
        nothing changed)."""
        with self._cond:
            self._signals.set_next_visit_model(model)
            self._prefetcher.kick()

    def update_signals_wanted(self) -> None:
        """Tell compute (the table's flag) whether routing and lookahead signals are used now:
        by a policy that reads them, or by prefetch. Without them compute writes none."""
        self._table.signals_wanted = bool(self._prefetcher.enabled or self._prefetcher.policy.needs_signals)


__all__ = ["LiveSwitches"]
