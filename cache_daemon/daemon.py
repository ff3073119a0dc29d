"""The daemon's domain objects wired together: store, host tier, device arena, residency.

CacheDaemon.start(config)
  ├─ read_manifest(store_dir)          the store must be complete
  ├─ StoreReader                        O_DIRECT reads + CRC checks
  ├─ HostTier                           host_budget_bytes // blob_bytes slots (0 = none)
  ├─ DeviceArena                        device_budget_bytes // blob_bytes slots (shm / CUDA)
  ├─ SlotTable                          <shm_dir>/expertcache-<daemon_id>.slots, mapped by compute
  └─ Residency                          slot table, pins, LRU, demand loads
"""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

from cache_daemon.config import DaemonConfig
from cache_daemon.hints import HintBoard, HintStats, HintSubscriber
from cache_daemon.metrics import DaemonMetrics
from cache_daemon.policy import make_policy
from cache_daemon.residency import ClientLedger, Residency, table_entries
from cache_daemon.tiers.base import Tier
from cache_daemon.tiers.device import ArenaHandle, DeviceArena, create_arena, slots_for_budget
from cache_daemon.tiers.host import HostTier
from cache_daemon.tiers.store import StoreReader
from expertcache.manifest import MANIFEST_NAME, StoreManifest, read_manifest
from expertcache.native import SlotTable

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AttachInfo:
    """Everything ``Attach`` returns."""

    arena: ArenaHandle
    num_slots: int
    slot_bytes: int
    manifest_json: str  # manifest.json, verbatim
    daemon_id: str
    slot_table_path: str  # absolute path of the shared slot table file
    client: ClientLedger | None  # the caller's client ledger, when it asked for one


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
class CacheStats:
    tiers: tuple[TierStats, ...]
    pinned: int
    demands: int
    checksum_failures: int
    store_io_mode: str
    store_read_seconds: float
    hints: HintStats | None = None


