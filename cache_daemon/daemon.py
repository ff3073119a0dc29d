"""The daemon's domain objects wired together (``CacheDaemon``): store, host tier, device arena,
slot table, signals, residency and predictor hints, started from one ``DaemonConfig``, with its
live settings changed whole or not at all (``update_config``). ``docs/daemon.md`` shows the start.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import uuid
from dataclasses import dataclass
from typing import Any

from cache_daemon.budget import Budget
from cache_daemon.client_handoff import ClientHandoff
from cache_daemon.config import LIVE_FIELDS, DaemonConfig
from cache_daemon.decisions.next_visit import NextVisitModel, NextVisitModelError
from cache_daemon.decisions.next_visit import read as read_next_visit_model
from cache_daemon.decisions.policy import EvictionPolicy, PolicyShape, make_policy
from cache_daemon.decisions.scheduler import PrefetchClass, PrefetchConfig
from cache_daemon.decisions.signals import ActivationSignals, SignalsConfig, next_visit_model_mismatch
from cache_daemon.hints import HintBoard, HintStats, HintSubscriber
from cache_daemon.memory_limit import cgroup_memory_limit, check_host_memory
from cache_daemon.metrics import DaemonMetrics, ScrapeStats, TierScrape
from cache_daemon.residency import PREFETCH_KINDS, ClientLedger, Residency, table_entries
from cache_daemon.tiers.base import Tier
from cache_daemon.tiers.device import ArenaHandle, ArenaKind, DeviceArena, create_arena, resolve_device
from cache_daemon.tiers.host import HostTier
from cache_daemon.tiers.store import StoreReader
from expertcache import native, prom
from expertcache.config_loader import validate
from expertcache.errors import InvalidArgument
from expertcache.layers import LayerMap
from expertcache.live_config import live_changes
from expertcache.manifest import StoreManifest, read_manifest_text
from expertcache.native import SlotTable
from expertcache.security import ClientSecurity

logger = logging.getLogger(__name__)

# How long close() waits for compute to release the arena's slots before freeing it anyway.
DETACH_GRACE_S = 10.0


@dataclass(frozen=True)
class AttachInfo:
    """Everything ``Attach`` returns."""

    arena: ArenaHandle
    num_slots: int
    slot_bytes: int
    manifest_json: str  # manifest.json, verbatim
    daemon_id: str
    client: ClientLedger | None  # the caller's client ledger, when it asked for one
    # Where the client trades handoff_token for the arena (a memfd) and, with a ledger, the table
    # and its region (cache_daemon.client_handoff); empty when there is nothing to hand over.
    handoff_socket: str = ""
    handoff_token: bytes = b""


@dataclass(frozen=True)
class TierStats:
    tier: Tier
    hits: int
    misses: int
    bytes_in: int
    capacity_slots: int
    resident: int
    evictions: int


@dataclass(frozen=True)
class PrefetchStats:
    """The prefetcher's counters for one prediction class."""

    cls: PrefetchClass
    started: int
    used: int  # used before eviction (accuracy = used / (used + wasted))
    wasted: int  # evicted unused
    cancelled: int  # queued reads cancelled for a demand
    promoted: int  # joined by a demand
    start_delay_seconds: float = 0.0  # summed: from the change that asked for a decision to each start


@dataclass(frozen=True)
class CacheStats:
    tiers: tuple[TierStats, ...]
    pinned: int
    demands: int
    checksum_failures: int
    store_io_mode: str
    store_read_seconds: float
    hints: HintStats | None = None
    arena_copy_seconds: float = 0.0  # host memory -> arena slots (host tier hits, staged reads)
    prefetch: tuple[PrefetchStats, ...] = ()
    config: DaemonConfig | None = None
    signals_rejected: int = 0  # malformed Route/LayerAhead messages dropped


@dataclass(frozen=True)
class ConfigUpdate:
    """What ``update_config`` did: the config now in force and the fields it changed."""

    config: DaemonConfig
    changed: tuple[str, ...]


def signals_config(config: DaemonConfig) -> SignalsConfig:
    return SignalsConfig(hint_ttl_tokens=config.hint_ttl_tokens)


