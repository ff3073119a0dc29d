"""Prefetch: ``Prefetcher`` holds the scheduler (and so the eviction policy), the prefetches not
used yet and the worker's wake-up; ``PrefetchWorker`` is the residency's worker thread: it
publishes the store reads that completed and starts the loads the scheduler decides. Split so the
parts that report changes need no reference to the worker, which needs them (docs/residency.md,
"Prefetch").
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from cache_daemon.decisions.policy import EvictionPolicy
from cache_daemon.decisions.scheduler import PrefetchClass, PrefetchScheduler, PrefetchStart, TierState
from cache_daemon.metrics import DaemonMetrics
from cache_daemon.residency.slots import Slots
from expertcache.keys import ExpertKey
from expertcache.native import TableState

if TYPE_CHECKING:
    from cache_daemon.residency.clients import Recency
    from cache_daemon.residency.loader import Load

logger = logging.getLogger(__name__)

# The metric label of each prefetch class.
PREFETCH_KINDS = {PrefetchClass.LAYER_AHEAD: "layer_ahead", PrefetchClass.EAMC: "eamc"}


class PrefetchTarget(TierState, Protocol):
    """The tier as the worker sees it: the scheduler's ``TierState``, and whether an admission
    waits for slots (prefetch then stands aside)."""

    @property
    def demand_waiting(self) -> int: ...


class Prefetcher:
    """The scheduler, whether prefetch is on, and what prefetch started and was not used yet.
    Everything here runs under the residency lock (``cond``'s) but ``close``; ``wake_fd`` is the
    worker's wake-up (an eventfd it sleeps on with the store's completions, ``PrefetchWorker``)."""

    def __init__(
        self, cond: threading.Condition, scheduler: PrefetchScheduler, metrics: DaemonMetrics
    ) -> None:
        self._cond = cond  # the residency's: its waiters are woken by every change
        self.wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.scheduler = scheduler
        self._metrics = metrics
        self.enabled = False
        self.closing = False
        self._dirty = True  # something the scheduler reads changed since its last decide
        # When the change the next decision answers came (the first kick since the worker took
        # its last work; time.monotonic): a start's delay counts from it.
        self._asked_at = time.monotonic()
        self._deciding_since = self._asked_at  # the asking time of the decision being run
        self._sleeping = False  # the worker sleeps on wake_fd (set under the lock)
        self._woken = False  # and wake_fd was written since it began to
        # The last decision went through all its candidates, and every start it decided was made
        # (scheduler.settled, and no victim pinned meanwhile): room in flight alone adds nothing.
        self.settled = False
        # prefetched, resident or loading, not used yet: its class and lookahead depth
        self._unused: dict[ExpertKey, tuple[PrefetchClass, int]] = {}

    @property
    def policy(self) -> EvictionPolicy:
        """The eviction policy (held by the scheduler: one policy for eviction and prefetch)."""
        return self.scheduler.policy

    def kick(self, *, decide: bool = True, landed: bool = False, asked_at: float | None = None) -> None:
        """Something the scheduler reads changed: wake the worker (only while prefetch is on) and
        every waiting admission (a slot, a load or a pin may have come free). ``decide=False``:
        the admissions only (a failed prefetch freed its slot; deciding again at once would only
        start the same load again, in a loop while the failure lasts: the next change retries it).
        ``landed``: only a load landed, which leaves the candidates as they were and frees room in
        flight: the worker decides only if the last decision stopped short of its candidates
        (``settled`` false); otherwise it would start nothing (two of three decisions at the e2e
        shape, every one a Python pass over the candidates). ``asked_at``: when the change came
        (``time.monotonic``; compute's signals: when the daemon read them), default now: the
        start delay of what the next decision starts counts from the first such change."""
        if decide and not (landed and self.settled):
            if not self._dirty:
                self._asked_at = time.monotonic() if asked_at is None else asked_at
            self._dirty = True
            # One wake-up per sleep: kicks that come before the worker runs add nothing (each
            # costs the kicking thread a wake-up of the worker otherwise, on every layer's signals).
            if self.enabled and self._sleeping and not self._woken:
                self._wake()
        self._cond.notify_all()

    def _wake(self) -> None:
        self._woken = True
        if self.wake_fd >= 0:  # not closed (a second shutdown)
            os.eventfd_write(self.wake_fd, 1)

    def started(self, start: PrefetchStart) -> None:
        self._unused[start.key] = (start.cls, start.depth)
        kind = PREFETCH_KINDS[start.cls]
        self._metrics.prefetch_started.labels(kind).inc()
        self._metrics.prefetch_start_delay_seconds.labels(kind).inc(
            max(0.0, time.monotonic() - self._deciding_since)
        )

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

    def evicted(self, key: ExpertKey, *, count: bool = True) -> None:
        """``key`` left the arena through ``try_evict``: tell the policy and the accounting (the
        caller counts the eviction itself when ``count`` is False)."""
        self.gone(key, evicted=True)
        self.scheduler.policy.on_remove(key)
        if count:
            self._metrics.tier["device"].evictions.inc()

    def is_unused_prefetch(self, key: ExpertKey) -> bool:
        return key in self._unused

    def take_work(self, tier: PrefetchTarget) -> bool:
        """The worker's check (under the lock): whether to decide now, that is something changed
        while prefetch is on and no admission waits for slots (the change is then taken)."""
        if self.closing or not (self._dirty and self.enabled and not tier.demand_waiting):
            return False
        self.begin_decision()
        self._dirty = False
        return True

    def begin_decision(self) -> None:
        """A decision starts now (under the lock): the starts it makes are delayed from the change
        that asked for it, or from now when nothing did."""
        self._deciding_since = self._asked_at if self._dirty else time.monotonic()

    def begin_sleep(self) -> None:
        """Under the lock, before the worker sleeps on ``wake_fd`` (outside it): the next kick
        (or ``stop``) writes it."""
        self._sleeping, self._woken = True, False

    def end_sleep(self) -> None:
        """Under the lock, after the worker woke: kicks no longer write ``wake_fd`` (emptied)."""
        self._sleeping = False
        try:
            os.eventfd_read(self.wake_fd)
        except BlockingIOError:  # woken by the store's completions only
            pass

    def stop(self) -> None:
        """Under the lock: the worker ends at its next check."""
        self.closing = True
        self._wake()

    def close(self) -> None:
        """Once the worker has ended: release ``wake_fd`` (idempotent; under the lock)."""
        if self.wake_fd >= 0:
            os.close(self.wake_fd)
            self.wake_fd = -1


@dataclass(eq=False, repr=False)
class PrefetchWorker:
    """The residency's worker thread: it publishes the loads whose store reads completed
    (``reap``, readable ``reap_fd``) and runs ``scheduler.decide`` over ``tier`` whenever the
    ``Prefetcher`` is kicked, starting the loads it decides (``start_load``) in free or evicted
    slots. One thread for both: a completed read usually frees what the next prefetch needs (a
    slot, bytes in flight), so its publication and the decision it allows cost one wake-up."""

    _cond: threading.Condition
    _prefetcher: Prefetcher
    _tier: PrefetchTarget
    _slots: Slots
    _recency: Recency
    _start_load: Callable[[ExpertKey, PrefetchClass, float, int], Load]
    _reap: Callable[[], int]
    _reap_fd: int | None  # None: no load is reaped (they run on the I/O pools)
    _thread: threading.Thread = field(init=False)

    def __post_init__(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="expertcache-residency", daemon=True)
        self._thread.start()

    def run(self) -> int:
        """Decide and start prefetches now (under the lock; what the worker does when woken); the
        number started."""
        prefetcher = self._prefetcher
        if not prefetcher.enabled or self._tier.demand_waiting or prefetcher.closing:
            return 0
        started = 0
        self._recency.sync(prefetcher.scheduler.policy, prefetcher.used)
        decided = prefetcher.scheduler.decide(self._tier)
        for start in decided:
            started += self.start(start)
        prefetcher.settled = prefetcher.scheduler.settled and started == len(decided)
        return started

    def start(self, start: PrefetchStart) -> bool:
        """Execute one decision if the tier still allows it (a victim must still be evictable)."""
        key, slots = start.key, self._slots
        if slots.state(key) is not TableState.ABSENT or key in self._tier.queue:
            return False
        if start.victim is not None and not slots.free:
            if not self._tier.evictable(start.victim) or not slots.try_evict(start.victim):
                return False  # pinned meanwhile: never displaced
            self._prefetcher.evicted(start.victim)
        if not slots.free:
            return False
        self._prefetcher.started(start)
        self._start_load(key, start.cls, start.score, start.depth)
        return True

    def _loop(self) -> None:
        prefetcher = self._prefetcher
        waker = select.poll()
        waker.register(prefetcher.wake_fd, select.POLLIN)
        if self._reap_fd is not None:
            waker.register(self._reap_fd, select.POLLIN)
        while True:
            try:
                self._reap()  # outside the lock; publishes under it
            except Exception:  # noqa: BLE001 - a bug here must not stop the thread
                logger.exception("publishing completed loads failed")
            with self._cond:
                if prefetcher.closing:
                    return
                if prefetcher.take_work(self._tier):
                    try:
                        self.run()
                    except Exception:  # noqa: BLE001 - a scheduling bug must not stop serving demands
                        logger.exception("prefetch decision failed; demands are unaffected")
                    continue  # what the decision changed is looked at before sleeping
                prefetcher.begin_sleep()
            waker.poll()  # no timeout: every kick, completion and stop writes a descriptor
            with self._cond:
                prefetcher.end_sleep()

    def close(self) -> None:
        """Stop the worker (called with the lock *not* held)."""
        with self._cond:
            self._prefetcher.stop()
        if self._thread is not threading.current_thread():
            self._thread.join()
            with self._cond:
                self._prefetcher.close()


__all__ = ["PREFETCH_KINDS", "PrefetchTarget", "PrefetchWorker", "Prefetcher"]
