"""The gRPC edge shared by every service: error mapping, health, reflection, security.

Domain code raises ``expertcache.errors`` exceptions; ``ErrorInterceptor`` turns them into a
status with their message. Anything else becomes ``INTERNAL`` with the traceback logged, so a
client never sees an empty status or an empty reply on failure. Request bytes that do not decode
as the method's message get ``INVALID_ARGUMENT`` (gRPC's own answer would be INTERNAL).

Interceptors run outermost first: the security ones (``expertcache.security``: the bearer token)
before ``ErrorInterceptor``, so an unauthenticated call never reaches a handler. Reflection is
served only when asked for (``reflection=True``; the services' ``--reflection`` flag).

The server itself is gRPC's asyncio one on a loop thread of its own (``expertcache.aio_bridge``),
bounded per connection, per client address and in all (``expertcache.transport``): a call that
waits for its request or for its reader holds no thread, and health always answers.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import grpc
from grpc_health.v1 import health
from grpc_reflection.v1alpha import reflection

from expertcache import telemetry
from expertcache.aio_bridge import NOT_SERVING, SERVING, Aborted, CallEnded, Health, LoopServer, set_all
from expertcache.errors import ExpertCacheError, InvalidArgument
from expertcache.logs import RateLimitedLog
from expertcache.prom import Registry
from expertcache.security import ServerSecurity
from expertcache.transport import StreamAccounting, TransportLimits

logger = logging.getLogger(__name__)
_unhandled = RateLimitedLog(logger)


def status_code(exc: ExpertCacheError) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, exc.grpc_code, grpc.StatusCode.INTERNAL)


def _abort(context: grpc.ServicerContext, exc: BaseException, method: str):
    if isinstance(exc, ExpertCacheError):
        context.abort(status_code(exc), str(exc))
    # A client can cause one per call: logged with its traceback at most once per 10 s per kind.
    _unhandled.log(
        logging.ERROR, f"{method} {type(exc).__name__}", "unhandled error in %s", method, exc_info=exc
    )
    context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}: {type(exc).__name__}: {exc}")


class _Undecodable:
    """Stands for a request message whose bytes did not parse (gRPC would answer INTERNAL)."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


def _tolerant(deserializer):
    if deserializer is None:
        return None

    def inner(data: bytes):
        try:
            return deserializer(data)
        except Exception as exc:  # noqa: BLE001 - any parse failure is the client's
            return _Undecodable(exc)

    return inner


def _undecodable(method: str, bad: _Undecodable) -> InvalidArgument:
    return InvalidArgument(
        f"the request to {method} is not a valid protobuf message of its type: {type(bad.error).__name__}: {bad.error}"
    )


def _checked_stream(requests, method: str):
    for request in requests:
        if isinstance(request, _Undecodable):
            raise _undecodable(method, request)
        yield request


class ErrorInterceptor(grpc.ServerInterceptor):
    """Maps domain exceptions to gRPC status codes for unary and streaming handlers, and
    undecodable request bytes to INVALID_ARGUMENT."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        streaming_requests = bool(handler.stream_unary or handler.stream_stream)

        def checked(request):
            if streaming_requests:
                return _checked_stream(request, method)
            if isinstance(request, _Undecodable):
                raise _undecodable(method, request)
            return request

        def wrap_unary(fn):
            def inner(request, context):
                try:
                    return fn(checked(request), context)
                except (Aborted, CallEnded):
                    raise  # the status is sent, or nobody is left to receive one
                except Exception as exc:  # noqa: BLE001 - the edge maps every failure
                    if isinstance(exc, grpc.RpcError) and context.code() is not None:
                        raise
                    _abort(context, exc, method)

            return inner

        def wrap_stream(fn):
            def inner(request, context):
                try:
                    yield from fn(checked(request), context)
                except (Aborted, CallEnded):
                    raise
                except Exception as exc:  # noqa: BLE001
                    if isinstance(exc, grpc.RpcError) and context.code() is not None:
                        raise
                    _abort(context, exc, method)

            return inner

        for kind, make, wrap in (
            ("unary_unary", grpc.unary_unary_rpc_method_handler, wrap_unary),
            ("unary_stream", grpc.unary_stream_rpc_method_handler, wrap_stream),
            ("stream_unary", grpc.stream_unary_rpc_method_handler, wrap_unary),
            ("stream_stream", grpc.stream_stream_rpc_method_handler, wrap_stream),
        ):
            fn = getattr(handler, kind)
            if fn:
                return make(wrap(fn), _tolerant(handler.request_deserializer), handler.response_serializer)
        return handler


def build_server(
    address: str,
    register: Iterable,
    service_names: Iterable[str],
    *,
    max_workers: int = 8,
    max_message_bytes: int = 64 << 20,
    security: ServerSecurity | None = None,
    reflection_enabled: bool = False,
    limits: TransportLimits | None = None,
    registry: Registry | None = None,
    name: str = "grpc",
) -> tuple[LoopServer, Health]:
    """A started-later server on ``address`` with health, error mapping, the configured
    security (TLS / mTLS / bearer token, ``expertcache.security``) and reflection, within the
    transport's ``limits`` (``expertcache.transport``; defaults when None).

    ``register`` holds callables ``f(server)`` that add servicers; ``service_names`` are the
    full names of those services (for health and reflection). Health starts NOT_SERVING for
    each name and for the server as a whole (``""``, what a Kubernetes gRPC probe asks by
    default): call ``set_serving`` once the service is ready. ``max_workers`` bounds the threads
    that run handlers' code (a call waiting for its request or its reader holds none). With
    tracing on, the RPCs that are not long-lived streams get a server span with the caller's
    context from the metadata (``opentelemetry-instrumentation-grpc``; ``expertcache.telemetry``).
    ``registry``: where the transport's refusals and cuts are counted on ``/metrics``.
    """
    security = security or ServerSecurity()
    limits = limits or TransportLimits.from_config()
    limits.check()
    accounting = StreamAccounting(limits)
    server = LoopServer(
        sync_interceptors=[*telemetry.server_interceptors(), *security.interceptors(), ErrorInterceptor()],
        accounting=accounting,
        options=[
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            # A server owns its port: a second one on it fails to start instead of silently
            # taking a share of the connections (gRPC's default on Linux is SO_REUSEPORT).
            ("grpc.so_reuseport", 0),
            *limits.server_options(),
        ],
        max_workers=max_workers,
        name=name,
    )
    if registry is not None:
        registry.add(accounting.stats.refused)
        registry.add(accounting.stats.cut)
    for add in register:
        add(server)
    names = list(service_names)
    set_all(server.health, names, NOT_SERVING)
    if reflection_enabled:
        reflection.enable_server_reflection(
            [*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server.aio
        )
    try:
        port = security.add_port(server, address)
    except BaseException:
        server.stop(0)
        raise
    if port == 0 and not address.startswith("unix:"):
        server.stop(0)
        raise OSError(f"cannot bind gRPC server to {address}")
    return server, server.health


def set_serving(health_status: Health, service_names: Iterable[str]) -> None:
    set_all(health_status, service_names, SERVING)
