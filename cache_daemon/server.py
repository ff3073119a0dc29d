"""The gRPC edge of the daemon: ``moe.cache.v1.ExpertCache`` converted to and from the domain.

Nothing here decides anything: each RPC converts its request, calls ``CacheDaemon`` /
``Residency``, and converts the answer. Domain errors propagate as exceptions, which
``expertcache.grpc_server.ErrorInterceptor`` maps to status codes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import grpc
from grpc_health.v1 import health
from moe.cache.v1 import cache_pb2, cache_pb2_grpc

from cache_daemon.daemon import AttachInfo, CacheDaemon, CacheStats
from cache_daemon.hints import HintStats
from cache_daemon.residency import ClientLedger, Ready
from cache_daemon.tiers.base import Tier
from cache_daemon.tiers.device import ArenaHandle, ArenaKind
from expertcache.errors import InvalidArgument
from expertcache.grpc_server import build_server, set_serving
from expertcache.keys import ExpertKey

logger = logging.getLogger(__name__)

SERVICE_NAME = cache_pb2.DESCRIPTOR.services_by_name["ExpertCache"].full_name
# Demand call metadata naming the caller's client ledger (see cache.proto, Demand).
CLIENT_INDEX_KEY = "expertcache-client-index"
CLIENT_EPOCH_KEY = "expertcache-client-epoch"
GRPC_MAX_WORKERS = 16  # one per concurrent Demand stream, plus room for Attach/GetStats/health

_ARENA_KIND_TO_PB = {
    ArenaKind.POSIX_SHM: cache_pb2.ARENA_KIND_POSIX_SHM,
    ArenaKind.CUDA_IPC: cache_pb2.ARENA_KIND_CUDA_IPC,
}
_TIER_TO_PB = {
    Tier.DEVICE: cache_pb2.TIER_DEVICE,
    Tier.HOST: cache_pb2.TIER_HOST,
    Tier.STORE: cache_pb2.TIER_STORE,
}


# -- wire <-> domain -------------------------------------------------------------------------
def arena_to_pb(arena: ArenaHandle) -> cache_pb2.ArenaHandle:
    return cache_pb2.ArenaHandle(
        kind=_ARENA_KIND_TO_PB[arena.kind],
        shm_name=arena.shm_name,
        cuda_ipc_handle=arena.cuda_ipc_handle,
        gpu_uuid=arena.gpu_uuid,
        cuda_offset=arena.cuda_offset,
        size_bytes=arena.size_bytes,
        cuda_ref_counter_handle=arena.cuda_ref_counter_handle,
        cuda_ref_counter_offset=arena.cuda_ref_counter_offset,
        cuda_event_handle=arena.cuda_event_handle,
        cuda_alloc_bytes=arena.cuda_alloc_bytes,
    )


def attach_to_pb(info: AttachInfo) -> cache_pb2.AttachResponse:
    return cache_pb2.AttachResponse(
        arena=arena_to_pb(info.arena),
        num_slots=info.num_slots,
        slot_bytes=info.slot_bytes,
        manifest_json=info.manifest_json,
        daemon_id=info.daemon_id,
        slot_table_path=info.slot_table_path,
        client_index=info.client.index if info.client is not None else -1,
        client_epoch=info.client.epoch if info.client is not None else 0,
    )


def ledger_from_metadata(metadata) -> ClientLedger | None:
    """The client ledger a Demand call names in its metadata, or None; ``InvalidArgument`` if malformed."""
    values = {k: v for k, v in metadata or () if k in (CLIENT_INDEX_KEY, CLIENT_EPOCH_KEY)}
    if not values:
        return None
    try:
        return ClientLedger(int(values[CLIENT_INDEX_KEY]), int(values[CLIENT_EPOCH_KEY]))
    except (KeyError, ValueError):
        raise InvalidArgument(
            f"Demand metadata must carry both {CLIENT_INDEX_KEY!r} and {CLIENT_EPOCH_KEY!r} as decimal "
            f"integers, got {values}"
        ) from None


def key_from_pb(ref: cache_pb2.ExpertRef) -> ExpertKey:
    return ExpertKey(int(ref.layer), int(ref.expert))


def ready_to_pb(ticket: int, ready: Ready) -> cache_pb2.DemandResponse:
    return cache_pb2.DemandResponse(
        ready=cache_pb2.ExpertReady(
            ticket=ticket,
            expert=cache_pb2.ExpertRef(layer=ready.key.layer, expert=ready.key.expert),
            slot=ready.slot,
            source=_TIER_TO_PB[ready.source],
        )
    )


def done_to_pb(ticket: int, elapsed_s: float) -> cache_pb2.DemandResponse:
    return cache_pb2.DemandResponse(done=cache_pb2.AcquireDone(ticket=ticket, elapsed_s=elapsed_s))


def stats_to_pb(stats: CacheStats) -> cache_pb2.CacheStats:
    return cache_pb2.CacheStats(
        tiers=[
            cache_pb2.TierStats(
                tier=_TIER_TO_PB[t.tier],
                hits=t.hits,
                misses=t.misses,
                bytes_in=t.bytes_in,
                capacity_slots=t.capacity_slots,
                resident=t.resident,
                evictions=t.evictions,
            )
            for t in stats.tiers
        ],
        pinned=stats.pinned,
        demands=stats.demands,
        checksum_failures=stats.checksum_failures,
        store_io_mode=stats.store_io_mode,
        store_read_seconds=stats.store_read_seconds,
        hints=hint_stats_to_pb(stats.hints) if stats.hints is not None else None,
    )


def hint_stats_to_pb(h: HintStats) -> cache_pb2.HintStats:
    return cache_pb2.HintStats(
        batches=h.batches,
        hints=h.hints,
        replaced=h.replaced,
        dropped=h.dropped,
        requests=h.requests,
        subscribed=h.subscribed,
    )


# -- the servicer ----------------------------------------------------------------------------
class ExpertCacheServicer(cache_pb2_grpc.ExpertCacheServicer):
    """``moe.cache.v1.ExpertCache`` over one ``CacheDaemon``."""

    def __init__(self, daemon: CacheDaemon) -> None:
        self._daemon = daemon

    def Attach(
        self, request: cache_pb2.AttachRequest, context: grpc.ServicerContext
    ) -> cache_pb2.AttachResponse:
        return attach_to_pb(self._daemon.attach(request.client_name, want_client=request.shm_fast_path))

    def Demand(
        self, request_iterator: Iterator[cache_pb2.DemandRequest], context: grpc.ServicerContext
    ) -> Iterator[cache_pb2.DemandResponse]:
        residency = self._daemon.residency
        session = residency.open_session(context.peer())
        # A cancelled stream may be blocked inside an Acquire: closing the session wakes it.
        context.add_callback(lambda: residency.close_session(session))
        try:
            ledger = ledger_from_metadata(context.invocation_metadata())
            if ledger is not None:
                # From now on the end of this stream reclaims the ledger's shm pins.
                residency.bind_client(session, ledger)
            for request in request_iterator:
                kind = request.WhichOneof("kind")
                if kind == "acquire":
                    acquire = request.acquire
                    start = time.monotonic()
                    for ready in residency.acquire(session, acquire.layer, acquire.experts):
                        yield ready_to_pb(acquire.ticket, ready)
                    yield done_to_pb(acquire.ticket, time.monotonic() - start)
                elif kind == "release":
                    residency.release(session, [key_from_pb(ref) for ref in request.release.experts])
                else:
                    raise InvalidArgument("DemandRequest sets neither 'acquire' nor 'release'")
        finally:
            residency.close_session(session)

    def GetStats(
        self, request: cache_pb2.GetStatsRequest, context: grpc.ServicerContext
    ) -> cache_pb2.CacheStats:
        return stats_to_pb(self._daemon.stats())


def create_server(
    daemon: CacheDaemon, socket_path: str, *, max_workers: int = GRPC_MAX_WORKERS
) -> tuple[grpc.Server, health.HealthServicer]:
    """A started server on ``unix://socket_path`` with health SERVING."""
    servicer = ExpertCacheServicer(daemon)
    server, health_servicer = build_server(
        f"unix://{socket_path}",
        [lambda s: cache_pb2_grpc.add_ExpertCacheServicer_to_server(servicer, s)],
        [SERVICE_NAME],
        max_workers=max_workers,
    )
    server.start()
    set_serving(health_servicer, [SERVICE_NAME])
    logger.info("serving %s on unix://%s", SERVICE_NAME, socket_path)
    return server, health_servicer
