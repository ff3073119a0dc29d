"""The device slot table and the demand logic: which expert is in which arena slot, who pins it.

Glossary (worked example: an arena of 4 slots; stream A sends ``Acquire(layer=1, experts=[0, 5])``
while L1E0 is already in slot 2 and L1E5 is nowhere):

- *entry*: the slot-table row of one ``ExpertKey``: state, slot, generation, holders.
- *state*: ``ABSENT`` (in no slot) → ``LOADING`` (slot reserved; an I/O thread is writing it) →
  ``RESIDENT`` (the slot holds the checksum-verified blob). A failed load goes back to ABSENT.
- *pin*: a session's (Demand stream's) claim on a key, counted per session. A key with pins is
  never evicted and its slot never overwritten; a slot is readable only RESIDENT and pinned.
- *generation*: incremented each time the key is loaded into a slot, so two residencies of the
  same key can be told apart.
- *admission*: the one step in which an Acquire pins its resident keys and reserves slots for
  its missing ones — all of them, or nothing.

::

    acquire(A, layer 1, [0, 5])
      admit (under the lock, all or nothing):
        L1E0 RESIDENT slot 2 → pin for A                     → yield Ready(L1E0, 2, DEVICE) now
        L1E5 ABSENT          → free slot 0 (or evict the least recently used RESIDENT key
                               with no pins) → LOADING, pin for A, submit load to the I/O pool
      I/O thread: host tier has L1E5? copy host slot → arena slot 0              (source HOST)
                  else read store → host slot (CRC-32) → copy to arena slot 0    (source STORE)
        → RESIDENT, notify                                   → yield Ready(L1E5, 0, source)
    release(A, [L1E0, L1E5]) → no pins left → both evictable

Why it never deadlocks: an Acquire takes nothing until everything it needs is available at
once (resident keys, keys already loading, and free-or-evictable slots for the rest), so two
Acquires never each hold part of what the other waits for. A wait ends when another stream
releases or closes, or after ``acquire_timeout_s`` (``AcquireTimeout``). An Acquire that could
never be admitted while its own stream keeps its pins is refused at once (``BadAcquire``): a
layer with more experts than slots is processed in waves (acquire ≤ ``num_slots``, run,
release, acquire the next). Two streams that demand the same missing key share one load.

Shared slot table (the compute fast path). Every transition above is mirrored into the native
``expertcache.native.SlotTable`` (one entry per ``(layer, expert)``, index
``layer * num_experts + expert``) that compute maps: slot reserved → ``begin_load``, load done →
``finish_load``, load failed → ``abort_load``; eviction goes only through ``try_evict``, which
fails while compute holds a pin there (*shm pin*), and the policy then picks another victim.
Compute pins RESIDENT entries itself (no RPC) and sends a Demand only for the others. Its shm
accesses reach the policy as the table's access stamps, fed in stamp order before each
admission, so LRU stays LRU. A compute process gets a client ledger at Attach
(``claim_client``), ties it to its Demand stream (``bind_client``); when that stream ends the
ledger's pins are reclaimed (``SlotTable.reclaim_client``), so a killed compute process never
leaves slots pinned. The protocol is in ``csrc/include/expertcache/slot_table.h``.

Prefetch (DESIGN §2). A worker thread, woken through the same condition variable whenever the
predictions change (compute's ``Route`` / ``LayerAhead`` messages, new predictor hints), a load
completes or a slot is freed — never polling — asks the shared ``PrefetchScheduler.decide`` what
to load ahead and starts each as a LOADING entry *without holders* (mirrored in the slot table
with ``begin_load``), read at its class's ``Priority`` on a separate pool of prefetch threads, so
a demand load never queues behind one::

    Route / LayerAhead / hints ─▶ ActivationSignals ─▶ worker: decide(self) ─▶ PrefetchStart
        (victim evicted if it is still evictable) → LOADING, no holders → RESIDENT, unused
    demand for a key a prefetch is loading   → joins that load, promotes it to DEMAND priority
    demand short of slots                    → cancels queued prefetches (their slots come free
                                               when the reads' issued chunks land; never awaited)
    prefetched key used before eviction      → used (accuracy); evicted unused → wasted

The worker stands aside while a demand waits for slots, so prefetch never takes a slot a demand
needs, and it evicts only through the same checks as a demand (no holders, ``try_evict``): a
pinned expert is never evicted or overwritten by prefetch either.

``cache_daemon.daemon.CacheDaemon`` wires the manifest, store, host tier, arena and
``Residency`` together; the gRPC servicer (``cache_daemon.server``) converts and delegates.
"""

from __future__ import annotations

import enum
import itertools
import logging
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from cache_daemon.errors import AcquireTimeout, BadAcquire, SessionClosed, ShuttingDown, SlotNotReadable
from cache_daemon.metrics import DaemonMetrics
from cache_daemon.policy import EvictionPolicy
from cache_daemon.prefetch import PrefetchClass, PrefetchConfig, PrefetchScheduler, PrefetchStart
from cache_daemon.signals import ActivationSignals
from cache_daemon.tiers.base import Tier
from cache_daemon.tiers.device import DeviceArena
from cache_daemon.tiers.host import HostTier
from cache_daemon.tiers.store import Priority, StoreReader, StoreReadHandle
from expertcache.errors import ExpertCacheError, FailedPrecondition, InvalidArgument, ResourceExhausted
from expertcache.keys import ExpertKey
from expertcache.manifest import StoreManifest
from expertcache.native import SlotTable

if TYPE_CHECKING:  # the board's module also holds the gRPC subscriber, which domain code never imports
    from cache_daemon.hints import HintBoard