def load_next_visit_model(config: DaemonConfig, manifest: StoreManifest) -> NextVisitModel | None:
    """The learned next-visit model ``config.next_visit_model`` names (None when it names none),
    checked against the served model; ``InvalidArgument`` naming the field and the file when it
    cannot be used."""
    if not config.next_visit_model:
        return None
    try:
        model = read_next_visit_model(config.next_visit_model)
    except NextVisitModelError as exc:
        raise InvalidArgument(f"config field 'next_visit_model': {exc}") from None
    problem = next_visit_model_mismatch(
        model, len(manifest.moe_layers), manifest.num_experts, signals_config(config)
    )
    if problem:
        raise InvalidArgument(f"config field 'next_visit_model' = {config.next_visit_model!r}: {problem}")
    logger.info(
        "next-visit model %s: %d MoE layers x %d experts, window %d layers, fitted on %s",
        config.next_visit_model,
        model.num_layers,
        model.num_experts,
        model.window,
        model.trained_on or "unrecorded data",
    )
    return model


def make_signals(config: DaemonConfig, manifest: StoreManifest) -> ActivationSignals:
    """The signals of the served model, with the learned next-visit model of
    ``config.next_visit_model`` when one is named (``load_next_visit_model``)."""
    return ActivationSignals(
        manifest.num_layers,
        manifest.num_experts,
        config=signals_config(config),
        layer_map=LayerMap(tuple(manifest.moe_layers), manifest.num_layers),
        next_visit_model=load_next_visit_model(config, manifest),
    )


def prefetch_config(config: DaemonConfig) -> PrefetchConfig:
    return PrefetchConfig(
        horizon_layers=config.prefetch_horizon_layers, min_probability=config.prefetch_min_probability
    )


def device_policy(name: str, manifest: StoreManifest, signals: ActivationSignals) -> EvictionPolicy:
    """The device tier's policy ``name`` over ``signals`` (layers numbered as in Acquire);
    ``InvalidArgument`` naming the field for a name the registry refuses."""
    try:
        return make_policy(name, PolicyShape(manifest.num_layers, manifest.num_experts), signals)
    except ValueError as exc:
        raise InvalidArgument(f"config field 'eviction_policy' = {name!r}: {exc}") from None


