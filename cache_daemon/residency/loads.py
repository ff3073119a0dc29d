"""The loads in flight (``Loads``): started, promoted by a demand, cancelled, run, and their
results published. It owns the ``PrefetchQueue`` (every load in flight, demand and prefetch) and
the ``Loader`` (the I/O pools), which calls back here under the residency lock.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from concurrent.futures import Executor

from cache_daemon.decisions.scheduler import PrefetchClass, PrefetchQueue
from cache_daemon.metrics import DaemonMetrics
from cache_daemon.residency.loader import PRIORITY, Load, Loader
from cache_daemon.residency.prefetcher import PREFETCH_KINDS, Prefetcher
from cache_daemon.residency.sessions import Sessions
from cache_daemon.residency.slots import Slots
from cache_daemon.tiers.base import Tier
from cache_daemon.tiers.device import DeviceArena
from cache_daemon.tiers.host import HostTier
from cache_daemon.tiers.store import StoreReader
from expertcache.keys import ExpertKey
from expertcache.protocol import GATHER_BELOW_BYTES


class Loads:
    """Every load in flight (``queue``) and the I/O that runs them. Called under the residency
    lock (``cond``), but ``run_deferred``, ``reap`` and ``shutdown``."""

    def __init__(
        self,
        cond: threading.Condition,
        slots: Slots,
        prefetcher: Prefetcher,
        sessions: Sessions,
        metrics: DaemonMetrics,
        arena: DeviceArena,
        store: StoreReader,
        host: HostTier | None,
        *,
        io_threads: int,
        executor: Executor | None,
    ) -> None:
        """``executor`` runs the demand loads; by default a private pool of ``io_threads``
        threads, shut down by ``shutdown`` (one passed in is left running)."""
        self._cond = cond
        self._slots = slots
        self._prefetcher = prefetcher
        self._sessions = sessions
        self._metrics = metrics
        self.queue = PrefetchQueue(arena.slot_bytes)
        # Large experts are published one by one as copied (compute starts on the first).
        self._publish_each = arena.slot_bytes >= GATHER_BELOW_BYTES
        self._loader = Loader(
            cond,
            arena,
            store,
            host,
            metrics,
            io_threads=io_threads,
            executor=executor,
            on_done=self._load_done,
            on_failed=self._load_failed,
            on_cancelled=self._drop_cancelled,
            on_slot_settled=self._slot_settled,
        )

    def start(
        self, key: ExpertKey, cls: PrefetchClass, score: float = 0.0, depth: int = 0, *, defer: bool = False
    ) -> Load:
        """A LOADING entry for ``key`` in a free slot, its load queued on the I/O pools, or with
        ``defer`` left to the admitting thread (``run_deferred``)."""
        slot = self._slots.begin_load(key)
        load = self.queue.add(Load(key, cls, score, depth, slot=slot, priority=PRIORITY[cls], deferred=defer))
        if not defer:
            self._loader.submit(load)  # type: ignore[arg-type]
        return load  # type: ignore[return-value]

    @property
    def reads_directly(self) -> bool:
        """Whether a load's store read is submitted by the thread that starts it
        (``Loader.reads_directly``): a demand load then need not be left to the admitting thread."""
        return self._loader.reads_directly

    def submit(self, load: Load) -> None:
        """Start ``load`` (``Loader.submit``)."""
        self._loader.submit(load)

    @property
    def reap_fd(self) -> int | None:
        """Readable while ``reap`` has loads to publish (``Loader.reap_fd``)."""
        return self._loader.reap_fd

    def reap(self) -> int:
        """Publish the loads whose store reads completed (``Loader.reap``; outside the lock)."""
        return self._loader.reap()

    def promote(self, load: Load) -> None:
        """A demand joined ``load``: from now on it is a demand load, read at demand priority."""
        if self.queue.promote(load.key) is None:
            return  # already a demand load
        if load.prefetch is not None:
            self._metrics.prefetch_promoted.labels(PREFETCH_KINDS[load.prefetch]).inc()
        self._loader.promote(load)

    def cancel_prefetches(self, n: int, wanted: set[ExpertKey]) -> int:
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

    def run_deferred(self, loads: Iterable[Load]) -> None:
        """Run demand loads admission left to the acquiring thread (outside the lock): those the
        host tier holds are copied here, in order (no hop to an I/O thread), published one by one
        when experts are large (compute starts on the first while the next is copied) or all at
        once (``GATHER_BELOW_BYTES``); the others go to the I/O pool (a store read), first, so that
        their reads start at once."""
        with self._cond:  # a demand that joined the load lists it too: the first to claim it runs it
            loads = [load for load in loads if not load.claimed]
            for load in loads:
                load.claimed = True
        if loads:
            # Those the host tier does not hold are submitted to the I/O pool as they are met
            # (their reads start at once); the others are copied here.
            self._loader.copy_from_host(loads, publish_each=self._publish_each)

    def copies_from_host(self, loads: list[Load]) -> bool:
        """Whether ``run_deferred(loads)`` would copy any of them from the host tier in the calling
        thread (microseconds each), rather than only submit store reads (milliseconds)."""
        return self._loader.holds_any(loads)

    def shutdown(self) -> None:
        """Stop the I/O threads (queued loads are dropped; running ones finish)."""
        self._loader.shutdown()

    # -- load results (the loader's callbacks, under the lock) --------------------------------
    def _load_done(self, load: Load, source: Tier) -> None:
        self.queue.remove(load.key)
        self._slots.finish_load(load.key)
        self._prefetcher.policy.on_insert(load.key)
        load.source, load.done = source, True
        self._sessions.load_landed(load.key, source)
        self._prefetcher.kick(landed=True)

    def _load_failed(self, load: Load, error: BaseException, keep_slot: bool = False) -> None:
        """Back to ABSENT: free the slot (unless ``keep_slot``: a late copy may still write it),
        drop every pin on the key, wake the waiters with ``error``."""
        key = load.key
        # The waiting clients hear why before the slot goes absent: a client that sees it absent
        # first would take it for a dropped stream (ChannelTransport._wait, SpanDemand).
        self._sessions.load_failed(key, error)
        self.queue.remove(key)
        self._slots.abort_load(key, load.slot, free_slot=not keep_slot)
        self._prefetcher.gone(key, evicted=False)
        load.error, load.done = error, True
        # A failed prefetch that no demand joined is not decided again at once (it would be
        # started again, in a loop while the failure lasts): the next change retries it.
        self._prefetcher.kick(decide=load.cls is PrefetchClass.DEMAND)

    def _slot_settled(self, slot: int) -> None:
        """The late copy into ``slot`` landed: it is free for loads again."""
        self._slots.release_slot(slot)
        self._prefetcher.kick()
        self._cond.notify_all()

    def _drop_cancelled(self, load: Load) -> None:
        """A cancelled prefetch load lets go of its slot (no holder waits for it)."""
        self.queue.remove(load.key)
        self._slots.abort_load(load.key, load.slot)
        self._prefetcher.gone(load.key, evicted=False)
        load.done = True
        self._prefetcher.kick()


__all__ = ["Loads"]
