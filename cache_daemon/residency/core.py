"""The device tier: acquire, release and admission over the arena's slots.

``Residency`` wires the parts (``slots``, ``clients``, ``loader``, ``prefetcher``) under one
condition variable and implements the scheduler's ``TierState``; its methods are grouped by
concern in ``admission``, ``loads``, ``sessions`` and ``switches`` (the state they share is
declared in ``state``). Its state, each with one owner:

- entry state, slot, generation and every pin: the native slot table (``Slots``);
- free slots: ``Slots``' allocator;
- loads in flight, demand and prefetch: one ``PrefetchQueue`` of ``Load`` records;
- which session holds which pins (to give them back): each ``Session``;
- predictions: ``ActivationSignals`` (fed through ``cache_daemon.decisions.intake``); eviction
  order: the policy, held by the prefetch scheduler.

Waiting is event-driven: an Acquire waiting for slots sleeps on the condition, woken by a
release, a finished or cancelled load, or (through the unpin watcher thread, asleep on the slot
table's futex word) compute dropping the last shared-memory pin of an entry; an Acquire waiting
for a load is woken when the load completes.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Executor
from dataclasses import dataclass

import torch

from cache_daemon.decisions.intake import SignalIntake
from cache_daemon.decisions.policy import EvictionPolicy
from cache_daemon.decisions.scheduler import (
    DEFAULT_INFLIGHT_BLOBS,
    PrefetchConfig,
    PrefetchQueue,
    PrefetchScheduler,
)
from cache_daemon.decisions.signals import ActivationSignals
from cache_daemon.errors import SlotNotReadable
from cache_daemon.metrics import DaemonMetrics
from cache_daemon.residency.admission import Admission
from cache_daemon.residency.clients import ClientLedgers, Recency, Session
from cache_daemon.residency.loader import Load, Loader
from cache_daemon.residency.loads import LoadCompletion
from cache_daemon.residency.prefetcher import Prefetcher
from cache_daemon.residency.sessions import ClientSessions
from cache_daemon.residency.slots import Slots, SlotState
from cache_daemon.residency.switches import LiveSwitches
from cache_daemon.tiers.device import DeviceArena
from cache_daemon.tiers.host import HostTier
from cache_daemon.tiers.store import Priority, StoreReader
from expertcache.keys import ExpertKey
from expertcache.layers import LayerMap
from expertcache.manifest import StoreManifest
from expertcache.native import SlotTable

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SlotInfo:
    """A snapshot of one entry of the slot table."""

    key: ExpertKey
    state: SlotState
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
    prefetching: int = 0  # prefetch loads in flight that no demand has joined
    inflight_bytes: int = 0  # bytes of every load in flight (prefetch adds only below the bound)
    demands_waiting: int = 0  # admissions waiting for slots (prefetch stands aside meanwhile)
    hints_dropped: int = 0  # predictor hints naming no live request or no MoE layer


def table_entries(manifest: StoreManifest) -> int:
    """Entries of the shared slot table for ``manifest``: one per (decoder layer, expert)."""
    return manifest.num_layers * manifest.num_experts


class Residency(Admission, LoadCompletion, ClientSessions, LiveSwitches):
    """The device tier: the slot table over a ``DeviceArena``, the demand logic and the prefetcher.

    All state is guarded by one condition variable — the sessions, the queue of loads, the
    policy, the activation signals and the prefetch scheduler alike; loads run on a private pool
    of ``io_threads`` threads (prefetch loads on a second pool of as many) and take the lock only
    to publish their result.
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
        self._manifest = manifest
        self._layers = LayerMap(tuple(manifest.moe_layers), manifest.num_layers)
        self._num_experts = manifest.num_experts
        self._arena = arena
        self._metrics = metrics
        self._timeout_s = acquire_timeout_s
        self._blob_bytes = manifest.blob_bytes
        # One lock; waiters on three conditions of it, so that a change wakes only who needs it:
        # admissions and acquires waiting for slots or loads (``_cond``), the unpin watcher
        # (``_watch``), the prefetch worker (its own, woken by ``Prefetcher.kick``).
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._watch = threading.Condition(self._lock)
        self._table = table
        self.slots = Slots(table, arena.num_slots, manifest.num_experts)
        self.queue = PrefetchQueue(manifest.blob_bytes)
        self._ledgers = ClientLedgers(table)
        self._recency = Recency(table, self.slots)
        self._sessions = set()
        self._channels = {}
        self._client_waits = {}
        self._closing = False
        self.demand_waiting = 0
        self._unpin_seen = None
        self._strays = {}
        self.signals = signals or ActivationSignals(
            manifest.num_layers, manifest.num_experts, layer_map=self._layers
        )
        if (self.signals.num_layers, self.signals.num_experts) != (manifest.num_layers, manifest.num_experts):
            raise ValueError(
                f"signals cover {self.signals.num_layers} layers x {self.signals.num_experts} experts; the store "
                f"has {manifest.num_layers} x {manifest.num_experts}"
            )
        self._loader = Loader(
            self._cond,
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
        # The one holder of the eviction policy, which eviction reads too (``policy``).
        scheduler = PrefetchScheduler(
            self.signals,
            policy,
            blob_bytes=manifest.blob_bytes,
            max_inflight_bytes=max_inflight_bytes or DEFAULT_INFLIGHT_BLOBS * manifest.blob_bytes,
            config=prefetch_config,
        )
        self._prefetcher = Prefetcher(self, self._cond, scheduler, metrics, threading.Condition(self._lock))
        self.intake = SignalIntake(
            self.signals, self._layers, self._cond, self._prefetcher.kick, metrics.signals
        )
        self._prefetcher.enabled = prefetch
        self._update_signals_wanted()
        self._watcher = threading.Thread(
            target=self._watch_unpins, name="expertcache-unpin-watch", daemon=True
        )
        self._watcher.start()

    @property
    def num_slots(self) -> int:
        """Slots the cache may fill now (the live device budget; the arena may have more)."""
        return self.slots.limit

    @property
    def table(self) -> SlotTable:
        return self._table

    @property
    def num_experts(self) -> int:
        return self._num_experts

    @property
    def blob_bytes(self) -> int:
        return self._blob_bytes

    @property
    def metrics(self) -> DaemonMetrics:
        return self._metrics

    @property
    def closing(self) -> bool:
        return self._closing

    @property
    def layers(self) -> LayerMap:
        return self._layers

    # -- TierState (read by the prefetch scheduler, under the lock) ---------------------
    @property
    def free_slots(self) -> int:
        # While a demand waits for slots, none is free for prefetch.
        return 0 if self.demand_waiting else self.slots.free

    def is_resident(self, key: ExpertKey) -> bool:
        return self.slots.is_resident(key)

    def evictable(self, key: ExpertKey) -> bool:
        return not self.demand_waiting and self.slots.evictable(key)

    @property
    def inflight_bytes(self) -> int:
        return self.queue.inflight_bytes

    # -- the prefetcher's side -----------------------------------------------------------
    def run_prefetch(self) -> int:
        """Decide and start prefetches now, in the calling thread (what the worker does when
        woken); returns the number of loads started. Nothing while prefetch is off or a demand
        waits for slots."""
        with self._cond:
            return self._prefetcher.run()

    def sync_recency(self) -> None:
        """Feed the policy compute's table hits since the last sync (under the lock)."""
        self._recency.sync(self.policy, self._prefetcher.used)

    def _watch_unpins(self) -> None:
        """Turns compute's unpins (the slot table's futex word) into wake-ups of waiting admissions;
        asleep unless an admission waits."""
        while True:
            with self._cond:
                while not self._closing and not (self.demand_waiting and self._unpin_seen is not None):
                    self._watch.wait()
                if self._closing:
                    return
                seen, self._unpin_seen = self._unpin_seen, None
            self._table.wait_unpin(seen)  # no timeout: an unpin, or shutdown's wake, ends it
            with self._cond:
                self._cond.notify_all()

    # -- read ---------------------------------------------------------------------------
    def read_slot(self, session: Session, key: ExpertKey) -> torch.Tensor:
        """``[blob_bytes]`` uint8 view of ``key``'s slot; only while RESIDENT and pinned by ``session``."""
        with self._cond:
            state = self.slots.state(key)
            pinned = session.pins(key) > 0
            if state is not SlotState.RESIDENT or not pinned:
                raise SlotNotReadable(
                    f"expert {key} is {state.value} and {'pinned' if pinned else 'not pinned'} by this stream: "
                    "a slot is readable only while RESIDENT and pinned"
                )
            return self._arena.slots[self.slots.slot(key)]

    # -- introspection ------------------------------------------------------------------
    def describe(self, key: ExpertKey) -> SlotInfo:
        with self._cond:
            state = self.slots.state(key)
            load = self.queue.get(key)
            priority = None
            if isinstance(load, Load):
                # The native reader's own view when the read is submitted (what it serves by).
                native = load.handle.state if load.handle is not None else None
                priority = Priority(native["priority"]) if native else load.priority
            return SlotInfo(
                key,
                state,
                self.slots.slot(key) if state is not SlotState.ABSENT else -1,
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
            return ResidencyStats(
                num_slots=self.num_slots,
                resident=sum(1 for _k, s in occupied.values() if s is SlotState.RESIDENT),
                loading=sum(1 for _k, s in occupied.values() if s is SlotState.LOADING),
                pinned=sum(1 for k, _s in occupied.values() if self.slots.pins(k) > 0),
                sessions=len(self._sessions),
                shm_hits=self._table.hits,
                prefetching=self.queue.prefetching(),
                inflight_bytes=self.queue.inflight_bytes,
                demands_waiting=self.demand_waiting,
                hints_dropped=self.intake.hints_dropped,
            )

    def shutdown(self) -> None:
        """Wake and fail every waiting Acquire (``ShuttingDown``), then stop the prefetcher, the
        unpin watcher and the I/O threads."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            self._watch.notify_all()
            servers = list(self._channels.values())
        for server in servers:
            server.wake()
        for server in servers:
            server.join(5.0)
        self._table.wake_unpin_waiters()
        if self._watcher is not threading.current_thread():
            self._watcher.join()
        self._prefetcher.close()
        self._loader.shutdown()

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