@dataclass(kw_only=True, eq=False)
class CacheDaemon:
    """The daemon's domain objects wired together: manifest, store, host tier, arena, residency.

    ``start`` checks the store and budgets (raising ``ExpertCacheError`` subclasses that
    ``__main__`` turns into exit code 2); ``close`` frees everything.
    """

    manifest: StoreManifest
    manifest_json: str
    daemon_id: str
    metrics: DaemonMetrics
    store: StoreReader
    host: HostTier
    arena: DeviceArena
    residency: Residency  # owns the slot table too (``Residency.table``)
    config: DaemonConfig = dataclasses.field(default_factory=lambda: DaemonConfig(store_dir="(unknown)"))

    def __post_init__(self) -> None:
        # The budgets as started: their ceilings are the memory allocated at start.
        self.budgets = (Budget.device(self.config), Budget.host(self.config))
        self._closed = False
        self.handoff = ClientHandoff(
            self.arena.arena_fd if self.arena.kind is ArenaKind.MEMFD else None, self.residency.handoff_fds
        )
        self._config_lock = threading.Lock()  # one update at a time
        # Predictor hints: each batch goes to the residency's signals as it arrives (and wakes
        # the prefetcher); the board keeps the latest per request for GetStats. Empty unless
        # subscribed.
        self.hints = HintBoard(
            stale_after_s=self.config.hint_stale_s, on_batch=self.residency.intake.apply_hints
        )
        self.hint_subscriber: HintSubscriber | None = None

    def subscribe_hints(self, config: DaemonConfig, pod: str) -> None:
        """Follow the predictor's hints for ``pod`` (``config.predictor_address`` must be set)."""
        self.hint_subscriber = HintSubscriber(
            config.predictor_address,
            self.manifest.model_id,
            pod,
            self.hints,
            shape=(len(self.manifest.moe_layers), self.manifest.num_experts, self.manifest.top_k),
            security=ClientSecurity.from_config(config),
        )
        logger.info("taking prefetch hints from the predictor at %s (pod %s)", config.predictor_address, pod)

    # -- live configuration ------------------------------------------------------------------
    def update_config(self, changes: dict[str, Any], source: str = "UpdateConfig") -> ConfigUpdate:
        """Apply ``changes`` (field name → value) to the live settings, all or nothing.

        ``InvalidArgument`` naming the field and value, with the old config kept, for an unknown
        field, a field that is not live (sizes and resources fixed at start), a value out of
        range or not finite, a budget above its ceiling or below one blob (``Budget``), or a policy
        the daemon does not run. A policy switch keeps every resident expert resident and every
        pin (``Residency.set_policy``).
        """
        with self._config_lock:
            try:
                new = self._validated(changes, source)
                device_limit, host_limit = self._budget_slots(new)
                policy = None
                if new.eviction_policy != self.config.eviction_policy:
                    policy = device_policy(new.eviction_policy, self.manifest, self.residency.signals)
                swap_model = new.next_visit_model != self.config.next_visit_model
                model = load_next_visit_model(new, self.manifest) if swap_model else None
            except InvalidArgument as exc:
                logger.warning("config update from %s refused, config unchanged: %s", source, exc)
                raise
            changed = tuple(f for f in LIVE_FIELDS if getattr(new, f) != getattr(self.config, f))
            if "device_budget_bytes" in changed:
                evicted = self.residency.set_slot_limit(device_limit)
                logger.info("device budget %d slots (%d evicted)", device_limit, evicted)
            if "host_budget_bytes" in changed:
                evicted = self.host.set_limit(host_limit)
                logger.info("host budget %d slots (%d evicted)", host_limit, evicted)
            if policy is not None:
                self.residency.set_policy(policy)
            if swap_model:
                self.residency.set_next_visit_model(model)
            self.residency.signals.config = signals_config(new)
            self.residency.configure_prefetch(
                enabled=new.prefetch, max_inflight_bytes=new.max_inflight_bytes, config=prefetch_config(new)
            )
            self.hints.stale_after_s = new.hint_stale_s
            self.config = new
            if changed:
                logger.info("config updated: %s", ", ".join(f"{f}={getattr(new, f)!r}" for f in changed))
            return ConfigUpdate(new, changed)

    def _validated(self, changes: dict[str, Any], source: str) -> DaemonConfig:
        names = {f.name for f in dataclasses.fields(DaemonConfig)}
        for name, value in changes.items():
            if name not in names:
                raise InvalidArgument(f"unknown config field {name!r}; live fields: {', '.join(LIVE_FIELDS)}")
            if name not in LIVE_FIELDS:
                raise InvalidArgument(
                    f"config field {name!r} = {value!r} cannot change while the daemon runs (it is fixed "
                    f"at start; restart the daemon); live fields: {', '.join(LIVE_FIELDS)}"
                )
        new = dataclasses.replace(self.config, **changes)
        validate(new, source)  # InvalidArgument naming the field, its value and the allowed range
        return new

    def _budget_slots(self, new: DaemonConfig) -> tuple[int, int]:
        """Device and host slots for ``new``'s budgets, within the ceilings allocated at start
        (``Budget.check_ceiling``, ``Budget.slots``: ``InvalidArgument`` naming the field)."""
        slots = []
        for budget in (b.resized(getattr(new, b.name)) for b in self.budgets):
            budget.check_ceiling()
            slots.append(budget.slots(self.manifest.blob_bytes, self.manifest.num_blobs))
        return slots[0], slots[1]

    def reload(self, fresh: DaemonConfig, source: str = "the config file") -> ConfigUpdate:
        """Adopt the live fields of ``fresh`` (the config loaded again after the ConfigMap
        changed, already validated whole). A changed restart-only field is logged as a warning
        naming it and left unapplied (it takes effect at the next start)."""
        changes = live_changes(DaemonConfig, self.config, fresh, source)
        return self.update_config(changes, source)

    @classmethod
    def start(cls, config: DaemonConfig, *, daemon_id: str | None = None) -> CacheDaemon:
        # A build without liburing or ISA-L still works, slower: say so once.
        logger.info("%s", native.build_summary())
        manifest, manifest_json = read_manifest_text(config.store_dir)
        blob = manifest.blob_bytes
        # The arena and the host pool are allocated at their ceilings (restart-only); the live
        # budgets choose how many of their slots the cache fills.
        device, host_budget = Budget.device(config), Budget.host(config)
        device_slots = device.slots(blob, manifest.num_blobs)
        num_slots = device.ceiling_slots(blob, manifest.num_blobs)
        host_in_use = host_budget.slots(blob, manifest.num_blobs)
        host_slots = host_budget.ceiling_slots(blob, manifest.num_blobs)
        # Pinned host memory and a CPU arena's shared pages cannot be reclaimed: they must fit in
        # the container's memory limit, or the container is OOM-killed later under load.
        arena_in_host_memory = resolve_device(config.device) == "cpu"
        check_host_memory(
            {
                "host_budget_bytes": host_slots * blob,
                "device_budget_bytes (CPU arena)": num_slots * blob if arena_in_host_memory else 0,
            },
            cgroup_memory_limit(),
        )
        signals = make_signals(config, manifest)  # before any memory is taken: a bad model file stops here
        daemon_id = daemon_id or uuid.uuid4().hex[:16]
        metrics = DaemonMetrics()
        store = StoreReader(
            config.store_dir,
            manifest,
            metrics,
            io_threads=config.io_threads,
            chunk_bytes=config.store_chunk_bytes,
        )
        arena = host = table = None
        try:
            arena = create_arena(config.device, num_slots, blob, daemon_id=daemon_id)
            # Compute maps it (read-only, with a region of its own) and pins resident experts
            # without RPC; memfds like a CPU arena, handed over the handoff socket: no file to
            # open or leave behind.
            table = SlotTable.create(f"expertcache-{daemon_id}", table_entries(manifest), num_slots)
            # The host tier is a plain LRU cache below the arena: predictions rank the arena.
            host = HostTier(
                host_slots,
                blob,
                make_policy("lru"),
                metrics,
                pin_memory=arena.pin_host_memory,
                numa_node=arena.numa_node,
            )
            host.set_limit(host_in_use)
            residency = Residency(
                manifest,
                arena,
                store,
                host,
                device_policy(config.eviction_policy, manifest, signals),
                metrics,
                table=table,
                io_threads=config.io_threads,
                acquire_timeout_s=config.acquire_timeout_s,
                signals=signals,
                prefetch=config.prefetch,
                max_inflight_bytes=config.max_inflight_bytes,
                prefetch_config=prefetch_config(config),
            )
            residency.set_slot_limit(device_slots)
        except BaseException:
            for part in (host, arena, store):
                if part is not None:
                    part.close()
            raise
        logger.info(
            "daemon %s: %s model %s, %d MoE layers x %d experts of %d bytes; arena %d of %d slots, "
            "host %d of %d slots, store reads %s",
            daemon_id,
            manifest.model_type,
            manifest.model_id,
            len(manifest.moe_layers),
            manifest.num_experts,
            blob,
            device_slots,
            num_slots,
            host_in_use,
            host_slots,
            store.io_mode,
        )
        return cls(
            manifest=manifest,
            manifest_json=manifest_json,
            daemon_id=daemon_id,
            metrics=metrics,
            store=store,
            host=host,
            arena=arena,
            residency=residency,
            config=config,
        )

    def serve_handoff(self, path: str) -> None:
        """Hand clients the arena, their table and region on the unix socket ``path``
        (``create_server`` starts it beside the gRPC socket); without it, Attach offers no client
        ledger and a CPU arena cannot be mapped."""
        self.handoff.start(path)

    def attach(self, client_name: str, *, want_client: bool = False) -> AttachInfo:
        """``want_client``: the caller pins through the slot table and needs a client ledger (only
        while the handoff socket is served)."""
        client = self.residency.claim_client() if want_client and self.handoff.path else None
        logger.info(
            "attach from %s%s",
            client_name or "an unnamed client",
            f" (client ledger {client.index})" if client is not None else "",
        )
        token = self.handoff.issue(client)
        return AttachInfo(
            arena=self.arena.handle(),
            num_slots=self.arena.num_slots,
            slot_bytes=self.arena.slot_bytes,
            manifest_json=self.manifest_json,
            daemon_id=self.daemon_id,
            client=client,
            handoff_socket=self.handoff.path if token else "",
            handoff_token=token,
        )

    def stats(self) -> CacheStats:
        m = self.metrics
        r = self.residency.stats()

        def tier_stats(
            tier: Tier, capacity: int, resident: int, extra_hits: int = 0, extra_misses: int = 0
        ) -> TierStats:
            label = tier.value
            return TierStats(
                tier=tier,
                hits=int(prom.value(m.hits, label)) + extra_hits,
                misses=int(prom.value(m.misses, label)) + extra_misses,
                bytes_in=int(prom.value(m.bytes_in, label)),
                capacity_slots=capacity,
                resident=resident,
                evictions=int(prom.value(m.evictions, label)),
            )

        num_blobs = self.manifest.num_blobs
        return CacheStats(
            tiers=(
                # Device hits include the pins compute took through the slot table (no Demand),
                # and misses the experts it waited for in flight and then pinned there.
                tier_stats(
                    Tier.DEVICE, r.num_slots, r.resident, extra_hits=r.shm_hits, extra_misses=r.shm_waited
                ),
                tier_stats(Tier.HOST, self.host.limit, self.host.resident_count()),
                tier_stats(Tier.STORE, num_blobs, num_blobs),
            ),
            pinned=r.pinned,
            demands=int(prom.value(m.demands)),
            checksum_failures=int(prom.value(m.checksum_failures)),
            store_io_mode=self.store.io_mode,
            store_read_seconds=float(prom.value(m.store_read_seconds)),
            arena_copy_seconds=float(prom.value(m.arena_copy_seconds)),
            signals_rejected=int(prom.value(m.signals, "rejected")),
            hints=self.hints.stats(),
            prefetch=tuple(
                PrefetchStats(
                    cls=cls,
                    started=int(prom.value(m.prefetch_started, kind)),
                    used=int(prom.value(m.prefetch_used, kind)),
                    wasted=int(prom.value(m.prefetch_wasted, kind)),
                    cancelled=int(prom.value(m.prefetch_cancelled, kind)),
                    promoted=int(prom.value(m.prefetch_promoted, kind)),
                    start_delay_seconds=float(prom.value(m.prefetch_start_delay_seconds, kind)),
                )
                for cls, kind in PREFETCH_KINDS.items()
            ),
            config=self.config,
        )

    def scrape_stats(self) -> ScrapeStats:
        """What ``/metrics`` shows besides the counters (``cache_daemon.metrics.registry``): the
        tiers as ``stats`` reports them, loads in flight, the store reader's queue."""
        stats = self.stats()
        reader = self.store.reader_stats()
        return ScrapeStats(
            tiers=tuple(
                TierScrape(
                    t.tier.value, t.hits, t.misses, t.bytes_in, t.evictions, t.capacity_slots, t.resident
                )
                for t in stats.tiers
            ),
            pinned=stats.pinned,
            inflight_bytes=self.residency.inflight_bytes,
            reader_queued=reader.get("queued", 0),
            reader_in_flight=reader.get("in_flight", 0),
            hint_requests=stats.hints.requests if stats.hints is not None else None,
        )

    def close(self, detach_grace_s: float = DETACH_GRACE_S) -> None:
        """Fail waiting Acquires, stop the I/O threads, free the tiers.

        The arena is freed only once no compute process pins a slot of it (waiting at most
        ``detach_grace_s``): compute releases a pin after the kernels reading the slot are done,
        and every expert is evicted meanwhile so that no new hit pins one. A CUDA arena freed
        under a kernel still reading it would fault compute's GPU context."""
        if self._closed:
            return
        self._closed = True
        if self.hint_subscriber is not None:
            self.hint_subscriber.close()
        self.residency.shutdown()
        pinned = self.residency.drain(detach_grace_s)
        if pinned:
            logger.warning(
                "%d experts are still pinned by compute after %.1fs: freeing the arena anyway",
                pinned,
                detach_grace_s,
            )
        self.store.close()
        self.host.close()
        self.handoff.close()
        self.arena.close()
        logger.info("daemon %s closed", self.daemon_id)