class CacheDaemon:
    """The daemon's domain objects wired together: manifest, store, host tier, arena, residency.

    ``start`` checks the store and budgets (raising ``ExpertCacheError`` subclasses that
    ``__main__`` turns into exit code 2); ``close`` frees everything and removes the shm file.
    """

    def __init__(
        self,
        *,
        manifest: StoreManifest,
        manifest_json: str,
        daemon_id: str,
        metrics: DaemonMetrics,
        store: StoreReader,
        host: HostTier,
        arena: DeviceArena,
        residency: Residency,
        table: SlotTable,
    ) -> None:
        self.manifest = manifest
        self.manifest_json = manifest_json
        self.daemon_id = daemon_id
        self.metrics = metrics
        self.store = store
        self.host = host
        self.arena = arena
        self.residency = residency
        self.table = table
        self._closed = False
        # Predictor hints: kept on a board for the prefetch scheduler; empty unless subscribed.
        self.hints = HintBoard()
        self.hint_subscriber: HintSubscriber | None = None

    def subscribe_hints(self, config: DaemonConfig, pod: str) -> None:
        """Follow the predictor's hints for ``pod`` (``config.predictor_address`` must be set)."""
        self.hints = HintBoard(stale_after_s=config.hint_stale_s)
        self.hint_subscriber = HintSubscriber(
            config.predictor_address, self.manifest.model_id, pod, self.hints
        )
        logger.info("taking prefetch hints from the predictor at %s (pod %s)", config.predictor_address, pod)

    @classmethod
    def start(cls, config: DaemonConfig, *, daemon_id: str | None = None) -> CacheDaemon:
        manifest = read_manifest(config.store_dir)
        manifest_json = (Path(config.store_dir) / MANIFEST_NAME).read_text()
        blob = manifest.blob_bytes
        num_slots = slots_for_budget(
            config.device_budget_bytes, blob, "device_budget_bytes", cap=manifest.num_blobs
        )
        host_slots = (
            slots_for_budget(config.host_budget_bytes, blob, "host_budget_bytes", cap=manifest.num_blobs)
            if config.host_budget_bytes
            else 0
        )
        daemon_id = daemon_id or uuid.uuid4().hex[:16]
        metrics = DaemonMetrics()
        store = StoreReader(config.store_dir, manifest, metrics, io_threads=config.io_threads)
        arena = host = table = None
        try:
            arena = create_arena(config.device, num_slots, blob, shm_dir=config.shm_dir, daemon_id=daemon_id)
            # Next to the shm arena (tmpfs): compute maps it and pins resident experts without RPC.
            table = SlotTable.create(
                os.path.abspath(os.path.join(config.shm_dir, f"expertcache-{daemon_id}.slots")),
                table_entries(manifest),
                num_slots,
            )
            host = HostTier(
                host_slots,
                blob,
                make_policy(config.eviction_policy),
                metrics,
                pin_memory=arena.pin_host_memory,
            )
            residency = Residency(
                manifest,
                arena,
                store,
                host,
                make_policy(config.eviction_policy),
                metrics,
                table=table,
                io_threads=config.io_threads,
                acquire_timeout_s=config.acquire_timeout_s,
            )
        except BaseException:
            if table is not None:
                _remove(table.path)
            for part in (host, arena, store):
                if part is not None:
                    part.close()
            raise
        logger.info(
            "daemon %s: %s model %s, %d MoE layers x %d experts of %d bytes; arena %d slots, host %d slots, "
            "store reads %s",
            daemon_id,
            manifest.model_type,
            manifest.model_id,
            len(manifest.moe_layers),
            manifest.num_experts,
            blob,
            num_slots,
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
            table=table,
        )

    def attach(self, client_name: str, *, want_client: bool = False) -> AttachInfo:
        """``want_client``: the caller pins through the slot table and needs a client ledger."""
        client = self.residency.claim_client() if want_client else None
        logger.info(
            "attach from %s%s",
            client_name or "an unnamed client",
            f" (client ledger {client.index})" if client is not None else "",
        )
        return AttachInfo(
            arena=self.arena.handle(),
            num_slots=self.arena.num_slots,
            slot_bytes=self.arena.slot_bytes,
            manifest_json=self.manifest_json,
            daemon_id=self.daemon_id,
            slot_table_path=self.table.path,
            client=client,
        )

    def stats(self) -> CacheStats:
        m = self.metrics
        r = self.residency.stats()

        def tier_stats(tier: Tier, capacity: int, resident: int, extra_hits: int = 0) -> TierStats:
            label = tier.value
            return TierStats(
                tier=tier,
                hits=int(m.hits.value(tier=label)) + extra_hits,
                misses=int(m.misses.value(tier=label)),
                bytes_in=int(m.bytes_in.value(tier=label)),
                capacity_slots=capacity,
                resident=resident,
                evictions=int(m.evictions.value(tier=label)),
            )

        num_blobs = self.manifest.num_blobs
        return CacheStats(
            tiers=(
                # Device hits include the pins compute took through the slot table (no Demand).
                tier_stats(Tier.DEVICE, r.num_slots, r.resident, extra_hits=r.shm_hits),
                tier_stats(Tier.HOST, self.host.num_slots, self.host.resident_count()),
                tier_stats(Tier.STORE, num_blobs, num_blobs),
            ),
            pinned=r.pinned,
            demands=int(m.demands.value()),
            checksum_failures=int(m.checksum_failures.value()),
            store_io_mode=self.store.io_mode,
            store_read_seconds=float(m.store_read_seconds.value()),
            hints=self.hints.stats(),
        )

    def close(self) -> None:
        """Fail waiting Acquires, stop the I/O threads, free the tiers, remove the shm files."""
        if self._closed:
            return
        self._closed = True
        if self.hint_subscriber is not None:
            self.hint_subscriber.close()
        self.residency.shutdown()
        self.store.close()
        self.host.close()
        self.arena.close()
        _remove(self.table.path)
        logger.info("daemon %s closed", self.daemon_id)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
