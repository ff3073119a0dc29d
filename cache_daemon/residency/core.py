"""The device tier: acquire, release and admission over the arena's slots.

``Residency`` wires the parts (``slots``, ``clients``, ``loader``, ``prefetcher``) under one
condition variable and implements the scheduler's ``TierState``. Its state, each with one owner:

- entry state, slot, generation and every pin: the native slot table (``Slots``);
- free slots: ``Slots``' allocator;
- loads in flight, demand and prefetch: one ``PrefetchQueue`` of ``Load`` records;
- which session holds which pins (to give them back): each ``Session``;
- predictions: ``ActivationSignals``; eviction order: the policy.

Waiting is event-driven: an Acquire waiting for slots sleeps on the condition, woken by a
release, a finished or cancelled load, or (through the unpin watcher thread, asleep on the slot
table's futex word) compute dropping the last shared-memory pin of an entry; an Acquire waiting
for a load is woken when the load completes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from cache_daemon.decisions.policy import EvictionPolicy
from cache_daemon.decisions.scheduler import (
    DEFAULT_INFLIGHT_BLOBS,
    PrefetchClass,
    PrefetchConfig,
    PrefetchQueue,
    PrefetchScheduler,
    PrefetchStart,
)
from cache_daemon.decisions.signals import ActivationSignals, LayerPrediction
from cache_daemon.errors import AcquireTimeout, BadAcquire, SessionClosed, ShuttingDown, SlotNotReadable
from cache_daemon.metrics import DaemonMetrics
from cache_daemon.residency.channel import ChannelServer
from cache_daemon.residency.clients import ClientLedger, ClientLedgers, Recency, Session
from cache_daemon.residency.loader import PRIORITY, Load, Loader
from cache_daemon.residency.prefetcher import PREFETCH_KINDS, Prefetcher
from cache_daemon.residency.slots import Slots, SlotState
from cache_daemon.tiers.base import Tier
from cache_daemon.tiers.device import DeviceArena
from cache_daemon.tiers.host import HostTier
from cache_daemon.tiers.store import Priority, StoreReader
from expertcache.channel import GATHER_BELOW_BYTES
from expertcache.errors import ExpertCacheError, InvalidArgument
from expertcache.keys import ExpertKey
from expertcache.layers import LayerMap
from expertcache.manifest import StoreManifest
from expertcache.native import SlotTable

if TYPE_CHECKING:  # the board's module also holds the gRPC subscriber, which domain code never imports
    from cache_daemon.hints import HintBatch

logger = logging.getLogger(__name__)


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


@dataclass(frozen=True, eq=False)
class RouteSignal:
    """A checked Route (``Residency.check_route``): layer ``layer`` of token ``token`` was routed
    to ``experts`` (unique, sorted)."""

    request_id: str | None
    token: int
    layer: int
    experts: np.ndarray


@dataclass(frozen=True, eq=False)
class LookaheadSignal:
    """A checked LayerAhead (``Residency.check_layer_ahead``): one prediction per depth."""

    token: int
    predictions: tuple[LayerPrediction, ...]
    request_id: str | None


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


# How long closing a session waits for its channel's thread to end (it ends at its next check:
# an admission waiting for slots is woken by the close, a copy in progress finishes).
CHANNEL_JOIN_S = 10.0


def table_entries(manifest: StoreManifest) -> int:
    """Entries of the shared slot table for ``manifest``: one per (decoder layer, expert)."""
    return manifest.num_layers * manifest.num_experts


class Residency:
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
        self._policy = policy
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
        self._sessions: set[Session] = set()
        # The channel servers of the bound client ledgers, and which of them wait for which load.
        self._channels: dict[Session, ChannelServer] = {}
        self._client_waits: dict[ExpertKey, list[tuple[ChannelServer, int]]] = {}
        self._closing = False
        self.demand_waiting = 0  # admissions waiting for slots: prefetch stands aside
        self._unpin_seen: int | None = None  # the unpin word as the oldest waiting admission read it
        self._hints_dropped = 0
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
        self._max_inflight_bytes = max_inflight_bytes or DEFAULT_INFLIGHT_BLOBS * manifest.blob_bytes
        scheduler = PrefetchScheduler(
            self.signals,
            policy,
            blob_bytes=manifest.blob_bytes,
            max_inflight_bytes=self._max_inflight_bytes,
            config=prefetch_config,
        )
        self._prefetcher = Prefetcher(self, self._cond, scheduler, metrics, threading.Condition(self._lock))
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

    def set_slot_limit(self, limit: int) -> int:
        """Change how many of the arena's slots the cache may fill (the live device budget).

        Shrinking evicts the experts the policy ranks last until the rest fits; a pinned or
        loading expert is never evicted under its reader: its slot is reclaimed by later
        admissions once it is released. Growing lets more stay resident. Every expert that
        still fits stays. Returns how many were evicted now."""
        if not 1 <= limit <= self._arena.num_slots:
            raise ValueError(f"slot limit must be in [1, {self._arena.num_slots}], got {limit}")
        evicted = 0
        with self._cond:
            self.slots.limit = limit
            self.sync_recency()
            excess = self.slots.used - limit
            if excess > 0:
                for victim in self._policy.choose_victims(excess, self.slots.evictable):
                    if self.slots.try_evict(victim):
                        self._evicted(victim)
                        evicted += 1
            self._cond.notify_all()
            self._prefetcher.kick()
        return evicted

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

    def _update_signals_wanted(self) -> None:
        """Tell compute (the table's flag) whether routing and lookahead signals are used now:
        by a policy that reads them, or by prefetch. Without them compute writes none."""
        self._table.signals_wanted = bool(
            self._prefetcher.enabled or getattr(self._policy, "needs_signals", False)
        )

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

    def is_loading(self, key: ExpertKey) -> bool:
        return key in self.queue

    def evictable(self, key: ExpertKey) -> bool:
        return not self.demand_waiting and self.slots.evictable(key)

    @property
    def inflight_bytes(self) -> int:
        return self.queue.inflight_bytes

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
            self.sync_recency()  # the old policy's order is complete before it is read
            resident = [key for key, state in self.slots.occupied().values() if state is SlotState.RESIDENT]
            order = self._policy.choose_victims(len(resident), lambda k: True)
            ranked = set(order)
            seed = order + [key for key in resident if key not in ranked]
            policy.seed(key for key in seed if self.slots.is_resident(key))
            old, self._policy = self._policy, policy
            self._prefetcher.scheduler.set_policy(policy)
            self._update_signals_wanted()
            self._prefetcher.kick()
        logger.info("eviction policy %s -> %s (%d resident experts kept)", old.name, policy.name, len(seed))

    def configure_prefetch(
        self, *, enabled: bool, max_inflight_bytes: int, config: PrefetchConfig | None = None
    ) -> None:
        """Turn prefetch on/off and retune it at runtime (loads already started complete)."""
        if max_inflight_bytes < 0:
            raise ValueError(f"max_inflight_bytes must be >= 0, got {max_inflight_bytes}")
        with self._cond:
            self._prefetcher.enabled = enabled
            self._max_inflight_bytes = max_inflight_bytes or DEFAULT_INFLIGHT_BLOBS * self._blob_bytes
            self._prefetcher.scheduler.max_inflight_bytes = self._max_inflight_bytes
            if config is not None:
                self._prefetcher.scheduler.config = config
            self._update_signals_wanted()
            self._prefetcher.kick()

    def set_next_visit_model(self, model) -> None:
        """Swap the signals' learned next-visit model (None: the routing transitions) at runtime
        (``ActivationSignals.set_next_visit_model``; ``ValueError`` for a model of another shape,
        nothing changed)."""
        with self._cond:
            self.signals.set_next_visit_model(model)
            self._prefetcher.kick()

    @property
    def prefetch_enabled(self) -> bool:
        return self._prefetcher.enabled

    # -- prediction inputs (compute's one-way messages, the predictor's hints) -----------
    def begin_request(self, request_id: str) -> None:
        with self._cond:
            self.signals.begin_request(request_id)
            self._prefetcher.kick()
        self._metrics.signals.labels("request_begin").inc()

    def end_request(self, request_id: str) -> None:
        with self._cond:
            self.signals.end_request(request_id)
            self._prefetcher.kick()
        self._metrics.signals.labels("request_end").inc()

    def observe(self, request_id: str, token: int, layer: int, experts: Iterable[int]) -> None:
        """Decoder layer ``layer`` of token ``token`` was routed to ``experts`` (hits included).
        ``InvalidArgument`` naming the value if the layer or an expert is not in the store."""
        self.apply_signals([self.check_route(request_id, token, layer, experts)])

    def layer_ahead(
        self, token: int, predictions: Iterable[LayerPrediction], request_id: str | None = None
    ) -> None:
        """Compute's lookahead for token ``token`` of ``request_id`` (None: the request last
        routed): one prediction per depth, layers as in Acquire. ``InvalidArgument`` naming the
        value for a malformed one (nothing applied)."""
        self.apply_signals([self.check_layer_ahead(token, predictions, request_id)])

    def check_route(self, request_id: str, token: int, layer: int, experts: Iterable[int]) -> RouteSignal:
        """A Route checked against the store (``InvalidArgument`` naming the value), to apply."""
        ex = self._check_prediction("Route", layer, experts)
        return RouteSignal(request_id or None, int(token), int(layer), ex)

    def check_layer_ahead(
        self, token: int, predictions: Iterable[LayerPrediction], request_id: str | None = None
    ) -> LookaheadSignal:
        """A LayerAhead checked against the store (``InvalidArgument`` naming the value), to apply."""
        checked = []
        depths: set[int] = set()
        for pred in predictions:
            what = f"LayerAhead prediction at depth {pred.depth}"
            if not 1 <= int(pred.depth) <= self._layers.num_moe:
                raise InvalidArgument(
                    f"LayerAhead depth {pred.depth} is outside 1..{self._layers.num_moe} (the store's MoE layers)"
                )
            if int(pred.depth) in depths:
                raise InvalidArgument(f"LayerAhead names depth {pred.depth} twice")
            depths.add(int(pred.depth))
            ex = self._check_prediction(what, pred.layer, pred.experts, unique=False)
            sc = np.asarray(list(pred.scores), dtype=np.float32)
            if sc.shape != ex.shape:
                raise InvalidArgument(
                    f"{what} for layer {pred.layer} has {ex.size} experts but {sc.size} scores: they must pair up"
                )
            if not np.isfinite(sc).all():
                raise InvalidArgument(f"{what} scores must be finite probabilities, got {sc.tolist()}")
            # Router outputs are probabilities up to rounding (and bias-corrected scores may stray):
            # a prediction is a hint, so clamp rather than fail compute's stream over it.
            checked.append(LayerPrediction(int(pred.layer), int(pred.depth), ex, np.clip(sc, 0.0, 1.0)))
        return LookaheadSignal(int(token), tuple(checked), request_id)

    def apply_signals(self, signals: Iterable[RouteSignal | LookaheadSignal]) -> None:
        """Apply checked signals in order and wake the prefetcher once."""
        with self._cond:
            self._apply_signals_locked(signals)

    def apply_channel_ops(self, ops: Iterable[tuple[str, object]]) -> None:
        """A client channel's drained records, in order, in one hold of the lock: ``("begin",
        request_id)``, ``("end", request_id)``, ``("signal", RouteSignal | LookaheadSignal)``."""
        with self._cond:
            self._apply_channel_ops_locked(ops)

    def _apply_channel_ops_locked(self, ops: Iterable[tuple[str, object]]) -> None:
        """Under the lock: the prefetch worker's kick takes effect once the lock is released."""
        counts: dict[str, int] = {}
        applied = False
        for op, value in ops:
            applied = True
            if op == "begin":
                self.signals.begin_request(value)  # type: ignore[arg-type]
                kind = "request_begin"
            elif op == "end":
                self.signals.end_request(value)  # type: ignore[arg-type]
                kind = "request_end"
            else:
                self._apply_signals_locked((value,), kick=False)  # type: ignore[arg-type]
                continue
            counts[kind] = counts.get(kind, 0) + 1
        if applied:
            self._prefetcher.kick()
        for kind, n in counts.items():
            self._metrics.signals.labels(kind).inc(n)

    def _apply_signals_locked(
        self, signals: Iterable[RouteSignal | LookaheadSignal], kick: bool = True
    ) -> None:
        applied = False
        for sig in signals:
            if isinstance(sig, RouteSignal):
                self.signals.observe(sig.layer, sig.experts, sig.token, sig.request_id)
                self._metrics.signals.labels("route").inc()
            else:
                self.signals.set_lookahead(list(sig.predictions), sig.token, sig.request_id)
                self._metrics.signals.labels("layer_ahead").inc()
            applied = True
        if applied and kick:
            self._prefetcher.kick()

    def apply_hints(self, batch: HintBatch) -> None:
        """A predictor hint batch (pushed by the hint board as it arrives): the request's hints,
        MoE layers translated to decoder layers, reach the signals and wake the prefetcher. Hints
        for a request that is not live here, or naming no MoE layer of the store, are dropped."""
        if batch.request_done:
            return
        layers = self._layers
        hints = []
        named: set[int] = set()
        dropped = 0
        for hint in batch.hints:
            if not 0 <= hint.moe_layer < layers.num_moe or not 0 <= hint.expert < self._num_experts:
                dropped += 1
                continue
            layer = layers.decoder(hint.moe_layer)
            named.add(layer)
            hints.append((layer, int(hint.expert), float(hint.score)))
        with self._cond:
            if batch.request_id not in self.signals.live_requests:
                self._hints_dropped += len(batch.hints)
                return
            self._hints_dropped += dropped
            self.signals.set_hints(hints, layers=named, request_id=batch.request_id)
            self._prefetcher.kick()

    def _check_prediction(
        self, what: str, layer: int, experts: Iterable[int], *, unique: bool = True
    ) -> np.ndarray:
        layer = int(layer)
        if not self._layers.is_moe(layer):
            raise InvalidArgument(
                f"{what} names layer {layer}, which is not a MoE layer of the store "
                f"(MoE layers: {list(self._layers.moe_layers)})"
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

    # -- the prefetcher's side -----------------------------------------------------------
    def run_prefetch(self) -> int:
        """Decide and start prefetches now, in the calling thread (what the worker does when
        woken); returns the number of loads started. Nothing while prefetch is off or a demand
        waits for slots."""
        with self._cond:
            return self._prefetcher.run()

    def sync_recency(self) -> None:
        """Feed the policy compute's table hits since the last sync (under the lock)."""
        self._recency.sync(self._policy, self._prefetcher.used)

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

    # -- client ledgers (shm pins of compute processes) ----------------------------------
    def claim_client(self) -> ClientLedger:
        """A free client ledger for an attaching compute process (``ResourceExhausted`` if none)."""
        with self._cond:
            ledger = self._ledgers.claim()
        self._table.claim_channel(ledger.index)  # emptied before the client can write to it
        return ledger

    def bind_client(self, session: Session, ledger: ClientLedger) -> None:
        """Tie ``ledger`` (claimed at Attach) to ``session``: when the session closes, the
        ledger's shm pins are reclaimed. ``FailedPrecondition`` if it is not claimed, bound
        elsewhere, or at another epoch."""
        with self._cond:
            self._check_open(session)
            self._ledgers.bind(session, ledger)
            server = ChannelServer(self, session, ledger, self._table.channel(ledger.index))
            self._channels[session] = server
        server.start()

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
            for key, n in session.held.items():
                self.slots.unhold(key, n)
            session.held.clear()
            self._sessions.discard(session)
            ledger, session.ledger = session.ledger, None
            server = self._channels.pop(session, None)
            if server is not None:
                self._forget_client_waits(server)
            self._prefetcher.kick()
        if server is not None:
            server.wake()  # it sees the session closed and ends
        if ledger is not None:
            # Outside the lock: reclaim may wait (bounded) for a client inside a pin call.
            removed = self._ledgers.reclaim(ledger)
            if server is not None:
                # Before the ledger (and its channel) can go to the next client: the thread must
                # not answer an old demand in a channel a new client already uses.
                server.join(CHANNEL_JOIN_S)
            with self._cond:
                self._ledgers.release(ledger)
                self._cond.notify_all()
            if removed:
                logger.info("reclaimed %d shm pin(s) of client ledger %d (%s)", removed, ledger, session)

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

        ``signals`` (checked by ``check_route`` / ``check_layer_ahead``: compute sends a layer's
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
            self._apply_signals_locked(signals)
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
        ``ops`` (the channel's signals that came with it, ``apply_channel_ops``) are applied in the
        same hold of the lock, just before the admission, as an Acquire's carried signals are.
        Returns the loads to run in the calling thread (``run_deferred``, outside the lock)."""
        try:
            layer, keys = self._check_demand("a demand", layer, experts)
        except BaseException:
            self.apply_channel_ops(ops)
            raise
        self._metrics.demands.inc()
        with self._cond:
            self._apply_channel_ops_locked(ops)
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

    def _forget_client_waits(self, client: ChannelServer) -> None:
        for key in list(self._client_waits):
            waiters = [w for w in self._client_waits[key] if w[0] is not client]
            if waiters:
                self._client_waits[key] = waiters
            else:
                del self._client_waits[key]

    def _check_open(self, session: Session) -> None:
        if self._closing:
            raise ShuttingDown("the cache daemon is shutting down")
        if session.closed:
            raise SessionClosed(f"Demand session {session.name or session.id} is closed")

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
            victims = self._policy.choose_victims(
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
            self._metrics.evictions.labels(Tier.DEVICE.value).inc(evicted)
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
                self._metrics.hits.labels(Tier.DEVICE.value).inc(hits)
            if misses:
                self._metrics.misses.labels(Tier.DEVICE.value).inc(misses)

    def _admit_each(
        self, session, client, keys, ready, pending, prefetched, created, slots, scheduler
    ) -> None:
        for key in keys:
            kind = self._prefetcher.used(key)
            scheduler.on_demand(key)
            load = self.queue.get(key)
            if load is None and slots.is_resident(key):
                self._hold(session, client, key)
                self._policy.on_access(key)
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
        self._policy.on_remove(key)
        if count:
            self._metrics.evictions.labels(Tier.DEVICE.value).inc()

    # -- load results (the loader's callbacks, under the lock) --------------------------------
    def _load_done(self, load: Load, source: Tier) -> None:
        self.queue.remove(load.key)
        self.slots.finish_load(load.key)
        self._policy.on_insert(load.key)
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
                if counts[key] > session.pins(key):
                    raise BadAcquire(f"Release of expert {key}, which this stream does not pin")
            for key in keys:
                self._drop_pin(session, key)
            self._prefetcher.kick()

    def _drop_pin(self, session: Session, key: ExpertKey) -> None:
        if session.drop(key):  # not already dropped (the load failed, or the session was closed)
            self.slots.unhold(key)

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
                hints_dropped=self._hints_dropped,
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


def _fresh_error(error: BaseException, key: ExpertKey) -> BaseException:
    """A new exception for one waiter (one object raised in several threads would share a traceback)."""
    if isinstance(error, ExpertCacheError):
        return type(error)(str(error))
    return ExpertCacheError(f"loading expert {key} failed: {type(error).__name__}: {error}")


__all__ = [
    "LookaheadSignal",
    "Ready",
    "Residency",
    "ResidencyStats",
    "RouteSignal",
    "SlotInfo",
    "table_entries",
]
