"""A load's life in the residency: started, promoted by a demand, cancelled, and its result.

The loader runs a load on its I/O threads and calls back here under the lock (``_load_done``,
``_load_failed``, ``_drop_cancelled``, ``_slot_settled``): the result is published to the slot
table, the policy, the waiting Acquires and client channels, and the prefetch worker is woken.
"""

from __future__ import annotations

from cache_daemon.decisions.scheduler import PrefetchClass, PrefetchStart
from cache_daemon.residency.loader import PRIORITY, Load
from cache_daemon.residency.prefetcher import PREFETCH_KINDS
from cache_daemon.residency.slots import SlotState
from cache_daemon.residency.state import ResidencyState
from cache_daemon.tiers.base import Tier
from expertcache.keys import ExpertKey


class LoadCompletion(ResidencyState):
    """Starting, promoting and cancelling loads, and publishing their results."""

    def start_prefetch(self, start: PrefetchStart) -> bool:
        """Execute one decision if the tier still allows it (a victim must still be evictable)."""
        key = start.key
        if self.slots.state(key) is not SlotState.ABSENT or key in self.queue:
            return False
        if start.victim is not None and not self.slots.free:
            if not self.evictable(start.victim) or not self.slots.try_evict(start.victim):
                return False  # pinned meanwhile: never displaced
            self._evicted(start.victim)
        if not self.slots.free:
            return False
        self._prefetcher.started(start)
        self._start_load(key, start.cls, start.score, start.depth)
        return True

    def _start_load(
        self, key: ExpertKey, cls: PrefetchClass, score: float = 0.0, depth: int = 0, *, defer: bool = False
    ) -> Load:
        """A LOADING entry for ``key`` in a free slot, its load queued on the I/O pools, or with
        ``defer`` left to the admitting thread (``run_deferred``)."""
        slot = self.slots.begin_load(key)
        load = self.queue.add(Load(key, cls, score, depth, slot=slot, priority=PRIORITY[cls], deferred=defer))
        if not defer:
            self._loader.submit(load)  # type: ignore[arg-type]
        return load  # type: ignore[return-value]

    def _promote(self, load: Load) -> None:
        """A demand joined ``load``: from now on it is a demand load, read at demand priority."""
        if self.queue.promote(load.key) is None:
            return  # already a demand load
        if load.prefetch is not None:
            self._metrics.prefetch_promoted.labels(PREFETCH_KINDS[load.prefetch]).inc()
        self._loader.promote(load)

    def _cancel_prefetches(self, n: int, wanted: set[ExpertKey]) -> int:
        """Cancel up to ``n`` queued prefetch loads no demand holds; returns the slots freed now.

        Lowest class first (EAMC before layer-ahead), unstarted before started. A load whose read
        is submitted loses only its unissued chunks: its slot comes free when the read ends."""
        freed = cancelled = 0
        for load in self.queue.cancel_candidates(keep=wanted):
            if cancelled >= n:
                break
            assert isinstance(load, Load)
            if not load.started:
                load.cancelled = True
                self._drop_cancelled(load)
                freed += 1
            elif load.handle is not None and load.handle.cancel():
                load.cancelled = True  # the I/O thread's wait ends with it; the slot frees then
            else:
                continue  # every chunk already issued: it completes soon anyway
            cancelled += 1
            if load.prefetch is not None:
                self._metrics.prefetch_cancelled.labels(PREFETCH_KINDS[load.prefetch]).inc()
        return freed

    def _evicted(self, key: ExpertKey, *, count: bool = True) -> None:
        """``key`` left the arena through ``try_evict``: tell the policy and the accounting (the
        caller counts the eviction itself when ``count`` is False)."""
        self._prefetcher.gone(key, evicted=True)
        self.policy.on_remove(key)
        if count:
            self._metrics.tier["device"].evictions.inc()

    # -- load results (the loader's callbacks, under the lock) --------------------------------
    def _load_done(self, load: Load, source: Tier) -> None:
        self.queue.remove(load.key)
        self.slots.finish_load(load.key)
        self.policy.on_insert(load.key)
        load.source, load.done = source, True
        for client, position in self._client_waits.pop(load.key, ()):
            client.loaded(position, source)
        self._prefetcher.kick()

    def _load_failed(self, load: Load, error: BaseException, keep_slot: bool = False) -> None:
        """Back to ABSENT: free the slot (unless ``keep_slot``: a late copy may still write it),
        drop every pin on the key, wake the waiters with ``error``."""
        key = load.key
        for session in self._sessions:
            n = session.held.pop(key, 0)
            self.slots.unhold(key, n)
        for client, _position in self._client_waits.pop(key, ()):
            client.failed(key, error)
        self.queue.remove(key)
        self.slots.abort_load(key, load.slot, free_slot=not keep_slot)
        self._prefetcher.gone(key, evicted=False)
        load.error, load.done = error, True
        self._prefetcher.kick()

    def _slot_settled(self, slot: int) -> None:
        """The late copy into ``slot`` landed: it is free for loads again."""
        self.slots.release_slot(slot)
        self._prefetcher.kick()
        self._cond.notify_all()

    def _drop_cancelled(self, load: Load) -> None:
        """A cancelled prefetch load lets go of its slot (no holder waits for it)."""
        self.queue.remove(load.key)
        self.slots.abort_load(load.key, load.slot)
        self._prefetcher.gone(load.key, evicted=False)
        load.done = True
        self._prefetcher.kick()


__all__ = ["LoadCompletion"]
