"""Admission: an Acquire (or a client's channel demand) pins its experts, all or nothing.

::

    acquire(session, layer, experts, signals)
      check (BadAcquire / InvalidArgument, nothing taken)
      under the lock: apply the carried signals, then _admit:
        _try_admit: free-or-evictable slots for every missing key? (short: cancel queued
                    prefetches, else wait, woken by releases, loads and compute's unpins)
          yes → _admit_keys: pin each key; resident → Ready now; loading → join (promote);
                absent → a deferred demand load (run_deferred, outside the lock)
      then yield Ready per key as its load lands; pins of keys never yielded are dropped

A wait for slots ends at ``acquire_timeout_s`` (``AcquireTimeout``); a failed load raises its
error in every Acquire waiting for it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from cache_daemon.decisions.intake import LookaheadSignal, RouteSignal
from cache_daemon.decisions.scheduler import PrefetchClass
from cache_daemon.errors import AcquireTimeout, BadAcquire
from cache_daemon.residency.channel import ChannelServer
from cache_daemon.residency.clients import Session
from cache_daemon.residency.loader import Load
from cache_daemon.residency.prefetcher import PREFETCH_KINDS
from cache_daemon.residency.sessions import STRAY_CONFIRM_S
from cache_daemon.residency.slots import SlotState
from cache_daemon.residency.state import ResidencyState
from cache_daemon.tiers.base import Tier
from expertcache.channel import GATHER_BELOW_BYTES
from expertcache.errors import ExpertCacheError
from expertcache.keys import ExpertKey


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


class Admission(ResidencyState):
    """The demand side of ``Residency``: acquire, admission and its waits."""

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
        admission, just before it: the victims are chosen knowing them, and the loads started
        are queued before any prefetch they trigger.

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
        timeout = self._timeout_s if timeout_s is None else timeout_s
        return self._acquire(session, layer, keys, time.monotonic() + timeout, timeout, tuple(signals))

    def _check_demand(self, what: str, layer: int, experts: Iterable[int]) -> tuple[int, list[ExpertKey]]:
        """``layer`` and the keys of ``experts``, checked (``BadAcquire`` / ``InvalidArgument``)."""
        experts = [int(e) for e in experts]
        # Compute sizes its waves by the arena (Attach's num_slots), not by the live budget.
        arena_slots = self._arena.num_slots
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
    ) -> tuple[list[Ready], dict[ExpertKey, Load], dict[ExpertKey, str]]:
        """Admission under the lock, waiting for slots (woken by releases, loads, unpins) until
        ``deadline`` → ``AcquireTimeout``."""
        waiting = False
        try:
            while True:
                self._check_open(session)
                # Read before the check: an unpin after it changes the word and wakes us.
                seen = self._table.unpin_seq
                admitted = self._try_admit(session, layer, keys, client)
                if admitted is not None:
                    return admitted
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AcquireTimeout(self._timeout_message(layer, keys, timeout))
                if self.audit_clients():  # a client pinning at will ends here, its pins with it
                    remaining = min(remaining, STRAY_CONFIRM_S)
                if not waiting:
                    waiting = True
                    self.demand_waiting += 1  # the prefetcher takes no slot meanwhile
                if self._unpin_seen is None:
                    self._unpin_seen = seen  # the watcher wakes us when compute unpins
                    self._watch.notify()
                self._cond.wait(remaining)
        finally:
            if waiting:
                self.demand_waiting -= 1
                if not self.demand_waiting:
                    self._unpin_seen = None
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
            self.intake.apply_locked(signals)
            ready, pending, prefetched = self._admit(session, layer, keys, deadline, timeout)
        unyielded = {item.key for item in ready} | set(pending)
        deferred = [load for load in pending.values() if load.deferred]
        try:
            for item in ready:
                unyielded.discard(item.key)  # suspended at the yield = the caller has it
                yield item
            self.run_deferred(deferred)  # host-tier copies in this thread, after the hits went out
            deferred = []
            while pending:
                with self._cond:
                    while True:
                        finished = [key for key, load in pending.items() if load.done]
                        if finished:
                            break
                        self._check_open(session)
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
                self.run_deferred(deferred)  # never left LOADING without a reader
            if unyielded:
                # Never handed out: the caller cannot know to release these pins, so drop them.
                with self._cond:
                    for key in unyielded:
                        self._drop_pin(session, key)
                    self._cond.notify_all()

    def admit_for_client(
        self, client: ChannelServer, layer: int, experts: Iterable[int], ops: list[tuple[str, object]] = ()
    ) -> list[Load]:
        """A demand posted on ``client``'s channel: admit it (all or nothing, waiting for slots
        up to ``acquire_timeout_s``), pinning every expert into the client's ledger. Resident ones
        get source DEVICE at once; the client is told as each missing one lands (or fails).
        ``ops`` (the channel's signals that came with it, ``SignalIntake.apply_ops``) are applied in the
        same hold of the lock, just before the admission, as an Acquire's carried signals are.
        Returns the loads to run in the calling thread (``run_deferred``, outside the lock)."""
        try:
            layer, keys = self._check_demand("a demand", layer, experts)
        except BaseException:
            self.intake.apply_ops(ops)
            raise
        self._metrics.demands.inc()
        with self._cond:
            self.intake.apply_ops_locked(ops)
            ready, pending, _ = self._admit(
                client.session, layer, keys, time.monotonic() + self._timeout_s, self._timeout_s, client
            )
            position = {key: i for i, key in enumerate(keys)}
            for item in ready:
                client.set_source(position[item.key], Tier.DEVICE)
            for key in pending:
                self._client_waits.setdefault(key, []).append((client, position[key]))
        return [load for load in pending.values() if load.deferred]

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
            self._loader.copy_from_host(loads, publish_each=self._blob_bytes >= GATHER_BELOW_BYTES)

    def _try_admit(
        self, session: Session, layer: int, keys: list[ExpertKey], client: ChannelServer | None = None
    ) -> tuple[list[Ready], dict[ExpertKey, Load], dict[ExpertKey, str]] | None:
        """Pin everything ``keys`` needs and start its loads, or take nothing and return None.
        The pins go to ``session``, or with ``client`` into that client's ledger. Demand loads are
        left to the caller (``Load.deferred``: ``run_deferred`` once the lock is released)."""
        wanted = set(keys)
        if client is None:
            held_elsewhere = len(set(session.held) - wanted)
            if held_elsewhere + len(keys) > self._arena.num_slots:
                raise BadAcquire(
                    f"Acquire of {len(keys)} experts for layer {layer} can never fit: this stream still pins "
                    f"{held_elsewhere} other experts and the arena has {self._arena.num_slots} slots; release "
                    "them first"
                )
        self.sync_recency()
        slots = self.slots
        loads = [self.queue.get(key) for key in keys]
        if any(ld is not None and ld.cancelled for ld in loads):
            return None  # a cancelled prefetch of a key still holds its slot: wait until it lets go
        missing = [
            key for key, ld in zip(keys, loads, strict=True) if ld is None and not slots.is_resident(key)
        ]
        refused: set[ExpertKey] = set()  # victims whose try_evict lost to a compute shm pin
        evicted = 0  # counted once below (a counter increment takes a lock)

        while (need := len(missing) - slots.free_for(len(missing))) > 0:
            victims = self.policy.choose_victims(
                need, lambda k: k not in wanted and k not in refused and slots.evictable(k)
            )
            if len(victims) < need:
                if slots.limit < slots.num_slots and len(missing) <= slots.unbudgeted_free:
                    # Below a shrunk budget everything evictable is gone and pins (compute's
                    # own, often) hold the rest: demand beats the budget and takes arena slots
                    # beyond it rather than wait on its own pins; later admissions evict back.
                    for victim in victims:
                        if slots.try_evict(victim):
                            self._evicted(victim, count=False)
                            evicted += 1
                    break
                # Short of slots: queued prefetches give way. A cancelled one frees its slot now,
                # or once the chunks its read already issued land; the admission is retried.
                if self._cancel_prefetches(need - len(victims), wanted):
                    continue  # some slots came free at once: choose again
                return None  # nothing taken; slots freed by earlier rounds simply stay free
            for victim in victims:
                if slots.try_evict(victim):
                    self._evicted(victim, count=False)
                    evicted += 1
                else:
                    refused.add(victim)  # compute pinned it between the check and the evict
        if evicted:
            self._metrics.tier["device"].evictions.inc(evicted)
        # Admitted: from here on nothing can fail (but a client whose ledger was just reclaimed).
        ready: list[Ready] = []
        pending: dict[ExpertKey, Load] = {}
        prefetched: dict[ExpertKey, str] = {}  # pending keys a prefetch was already loading
        created: list[Load] = []
        try:
            self._admit_keys(session, client, keys, ready, pending, prefetched, created)
        except BaseException:
            # A client whose ledger was reclaimed meanwhile: its loads were started for nobody.
            # They still complete into the cache (the I/O pool runs them), never LOADING for ever.
            for load in created:
                load.claimed = True
                self._loader.submit(load)
            raise
        return ready, pending, prefetched

    def _admit_keys(
        self,
        session: Session,
        client: ChannelServer | None,
        keys: list[ExpertKey],
        ready: list[Ready],
        pending: dict[ExpertKey, Load],
        prefetched: dict[ExpertKey, str],
        created: list[Load],
    ) -> None:
        """The admitted half of ``_try_admit``: pin each key, start the loads of missing ones."""
        slots = self.slots
        scheduler = self._prefetcher.scheduler
        hits = misses = 0
        try:
            self._admit_each(session, client, keys, ready, pending, prefetched, created, slots, scheduler)
        finally:
            hits, misses = len(ready), len(pending)
            if hits:
                self._metrics.tier["device"].hits.inc(hits)
            if misses:
                self._metrics.tier["device"].misses.inc(misses)

    def _admit_each(
        self, session, client, keys, ready, pending, prefetched, created, slots, scheduler
    ) -> None:
        for key in keys:
            kind = self._prefetcher.used(key)
            scheduler.on_demand(key)
            load = self.queue.get(key)
            if load is None and slots.is_resident(key):
                self._hold(session, client, key)
                scheduler.policy.on_access(key)
                ready.append(Ready(key, slots.slot(key), Tier.DEVICE, kind or ""))
                continue
            if load is not None:
                if kind is None and load.prefetch is not None:
                    kind = PREFETCH_KINDS[load.prefetch]
                if kind:
                    prefetched[key] = kind
                self._promote(load)
            else:
                load = self._start_load(key, PrefetchClass.DEMAND, defer=True)
                created.append(load)
            self._hold(session, client, key)
            pending[key] = load

    def _hold(self, session: Session, client: ChannelServer | None, key: ExpertKey) -> None:
        if client is None:
            self.slots.hold(key)
            session.add(key)
        else:
            client.hold(key)

    def _timeout_message(self, layer: int, keys: list[ExpertKey], timeout: float) -> str:
        occupied = self.slots.occupied()
        pinned = sum(1 for key, _state in occupied.values() if self.slots.pins(key) > 0)
        loading = sum(1 for _key, state in occupied.values() if state is SlotState.LOADING)
        missing = sum(1 for key in keys if self.slots.state(key) is SlotState.ABSENT)
        return (
            f"timed out after {timeout:.3g}s (acquire_timeout_s) waiting for {missing} free slot(s) for "
            f"layer {layer}: {pinned} of {self.num_slots} slots are pinned ({loading} loading) by "
            f"{len(self._sessions)} stream(s)"
        )


def _fresh_error(error: BaseException, key: ExpertKey) -> BaseException:
    """A new exception for one waiter (one object raised in several threads would share a traceback)."""
    if isinstance(error, ExpertCacheError):
        return type(error)(str(error))
    return ExpertCacheError(f"loading expert {key} failed: {type(error).__name__}: {error}")


__all__ = ["Admission", "Ready"]
