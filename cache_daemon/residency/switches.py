"""Live switches: the device budget, the eviction policy, prefetch and the next-visit model,
changed at runtime (``CacheDaemon.reconfigure``) without losing a resident expert or a pin.

The eviction policy has one holder, the prefetch scheduler: eviction and prefetch read the same
one, so a switch is one assignment.
"""

from __future__ import annotations

import logging

from cache_daemon.decisions.policy import EvictionPolicy
from cache_daemon.decisions.scheduler import DEFAULT_INFLIGHT_BLOBS, PrefetchConfig
from cache_daemon.residency.slots import SlotState
from cache_daemon.residency.state import ResidencyState

logger = logging.getLogger(__name__)


class LiveSwitches(ResidencyState):
    """Runtime changes of the residency's settings."""

    def set_slot_limit(self, limit: int) -> int:
        """Change how many of the arena's slots the cache may fill (the live device budget).

        Shrinking evicts the experts the policy ranks last until the rest fits; a pinned or
        loading expert is never evicted under its reader: its slot is reclaimed by later
        admissions once it is released. Growing lets more stay resident. Every expert that
        still fits stays. Returns how many were evicted now."""
        if not 1 <= limit <= self._arena.num_slots:
            raise ValueError(f"slot limit must be in [1, {self._arena.num_slots}], got {limit}")
        evicted = 0
        with self._cond:
            self.slots.limit = limit
            self.sync_recency()
            excess = self.slots.used - limit
            if excess > 0:
                for victim in self.policy.choose_victims(excess, self.slots.evictable):
                    if self.slots.try_evict(victim):
                        self._evicted(victim)
                        evicted += 1
            self._cond.notify_all()
            self._prefetcher.kick()
        return evicted

    def set_policy(self, policy: EvictionPolicy) -> None:
        """Switch the device tier's eviction policy at runtime, losing nothing.

        ``policy`` (fresh, over ``self.signals``) is seeded with every resident expert, in the
        old policy's eviction order (best victim first = oldest), so each stays resident and
        ranked; pins are the tier's, untouched; loads in flight complete and are inserted into
        the new policy when they do."""
        if getattr(policy, "signals", None) not in (None, self.signals):
            raise ValueError(f"policy {policy.name!r} reads other ActivationSignals than this tier's")
        with self._cond:
            self.sync_recency()  # the old policy's order is complete before it is read
            resident = [key for key, state in self.slots.occupied().values() if state is SlotState.RESIDENT]
            old = self.policy
            order = old.choose_victims(len(resident), lambda k: True)
            ranked = set(order)
            seed = order + [key for key in resident if key not in ranked]
            policy.seed(key for key in seed if self.slots.is_resident(key))
            self.scheduler.set_policy(policy)
            self._update_signals_wanted()
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
            scheduler = self.scheduler
            scheduler.max_inflight_bytes = max_inflight_bytes or DEFAULT_INFLIGHT_BLOBS * self._blob_bytes
            if config is not None:
                scheduler.config = config
            self._update_signals_wanted()
            self._prefetcher.kick()

    def set_next_visit_model(self, model) -> None:
        """Swap the signals' learned next-visit model (None: the routing transitions) at runtime
        (``ActivationSignals.set_next_visit_model``; ``ValueError`` for a model of another shape,
        nothing changed)."""
        with self._cond:
            self.signals.set_next_visit_model(model)
            self._prefetcher.kick()

    @property
    def prefetch_enabled(self) -> bool:
        return self._prefetcher.enabled

    def _update_signals_wanted(self) -> None:
        """Tell compute (the table's flag) whether routing and lookahead signals are used now:
        by a policy that reads them, or by prefetch. Without them compute writes none."""
        self._table.signals_wanted = bool(
            self._prefetcher.enabled or getattr(self.policy, "needs_signals", False)
        )


__all__ = ["LiveSwitches"]
