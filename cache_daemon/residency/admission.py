"""Admission: an Acquire (or a client channel's demand) pins its experts, all or nothing
(``Admission``), waiting for slots while short, woken by releases, loads and compute's unpins
(``UnpinWatcher``). Taking nothing until everything fits is what keeps two Acquires from
deadlocking (docs/residency.md, "Admission").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from cache_daemon.decisions.intake import LookaheadSignal, RouteSignal, SignalIntake
from cache_daemon.decisions.scheduler import PrefetchClass, PrefetchQueue
from cache_daemon.errors import AcquireTimeout, BadAcquire
from cache_daemon.metrics import DaemonMetrics
from cache_daemon.residency.channel import ChannelServer
from cache_daemon.residency.clients import Recency, Session
from cache_daemon.residency.loader import Load
from cache_daemon.residency.loads import Loads
from cache_daemon.residency.prefetcher import PREFETCH_KINDS, Prefetcher
from cache_daemon.residency.sessions import STRAY_CONFIRM_S, Sessions
from cache_daemon.residency.slots import Slots
from cache_daemon.tiers.base import Tier
from expertcache.errors import ExpertCacheError
from expertcache.keys import ExpertKey
from expertcache.manifest import StoreManifest
from expertcache.native import SlotTable, TableState


@dataclass(frozen=True)
class Ready:
    """``key`` is RESIDENT in arena ``slot`` and pinned for the session; ``source`` is the tier it
    was found in when the Acquire arrived (DEVICE if already resident, else where its load read it)."""

    key: ExpertKey
    slot: int
    source: Tier
    # The prefetch that brought it (or was bringing it) into the arena: its kind (layer_ahead,
    # eamc), "" for none. For traces (prefetch hit, by which signal); not part of equality.
    prefetch: str = field(default="", compare=False)


@dataclass(slots=True)
class Admitted:
    """What one admission took for its keys."""

    ready: list[Ready] = field(default_factory=list)  # resident: pinned, ready now
    pending: dict[ExpertKey, Load] = field(default_factory=dict)  # pinned, their loads in flight
    # pending keys a prefetch was already loading: that prefetch's kind
    prefetched: dict[ExpertKey, str] = field(default_factory=dict)
    created: list[Load] = field(default_factory=list)  # loads this admission started


class UnpinWatcher:
    """A thread that turns compute's unpins (the slot table's futex word) into wake-ups of the
    admissions waiting on ``cond``; asleep (on ``watch``, a condition of the same lock) unless
    one waits."""

    def __init__(self, cond: threading.Condition, watch: threading.Condition, table: SlotTable) -> None:
        self._cond = cond
        self._watch = watch
        self._table = table
        self._seen: int | None = None  # the unpin word as the oldest waiting admission read it
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="expertcache-unpin-watch", daemon=True)
        self._thread.start()

    # -- under the lock ------------------------------------------------------------------------
    def watch(self, seen: int) -> None:
        """An admission waits, having read the unpin word as ``seen``: wake it on a change."""
        if self._seen is None:
            self._seen = seen
            self._watch.notify()

    def unwatch(self) -> None:
        """No admission waits any more."""
        self._seen = None

    def stop(self) -> None:
        self._closing = True
        self._watch.notify_all()

    # -- the thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closing and self._seen is None:
                    self._watch.wait()
                if self._closing:
                    return
                seen, self._seen = self._seen, None
            self._table.wait_unpin(seen)  # no timeout: an unpin, or shutdown's wake, ends it
            with self._cond:
                self._cond.notify_all()

    def join(self) -> None:
        """After ``stop`` and the table's ``wake_unpin_waiters``."""
        if self._thread is not threading.current_thread():
            self._thread.join()


