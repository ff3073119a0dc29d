"""The gRPC edge of the daemon: ``moe.cache.v1.ExpertCache`` converted to and from the domain.

Nothing here decides anything: each RPC converts its request, calls ``CacheDaemon`` /
``Residency``, and converts the answer. Domain errors propagate as exceptions, which
``expertcache.grpc_server.ErrorInterceptor`` maps to status codes.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator

import grpc
import numpy as np
from moe.cache.v1 import cache_pb2, cache_pb2_grpc

from cache_daemon.client_messages import AcquireTrace, ClientMessages, Op
from cache_daemon.config import DaemonConfig
from cache_daemon.daemon import AttachInfo, CacheDaemon, CacheStats, ConfigUpdate, PrefetchStats
from cache_daemon.decisions.scheduler import PrefetchClass
from cache_daemon.decisions.signals import LayerPrediction
from cache_daemon.hints import HintStats
from cache_daemon.residency import ClientLedger, Ready
from cache_daemon.tiers.device import ArenaHandle, ArenaKind
from expertcache.aio_bridge import Health, LoopServer
from expertcache.errors import InvalidArgument
from expertcache.grpc_server import build_server, set_serving
from expertcache.keys import ExpertKey
from expertcache.paths import HANDOFF_SOCKET_SUFFIX
from expertcache.prom import Registry
from expertcache.protocol import CLIENT_EPOCH_KEY, CLIENT_INDEX_KEY, PB_TIER
from expertcache.transport import TransportLimits

logger = logging.getLogger(__name__)
SOCKET_MODE = 0o600

SERVICE_NAME = cache_pb2.DESCRIPTOR.services_by_name["ExpertCache"].full_name
# Route and LayerAhead messages one Acquire may carry, of each kind: compute's largest batch.
GRPC_MAX_WORKERS = 16  # one per concurrent Demand stream, plus room for Attach/GetStats/health

_ARENA_KIND_TO_PB = {
    ArenaKind.MEMFD: cache_pb2.ARENA_KIND_MEMFD,
    ArenaKind.CUDA_IPC: cache_pb2.ARENA_KIND_CUDA_IPC,
}
_PREFETCH_CLASS_TO_PB = {
    PrefetchClass.LAYER_AHEAD: cache_pb2.PREFETCH_CLASS_LAYER_AHEAD,
    PrefetchClass.EAMC: cache_pb2.PREFETCH_CLASS_EAMC,
}
# UpdateConfigRequest's optional fields, all named as DaemonConfig's fields.
_UPDATE_FIELDS = tuple(f.name for f in cache_pb2.UpdateConfigRequest.DESCRIPTOR.fields)


# -- wire <-> domain -------------------------------------------------------------------------
def _same_named(pb_cls, obj, **converted):
    """A ``pb_cls`` message: ``converted`` as given, every other field ``obj``'s attribute of the
    same name (the domain types mirror their messages field for field, as ``_UPDATE_FIELDS``)."""
    names = [f.name for f in pb_cls.DESCRIPTOR.fields if f.name not in converted]
    return pb_cls(**{name: getattr(obj, name) for name in names}, **converted)


def arena_to_pb(arena: ArenaHandle) -> cache_pb2.ArenaHandle:
    return _same_named(cache_pb2.ArenaHandle, arena, kind=_ARENA_KIND_TO_PB[arena.kind])


def attach_to_pb(info: AttachInfo) -> cache_pb2.AttachResponse:
    return _same_named(
        cache_pb2.AttachResponse,
        info,
        arena=arena_to_pb(info.arena),
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
    return ExpertKey(int(ref.decoder_layer), int(ref.expert))


def lookahead_from_pb(pb: cache_pb2.LayerAhead) -> list[LayerPrediction]:
    return [
        LayerPrediction(
            int(p.decoder_layer),
            int(p.depth),
            np.asarray(p.experts, np.int64),
            np.asarray(p.scores, np.float32),
        )
        for p in pb.predictions
    ]


def ready_to_pb(ticket: int, ready: Ready) -> cache_pb2.DemandResponse:
    return cache_pb2.DemandResponse(
        ready=cache_pb2.ExpertReady(
            ticket=ticket,
            expert=cache_pb2.ExpertRef(decoder_layer=ready.key.layer, expert=ready.key.expert),
            slot=ready.slot,
            source=PB_TIER[ready.source],
        )
    )


def done_to_pb(ticket: int, elapsed_s: float) -> cache_pb2.DemandResponse:
    return cache_pb2.DemandResponse(done=cache_pb2.AcquireDone(ticket=ticket, elapsed_s=elapsed_s))


def stats_to_pb(stats: CacheStats) -> cache_pb2.CacheStats:
    return _same_named(
        cache_pb2.CacheStats,
        stats,
        tiers=[_same_named(cache_pb2.TierStats, t, tier=PB_TIER[t.tier]) for t in stats.tiers],
        hints=hint_stats_to_pb(stats.hints) if stats.hints is not None else None,
        prefetch=[prefetch_stats_to_pb(p) for p in stats.prefetch],
        config=live_config_to_pb(stats.config) if stats.config is not None else None,
    )


def prefetch_stats_to_pb(p: PrefetchStats) -> cache_pb2.PrefetchStats:
    return _same_named(cache_pb2.PrefetchStats, p, prediction=_PREFETCH_CLASS_TO_PB[p.cls])


def live_config_to_pb(config: DaemonConfig) -> cache_pb2.LiveConfig:
    return _same_named(cache_pb2.LiveConfig, config)


def update_from_pb(request: cache_pb2.UpdateConfigRequest) -> dict[str, object]:
    """The fields the request sets (proto3 ``optional``: unset = keep), by DaemonConfig name."""
    return {name: getattr(request, name) for name in _UPDATE_FIELDS if request.HasField(name)}


def update_to_pb(update: ConfigUpdate) -> cache_pb2.UpdateConfigResponse:
    return cache_pb2.UpdateConfigResponse(
        config=live_config_to_pb(update.config), changed=list(update.changed)
    )


def hint_stats_to_pb(h: HintStats) -> cache_pb2.HintStats:
    return _same_named(cache_pb2.HintStats, h)


# -- the servicer ----------------------------------------------------------------------------
def _signal_op(messages: ClientMessages, kind: str, message) -> Op | None:
    """One of the Demand stream's one-way messages, checked (``ClientMessages``)."""
    if kind == "request_begin":
        return messages.begin(message.request_id)
    if kind == "request_end":
        return messages.end(message.request_id)
    if kind == "route":
        return messages.route(message.request_id, message.token, message.decoder_layer, message.experts)
    return messages.layer_ahead(message.request_id, message.token, lookahead_from_pb(message))


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
        """The Demand stream's transport: each message decoded and handed to ``ClientMessages``
        (as the channel's records are, ``residency.channel``)."""
        daemon = self._daemon
        residency, metrics = daemon.residency, daemon.metrics
        session = residency.open_session(context.peer())
        # A cancelled stream may be blocked inside an Acquire: closing the session wakes it.
        context.add_callback(lambda: residency.close_session(session))
        try:
            ledger = ledger_from_metadata(context.invocation_metadata())
            if ledger is not None:
                # From now on the end of this stream reclaims the ledger's shm pins.
                residency.bind_client(session, ledger)
            messages = ClientMessages(residency.intake, metrics.signals.labels("rejected"), context.peer())
            for request in request_iterator:
                kind = request.WhichOneof("kind")
                if kind == "acquire":
                    yield from self._acquire(session, messages, request.acquire)
                elif kind == "release":
                    residency.release(session, [key_from_pb(ref) for ref in request.release.experts])
                elif kind in ("route", "layer_ahead", "request_begin", "request_end"):
                    op = _signal_op(messages, kind, getattr(request, kind))
                    if op is not None:
                        residency.intake.apply_ops([op])
                else:
                    raise InvalidArgument(
                        "DemandRequest sets none of acquire, release, route, layer_ahead, request_begin, request_end"
                    )
        finally:
            residency.close_session(session)

    def _acquire(
        self, session, messages: ClientMessages, acquire: cache_pb2.Acquire
    ) -> Iterator[cache_pb2.DemandResponse]:
        daemon = self._daemon
        start = time.monotonic()
        messages.check_carried(acquire.decoder_layer, len(acquire.routes), len(acquire.layer_aheads))
        ops = [_signal_op(messages, "route", r) for r in acquire.routes]
        ops += [_signal_op(messages, "layer_ahead", a) for a in acquire.layer_aheads]
        carried = [op[1] for op in ops if op is not None]
        trace = AcquireTrace.start(
            acquire.trace_context, acquire.decoder_layer, acquire.experts, daemon.manifest.blob_bytes
        )
        try:
            for ready in daemon.residency.acquire(
                session, acquire.decoder_layer, acquire.experts, signals=carried
            ):
                if trace is not None:
                    trace.ready(ready.key, ready.source, ready.prefetch)
                yield ready_to_pb(acquire.ticket, ready)
        finally:
            if trace is not None:
                trace.end()
        elapsed = time.monotonic() - start
        daemon.metrics.acquire_wait.observe(elapsed)
        daemon.metrics.acquire_experts.observe(len(acquire.experts))
        yield done_to_pb(acquire.ticket, elapsed)

    def GetStats(
        self, request: cache_pb2.GetStatsRequest, context: grpc.ServicerContext
    ) -> cache_pb2.CacheStats:
        return stats_to_pb(self._daemon.stats())

    def UpdateConfig(
        self, request: cache_pb2.UpdateConfigRequest, context: grpc.ServicerContext
    ) -> cache_pb2.UpdateConfigResponse:
        return update_to_pb(self._daemon.update_config(update_from_pb(request)))


