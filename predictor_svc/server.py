"""The gRPC edge of the predictor: ``moe.predictor.v1.Predictor`` converted to and from the domain.

Nothing here decides anything: each RPC converts its messages, calls ``PredictorService`` and
converts the answer. Domain errors propagate as exceptions, which
``expertcache.grpc_server.ErrorInterceptor`` maps to status codes (BadActivation →
INVALID_ARGUMENT naming the field).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import grpc
from moe.predictor.v1 import predictor_pb2, predictor_pb2_grpc

from expertcache import telemetry
from expertcache.aio_bridge import Health, LoopServer
from expertcache.grpc_server import build_server, set_serving, status_code
from expertcache.prom import Registry
from expertcache.security import ServerSecurity
from expertcache.transport import TransportLimits
from predictor_svc.errors import BadActivation, LimitReached, ModelNotRegistered, RequestEnded
from predictor_svc.service import Activation, PredictorService, ServiceStats
from predictor_svc.subscriptions import PublishedHints

logger = logging.getLogger(__name__)

SERVICE_NAME = predictor_pb2.DESCRIPTOR.services_by_name["Predictor"].full_name
# What one Observe message may be refused for: it ends its request's reporting, not the stream
# (PredictorStopping and a message that does not decode still end the stream).
REQUEST_REFUSALS = (BadActivation, LimitReached, ModelNotRegistered)
SUBSCRIBE_POLL_S = 0.5  # how often a hint stream notices a cancelled client with nothing to send


# -- wire <-> domain -------------------------------------------------------------------------
def client_of(context: grpc.ServicerContext) -> str:
    """Who is calling: the certificate's common name under mTLS, else the peer's address without
    its port (one pod = one client; a new connection does not make a new client). The key of the
    per-client limits. Metadata is not trusted: any client could claim any name there."""
    try:
        names = context.auth_context().get("x509_common_name") or []
    except Exception:  # noqa: BLE001 - no auth context on this transport
        names = []
    if names:
        name = names[0]
        return "cn:" + (name.decode(errors="replace") if isinstance(name, bytes) else str(name))
    peer = context.peer() or ""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        host, sep, port = rest.rpartition(":")
        return f"{kind}:{host}" if sep and port.isdigit() else peer
    return peer


def activation_from_pb(msg: predictor_pb2.Activation, client: str = "") -> Activation:
    return Activation(
        request_id=msg.request_id,
        model_id=msg.model_id,
        pod=msg.pod,
        token_index=msg.token_index,
        experts=msg.experts,  # repeated uint32: sized and indexable, converted once by the service
        top_k=msg.top_k,
        request_done=msg.request_done,
        num_moe_layers=msg.num_moe_layers,
        num_experts=msg.num_experts,
        client=client,
        trace_context=msg.trace_context,
        nonce=msg.request_nonce,
    )


def hint_batch_to_pb(batch: PublishedHints) -> predictor_pb2.HintBatch:
    pb = predictor_pb2.HintBatch(
        request_id=batch.request_id,
        token_index=batch.token_index,
        request_done=batch.request_done,
        request_nonce=batch.nonce,
        hints=[
            predictor_pb2.Hint(moe_layer=h.moe_layer, expert=h.expert, score=h.score) for h in batch.hints
        ],
    )
    if batch.trace_context:
        pb.trace_context.update(batch.trace_context)
    return pb


def stats_to_pb(stats: ServiceStats) -> predictor_pb2.PredictorStats:
    return predictor_pb2.PredictorStats(
        eamc_entries=stats.eamc_entries,
        live_requests=stats.live_requests,
        queries=stats.queries,
        mean_match_s=stats.mean_match_s,
        store_kind=stats.store_kind,
        store_errors=stats.store_errors,
        observed_tokens=stats.observed_tokens,
        requests_done=stats.requests_done,
        entries_inserted=stats.entries_inserted,
        inserts_pending=stats.inserts_pending,
        inserts_dropped=stats.inserts_dropped,
        requests_expired=stats.requests_expired,
        hint_batches_published=stats.hint_batches_published,
        hints_replaced=stats.hints_replaced,
        hints_dropped=stats.hints_dropped,
        subscribers=stats.subscribers,
        store_degraded=stats.store_degraded,
        live_bytes=stats.live_bytes,
        eamc_bytes=stats.eamc_bytes,
        eamc_reserved_bytes=stats.eamc_reserved_bytes,
        pending_insert_bytes=stats.pending_insert_bytes,
        refused=stats.refused,
        models=[
            predictor_pb2.ModelStats(
                model_id=m.model_id,
                eamc_entries=m.eamc_entries,
                num_moe_layers=m.layers,
                num_experts=m.num_experts,
                top_k=m.top_k,
                live_requests=m.live_requests,
            )
            for m in stats.models
        ],
    )


# -- the servicer ----------------------------------------------------------------------------
class PredictorServicer(predictor_pb2_grpc.PredictorServicer):
    """``moe.predictor.v1.Predictor`` over one ``PredictorService``."""

    def __init__(self, service: PredictorService) -> None:
        self._service = service

    def RegisterModel(
        self, request: predictor_pb2.RegisterModelRequest, context: grpc.ServicerContext
    ) -> predictor_pb2.RegisterModelResponse:
        shape, created = self._service.register_model(
            request.model_id, request.num_moe_layers, request.num_experts, request.top_k, client_of(context)
        )
        if created:
            logger.info("model %r registered by %s", request.model_id, client_of(context))
        return predictor_pb2.RegisterModelResponse(
            model_id=request.model_id,
            num_moe_layers=shape.layers,
            num_experts=shape.experts,
            top_k=shape.top_k,
            created=created,
        )

    def Observe(
        self, request_iterator: Iterator[predictor_pb2.Activation], context: grpc.ServicerContext
    ) -> predictor_pb2.ObserveSummary:
        summary = predictor_pb2.ObserveSummary()
        client = client_of(context)
        for msg in request_iterator:
            activation = activation_from_pb(msg, client)
            try:
                if telemetry.ENABLED and msg.trace_context:
                    finished = self._observe_traced(msg, activation)
                else:
                    finished = self._service.observe(activation)
            except RequestEnded:
                summary.activations_refused += 1
                continue
            except REQUEST_REFUSALS as exc:
                # One request's bad message ends that request, never the stream: the stream is
                # shared by every request of its compute.
                self._service.end_refused(activation, exc)
                summary.activations_refused += 1
                summary.requests_refused += 1
                if not summary.first_refusal:
                    summary.first_refusal = f"{status_code(exc).name}: {exc}"
                continue
            if finished:
                summary.requests_done += 1
            summary.activations += 1
        return summary

    def _observe_traced(self, msg: predictor_pb2.Activation, activation: Activation) -> bool:
        """One traced activation: an ``observe`` span under the request's Generate span (from
        ``Activation.trace_context``), linked to it too, current while the service publishes hints."""
        with telemetry.span_from_message(
            "observe",
            msg.trace_context,
            telemetry.SpanKind.CONSUMER,
            {
                "expertcache.model": msg.model_id,
                "expertcache.request_id": msg.request_id,
                "expertcache.token_index": msg.token_index,
                "expertcache.request_done": msg.request_done,
            },
        ):
            return self._service.observe(activation)

    def SubscribeHints(
        self, request: predictor_pb2.SubscribeHintsRequest, context: grpc.ServicerContext
    ) -> Iterator[predictor_pb2.HintBatch]:
        sub = self._service.subscribe(request.model_id, request.pod)
        # A cancelled client must not leave its subscription collecting hints.
        context.add_callback(sub.close)
        try:
            while context.is_active() and not sub.closed:
                batch = sub.get(SUBSCRIBE_POLL_S)
                if batch is not None:
                    if batch.trace_context and telemetry.ENABLED:
                        self._traced_send(batch)
                    yield hint_batch_to_pb(batch)
        finally:
            sub.close()

    @staticmethod
    def _traced_send(batch: PublishedHints) -> None:
        """A ``send_hints`` span: the batch leaves on a SubscribeHints stream (linked to its request)."""
        with telemetry.span_from_message(
            "send_hints",
            batch.trace_context,
            telemetry.SpanKind.PRODUCER,
            {"expertcache.request_id": batch.request_id, "expertcache.hints": len(batch.hints)},
        ):
            pass

    def GetStats(
        self, request: predictor_pb2.GetStatsRequest, context: grpc.ServicerContext
    ) -> predictor_pb2.PredictorStats:
        return stats_to_pb(self._service.stats())


def create_server(
    service: PredictorService,
    address: str,
    *,
    max_workers: int,
    security: ServerSecurity | None = None,
    reflection_enabled: bool = False,
    limits: TransportLimits | None = None,
    registry: Registry | None = None,
) -> tuple[LoopServer, Health]:
    """A started server on ``address`` (host:port); TLS / mTLS / bearer token as ``security``
    says (``expertcache.security``). Health turns SERVING once the service has loaded its EAMCs
    (``PredictorService.loaded``): a replica still loading would answer with empty hints."""
    servicer = PredictorServicer(service)
    server, health_servicer = build_server(
        address,
        [lambda s: predictor_pb2_grpc.add_PredictorServicer_to_server(servicer, s)],
        [SERVICE_NAME],
        max_workers=max_workers,
        security=security,
        reflection_enabled=reflection_enabled,
        limits=limits,
        registry=registry,
        name="predictor-grpc",
    )
    server.start()

    def serve_once_loaded() -> None:
        if not service.inserts.wait_loaded():  # closed before the EAMC was loaded
            return
        set_serving(health_servicer, [SERVICE_NAME])
        logger.info("EAMC loaded: %s SERVING", SERVICE_NAME)

    threading.Thread(target=serve_once_loaded, name="predictor-ready", daemon=True).start()
    logger.info("serving %s on %s (NOT_SERVING until the EAMC is loaded)", SERVICE_NAME, address)
    return server, health_servicer