# While an admission waits for slots, compute may drop shm pins without telling the daemon:
# the wait re-checks the shared table this often.
SHM_PIN_POLL_S = 0.005
# A client ledger claimed at Attach but never tied to a Demand stream is taken back after this
# long, when every ledger is in use (the client died between Attach and Demand).
UNBOUND_CLAIM_EXPIRY_S = 30.0

logger = logging.getLogger(__name__)

# The store read priority and the metric label of each prefetch class.
_PRIORITY = {PrefetchClass.LAYER_AHEAD: Priority.LAYER_AHEAD, PrefetchClass.EAMC: Priority.PREFETCH}
PREFETCH_KINDS = {PrefetchClass.LAYER_AHEAD: "layer_ahead", PrefetchClass.EAMC: "eamc"}


class _Cancelled(Exception):
    """A prefetch load was cancelled before its store read was submitted."""


class SlotState(enum.Enum):
    ABSENT = "absent"
    LOADING = "loading"
    RESIDENT = "resident"


@dataclass(frozen=True)
class Ready:
    """``key`` is RESIDENT in arena ``slot`` and pinned for the session; ``source`` is the tier it
    was found in when the Acquire arrived (DEVICE if already resident, else where its load read it)."""

    key: ExpertKey
    slot: int
    source: Tier


@dataclass(frozen=True)
class SlotInfo:
    """A snapshot of one entry of the slot table."""

    key: ExpertKey
    state: SlotState
    slot: int  # -1 when ABSENT
    pins: int
    generation: int
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


@dataclass(frozen=True)
class ClientLedger:
    """A client ledger of the shared slot table handed to one compute process at Attach."""

    index: int
    epoch: int


def table_entries(manifest: StoreManifest) -> int:
    """Entries of the shared slot table for ``manifest``: one per (decoder layer, expert)."""
    return manifest.num_layers * manifest.num_experts


class Session:
    """The pins of one Demand stream. Made by ``Residency.open_session``.

    A session's ``acquire`` and ``release`` calls must not overlap (a stream handles one
    request at a time); ``close_session`` may come from any thread at any time.
    """

    _ids = itertools.count(1)

    def __init__(self, name: str) -> None:
        self.id = next(Session._ids)
        self.name = name
        self.closed = False
        self.held: set[ExpertKey] = set()  # keys this session pins; guarded by the Residency lock
        self.ledger: int | None = None  # the client ledger tied to this stream (bind_client)

    def __repr__(self) -> str:
        return f"Session({self.id}, {self.name!r})"


@dataclass(eq=False)
class _Load:
    """One in-flight load of ``key`` into ``slot``; shared by every Acquire waiting for it.

    A prefetch load (``prefetch`` set) has no holders until a demand joins it; it can be
    promoted to demand priority, or cancelled while its read is still queued."""

    key: ExpertKey
    slot: int
    done: bool = False
    source: Tier = Tier.STORE
    error: BaseException | None = None
    prefetch: PrefetchClass | None = None  # None: started by a demand
    priority: Priority = Priority.DEMAND
    started: bool = False  # an I/O thread has taken it (set once, under the lock)
    handle: StoreReadHandle | None = None  # its store read, while one is submitted and unwaited
    cancelled: bool = False
    inflight: bool = False  # counted in the prefetch bytes in flight


@dataclass(eq=False)
class _Entry:
    key: ExpertKey
    state: SlotState = SlotState.ABSENT
    slot: int = -1
    generation: int = 0
    holders: dict[Session, int] = field(default_factory=dict)  # session -> pins
    load: _Load | None = None
    prefetched: PrefetchClass | None = None  # loaded by a prefetch and not used yet

    @property
    def pins(self) -> int:
        return sum(self.holders.values())