@dataclass(eq=False, repr=False)
class Admission:
    """The demand side of the residency: acquire, admission and its waits. It is also the tier
    as the prefetch scheduler sees it (``TierState``): while a demand waits for slots, no slot
    is free or evictable for prefetch."""

    _cond: threading.Condition
    _table: SlotTable
    _slots: Slots
    _loads: Loads
    _sessions: Sessions
    _prefetcher: Prefetcher
    _recency: Recency
    _watcher: UnpinWatcher
    _intake: SignalIntake
    _metrics: DaemonMetrics
    _manifest: StoreManifest  # checks the keys
    timeout_s: float  # acquire_timeout_s
    demand_waiting: int = field(default=0, init=False)  # admissions waiting for slots: prefetch stands aside

    # -- TierState (read by the prefetch scheduler, under the lock) ---------------------
    @property
    def free_slots(self) -> int:
        # While a demand waits for slots, none is free for prefetch.
        return 0 if self.demand_waiting else self._slots.free

    @property
    def queue(self) -> PrefetchQueue:
        return self._loads.queue

    def is_resident(self, key: ExpertKey) -> bool:
        return self._slots.is_resident(key)

    def evictable(self, key: ExpertKey) -> bool:
        return not self.demand_waiting and self._slots.evictable(key)

    # -- acquire ------------------------------------------------------------------------
    def acquire(
        self,
        session: Session,
        layer: int,
        experts: Iterable[int],
        timeout_s: float | None = None,
        signals: Iterable[RouteSignal | LookaheadSignal] = (),
    ) -> Iterator[Ready]:
        """Pin ``layer``'s ``experts`` for ``session``, yielding a ``Ready`` per expert as it is ready.

        ``signals`` (checked by ``intake.check_route`` / ``check_layer_ahead``: compute sends a layer's
        Route and LayerAhead with its Acquire) are applied in the same hold of the lock as the
        admission, just after it (``_admit``).

        Already-resident experts come first (in request order), then the others as their loads
        complete. Each Ready is one pin the session holds until ``release`` or
        ``close_session``; if the iterator ends early (error, timeout, ``close()``), pins of
        experts not yet yielded are dropped. The arguments are checked now (``BadAcquire`` /
        ``InvalidArgument`` naming the value); waiting happens while iterating, bounded by
        ``timeout_s`` (default ``acquire_timeout_s``) → ``AcquireTimeout``. A failed load raises
        its ``DataLoss`` in every Acquire waiting for it.
        """
        layer, keys = self._check_demand("Acquire", layer, experts)
        self._metrics.demands.inc()
        timeout = self.timeout_s if timeout_s is None else timeout_s
        return self._acquire(session, layer, keys, time.monotonic() + timeout, timeout, tuple(signals))

    def _check_demand(self, what: str, layer: int, experts: Iterable[int]) -> tuple[int, list[ExpertKey]]:
        """``layer`` and the keys of ``experts``, checked (``BadAcquire`` / ``InvalidArgument``)."""
        experts = [int(e) for e in experts]
        # Compute sizes its waves by the arena (Attach's num_slots), not by the live budget.
        arena_slots = self._slots.num_slots
        if len(experts) > arena_slots:
            raise BadAcquire(
                f"{what} for layer {layer} names {len(experts)} experts but the arena has {arena_slots} "
                f"slots: acquire them in waves of at most {arena_slots} (release each wave first)"
            )
        seen: set[int] = set()
        keys = []
        for expert in experts:
            if expert in seen:
                raise BadAcquire(f"{what} for layer {layer} names expert {expert} more than once")
            seen.add(expert)
            key = ExpertKey(int(layer), expert)
            self._manifest.check_key(key)
            keys.append(key)
        return int(layer), keys

    def _admit(
        self,
        session: Session,
        layer: int,
        keys: list[ExpertKey],
        deadline: float,
        timeout: float,
        client: ChannelServer | None = None,
    ) -> Admitted:
        """Admission under the lock, waiting for slots (woken by releases, loads, unpins) until
        ``deadline`` → ``AcquireTimeout``."""
        waiting = False
        try:
            while True:
                self._sessions.check_open(session)
                # Read before the check: an unpin after it changes the word and wakes us.
                seen = self._table.unpin_seq
                admitted = self._try_admit(session, layer, keys, client)
                if admitted is not None:
                    return admitted
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AcquireTimeout(self._timeout_message(layer, keys, timeout))
                if self._sessions.audit_clients():  # a client pinning at will ends here, its pins with it
                    remaining = min(remaining, STRAY_CONFIRM_S)
                if not waiting:
                    waiting = True
                    self.demand_waiting += 1  # the prefetcher takes no slot meanwhile
                self._watcher.watch(seen)  # the watcher wakes us when compute unpins
                self._cond.wait(remaining)
        finally:
            if waiting:
                self.demand_waiting -= 1
                if not self.demand_waiting:
                    self._watcher.unwatch()
                self._prefetcher.kick()

    def _acquire(
        self,
        session: Session,
        layer: int,
        keys: list[ExpertKey],
        deadline: float,
        timeout: float,
        signals: tuple[RouteSignal | LookaheadSignal, ...],
    ) -> Iterator[Ready]:
        with self._cond:
            # The signals that came with the demand are applied after its admission, in the same
            # hold of the lock, whatever its outcome: its victims are chosen on the estimates the
            # last decision already computed, and its reads start before the estimates are
            # brought up to the new signals (a few hundred microseconds of Python on a busy node,
            # most of a store read). The layer's route and lookahead then steer the prefetch
            # decision that follows. Measured end to end (mxfp4, the e2e shape, with the demand's
            # reads submitted here too): 2-9% less time per token, the wait for experts down
            # 1-4 ms a token, at 0.5-1 more misses a token. (The channel applies its signals
            # once the demand is answered: ChannelServer.)
            try:
                admitted = self._admit(session, layer, keys, deadline, timeout)
            finally:
                self._intake.apply_locked(signals)
        ready, pending, prefetched = admitted.ready, admitted.pending, admitted.prefetched
        unyielded = {item.key for item in ready} | set(pending)
        deferred = [load for load in pending.values() if load.deferred]
        try:
            for item in ready:
                unyielded.discard(item.key)  # suspended at the yield = the caller has it
                yield item
            self._loads.run_deferred(deferred)  # host-tier copies in this thread, after the hits went out
            deferred = []
            while pending:
                with self._cond:
                    while True:
                        finished = [key for key, load in pending.items() if load.done]
                        if finished:
                            break
                        self._sessions.check_open(session)
                        remaining = deadline - time.monotonic()
                        if remaining <= 0:
                            raise AcquireTimeout(
                                f"timed out after {timeout:.3g}s (acquire_timeout_s) waiting for "
                                f"{len(pending)} expert(s) of layer {layer} to load: "
                                f"{', '.join(map(str, sorted(pending)))}"
                            )
                        self._cond.wait(remaining)
                failed = next((key for key in finished if pending[key].error is not None), None)
                if failed is not None:
                    raise _fresh_error(pending[failed].error, failed)
                for key in finished:
                    load = pending.pop(key)
                    unyielded.discard(key)
                    yield Ready(key, load.slot, load.source, prefetched.get(key, ""))
        finally:
            if deferred:
                self._loads.run_deferred(deferred)  # never left LOADING without a reader
            if unyielded:
                # Never handed out: the caller cannot know to release these pins, so drop them.
                with self._cond:
                    for key in unyielded:
                        self._sessions.drop_pin(session, key)
                    self._cond.notify_all()

    def admit_for_client(self, client: ChannelServer, layer: int, experts: Iterable[int]) -> list[Load]:
        """A demand posted on ``client``'s channel: admit it (all or nothing, waiting for slots
        up to ``acquire_timeout_s``), pinning every expert into the client's ledger. Resident ones
        get source DEVICE at once; the client is told as each missing one lands (or fails).
        The signals that came with it are not applied here: the channel applies them once the
        demand is answered (``ChannelServer``). Returns the loads to run in the calling thread
        (``Loads.run_deferred``, outside the lock)."""
        layer, keys = self._check_demand("a demand", layer, experts)
        self._metrics.demands.inc()
        with self._cond:
            admitted = self._admit(
                client.session,
                layer,
                keys,
                time.monotonic() + self.timeout_s,
                self.timeout_s,
                client,
            )
            position = {key: i for i, key in enumerate(keys)}
            for item in admitted.ready:
                client.set_source(position[item.key], Tier.DEVICE, item.prefetch)
            if admitted.pending:
                self._sessions.wait_for_loads(client, admitted.pending, position)
        return [load for load in admitted.pending.values() if load.deferred]

    def _try_admit(
        self, session: Session, layer: int, keys: list[ExpertKey], client: ChannelServer | None = None
    ) -> Admitted | None:
        """Pin everything ``keys`` needs and start its loads, or take nothing and return None.
        The pins go to ``session``, or with ``client`` into that client's ledger. Demand loads are
        left to the caller (``Load.deferred``: ``Loads.run_deferred`` once the lock is released)."""
        wanted = set(keys)
        slots = self._slots
        if client is None:
            held_elsewhere = len(set(session.held) - wanted)
            if held_elsewhere + len(keys) > slots.num_slots:
                raise BadAcquire(
                    f"Acquire of {len(keys)} experts for layer {layer} can never fit: this stream still pins "
                    f"{held_elsewhere} other experts and the arena has {slots.num_slots} slots; release "
                    "them first"
                )
        prefetcher = self._prefetcher
        self._recency.sync(prefetcher.scheduler.policy, prefetcher.used)
        queue = self._loads.queue
        loads = [queue.get(key) for key in keys]
        if any(ld is not None and ld.cancelled for ld in loads):
            return None  # a cancelled prefetch of a key still holds its slot: wait until it lets go
        missing = [
            key for key, ld in zip(keys, loads, strict=True) if ld is None and not slots.is_resident(key)
        ]
        refused: set[ExpertKey] = set()  # victims whose try_evict lost to a compute shm pin
        evicted = 0  # counted once below (a counter increment takes a lock)

        while (need := len(missing) - slots.free_for(len(missing))) > 0:
            victims = prefetcher.scheduler.policy.choose_victims(
                need, lambda k: k not in wanted and k not in refused and slots.evictable(k)
            )
            if len(victims) < need:
                if slots.limit < slots.num_slots and len(missing) <= slots.unbudgeted_free:
                    # Below a shrunk budget everything evictable is gone and pins (compute's
                    # own, often) hold the rest: demand beats the budget and takes arena slots
                    # beyond it rather than wait on its own pins; later admissions evict back.
                    for victim in victims:
                        if slots.try_evict(victim):
                            prefetcher.evicted(victim, count=False)
                            evicted += 1
                    break
                # Short of slots: queued prefetches give way. A cancelled one frees its slot now,
                # or once the chunks its read already issued land; the admission is retried.
                if self._loads.cancel_prefetches(need - len(victims), wanted):
                    continue  # some slots came free at once: choose again
                return None  # nothing taken; slots freed by earlier rounds simply stay free
            for victim in victims:
                if slots.try_evict(victim):
                    prefetcher.evicted(victim, count=False)
                    evicted += 1
                else:
                    refused.add(victim)  # compute pinned it between the check and the evict
        if evicted:
            self._metrics.tier["device"].evictions.inc(evicted)
        # Admitted: from here on nothing can fail (but a client whose ledger was just reclaimed).
        admitted = Admitted()
        try:
            self._admit_keys(session, client, keys, admitted)
        except BaseException:
            # A client whose ledger was reclaimed meanwhile: its loads were started for nobody.
            # They still complete into the cache (the I/O pool runs them), never LOADING for ever.
            for load in admitted.created:
                if load.deferred:
                    load.claimed = True
                    self._loads.submit(load)
            raise
        return admitted

    def _admit_keys(
        self, session: Session, client: ChannelServer | None, keys: list[ExpertKey], into: Admitted
    ) -> None:
        """The admitted half of ``_try_admit``: pin each key, start the loads of missing ones
        (into ``into``), and count the hits and misses."""
        try:
            self._admit_each(session, client, keys, into)
        finally:
            hits, misses = len(into.ready), len(into.pending)
            if hits:
                self._metrics.tier["device"].hits.inc(hits)
            if misses:
                self._metrics.tier["device"].misses.inc(misses)

    def _admit_each(
        self, session: Session, client: ChannelServer | None, keys: list[ExpertKey], into: Admitted
    ) -> None:
        slots, queue, prefetcher = self._slots, self._loads.queue, self._prefetcher
        scheduler = prefetcher.scheduler
        ready, pending = into.ready, into.pending
        # The reads first: each missing key's load starts (a read straight from the store into
        # its slot is submitted here, before the answer; one that may copy from the host tier is
        # left to the admitting thread) and each prefetch a demand joins is promoted to demand
        # priority, before the bookkeeping below, which costs the demand tens of microseconds of
        # Python a key on a busy node while the disk could already be reading.
        loads: dict[ExpertKey, Load] = {}
        for key in keys:
            load = queue.get(key)
            if load is not None:
                self._loads.promote(load)
            elif not slots.is_resident(key):
                load = self._loads.start(key, PrefetchClass.DEMAND, defer=not self._loads.reads_directly)
                into.created.append(load)
            else:
                continue
            loads[key] = load
        for key in keys:
            kind = prefetcher.used(key)
            scheduler.on_demand(key)
            load = loads.get(key)
            if load is None:
                self._hold(session, client, key)
                scheduler.policy.on_access(key)
                ready.append(Ready(key, slots.slot(key), Tier.DEVICE, kind or ""))
                continue
            if kind is None and load.prefetch is not None:
                kind = PREFETCH_KINDS[load.prefetch]
            if kind:
                into.prefetched[key] = kind
            self._hold(session, client, key)
            pending[key] = load

    def _hold(self, session: Session, client: ChannelServer | None, key: ExpertKey) -> None:
        if client is None:
            self._slots.hold(key)
            session.add(key)
        else:
            client.hold(key)

    def _timeout_message(self, layer: int, keys: list[ExpertKey], timeout: float) -> str:
        slots = self._slots
        occupied = slots.occupied()
        pinned = sum(1 for key, _state in occupied.values() if slots.pins(key) > 0)
        loading = sum(1 for _key, state in occupied.values() if state is TableState.LOADING)
        missing = sum(1 for key in keys if slots.state(key) is TableState.ABSENT)
        return (
            f"timed out after {timeout:.3g}s (acquire_timeout_s) waiting for {missing} free slot(s) for "
            f"layer {layer}: {pinned} of {slots.limit} slots are pinned ({loading} loading) by "
            f"{self._sessions.count} stream(s)"
        )


def _fresh_error(error: BaseException, key: ExpertKey) -> BaseException:
    """A new exception for one waiter (one object raised in several threads would share a traceback)."""
    if isinstance(error, ExpertCacheError):
        return type(error)(str(error))
    return ExpertCacheError(f"loading expert {key} failed: {type(error).__name__}: {error}")


__all__ = ["Admission", "Admitted", "Ready", "UnpinWatcher"]