def handoff_path(socket_path: str) -> str:
    """The handoff socket beside the gRPC socket ``socket_path`` (``expertcache.handoff``)."""
    return socket_path + HANDOFF_SOCKET_SUFFIX


def create_server(
    daemon: CacheDaemon,
    socket_path: str,
    *,
    max_workers: int = GRPC_MAX_WORKERS,
    limits: TransportLimits | None = None,
    registry: Registry | None = None,
) -> tuple[LoopServer, Health]:
    """A started server on ``unix://socket_path`` with health SERVING.

    The socket is owner-only (0600) whatever the umask: it is created under umask 077 and
    chmod'ed after the bind (its directory is 0700 as well, see ``__main__``)."""
    servicer = ExpertCacheServicer(daemon)
    old_umask = os.umask(0o077)
    try:
        server, health_servicer = build_server(
            f"unix://{socket_path}",
            [lambda s: cache_pb2_grpc.add_ExpertCacheServicer_to_server(servicer, s)],
            [SERVICE_NAME],
            max_workers=max_workers,
            limits=limits or TransportLimits.from_config(daemon.config),
            registry=registry,
            name="daemon-grpc",
        )
    finally:
        os.umask(old_umask)
    os.chmod(socket_path, SOCKET_MODE)  # just bound by this process, in a directory only we can write
    daemon.serve_handoff(handoff_path(socket_path))
    server.start()
    set_serving(health_servicer, [SERVICE_NAME])
    logger.info("serving %s on unix://%s", SERVICE_NAME, socket_path)
    return server, health_servicer