class Residency:
    """The device tier: the slot table over a ``DeviceArena`` and the demand logic.

    All state is guarded by one condition variable — the slot table, the policy, the
    activation signals and the prefetch scheduler alike; loads run on a private pool of
    ``io_threads`` threads (prefetch loads on a second pool of as many) and take the lock only
    to publish their result. It implements the scheduler's ``TierState`` for the worker.
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
        hints: HintBoard | None = None,
    ) -> None:
        """``executor`` runs the loads; by default a private pool of ``io_threads`` threads, shut
        down by ``shutdown``. One passed in is left running: its owner shuts it down. ``table`` is
        the shared slot table (``table_entries(manifest)`` entries, one per arena slot), all ABSENT;
        its owner removes the file.

        ``signals``: the predictions ``policy`` reads (``ActivationSignals(manifest.num_layers,
        manifest.num_experts)``, layers numbered as in Acquire); a fresh one when None.
        ``prefetch``: start prefetch loads; ``max_inflight_bytes`` bounds the bytes of loads in
        flight a prefetch may add to (0: four blobs); ``prefetch_config`` tunes the scheduler.
        ``hints``: the predictor's board, read when the worker wakes."""
        if arena.slot_bytes != manifest.blob_bytes:
            raise ValueError(
                f"arena slots of {arena.slot_bytes} bytes cannot hold blobs of {manifest.blob_bytes}"
            )
        if table.num_entries != table_entries(manifest) or table.num_slots != arena.num_slots:
            raise ValueError(
                f"slot table {table.path} has {table.num_entries} entries and {table.num_slots} slots; "
                f"expected {table_entries(manifest)} entries and {arena.num_slots} slots"
            )
        self._table = table
        self._num_experts = manifest.num_experts
        self._synced_clock = table.clock  # access stamps up to here are known to the policy
        self._ledgers: dict[
            int, tuple[Session | None, float]
        ] = {}  # claimed: index -> (bound session, claimed at)
        self._manifest = manifest
        self._arena = arena
        self._store = store
        self._host = host if host is not None and host.enabled else None
        self._policy = policy
        self._metrics = metrics
        self._timeout_s = acquire_timeout_s
        self._cond = threading.Condition()
        self._entries: dict[ExpertKey, _Entry] = {}
        self._owner: list[ExpertKey | None] = [None] * arena.num_slots  # slot -> key
        self._free: list[int] = list(range(arena.num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._sessions: set[Session] = set()
        self._closing = False
        self._owns_pool = executor is None
        self._pool = executor or ThreadPoolExecutor(
            max_workers=io_threads, thread_name_prefix="expertcache-io"
        )
        # Prefetch loads never occupy a demand I/O thread: a demand load never waits behind one.
        self._prefetch_pool = ThreadPoolExecutor(
            max_workers=io_threads, thread_name_prefix="expertcache-prefetch"
        )
        self._blob_bytes = manifest.blob_bytes
        self._moe_layers = frozenset(manifest.moe_layers)
        self.signals = signals or ActivationSignals(manifest.num_layers, manifest.num_experts)
        if (self.signals.num_layers, self.signals.num_experts) != (manifest.num_layers, manifest.num_experts):
            raise ValueError(
                f"signals cover {self.signals.num_layers} layers x {self.signals.num_experts} experts; the store "
                f"has {manifest.num_layers} x {manifest.num_experts}"
            )
        self._prefetch = prefetch
        self._max_inflight_bytes = max_inflight_bytes or 4 * manifest.blob_bytes
        self._scheduler = PrefetchScheduler(
            self.signals,
            policy,
            blob_bytes=manifest.blob_bytes,
            max_inflight_bytes=self._max_inflight_bytes,
            config=prefetch_config,
        )
        self._inflight_bytes = 0
        self._demand_waiting = 0  # admissions waiting for slots: prefetch stands aside
        self._dirty = True  # something the scheduler reads changed since its last decide
        self._hints = hints
        self._hint_batches = -1  # hint batches already passed to the signals
        self._worker = threading.Thread(
            target=self._prefetch_loop, name="expertcache-prefetcher", daemon=True
        )
        self._worker.start()

    @property
    def num_slots(self) -> int:
        return self._arena.num_slots

    # -- TierState (read by the prefetch scheduler, under the lock) ---------------------
    @property
    def free_slots(self) -> int:
        # While a demand waits for slots, none is free for prefetch.
        return 0 if self._demand_waiting else len(self._free)

    @property
    def inflight_bytes(self) -> int:
        return self._inflight_bytes

    def is_resident(self, key: ExpertKey) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.state is SlotState.RESIDENT

    def is_loading(self, key: ExpertKey) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.state is SlotState.LOADING

    def evictable(self, key: ExpertKey) -> bool:
        entry = self._entries.get(key)
        return (
            not self._demand_waiting
            and entry is not None
            and entry.state is SlotState.RESIDENT
            and not entry.holders
            and self._table.pins(self._index(key)) == 0
        )

    # -- live settings ------------------------------------------------------------------
    @property
    def policy(self) -> EvictionPolicy:
        return self._policy

    def set_policy(self, policy: EvictionPolicy) -> None:
        """Switch the device tier's eviction policy at runtime, losing nothing.

        ``policy`` (fresh, over ``self.signals``) is seeded with every resident expert, in the
        old policy's eviction order (best victim first = oldest), so each stays resident and
        ranked; pins are the tier's, untouched; loads in flight complete and are inserted into
        the new policy when they do."""
        if getattr(policy, "signals", None) not in (None, self.signals):
            raise ValueError(f"policy {policy.name!r} reads other ActivationSignals than this tier's")
        with self._cond:
            self._sync_recency_locked()  # the old policy's order is complete before it is read
            resident = [key for key in self._owner if key is not None and self.is_resident(key)]
            order = self._policy.choose_victims(len(resident), lambda k: True)
            ranked = set(order)
            seed = order + [key for key in resident if key not in ranked]
            policy.seed(key for key in seed if self.is_resident(key))
            old, self._policy = self._policy, policy
            self._scheduler.set_policy(policy)
            self._kick_locked()
        logger.info("eviction policy %s -> %s (%d resident experts kept)", old.name, policy.name, len(seed))

    def configure_prefetch(
        self, *, enabled: bool, max_inflight_bytes: int, config: PrefetchConfig | None = None
    ) -> None:
        """Turn prefetch on/off and retune it at runtime (loads already started complete)."""
        if max_inflight_bytes < 0:
            raise ValueError(f"max_inflight_bytes must be >= 0, got {max_inflight_bytes}")
        with self._cond:
            self._prefetch = enabled
            self._max_inflight_bytes = max_inflight_bytes or 4 * self._blob_bytes
            self._scheduler.max_inflight_bytes = self._max_inflight_bytes
            if config is not None:
                self._scheduler.config = config
            self._kick_locked()

    @property
    def prefetch_enabled(self) -> bool:
        return self._prefetch

    def set_hint_board(self, board: HintBoard | None) -> None:
        """Read predictor hints from ``board`` from now on."""
        with self._cond:
            self._hints, self._hint_batches = board, -1
            self._kick_locked()

    # -- prediction inputs (compute's one-way messages) ---------------------------------
    def begin_request(self, request_id: str) -> None:
        with self._cond:
            self.signals.begin_request(request_id)
            self._kick_locked()
        self._metrics.signals.inc(kind="request_begin")

    def end_request(self, request_id: str) -> None:
        with self._cond:
            self.signals.end_request(request_id)
            self._kick_locked()
        self._metrics.signals.inc(kind="request_end")

    def observe(self, request_id: str, token: int, layer: int, experts: Iterable[int]) -> None:
        """Layer ``layer`` of token ``token`` was routed to ``experts`` (hits included).
        ``InvalidArgument`` naming the value if the layer or an expert is not in the store."""
        ex = self._check_prediction("Route", layer, experts)
        with self._cond:
            if request_id and request_id != self.signals.request_id:
                self.signals.begin_request(request_id)  # its RequestBegin was lost
            self.signals.observe(layer, ex, int(token))  # in use now: never a prefetch victim
            self._kick_locked()
        self._metrics.signals.inc(kind="route")

    def layer_ahead(self, token: int, layer: int, experts: Iterable[int], scores: Iterable[float]) -> None:
        """Compute's prediction of layer ``layer`` of token ``token`` with router probabilities."""
        ex = self._check_prediction("LayerAhead", layer, experts, unique=False)
        sc = np.asarray(list(scores), dtype=np.float32)
        if sc.shape != ex.shape:
            raise InvalidArgument(
                f"LayerAhead for layer {layer} has {ex.size} experts but {sc.size} scores: they must pair up"
            )
        if not np.isfinite(sc).all():
            raise InvalidArgument(f"LayerAhead scores must be finite probabilities, got {sc.tolist()}")
        # Router outputs are probabilities up to rounding (and bias-corrected scores may stray):
        # a prediction is a hint, so clamp rather than fail compute's stream over it.
        sc = np.clip(sc, 0.0, 1.0)
        with self._cond:
            self.signals.set_layer_ahead(layer, ex, sc, int(token))
            self._kick_locked()
        self._metrics.signals.inc(kind="layer_ahead")

    def _check_prediction(
        self, what: str, layer: int, experts: Iterable[int], *, unique: bool = True
    ) -> np.ndarray:
        layer = int(layer)
        if layer not in self._moe_layers:
            raise InvalidArgument(
                f"{what} names layer {layer}, which is not a MoE layer of the store "
                f"(MoE layers: {sorted(self._moe_layers)})"
            )
        ex = np.asarray([int(e) for e in experts], dtype=np.int64)
        bad = ex[(ex < 0) | (ex >= self._num_experts)]
        if bad.size:
            raise InvalidArgument(
                f"{what} for layer {layer} names expert {int(bad[0])}; the store has experts 0..{self._num_experts - 1}"
            )
        if not unique and np.unique(ex).size != ex.size:
            raise InvalidArgument(f"{what} for layer {layer} names an expert twice: {ex.tolist()}")
        return np.unique(ex) if unique else ex

    # -- the prefetch worker ------------------------------------------------------------
    def _kick_locked(self) -> None:
        """Something the scheduler reads changed: wake the worker (and every waiter)."""
        self._dirty = True
        self._cond.notify_all()

    def _prefetch_loop(self) -> None:
        while True:
            with self._cond:
                while not self._closing and not (self._dirty and self._prefetch and not self._demand_waiting):
                    self._cond.wait()  # no timeout: every change notifies
                if self._closing:
                    return
                self._dirty = False
                try:
                    self._prefetch_locked()
                except Exception:  # noqa: BLE001 - a scheduling bug must not stop serving demands
                    logger.exception("prefetch decision failed; demands are unaffected")

    def run_prefetch(self) -> int:
        """Decide and start prefetches now, in the calling thread (what the worker does when
        woken); returns the number of loads started. Nothing while prefetch is off or a demand
        waits for slots."""
        with self._cond:
            if not self._prefetch or self._demand_waiting or self._closing:
                return 0
            return self._prefetch_locked()

    def _prefetch_locked(self) -> int:
        self._sync_recency_locked()
        self._take_hints_locked()
        started = 0
        for start in self._scheduler.decide(self):
            started += self._start_prefetch_locked(start)
        return started

    def _take_hints_locked(self) -> None:
        """Pass the predictor's hints to the signals when the board got a new batch."""
        board = self._hints
        if board is None:
            return
        batches = board.stats().batches
        if batches == self._hint_batches:
            return
        self._hint_batches = batches
        moe_layers = self._manifest.moe_layers
        best: dict[tuple[int, int], float] = {}
        for layers in board.snapshot().values():
            for index, hints in layers.items():
                if not 0 <= index < len(moe_layers):
                    continue  # hints name MoE layer indices (manifest order); ignore a foreign one
                for expert, score in hints:
                    if 0 <= expert < self._num_experts:
                        key = (moe_layers[index], int(expert))
                        best[key] = max(best.get(key, 0.0), float(score))
        if best:
            self.signals.set_hints(
                ((layer, expert, score) for (layer, expert), score in best.items()), self.signals.position[0]
            )

    def _start_prefetch_locked(self, start: PrefetchStart) -> bool:
        """Execute one decision if the tier still allows it (a victim must still be evictable)."""
        entry = self._entries.setdefault(start.key, _Entry(start.key))
        if entry.state is not SlotState.ABSENT:
            self._scheduler.on_done(start.key)
            return False
        if start.victim is not None and not self._free:
            if not self.evictable(start.victim) or not self._table.try_evict(self._index(start.victim)):
                self._scheduler.on_done(start.key)  # pinned meanwhile: never displaced
                return False
            self._evict_locked(start.victim)
        if not self._free:
            self._scheduler.on_done(start.key)
            return False
        self._start_load_locked(entry, prefetch=start.cls)
        return True

    @property
    def table(self) -> SlotTable:
        return self._table

    def _index(self, key: ExpertKey) -> int:
        return key.entry(self._num_experts)

    def _key_of(self, index: int) -> ExpertKey:
        return ExpertKey.of_entry(index, self._num_experts)

    # -- client ledgers (shm pins of compute processes) ----------------------------------
    def claim_client(self) -> ClientLedger:
        """A free client ledger for an attaching compute process (``ResourceExhausted`` if none)."""
        with self._cond:
            now = time.monotonic()
            free = next((i for i in range(self._table.num_clients) if i not in self._ledgers), None)
            if free is None:
                # A ledger claimed long ago and never tied to a stream: its client died after Attach.
                free = next(
                    (
                        i
                        for i, (bound, since) in sorted(self._ledgers.items())
                        if bound is None and now - since > UNBOUND_CLAIM_EXPIRY_S
                    ),
                    None,
                )
                if free is None:
                    raise ResourceExhausted(
                        f"all {self._table.num_clients} client ledgers of slot table {self._table.path} are in "
                        "use by attached compute processes; detach one or attach with the shm fast path off"
                    )
                logger.warning(
                    "taking back client ledger %d, claimed %.0fs ago and never used",
                    free,
                    now - self._ledgers[free][1],
                )
                self._table.reclaim_client(free)
            self._ledgers[free] = (None, now)
            return ClientLedger(free, self._table.client_epoch(free))

    def bind_client(self, session: Session, ledger: ClientLedger) -> None:
        """Tie ``ledger`` (claimed at Attach) to ``session``: when the session closes, the
        ledger's shm pins are reclaimed. ``FailedPrecondition`` if it is not claimed, bound
        elsewhere, or at another epoch."""
        with self._cond:
            self._check_open(session)
            claim = self._ledgers.get(ledger.index)
            epoch = (
                self._table.client_epoch(ledger.index)
                if 0 <= ledger.index < self._table.num_clients
                else None
            )
            if claim is None or claim[0] is not None or epoch != ledger.epoch or session.ledger is not None:
                raise FailedPrecondition(
                    f"client ledger {ledger.index} (epoch {ledger.epoch}) is not an unused ledger claimed at "
                    f"Attach (current epoch {epoch}): Attach again before opening a Demand stream"
                )
            self._ledgers[ledger.index] = (session, claim[1])
            session.ledger = ledger.index

    def _sync_recency_locked(self) -> None:
        """Feed the policy the accesses compute made through the table since the last sync."""
        clock = self._table.clock
        if clock == self._synced_clock:
            return
        for index in self._table.accessed_since(self._synced_clock):
            entry = self._entries.get(self._key_of(index))
            if entry is not None and entry.state is SlotState.RESIDENT:
                self._policy.on_access(entry.key)
                self._mark_used_locked(entry)
        self._synced_clock = clock

    def _mark_used_locked(self, entry: _Entry) -> None:
        """``entry`` was used (acquired, joined, pinned by compute): a prefetch of it paid off."""
        if entry.prefetched is not None:
            self._metrics.prefetch_used.inc(kind=PREFETCH_KINDS[entry.prefetched])
            entry.prefetched = None

    # -- sessions -----------------------------------------------------------------------
    def open_session(self, name: str = "") -> Session:
        session = Session(name)
        with self._cond:
            if self._closing:
                raise ShuttingDown("the cache daemon is shutting down")
            self._sessions.add(session)
        return session

    def close_session(self, session: Session) -> None:
        """Drop every pin ``session`` holds and end it. Idempotent; any thread."""
        with self._cond:
            if session.closed:
                return
            session.closed = True
            for key in session.held:
                self._entries[key].holders.pop(session, None)
            session.held.clear()
            self._sessions.discard(session)
            ledger, session.ledger = session.ledger, None
            self._kick_locked()
        if ledger is not None:
            # Outside the lock: reclaim may wait (bounded) for a client inside a pin call.
            removed = self._table.reclaim_client(ledger)
            with self._cond:
                del self._ledgers[ledger]
                self._cond.notify_all()
            if removed:
                logger.info("reclaimed %d shm pin(s) of client ledger %d (%s)", removed, ledger, session)

    # -- acquire ------------------------------------------------------------------------
    def acquire(
        self, session: Session, layer: int, experts: Iterable[int], timeout_s: float | None = None
    ) -> Iterator[Ready]:
        """Pin ``layer``'s ``experts`` for ``session``, yielding a ``Ready`` per expert as it is ready.

        Already-resident experts come first (in request order), then the others as their loads
        complete. Each Ready is one pin the session holds until ``release`` or
        ``close_session``; if the iterator ends early (error, timeout, ``close()``), pins of
        experts not yet yielded are dropped. The arguments are checked now (``BadAcquire`` /
        ``InvalidArgument`` naming the value); waiting happens while iterating, bounded by
        ``timeout_s`` (default ``acquire_timeout_s``) → ``AcquireTimeout``. A failed load raises
        its ``DataLoss`` in every Acquire waiting for it.
        """
        experts = [int(e) for e in experts]
        if len(experts) > self.num_slots:
            raise BadAcquire(
                f"Acquire for layer {layer} names {len(experts)} experts but the arena has {self.num_slots} "
                f"slots: acquire them in waves of at most {self.num_slots} (release each wave first)"
            )
        seen: set[int] = set()
        keys = []
        for expert in experts:
            if expert in seen:
                raise BadAcquire(f"Acquire for layer {layer} names expert {expert} more than once")
            seen.add(expert)
            key = ExpertKey(int(layer), expert)
            self._manifest.check_key(key)
            keys.append(key)
        self._metrics.demands.inc()
        timeout = self._timeout_s if timeout_s is None else timeout_s
        return self._acquire(session, int(layer), keys, time.monotonic() + timeout, timeout)

    def _acquire(
        self, session: Session, layer: int, keys: list[ExpertKey], deadline: float, timeout: float
    ) -> Iterator[Ready]:
        with self._cond:
            waiting = False
            try:
                while True:
                    self._check_open(session)
                    admitted = self._try_admit(session, layer, keys)
                    if admitted is not None:
                        ready, pending = admitted
                        break
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise AcquireTimeout(self._timeout_message_locked(layer, keys, timeout))
                    if not waiting:
                        waiting = True
                        self._demand_waiting += 1  # the prefetcher takes no slot meanwhile
                    # Shm unpins wake nobody: poll the table while waiting.
                    self._cond.wait(min(remaining, SHM_PIN_POLL_S))
            finally:
                if waiting:
                    self._demand_waiting -= 1
                    self._kick_locked()
        unyielded = {item.key for item in ready} | set(pending)
        try:
            for item in ready:
                unyielded.discard(item.key)  # suspended at the yield = the caller has it
                yield item
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
                    yield Ready(key, load.slot, load.source)
        finally:
            if unyielded:
                # Never handed out: the caller cannot know to release these pins, so drop them.
                with self._cond:
                    for key in unyielded:
                        self._drop_pin_locked(session, key)
                    self._cond.notify_all()

    def _check_open(self, session: Session) -> None:
        if self._closing:
            raise ShuttingDown("the cache daemon is shutting down")
        if session.closed:
            raise SessionClosed(f"Demand session {session.name or session.id} is closed")

    def _try_admit(
        self, session: Session, layer: int, keys: list[ExpertKey]
    ) -> tuple[list[Ready], dict[ExpertKey, _Load]] | None:
        """Pin everything ``keys`` needs and start its loads, or take nothing and return None."""
        wanted = set(keys)
        held_elsewhere = len(session.held - wanted)
        if held_elsewhere + len(keys) > self.num_slots:
            raise BadAcquire(
                f"Acquire of {len(keys)} experts for layer {layer} can never fit: this stream still pins "
                f"{held_elsewhere} other experts and the arena has {self.num_slots} slots; release them first"
            )
        self._sync_recency_locked()
        entries = [self._entries.setdefault(key, _Entry(key)) for key in keys]
        if any(e.load is not None and e.load.cancelled for e in entries):
            return None  # a cancelled prefetch of a key still holds its slot: wait until it lets go
        missing = [e for e in entries if e.state is SlotState.ABSENT]
        refused: set[ExpertKey] = set()  # victims whose try_evict lost to a compute shm pin
        table = self._table
        while (need := len(missing) - len(self._free)) > 0:
            victims = self._policy.choose_victims(
                need,
                lambda k: (
                    k not in wanted
                    and k not in refused
                    and self._entries[k].state is SlotState.RESIDENT
                    and not self._entries[k].holders
                    and table.pins(self._index(k)) == 0
                ),
            )
            if len(victims) < need:
                # Short of slots: queued prefetches give way. A cancelled one frees its slot now,
                # or once the chunks its read already issued land; the admission is retried.
                if self._cancel_prefetches_locked(need - len(victims), wanted):
                    continue  # some slots came free at once: choose again
                return None  # nothing taken; slots freed by earlier rounds simply stay free
            for victim in victims:
                if table.try_evict(self._index(victim)):
                    self._evict_locked(victim)
                else:
                    refused.add(victim)  # compute pinned it between the check and the evict
        # Admitted: from here on nothing can fail.
        ready: list[Ready] = []
        pending: dict[ExpertKey, _Load] = {}
        for entry in entries:
            entry.holders[session] = entry.holders.get(session, 0) + 1
            session.held.add(entry.key)
            self._mark_used_locked(entry)
            self._scheduler.on_demand(entry.key)
            if entry.state is SlotState.RESIDENT:
                self._metrics.hits.inc(tier=Tier.DEVICE.value)
                self._policy.on_access(entry.key)
                ready.append(Ready(entry.key, entry.slot, Tier.DEVICE))
            else:
                self._metrics.misses.inc(tier=Tier.DEVICE.value)
                if entry.state is SlotState.LOADING:
                    assert entry.load is not None
                    self._promote_locked(entry.load)
                    pending[entry.key] = entry.load
                else:
                    pending[entry.key] = self._start_load_locked(entry)
        return ready, pending

    def _promote_locked(self, load: _Load) -> None:
        """A demand joined prefetch ``load``: from now on it is read at demand priority."""
        if load.prefetch is None or load.priority is Priority.DEMAND:
            return
        load.priority = Priority.DEMAND
        self._metrics.prefetch_promoted.inc(kind=PREFETCH_KINDS[load.prefetch])
        if not load.started:
            # Still queued behind other prefetches: a demand I/O thread takes it now (whichever
            # thread starts it first runs it, the other finds it started and returns).
            self._submit_locked(self._pool, load)
        elif load.handle is not None:
            load.handle.promote(Priority.DEMAND)

    def _uncount_locked(self, load: _Load) -> None:
        if load.inflight:
            load.inflight = False
            self._inflight_bytes -= self._blob_bytes

    def _cancel_prefetches_locked(self, n: int, wanted: set[ExpertKey]) -> int:
        """Cancel up to ``n`` queued prefetch loads no demand holds; returns the slots freed now.

        Lowest class first (EAMC before layer-ahead), unstarted before started. A load whose read
        is submitted loses only its unissued chunks: its slot comes free when the read ends."""
        candidates = []
        for key in self._scheduler.cancel_candidates(self):  # lowest class and score first
            entry = self._entries.get(key)
            load = entry.load if entry is not None else None
            if (
                load is not None
                and load.prefetch is not None
                and load.priority is not Priority.DEMAND
                and not load.cancelled
                and not entry.holders
                and key not in wanted
            ):
                candidates.append(load)
        candidates.sort(key=lambda ld: ld.started)  # stable: unstarted first, same order otherwise
        freed = cancelled = 0
        for load in candidates:
            if cancelled >= n:
                break
            if not load.started:
                load.cancelled = True
                self._drop_cancelled_locked(load)
                freed += 1
            elif load.handle is not None and load.handle.cancel():
                load.cancelled = True  # the I/O thread's wait ends with it; the slot frees then
            else:
                continue  # every chunk already issued: it completes soon anyway
            cancelled += 1
            self._metrics.prefetch_cancelled.inc(kind=PREFETCH_KINDS[load.prefetch])
        return freed

    def _drop_cancelled_locked(self, load: _Load) -> None:
        """A cancelled prefetch load lets go of its slot (no holder waits for it)."""
        entry = self._entries[load.key]
        assert entry.load is load and not entry.holders
        entry.state, entry.slot, entry.load, entry.prefetched = SlotState.ABSENT, -1, None, None
        self._table.abort_load(self._index(load.key))
        self._owner[load.slot] = None
        self._free.append(load.slot)
        self._uncount_locked(load)
        self._scheduler.on_dropped(load.key)
        load.done = True
        self._kick_locked()

    def _evict_locked(self, key: ExpertKey) -> None:
        entry = self._entries[key]
        assert entry.state is SlotState.RESIDENT and not entry.holders, f"evicting {key} in {entry}"
        if entry.prefetched is not None:
            self._metrics.prefetch_wasted.inc(kind=PREFETCH_KINDS[entry.prefetched])
            entry.prefetched = None
        self._owner[entry.slot] = None
        self._free.append(entry.slot)
        entry.state, entry.slot = SlotState.ABSENT, -1
        self._policy.on_remove(key)
        self._metrics.evictions.inc(tier=Tier.DEVICE.value)

    def _start_load_locked(self, entry: _Entry, prefetch: PrefetchClass | None = None) -> _Load:
        slot = self._free.pop()
        assert self._owner[slot] is None
        self._owner[slot] = entry.key
        entry.state, entry.slot = SlotState.LOADING, slot
        entry.generation += 1
        self._table.begin_load(self._index(entry.key), slot)
        load = entry.load = _Load(entry.key, slot, inflight=True)
        self._inflight_bytes += self._blob_bytes
        if prefetch is None:
            self._submit_locked(self._pool, load)
        else:
            load.prefetch, load.priority = prefetch, _PRIORITY[prefetch]
            entry.prefetched = prefetch
            self._metrics.prefetch_started.inc(kind=PREFETCH_KINDS[prefetch])
            self._submit_locked(self._prefetch_pool, load)
        return load

    def _submit_locked(self, pool: Executor, load: _Load) -> None:
        try:
            pool.submit(self._run_load, load)
        except RuntimeError as exc:  # the I/O pool is shut down
            if not load.started and not load.done:
                self._fail_load_locked(load, ShuttingDown(f"cannot load expert {load.key}: {exc}"))

    def _fail_load_locked(self, load: _Load, error: BaseException) -> None:
        """Back to ABSENT: free the slot, drop every pin on the key, wake the waiters with ``error``."""
        entry = self._entries[load.key]
        assert entry.load is load
        for session in entry.holders:
            session.held.discard(load.key)
        entry.holders.clear()
        entry.state, entry.slot, entry.load, entry.prefetched = SlotState.ABSENT, -1, None, None
        self._table.abort_load(self._index(load.key))
        self._owner[load.slot] = None
        self._free.append(load.slot)
        self._uncount_locked(load)
        self._scheduler.on_done(load.key)
        load.error, load.done = error, True
        self._kick_locked()

    def _pinned_locked(self, key: ExpertKey) -> bool:
        return bool(self._entries[key].holders) or self._table.pins(self._index(key)) > 0

    def _timeout_message_locked(self, layer: int, keys: list[ExpertKey], timeout: float) -> str:
        pinned = sum(1 for key in self._owner if key is not None and self._pinned_locked(key))
        loading = sum(
            1 for key in self._owner if key is not None and self._entries[key].state is SlotState.LOADING
        )
        missing = sum(1 for key in keys if self._entries[key].state is SlotState.ABSENT)
        return (
            f"timed out after {timeout:.3g}s (acquire_timeout_s) waiting for {missing} free slot(s) for "
            f"layer {layer}: {pinned} of {self.num_slots} slots are pinned ({loading} loading) by "
            f"{len(self._sessions)} stream(s)"
        )

    # -- loads (I/O threads) ------------------------------------------------------------
    def _run_load(self, load: _Load) -> None:
        with self._cond:
            if load.started or load.done:
                return  # promoted: the other pool's thread runs it (or it was cancelled unstarted)
            load.started = True
        try:
            source = self._fill(load)
        except BaseException as exc:  # noqa: BLE001 - every failure must free the slot and wake waiters
            with self._cond:
                if load.cancelled:
                    self._drop_cancelled_locked(load)
                    return
                logger.warning("loading expert %s into slot %d failed: %s", load.key, load.slot, exc)
                self._fail_load_locked(load, exc)
            return
        self._metrics.bytes_in.inc(self._arena.slot_bytes, tier=Tier.DEVICE.value)
        with self._cond:
            entry = self._entries[load.key]
            assert entry.load is load and entry.slot == load.slot
            entry.state, entry.load = SlotState.RESIDENT, None
            self._table.finish_load(self._index(load.key))
            self._policy.on_insert(load.key)
            self._uncount_locked(load)
            self._scheduler.on_done(load.key)
            load.source, load.done = source, True
            self._kick_locked()

    def _read(self, load: _Load, out: torch.Tensor | memoryview) -> None:
        """Read ``load.key``'s blob into ``out`` at the load's priority, cancellable meanwhile."""
        with self._cond:
            if load.cancelled:
                raise _Cancelled(f"prefetch of {load.key} cancelled")
            handle = load.handle = self._store.submit(load.key, out, load.priority)
        try:
            handle.wait()
        finally:
            with self._cond:
                load.handle = None

    def _fill(self, load: _Load) -> Tier:
        """Write ``load.key``'s verified blob into arena slot ``load.slot``; returns the tier it
        came from."""
        key, slot = load.key, load.slot
        host = self._host
        if host is not None:
            if host.pin(key):
                self._metrics.hits.inc(tier=Tier.HOST.value)
                try:
                    self._arena.copy_in(slot, host.get(key))
                finally:
                    host.unpin(key)
                return Tier.HOST
            self._metrics.misses.inc(tier=Tier.HOST.value)
            view = host.put_from(key, lambda buf: self._read(load, buf))
            if view is not None:
                try:
                    self._arena.copy_in(slot, view)
                finally:
                    host.unpin(key)
                return Tier.STORE
            # Every host slot is pinned by concurrent loads: skip the host tier this time.
        direct = self._arena.host_buffer(slot)
        if direct is not None:
            self._read(load, direct)  # the slot is LOADING: nobody can read it yet
        else:
            staging = self._arena.staging_buffer()
            self._read(load, staging)
            self._arena.copy_in(slot, staging)
        return Tier.STORE

    # -- release / read -----------------------------------------------------------------
    def release(self, session: Session, keys: Iterable[ExpertKey]) -> None:
        """Drop one pin per key. A key the session does not pin raises ``BadAcquire`` and
        releases nothing."""
        keys = list(keys)
        with self._cond:
            self._check_open(session)
            counts: dict[ExpertKey, int] = {}
            for key in keys:
                counts[key] = counts.get(key, 0) + 1
                entry = self._entries.get(key)
                held = entry.holders.get(session, 0) if entry is not None else 0
                if counts[key] > held:
                    raise BadAcquire(f"Release of expert {key}, which this stream does not pin")
            for key in keys:
                self._drop_pin_locked(session, key)
            self._kick_locked()

    def _drop_pin_locked(self, session: Session, key: ExpertKey) -> None:
        entry = self._entries.get(key)
        if entry is None or session not in entry.holders:
            return  # already dropped (the load failed, or the session was closed)
        if entry.holders[session] > 1:
            entry.holders[session] -= 1
        else:
            del entry.holders[session]
            session.held.discard(key)

    def read_slot(self, session: Session, key: ExpertKey) -> torch.Tensor:
        """``[blob_bytes]`` uint8 view of ``key``'s slot; only while RESIDENT and pinned by ``session``."""
        with self._cond:
            entry = self._entries.get(key)
            state = entry.state if entry is not None else SlotState.ABSENT
            pinned = entry is not None and session in entry.holders
            if state is not SlotState.RESIDENT or not pinned:
                raise SlotNotReadable(
                    f"expert {key} is {state.value} and {'pinned' if pinned else 'not pinned'} by this stream: "
                    "a slot is readable only while RESIDENT and pinned"
                )
            return self._arena.slots[entry.slot]

    # -- introspection ------------------------------------------------------------------
    def describe(self, key: ExpertKey) -> SlotInfo:
        with self._cond:
            entry = self._entries.get(key) or _Entry(key)
            pins = entry.pins + self._table.pins(self._index(key))
            priority = None
            if entry.load is not None:
                # The native reader's own view when the read is submitted (what it serves by).
                native = entry.load.handle.state if entry.load.handle is not None else None
                priority = Priority(native["priority"]) if native else entry.load.priority
            return SlotInfo(
                key, entry.state, entry.slot, pins, entry.generation, priority, entry.prefetched is not None
            )

    def slot_owner(self, slot: int) -> ExpertKey | None:
        with self._cond:
            return self._owner[slot]

    def stats(self) -> ResidencyStats:
        with self._cond:
            states = [self._entries[k].state for k in self._owner if k is not None]
            return ResidencyStats(
                num_slots=self.num_slots,
                resident=sum(1 for s in states if s is SlotState.RESIDENT),
                loading=sum(1 for s in states if s is SlotState.LOADING),
                pinned=sum(1 for k in self._entries if self._pinned_locked(k)),
                sessions=len(self._sessions),
                shm_hits=self._table.hits,
                prefetching=sum(
                    1
                    for k in self._owner
                    if k is not None
                    and (ld := self._entries[k].load) is not None
                    and ld.prefetch is not None
                    and ld.priority is not Priority.DEMAND
                ),
                inflight_bytes=self._inflight_bytes,
                demands_waiting=self._demand_waiting,
            )

    def shutdown(self) -> None:
        """Wake and fail every waiting Acquire (``ShuttingDown``), then stop the prefetcher and
        the I/O threads."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._worker is not threading.current_thread():
            self._worker.join()
        self._prefetch_pool.shutdown(wait=True, cancel_futures=True)
        if self._owns_pool:
            self._pool.shutdown(wait=True, cancel_futures=True)


def _fresh_error(error: BaseException, key: ExpertKey) -> BaseException:
    """A new exception for one waiter (one object raised in several threads would share a traceback)."""
    if isinstance(error, ExpertCacheError):
        return type(error)(str(error))
    return ExpertCacheError(f"loading expert {key} failed: {type(error).__name__}: {error}")


# -- the daemon as a whole ---------------------------------------------------------------
