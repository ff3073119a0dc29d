"""The device tier's facade (``Residency``): one lock, the public API, and the parts it wires.

Each part owns its state and gets only the collaborators it uses (docs/residency.md, "Parts"):
``Slots`` (the table), ``Sessions`` (pins and clients), ``Loads`` (loads in flight),
``Admission`` (acquire and its waits), ``Prefetcher`` / ``PrefetchWorker`` and ``LiveSwitches``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Executor
from dataclasses import dataclass

import torch

from cache_daemon.decisions.intake import LookaheadSignal, RouteSignal, SignalIntake
from cache_daemon.decisions.policy import EvictionPolicy
from cache_daemon.decisions.scheduler import (
    DEFAULT_INFLIGHT_BLOBS,
    PrefetchConfig,
    PrefetchScheduler,
)
from cache_daemon.decisions.signals import ActivationSignals
from cache_daemon.errors import SlotNotReadable
from cache_daemon.metrics import DaemonMetrics
from cache_daemon.residency.admission import Admission, Ready, UnpinWatcher
from cache_daemon.residency.channel import ChannelPort
from cache_daemon.residency.clients import ClientLedger, Recency, Session
from cache_daemon.residency.loader import Load
from cache_daemon.residency.loads import Loads
from cache_daemon.residency.prefetcher import Prefetcher, PrefetchWorker
from cache_daemon.residency.sessions import Sessions
from cache_daemon.residency.slots import Slots
from cache_daemon.residency.switches import LiveSwitches
from cache_daemon.tiers.device import DeviceArena
from cache_daemon.tiers.host import HostTier
from cache_daemon.tiers.store import Priority, StoreReader
from expertcache.keys import ExpertKey
from expertcache.layers import LayerMap
from expertcache.manifest import StoreManifest
from expertcache.native import SlotTable, TableState

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SlotInfo:
    """A snapshot of one entry of the slot table."""

    key: ExpertKey
    state: TableState
    slot: int  # -1 when ABSENT
    pins: int  # every pin: Demand sessions' and compute's shared-memory ones
    generation: int  # loads completed into a slot so far (the table's)
    load_priority: Priority | None = None  # its load's read priority (the reader's) while LOADING
    prefetched: bool = False  # loaded (or loading) by a prefetch and not used yet


@dataclass(frozen=True)
class ResidencyStats:
    num_slots: int
    resident: int
    loading: int
    pinned: int  # keys with at least one pin (Demand or shm)
    sessions: int
    shm_hits: int  # pins compute took through the shared slot table (hits without RPC)
    shm_waited: int = 0  # experts in flight compute waited for and pinned there (misses without RPC)
    prefetching: int = 0  # prefetch loads in flight that no demand has joined
    inflight_bytes: int = 0  # bytes of every load in flight (prefetch adds only below the bound)
    demands_waiting: int = 0  # admissions waiting for slots (prefetch stands aside meanwhile)
    hints_dropped: int = 0  # predictor hints naming no live request or no MoE layer


def table_entries(manifest: StoreManifest) -> int:
    """Entries of the shared slot table for ``manifest``: one per (decoder layer, expert)."""
    return manifest.num_layers * manifest.num_experts


class Residency:
    """The device tier: the slot table over a ``DeviceArena``, the demand logic and the prefetcher.

    All state is guarded by one lock, held through the condition ``_cond`` that admissions and
    acquires wait on (the parts share it). A load read from the store straight into its slot is
    published by the worker thread (``PrefetchWorker``, which also starts the prefetches) when its
    read completes; other loads run on a private pool of ``io_threads`` threads (prefetch loads on
    a second pool of as many). Both take the lock only to publish their results.
    """

    def __init__(
        self,
        manifest: StoreManifest,
        arena: DeviceArena,
        store: StoreReader,
        host: HostTier | None,
        policy: EvictionPolicy,
        metrics: DaemonMetrics,
        *,
        table: SlotTable,
        io_threads: int = 4,
        acquire_timeout_s: float = 60.0,
        executor: Executor | None = None,
        signals: ActivationSignals | None = None,
        prefetch: bool = False,
        max_inflight_bytes: int = 0,
        prefetch_config: PrefetchConfig | None = None,
    ) -> None:
        """``executor`` runs the demand loads; by default a private pool of ``io_threads``
        threads, shut down by ``shutdown`` (one passed in is left running). ``table`` is the
        shared slot table (``table_entries(manifest)`` entries, one per arena slot), all ABSENT;
        its owner removes the file.

        ``signals``: the predictions ``policy`` reads (``ActivationSignals(manifest.num_layers,
        manifest.num_experts, layer_map=...)``, layers numbered as in Acquire); a fresh one when
        None. ``prefetch``: start prefetch loads; ``max_inflight_bytes`` bounds the bytes of loads
        in flight a prefetch may add to (0: four blobs); ``prefetch_config`` tunes the scheduler."""
        if arena.slot_bytes != manifest.blob_bytes:
            raise ValueError(
                f"arena slots of {arena.slot_bytes} bytes cannot hold blobs of {manifest.blob_bytes}"
            )
        if table.num_entries != table_entries(manifest) or table.num_slots != arena.num_slots:
            raise ValueError(
                f"slot table {table.path} has {table.num_entries} entries and {table.num_slots} slots; "
                f"expected {table_entries(manifest)} entries and {arena.num_slots} slots"
            )
        layers = LayerMap(tuple(manifest.moe_layers), manifest.num_layers)
        # One lock; waiters on two conditions of it, so that a change wakes only who needs it:
        # admissions and acquires waiting for slots or loads (``_cond``), the unpin watcher. The
        # worker thread sleeps outside it, on ``Prefetcher.wake_fd`` (``kick``) and the store's
        # completions.
        lock = threading.RLock()
        self._cond = cond = threading.Condition(lock)
        self._table = table
        self._arena = arena
        self.slots = slots = Slots(table, arena.num_slots, manifest.num_experts)
        self.signals = signals or ActivationSignals(
            manifest.num_layers, manifest.num_experts, layer_map=layers
        )
        if (self.signals.num_layers, self.signals.num_experts) != (manifest.num_layers, manifest.num_experts):
            raise ValueError(
                f"signals cover {self.signals.num_layers} layers x {self.signals.num_experts} experts; the store "
                f"has {manifest.num_layers} x {manifest.num_experts}"
            )
        # The one holder of the eviction policy, which eviction reads too (``policy``).
        scheduler = PrefetchScheduler(
            self.signals,
            policy,
            blob_bytes=manifest.blob_bytes,
            max_inflight_bytes=max_inflight_bytes or DEFAULT_INFLIGHT_BLOBS * manifest.blob_bytes,
            config=prefetch_config,
        )
        self._prefetcher = prefetcher = Prefetcher(cond, scheduler, metrics)
        recency = Recency(table, slots)
        self._sessions = sessions = Sessions(cond, table, slots, metrics, prefetcher.kick)
        self._loads = loads = Loads(
            cond,
            slots,
            prefetcher,
            sessions,
            metrics,
            arena,
            store,
            host,
            io_threads=io_threads,
            executor=executor,
        )
        self.intake = SignalIntake(self.signals, layers, cond, prefetcher.kick, metrics.signals)
        self._watcher = UnpinWatcher(cond, threading.Condition(lock), table)
        self._admission = admission = Admission(
            cond,
            table,
            slots,
            loads,
            sessions,
            prefetcher,
            recency,
            self._watcher,
            self.intake,
            metrics,
            manifest,
            timeout_s=acquire_timeout_s,
        )
        self._worker = PrefetchWorker(
            cond, prefetcher, admission, slots, recency, loads.start, loads.reap, loads.reap_fd
        )
        prefetcher.enabled = prefetch
        self._switches = LiveSwitches(
            cond, table, slots, recency, prefetcher, self.signals, manifest.blob_bytes
        )
        self._switches.update_signals_wanted()
        self._channel_port = ChannelPort(
            admit=admission.admit_for_client,
            run_deferred=loads.run_deferred,
            copies_from_host=loads.copies_from_host,
            close_session=sessions.close_session,
            closing=lambda: sessions.closing,
            intake=self.intake,
            metrics=metrics,
            table=table,
            num_experts=manifest.num_experts,
            blob_bytes=manifest.blob_bytes,
        )

    @property
    def num_slots(self) -> int:
        """Slots the cache may fill now (the live device budget; the arena may have more)."""
        return self.slots.limit

    @property
    def table(self) -> SlotTable:
        return self._table

    @property
    def num_experts(self) -> int:
        return self.slots.num_experts

    @property
    def closing(self) -> bool:
        return self._sessions.closing

    @property
    def scheduler(self) -> PrefetchScheduler:
        """The prefetch scheduler; it holds the eviction policy that the residency evicts by too."""
        return self._prefetcher.scheduler

    @property
    def policy(self) -> EvictionPolicy:
        """The eviction policy (held by the scheduler: one policy for eviction and prefetch)."""
        return self._prefetcher.scheduler.policy

    @property
    def inflight_bytes(self) -> int:
        return self._loads.queue.inflight_bytes

    @property
    def prefetch_enabled(self) -> bool:
        return self._prefetcher.enabled

    # -- demand (``Admission``) and pins (``Sessions``) -------------------------------------
    def acquire(
        self,
        session: Session,
        layer: int,
        experts: Iterable[int],
        timeout_s: float | None = None,
        signals: Iterable[RouteSignal | LookaheadSignal] = (),
    ) -> Iterator[Ready]:
        """Pin ``layer``'s ``experts`` for ``session``, yielding a ``Ready`` per expert as it is
        ready (``Admission.acquire``)."""
        return self._admission.acquire(session, layer, experts, timeout_s, signals)

    def release(self, session: Session, keys: Iterable[ExpertKey]) -> None:
        """Drop one pin per key (``BadAcquire``, nothing released, for a key not pinned)."""
        self._sessions.release(session, keys)

    def open_session(self, name: str = "") -> Session:
        return self._sessions.open_session(name)

    def close_session(self, session: Session) -> None:
        """Drop every pin ``session`` holds and end it. Idempotent; any thread."""
        self._sessions.close_session(session)

    def claim_client(self) -> ClientLedger:
        """A free client ledger for an attaching compute process (``ResourceExhausted`` if none)."""
        return self._sessions.claim_client()

    def handoff_fds(self, ledger: ClientLedger) -> list[int] | None:
        """New descriptors of the table and of ``ledger``'s region (``Sessions.handoff_fds``)."""
        return self._sessions.handoff_fds(ledger)

    def bind_client(self, session: Session, ledger: ClientLedger) -> None:
        """Tie ``ledger`` (claimed at Attach) to ``session`` and serve its channel until the
        session closes (``FailedPrecondition`` if it is not claimed, bound elsewhere, or at
        another epoch)."""
        self._sessions.bind_client(session, ledger, self._channel_port)

    def audit_clients(self) -> bool:
        """Under the lock: end the sessions of clients whose regions pin at will
        (``Sessions.audit_clients``)."""
        return self._sessions.audit_clients()

    # -- prefetch and live switches ----------------------------------------------------------
    def run_prefetch(self) -> int:
        """Decide and start prefetches now, in the calling thread (what the worker does when
        woken); returns the number of loads started. Nothing while prefetch is off or a demand
        waits for slots."""
        with self._cond:
            self._prefetcher.begin_decision()
            return self._worker.run()

    def set_slot_limit(self, limit: int) -> int:
        """Change the live device budget; returns how many experts were evicted now
        (``LiveSwitches.set_slot_limit``)."""
        return self._switches.set_slot_limit(limit)

    def set_policy(self, policy: EvictionPolicy) -> None:
        """Switch the eviction policy at runtime, losing nothing (``LiveSwitches.set_policy``)."""
        self._switches.set_policy(policy)

    def configure_prefetch(
        self, *, enabled: bool, max_inflight_bytes: int, config: PrefetchConfig | None = None
    ) -> None:
        """Turn prefetch on/off and retune it at runtime (loads already started complete)."""
        self._switches.configure_prefetch(
            enabled=enabled, max_inflight_bytes=max_inflight_bytes, config=config
        )

    def set_next_visit_model(self, model) -> None:
        """Swap the signals' learned next-visit model at runtime (``ValueError`` for a model of
        another shape, nothing changed)."""
        self._switches.set_next_visit_model(model)

    # -- read ---------------------------------------------------------------------------
    def read_slot(self, session: Session, key: ExpertKey) -> torch.Tensor:
        """``[blob_bytes]`` uint8 view of ``key``'s slot; only while RESIDENT and pinned by ``session``."""
        with self._cond:
            state = self.slots.state(key)
            pinned = session.pins(key) > 0
            if state is not TableState.RESIDENT or not pinned:
                raise SlotNotReadable(
                    f"expert {key} is {state.name.lower()} and {'pinned' if pinned else 'not pinned'} by this stream: "
                    "a slot is readable only while RESIDENT and pinned"
                )
            return self._arena.slots[self.slots.slot(key)]

    # -- introspection ------------------------------------------------------------------
    def describe(self, key: ExpertKey) -> SlotInfo:
        with self._cond:
            state = self.slots.state(key)
            load = self._loads.queue.get(key)
            priority = None
            if isinstance(load, Load):
                # The native reader's own view when the read is submitted (what it serves by).
                native = load.handle.state if load.handle is not None else None
                priority = Priority(native["priority"]) if native else load.priority
            return SlotInfo(
                key,
                state,
                self.slots.slot(key) if state is not TableState.ABSENT else -1,
                self.slots.pins(key),
                self.slots.generation(key),
                priority,
                self._prefetcher.is_unused_prefetch(key),
            )

    def slot_owner(self, slot: int) -> ExpertKey | None:
        with self._cond:
            owner = self.slots.occupied().get(slot)
            return None if owner is None else owner[0]

    def stats(self) -> ResidencyStats:
        with self._cond:
            occupied = self.slots.occupied()
            queue = self._loads.queue
            return ResidencyStats(
                num_slots=self.num_slots,
                resident=sum(1 for _k, s in occupied.values() if s is TableState.RESIDENT),
                loading=sum(1 for _k, s in occupied.values() if s is TableState.LOADING),
                pinned=sum(1 for k, _s in occupied.values() if self.slots.pins(k) > 0),
                sessions=self._sessions.count,
                shm_hits=self._table.hits,
                shm_waited=self._table.waited,
                prefetching=queue.prefetching(),
                inflight_bytes=queue.inflight_bytes,
                demands_waiting=self._admission.demand_waiting,
                hints_dropped=self.intake.hints_dropped,
            )

    def shutdown(self) -> None:
        """Wake and fail every waiting Acquire (``ShuttingDown``), then stop the prefetcher, the
        unpin watcher and the I/O threads."""
        with self._cond:
            servers = self._sessions.close()
            self._cond.notify_all()
            self._watcher.stop()
        for server in servers:
            server.wake()
        for server in servers:
            server.join(5.0)
        self._table.wake_unpin_waiters()
        self._watcher.join()
        self._worker.close()
        self._loads.shutdown()

    def drain(self, timeout_s: float) -> int:
        """After ``shutdown``: evict every expert nobody pins, and wait (at most ``timeout_s``) for
        the pinned ones to be released, evicting each as it is. Compute releases a pin only once
        the kernels reading the slot are done, so when this returns 0 no compute process reads the
        arena and its memory may go. Returns how many entries are still pinned."""
        deadline = time.monotonic() + timeout_s
        entries = range(self._table.num_entries)
        while True:
            seen = self._table.unpin_seq
            with self._cond:
                pinned = 0
                for index in entries:
                    if self._table.pins(index) > 0:
                        pinned += 1
                    elif self.slots.is_resident(key := self.slots.key_of(index)):
                        self.slots.try_evict(key)  # compute cannot pin it any more: its hits miss
            remaining = deadline - time.monotonic()
            if pinned == 0 or remaining <= 0:
                return pinned
            self._table.wait_unpin(seen, remaining)  # an unpin (or the deadline) ends the wait


__all__ = ["Residency", "ResidencyStats", "SlotInfo", "table_entries"]
