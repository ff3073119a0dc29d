"""The prefetch worker: one thread that turns the scheduler's decisions into loads.

::

    compute's Route / LayerAhead ─┐
    predictor hint batch (pushed) ├─▶ kick() ─▶ worker wakes (condition, no timeout)
    load done, pin released ──────┘                │ decide(tier) (cache_daemon.decisions)
                                                   ▼
                              start(PrefetchStart): victim still evictable? try_evict → LOADING,
                              no holders, in the residency's one PrefetchQueue, read at its class's
                              priority on the prefetch pool

The worker stands aside while a demand waits for slots (it takes no slot a demand needs), and it
evicts only through the same checks as a demand (no pin of anyone, ``try_evict``): a pinned
expert is never evicted or overwritten by prefetch either.

Accounting (``moe_cache_prefetch_*_total{kind}``): a prefetched expert is *used* when it is
acquired, joined by a demand or pinned by compute before eviction, *wasted* when it is evicted
unused.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from cache_daemon.decisions.scheduler import PrefetchClass, PrefetchScheduler, PrefetchStart
from cache_daemon.metrics import DaemonMetrics
from expertcache.keys import ExpertKey

if TYPE_CHECKING:
    from cache_daemon.residency.core import Residency

logger = logging.getLogger(__name__)

# The metric label of each prefetch class.
PREFETCH_KINDS = {PrefetchClass.LAYER_AHEAD: "layer_ahead", PrefetchClass.EAMC: "eamc"}


class Prefetcher:
    """Runs ``scheduler.decide`` over ``residency`` whenever something it reads changed."""

    def __init__(
        self,
        residency: Residency,
        cond: threading.Condition,
        scheduler: PrefetchScheduler,
        metrics: DaemonMetrics,
        wake: threading.Condition,
    ) -> None:
        """``cond``: the residency's condition (its waiters are woken by every change); ``wake``:
        the worker's own condition on the same lock."""
        self._residency = residency
        self._cond = cond  # the residency's: its waiters are woken by every change
        self._wake = wake
        self.scheduler = scheduler
        self._metrics = metrics
        self.enabled = False
        self._dirty = True  # something the scheduler reads changed since its last decide
        self._sleeping = False  # the worker waits on _wake (under the lock)
        self._woken = False  # and was notified since it began to
        self._closing = False
        # prefetched, resident or loading, not used yet: its class and lookahead depth
        self._unused: dict[ExpertKey, tuple[PrefetchClass, int]] = {}
        self._thread = threading.Thread(target=self._loop, name="expertcache-prefetcher", daemon=True)
        self._thread.start()

    # -- under the residency lock ------------------------------------------------------------------
    def kick(self) -> None:
        """Something the scheduler reads changed: wake the worker (only while prefetch is on) and
        every waiting admission (a slot, a load or a pin may have come free)."""
        self._dirty = True
        # One wake-up per sleep: kicks that come before the worker runs add nothing (each costs
        # the kicking thread a hand-off of the interpreter otherwise, on every layer's signals).
        if self.enabled and self._sleeping and not self._woken:
            self._woken = True
            self._wake.notify()
        self._cond.notify_all()

    def run(self) -> int:
        """Decide and start prefetches now (what the worker does when woken); the number started."""
        if not self.enabled or self._residency.demand_waiting or self._closing:
            return 0
        started = 0
        self._residency.sync_recency()
        for start in self.scheduler.decide(self._residency):
            started += self._residency.start_prefetch(start)
        return started

    def started(self, start: PrefetchStart) -> None:
        self._unused[start.key] = (start.cls, start.depth)
        self._metrics.prefetch_started.labels(PREFETCH_KINDS[start.cls]).inc()

    def used(self, key: ExpertKey) -> str | None:
        """``key`` was used (acquired, joined, pinned by compute): a prefetch of it paid off.
        Returns that prefetch's kind (``PREFETCH_KINDS``), None if ``key`` was not prefetched."""
        got = self._unused.pop(key, None)
        if got is None:
            return None
        cls, depth = got
        self.scheduler.record_outcome(depth, used=True)
        kind = PREFETCH_KINDS[cls]
        self._metrics.prefetch_used.labels(kind).inc()
        return kind

    def gone(self, key: ExpertKey, *, evicted: bool) -> None:
        """``key`` left the arena (evicted, or its load failed or was cancelled)."""
        got = self._unused.pop(key, None)
        if got is not None and evicted:
            cls, depth = got
            self.scheduler.record_outcome(depth, used=False)
            self._metrics.prefetch_wasted.labels(PREFETCH_KINDS[cls]).inc()

    def is_unused_prefetch(self, key: ExpertKey) -> bool:
        return key in self._unused

    # -- the worker --------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closing and not (
                    self._dirty and self.enabled and not self._residency.demand_waiting
                ):
                    self._sleeping, self._woken = True, False
                    try:
                        self._wake.wait()  # no timeout: every change kicks
                    finally:
                        self._sleeping = False
                if self._closing:
                    return
                self._dirty = False
                try:
                    self.run()
                except Exception:  # noqa: BLE001 - a scheduling bug must not stop serving demands
                    logger.exception("prefetch decision failed; demands are unaffected")

    def close(self) -> None:
        """Stop the worker (called with the lock *not* held)."""
        with self._cond:
            self._closing = True
            self._wake.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join()


__all__ = ["PREFETCH_KINDS", "Prefetcher"]
