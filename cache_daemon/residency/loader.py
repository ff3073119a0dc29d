"""Loads: an expert's blob from the host tier or the store into its arena slot, on I/O threads
(a demand pool and a prefetch pool, so a demand load never queues behind a prefetch), or, read
from the store straight into a host-memory slot, by the native reader alone, its completion
published by the residency's worker thread (``reap``). Results go back through the callbacks of
``Loads``, under the residency lock (docs/residency.md, "Loads").
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from cache_daemon.decisions.scheduler import PrefetchClass, QueuedLoad
from cache_daemon.errors import CopyInFlight, ShuttingDown
from cache_daemon.metrics import DaemonMetrics
from cache_daemon.tiers.base import Tier
from cache_daemon.tiers.device import DeviceArena
from cache_daemon.tiers.host import HostTier
from cache_daemon.tiers.store import Priority, StoreReader

logger = logging.getLogger(__name__)

# The store read priority of each load class.
PRIORITY = {
    PrefetchClass.DEMAND: Priority.DEMAND,
    PrefetchClass.LAYER_AHEAD: Priority.LAYER_AHEAD,
    PrefetchClass.EAMC: Priority.PREFETCH,
}


class ReadCancelled(Exception):
    """A prefetch load was cancelled before its store read was submitted: the read never starts."""


@dataclass(eq=False)
class Load(QueuedLoad):
    """One load of ``key`` into arena ``slot``, shared by every Acquire waiting for it; its entry
    in the residency's ``PrefetchQueue`` (``handle``: its store read while one is submitted)."""

    slot: int = -1
    priority: Priority = Priority.DEMAND
    # Left to the admitting thread (Loads.run_deferred), not queued on a pool at admission;
    # ``claimed`` once a thread took it (a demand that joined it may hold it in its list too).
    deferred: bool = False
    claimed: bool = False
    done: bool = False
    source: Tier = Tier.STORE
    error: BaseException | None = None


