"""The gRPC edge shared by every service: error mapping, health, reflection.

Domain code raises ``expertcache.errors`` exceptions; ``ErrorInterceptor`` turns them into a
status with their message. Anything else becomes ``INTERNAL`` with the traceback logged, so a
client never sees an empty status or an empty reply on failure.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from expertcache import telemetry
from expertcache.errors import ExpertCacheError

logger = logging.getLogger(__name__)


def status_code(exc: ExpertCacheError) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, exc.grpc_code, grpc.StatusCode.INTERNAL)


def _abort(context: grpc.ServicerContext, exc: BaseException, method: str):
    if isinstance(exc, ExpertCacheError):
        context.abort(status_code(exc), str(exc))
    logger.error("unhandled error in %s", method, exc_info=exc)
    context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}: {type(exc).__name__}: {exc}")


class ErrorInterceptor(grpc.ServerInterceptor):
    """Maps domain exceptions to gRPC status codes for unary and streaming handlers."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method

        def wrap_unary(fn):
            def inner(request, context):
                try:
                    return fn(request, context)
                except Exception as exc:  # noqa: BLE001 - the edge maps every failure
                    if isinstance(exc, grpc.RpcError) and context.code() is not None:
                        raise
                    _abort(context, exc, method)

            return inner

        def wrap_stream(fn):
            def inner(request, context):
                try:
                    yield from fn(request, context)
                except Exception as exc:  # noqa: BLE001
                    if isinstance(exc, grpc.RpcError) and context.code() is not None:
                        raise
                    _abort(context, exc, method)

            return inner

        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                wrap_unary(handler.unary_unary), handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                wrap_stream(handler.unary_stream), handler.request_deserializer, handler.response_serializer
            )
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                wrap_unary(handler.stream_unary), handler.request_deserializer, handler.response_serializer
            )
        if handler.stream_stream:
            return grpc.stream_stream_rpc_method_handler(
                wrap_stream(handler.stream_stream), handler.request_deserializer, handler.response_serializer
            )
        return handler


def build_server(
    address: str,
    register: Iterable,
    service_names: Iterable[str],
    *,
    max_workers: int = 8,
    max_message_bytes: int = 64 << 20,
) -> tuple[grpc.Server, health.HealthServicer]:
    """A started-later server on ``address`` with health, reflection and error mapping.

    ``register`` holds callables ``f(server)`` that add servicers; ``service_names`` are the
    full names of those services (for health and reflection). Health starts NOT_SERVING for
    each name; call ``set_serving`` once the service is ready. With tracing on, the RPCs that are
    not long-lived streams get a server span with the caller's context from the metadata
    (``opentelemetry-instrumentation-grpc``; ``expertcache.telemetry``).
    """
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers),
        interceptors=[*telemetry.server_interceptors(), ErrorInterceptor()],
        options=[
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
        ],
    )
    for add in register:
        add(server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(service_names)
    for name in names:
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    if server.add_insecure_port(address) == 0 and not address.startswith("unix:"):
        raise OSError(f"cannot bind gRPC server to {address}")
    return server, health_servicer


def set_serving(health_servicer: health.HealthServicer, service_names: Iterable[str]) -> None:
    for name in [*service_names, ""]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