class Loader:
    """The two I/O pools and the fill of an arena slot. ``cond`` is the residency's lock."""

    def __init__(
        self,
        cond: threading.Condition,
        arena: DeviceArena,
        store: StoreReader,
        host: HostTier | None,
        metrics: DaemonMetrics,
        *,
        io_threads: int,
        executor: Executor | None,
        on_done: Callable[[Load, Tier], None],
        on_failed: Callable[[Load, BaseException], None],
        on_cancelled: Callable[[Load], None],
        on_slot_settled: Callable[[int], None],
    ) -> None:
        self._cond = cond
        self._arena = arena
        self._store = store
        self._host = host if host is not None and host.enabled else None
        # No host tier and host-memory slots: ``submit`` submits the store read itself.
        self.reads_directly = self._host is None and arena.num_slots > 0 and arena.host_buffer(0) is not None
        self._metrics = metrics
        self._on_done = on_done
        self._on_failed = on_failed
        self._on_cancelled = on_cancelled
        self._on_slot_settled = on_slot_settled
        self._owns_pool = executor is None
        self._pool = executor or ThreadPoolExecutor(
            max_workers=io_threads, thread_name_prefix="expertcache-io"
        )
        self._prefetch_pool = ThreadPoolExecutor(
            max_workers=io_threads, thread_name_prefix="expertcache-prefetch"
        )

    # -- under the residency lock ------------------------------------------------------------------
    def submit(self, load: Load) -> None:
        """Start ``load``: its store read, or its run on its class's pool (a failure to start
        fails the load).

        A load read from the store straight into its arena slot (no host tier, and the slot is
        host memory) has its read submitted here, in the calling thread, so the disk starts on it
        at once rather than when an I/O thread gets the interpreter (0.2-0.5 ms on a busy node);
        no I/O thread then waits for it: the residency's worker thread publishes it when it
        completes (``reap``), with the other reads that completed meanwhile."""
        if self.reads_directly and not load.started and not load.cancelled:
            with self._cond:  # a reentrant lock: most callers hold it already
                try:
                    load.handle = self._store.submit(
                        load.key, self._arena.host_buffer(load.slot), load.priority, owner=load
                    )
                except BaseException as exc:  # noqa: BLE001 - the load fails, the caller goes on
                    logger.warning("loading expert %s into slot %d failed: %s", load.key, load.slot, exc)
                    self._on_failed(load, exc)
                    return
                load.started = True
            return
        pool = self._pool if load.cls is PrefetchClass.DEMAND else self._prefetch_pool
        try:
            pool.submit(self._run, load)
        except RuntimeError as exc:  # the I/O pool is shut down
            if not load.started and not load.done:
                self._on_failed(load, ShuttingDown(f"cannot load expert {load.key}: {exc}"))

    @property
    def reap_fd(self) -> int | None:
        """A descriptor readable while ``reap`` has loads to publish; None when no load is reaped
        (they run on the I/O pools)."""
        return self._store.event_fd if self.reads_directly else None

    def reap(self) -> int:
        """Publish the loads whose store reads (submitted by ``submit``) completed, under one hold
        of the lock; returns how many. The worker thread's part of a load; never waits."""
        if not self.reads_directly:
            return 0
        published = 0
        while finished := self._store.reap():
            ok = sum(1 for _handle, error in finished if error is None)
            if ok:
                self._metrics.tier["device"].bytes_in.inc(ok * self._arena.slot_bytes)
            with self._cond:
                for handle, error in finished:
                    load = handle.owner
                    load.handle = None
                    if error is None:
                        self._on_done(load, Tier.STORE)
                    else:
                        self._settle_failure(load, error)
            published += len(finished)
        return published

    def promote(self, load: Load) -> None:
        """A demand joined ``load``: read it at demand priority from now on."""
        if load.priority is Priority.DEMAND:
            return
        load.priority = Priority.DEMAND
        if not load.started:
            self.submit(load)  # a demand thread takes it unless a prefetch thread already has
        elif load.handle is not None:
            load.handle.promote(Priority.DEMAND)

    def run(self, load: Load) -> None:
        """Run ``load`` in the calling thread (outside the lock), as an I/O thread would."""
        self._run(load)

    def holds_any(self, loads: list[Load]) -> bool:
        """Whether the host tier holds any of ``loads`` now (``copy_from_host`` would copy it in
        the calling thread rather than read the store)."""
        host = self._host
        return host is not None and any(host.contains(load.key) for load in loads)

    def copy_from_host(self, loads: list[Load], *, publish_each: bool) -> None:
        """Copy, in the calling thread (outside the lock), each of ``loads`` that the host tier
        holds into its arena slot: the hot path of a demand miss on a node with ample RAM, with
        one lock hold per copy of the host tier's and none of the residency's until the results
        are published: after each copy (``publish_each``: a large expert, whose compute may
        start while the next is copied) or all at once. A load the host tier does not hold is
        submitted to the I/O pool (a store read) as it is met. Only for loads no other thread can
        see as runnable: demand loads left to their admitting thread (``Load.deferred``)."""
        host = self._host
        done: list[Load] = []
        copy_s = 0.0
        for load in loads:
            view = host.pin_view(load.key) if host is not None else None
            if view is None:
                self.submit(load)
                continue
            load.started = True  # nothing else runs it (deferred); set before the copy for describe()
            started = time.perf_counter()
            try:
                self._arena.copy_in(load.slot, view)
            except BaseException as exc:  # noqa: BLE001 - fail this load, go on with the others
                copy_s += time.perf_counter() - started
                self._fail_copy(load, exc, lambda key=load.key: host.unpin(key))
                continue
            copy_s += time.perf_counter() - started
            host.unpin(load.key)
            done.append(load)
            if publish_each:
                self._publish_host_copies([load], copy_s)
                copy_s, done = 0.0, []
        if done or copy_s:
            self._publish_host_copies(done, copy_s)

    def _publish_host_copies(self, loads: list[Load], copy_s: float) -> None:
        metrics = self._metrics
        if copy_s:
            metrics.arena_copy_seconds.inc(copy_s)
        if not loads:
            return
        metrics.tier["host"].hits.inc(len(loads))
        metrics.tier["device"].bytes_in.inc(len(loads) * self._arena.slot_bytes)
        with self._cond:
            for load in loads:
                self._on_done(load, Tier.HOST)

    def _fail_copy(self, load: Load, exc: BaseException, release: Callable[[], None]) -> None:
        """A copy from the host tier failed: as ``_run`` does for any failed load."""
        if isinstance(exc, CopyInFlight):
            self._settle_late_copy(load, exc, release)
            return
        release()
        logger.warning("loading expert %s into slot %d failed: %s", load.key, load.slot, exc)
        with self._cond:
            self._on_failed(load, exc)

    def _settle_late_copy(
        self, load: Load, exc: CopyInFlight, release: Callable[[], None] | None = None
    ) -> None:
        """A copy into ``load``'s slot failed while still in flight. The waiters fail now; the slot
        and the copy's source (``release``, then the copy's own cleanups) stay reserved until the
        copy lands (this thread waits for it), so nothing reuses memory the GPU still writes."""
        logger.error("loading expert %s into slot %d: %s", load.key, load.slot, exc)
        with self._cond:
            self._on_failed(load, exc, keep_slot=True)
        try:
            exc.wait_done()
        finally:
            if release is not None:
                release()
            for cleanup in exc.cleanups:
                cleanup()
            with self._cond:
                self._on_slot_settled(load.slot)

    # -- I/O threads -------------------------------------------------------------------------------
    def _run(self, load: Load) -> None:
        with self._cond:
            if load.started or load.done or load.cancelled:
                return  # promoted: the other pool's thread runs it (or it was cancelled unstarted)
            load.started = True
        try:
            source = self._fill(load)
        except CopyInFlight as exc:
            self._settle_late_copy(load, exc)
            logger.warning("the late copy into slot %d landed: the slot is free again", load.slot)
            return
        except BaseException as exc:  # noqa: BLE001 - every failure must free the slot and wake waiters
            self._settle_failure(load, exc)
            return
        self._metrics.tier["device"].bytes_in.inc(self._arena.slot_bytes)
        with self._cond:
            self._on_done(load, source)

    def _settle_failure(self, load: Load, exc: BaseException) -> None:
        with self._cond:
            if load.cancelled:
                self._on_cancelled(load)
                return
            logger.warning("loading expert %s into slot %d failed: %s", load.key, load.slot, exc)
            self._on_failed(load, exc)

    def _read(self, load: Load, out: torch.Tensor | memoryview) -> None:
        """Read ``load.key``'s blob into ``out`` at the load's priority, cancellable meanwhile."""
        with self._cond:
            if load.cancelled:
                raise ReadCancelled(f"prefetch of {load.key} cancelled")
            load.handle = self._store.submit(load.key, out, load.priority)
        self._wait_read(load)

    def _wait_read(self, load: Load) -> None:
        try:
            load.handle.wait()
        finally:
            with self._cond:
                load.handle = None

    def _copy_in(self, slot: int, src, release: Callable[[], None] | None = None) -> None:
        """Copy ``src`` into arena ``slot``, then ``release`` it (unpin its host slot). A copy
        still in flight keeps ``src``: its release then runs when the copy lands."""
        started = time.perf_counter()
        try:
            self._arena.copy_in(slot, src)
            self._metrics.arena_copy_seconds.inc(time.perf_counter() - started)
        except CopyInFlight as exc:
            if release is not None:
                exc.cleanups.append(release)
            raise
        except BaseException:
            if release is not None:
                release()
            raise
        if release is not None:
            release()

    def _fill(self, load: Load) -> Tier:
        """Write ``load.key``'s verified blob into arena slot ``load.slot``; returns the tier it
        came from."""
        key, slot = load.key, load.slot
        host = self._host
        if host is not None:
            if host.pin(key):
                self._metrics.tier["host"].hits.inc()
                self._copy_in(slot, host.get(key), lambda: host.unpin(key))
                return Tier.HOST
            self._metrics.tier["host"].misses.inc()
            reservation = host.reserve(key)
            if reservation is not None:
                if reservation.present:  # another load put it there meanwhile
                    self._copy_in(slot, reservation.view, lambda: host.unpin(key))
                    return Tier.HOST
                try:
                    self._read(load, reservation.view)
                except BaseException:
                    host.abandon(reservation)
                    raise
                view = host.commit(reservation)
                if view is not None:
                    self._copy_in(slot, view, lambda: host.unpin(key))
                    return Tier.STORE
            # Every host slot is pinned by concurrent loads (or the tier closed): skip it this time.
        direct = self._arena.host_buffer(slot)
        if direct is not None:
            self._read(load, direct)  # the slot is LOADING: nobody can read it yet
        else:
            staging = self._arena.staging_buffer()  # this thread's: it waits for a late copy itself
            self._read(load, staging)
            self._copy_in(slot, staging)
        return Tier.STORE

    def shutdown(self) -> None:
        """Stop the I/O threads (queued loads are dropped; running ones finish) and publish the
        reaped loads that completed by now (the worker thread has stopped)."""
        self._prefetch_pool.shutdown(wait=True, cancel_futures=True)
        if self._owns_pool:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self.reap()


__all__ = ["PRIORITY", "Load", "Loader", "ReadCancelled"]
