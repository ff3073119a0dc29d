"""The services' synchronous servicers served by gRPC's asyncio core, on a loop of their own.

With gRPC's thread-per-call server a call holds a thread from its headers on: while its request
message has not arrived, and while its client does not read. A hundred such streams were enough to
take every thread of a replica, its health check included. Here the server is a ``grpc.aio``
server running on one event-loop thread (``LoopServer``), and only the handlers' own code runs in
the thread pool:

- every synchronous handler is turned into an asynchronous one (``Bridge``). A method with a
  single request message is served as a request *stream*, so that its handler starts at the
  call's headers: it is counted against ``expertcache.transport.StreamAccounting`` at once, and
  its request message is awaited on the loop for at most ``request_timeout_s``;
- a unary handler then runs in the pool; a streaming one runs its generator in a pool thread that
  hands each response to the loop without ever waiting for the client, while the loop writes them;
  a write the client does not take within ``stream_stall_timeout_s`` ends the call;
- the handlers keep the ``grpc.ServicerContext`` they were written for (``SyncContext``):
  ``add_callback`` callbacks run once when the call ends for any reason (client cancel, stall,
  server stop, completion), ``is_active`` turns false then, ``abort`` ends the call with its
  status as soon as its ``Aborted`` reaches the loop.

A handler's abort is sent as the call's status (``set_code``, ``set_details``) when the call
returns, not by ``grpc.aio``'s own ``abort``: that one keeps its ``AbortError`` on the call's state
for as long as the call lives, and the error's traceback holds the frames it went through, which
hold the call: a cycle, so every aborted call (its request, 1 MB of prompt text for a refused
prompt) stayed in memory until the cyclic garbage collector ran. The loop's own refusals (admission,
no request message, a stalled stream) end the same way (``_end``). Nothing of a call refers back
to it now, and what a call held is freed when it ends.

Health is served by gRPC's asynchronous health servicer on the loop itself, within a budget of its
own (``transport.HEALTH_STREAMS``): a probe needs no pool thread and no data-plane capacity.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import _async as health_async
from grpc_health.v1 import health_pb2, health_pb2_grpc

from expertcache.errors import ExpertCacheError
from expertcache.logs import RateLimitedLog
from expertcache.transport import StreamAccounting, TransportStats

logger = logging.getLogger(__name__)

_REFUSAL_LOG_INTERVAL_S = 10.0


class Aborted(Exception):  # noqa: N818 - the name says what happened, like grpc's own
    """Raised in a handler's thread by ``SyncContext.abort``: the status is already sent."""


class _Ended(Exception):  # noqa: N818 - raised by ``_end``, caught by the call's own coroutine
    """A call the loop ends: its status is set, and its coroutine returns."""


def _end(context: grpc.aio.ServicerContext, code: grpc.StatusCode, details: str):
    """End the call with ``code`` and ``details`` (``grpc.aio``'s ``abort`` would keep a cycle
    through the call: see the module docstring)."""
    context.set_code(code)
    context.set_details(details)
    raise _Ended


class CallEnded(grpc.RpcError):
    """Raised in a handler's thread reading requests of a call that has ended (the client went
    away, the server stopped): nothing is left to answer."""


class _Raised:
    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


_END = object()


class LoopFeed:
    """A synchronous iterator served on the event loop: a pool thread runs it and hands each item
    to the loop as it comes, never waiting for the consumer, so a reader that does not read holds
    no thread; the loop takes them with ``next``. The writer bounds each write on its side (the
    stall bound, ``within`` or a wait of its own). Used by the gRPC bridge's streaming handlers
    and by compute's HTTP front door.

    ``responses()`` makes the iterator in the pool thread; ``active()`` false stops taking from
    it; a generator is closed when it is left (its ``finally`` runs in that thread)."""

    def __init__(
        self,
        pool: ThreadPoolExecutor,
        loop: asyncio.AbstractEventLoop,
        responses: Callable[[], Iterable],
        active: Callable[[], bool] | None = None,
    ) -> None:
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self._responses = responses
        self._active = active
        pool.submit(self._produce)

    def _hand(self, item) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: the server stopped
            pass

    def _produce(self) -> None:
        responses = None
        try:
            responses = self._responses()
            for response in responses:
                self._hand(response)
                if self._active is not None and not self._active():
                    break
        except BaseException as exc:  # noqa: BLE001 - handed to the loop, which ends the call with it
            self._hand(_Raised(exc))
            return
        finally:
            close = getattr(responses, "close", None)
            if close is not None:
                close()
        self._hand(_END)

    async def next(self, end=None):
        """The next item; ``end`` once the iterator is done; raises what the iterator raised."""
        item = await self._queue.get()
        if item is _END:
            return end
        if isinstance(item, _Raised):
            try:
                raise item.error
            finally:
                del item  # the error's traceback holds this frame: no cycle through it
        return item


async def within(awaitable, seconds: float):
    """``awaitable``'s result, ``TimeoutError`` (and ``awaitable`` cancelled) after ``seconds``;
    no bound at 0: a request's arrival (``request_timeout_s``), a stream's write (its stall)."""
    return await (asyncio.wait_for(awaitable, seconds) if seconds > 0 else awaitable)


def _behavior(handler: grpc.RpcMethodHandler):
    return handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream


def is_async(handler: grpc.RpcMethodHandler) -> bool:
    behavior = _behavior(handler)
    return inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)


class SyncContext:
    """``grpc.ServicerContext`` for a synchronous handler running in the pool."""

    def __init__(self, context: grpc.aio.ServicerContext, loop: asyncio.AbstractEventLoop) -> None:
        self._context = context
        self._loop = loop
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []
        self._active = True
        self.aborted: tuple[grpc.StatusCode, str] | None = None  # the status ``abort`` asked for

    # -- the call's end ---------------------------------------------------------------------
    def is_active(self) -> bool:
        return self._active

    def add_callback(self, callback: Callable[[], None]) -> bool:
        """Runs ``callback`` once when the call ends; False (and not run) when it already has."""
        with self._lock:
            if not self._active:
                return False
            self._callbacks.append(callback)
            return True

    def end(self) -> None:
        """The call is over: mark it and run its callbacks (once, in this thread)."""
        with self._lock:
            if not self._active:
                return
            self._active = False
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            try:
                callback()
            except Exception:  # noqa: BLE001 - one callback must not keep the others from running
                logger.exception("a call's end callback failed")

    def end_soon(self) -> None:
        """``end`` without blocking the event loop: callbacks may take locks or join threads."""
        with self._lock:
            if not self._callbacks:
                self._active = False
                return
        threading.Thread(target=self.end, name="grpc-call-end", daemon=True).start()

    # -- what handlers ask of their context ---------------------------------------------------
    def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        """Ends the call with ``code`` and ``details``: the ``Aborted`` raised here carries them to
        the loop (``Bridge.call``), which sets them as the call's status and returns."""
        if code == grpc.StatusCode.OK:  # as grpc's own servers: an abort is never a success
            code, details = grpc.StatusCode.UNKNOWN, ""
        self.aborted = (code, details)
        raise Aborted(details)

    def abort_with_status(self, status) -> None:
        self.abort(status.code, status.details)

    def send_initial_metadata(self, metadata) -> None:
        asyncio.run_coroutine_threadsafe(self._context.send_initial_metadata(metadata), self._loop).result()

    def time_remaining(self) -> float | None:
        return self._context.time_remaining()

    def invocation_metadata(self):
        return self._context.invocation_metadata()

    def peer(self) -> str:
        return self._context.peer()

    def peer_identities(self):
        return self._context.peer_identities()

    def peer_identity_key(self):
        return self._context.peer_identity_key()

    def auth_context(self):
        return self._context.auth_context()

    def set_code(self, code) -> None:
        self._context.set_code(code)

    def code(self):
        return self.aborted[0] if self.aborted is not None else self._context.code()

    def set_details(self, details: str) -> None:
        self._context.set_details(details)

    def details(self):
        return self.aborted[1] if self.aborted is not None else self._context.details()

    def set_trailing_metadata(self, metadata) -> None:
        self._context.set_trailing_metadata(metadata)

    def trailing_metadata(self):
        return self._context.trailing_metadata()

    def set_compression(self, compression) -> None:
        self._context.set_compression(compression)

    def disable_next_message_compression(self) -> None:
        self._context.disable_next_message_compression()


class _Requests:
    """The request stream of a call as the synchronous iterator a handler expects."""

    def __init__(self, context: grpc.aio.ServicerContext, loop: asyncio.AbstractEventLoop, sync: SyncContext):
        self._context = context
        self._loop = loop
        self._sync = sync

    def __iter__(self):
        return self

    def __next__(self):
        if not self._sync.is_active():
            raise CallEnded()
        try:
            message = asyncio.run_coroutine_threadsafe(self._context.read(), self._loop).result()
        except Exception as exc:  # noqa: BLE001 - the call ended under the read
            raise CallEnded() from exc
        if message is grpc.aio.EOF:
            raise StopIteration
        return message


class Bridge(grpc.aio.ServerInterceptor):
    """The one aio interceptor: applies the services' synchronous interceptors (telemetry,
    security, error mapping: ``sync_interceptors``, outermost first) to each handler, then serves
    the result as an asynchronous handler within the transport's bounds."""

    def __init__(
        self,
        sync_interceptors: Sequence[grpc.ServerInterceptor],
        pool: ThreadPoolExecutor,
        accounting: StreamAccounting,
    ) -> None:
        self._interceptors = list(sync_interceptors)
        self._pool = pool
        self.accounting = accounting
        self._log = RateLimitedLog(logger, _REFUSAL_LOG_INTERVAL_S)

    @property
    def stats(self) -> TransportStats:
        return self.accounting.stats

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        if is_async(handler):
            return self._counted_async(handler, method)
        for interceptor in reversed(self._interceptors):
            handler = interceptor.intercept_service(
                lambda _details, inner=handler: inner, handler_call_details
            )
            if handler is None:
                return None
            refusal = getattr(_behavior(handler), "refusal", None)
            if refusal is not None:
                return self._refused(handler, method, *refusal)
        return self._bridged(handler, method)

    def _refused(
        self, handler: grpc.RpcMethodHandler, method: str, code, message: str
    ) -> grpc.RpcMethodHandler:
        """A call refused by its headers alone (no token): answered at once, its request unread."""

        async def refuse(_requests, context):  # logged (rate-limited) by the interceptor that refused it
            _set_status(context, code, message)

        return grpc.stream_stream_rpc_method_handler(
            refuse, handler.request_deserializer, handler.response_serializer
        )

    # -- admission ------------------------------------------------------------------------------
    async def _admit(self, context: grpc.aio.ServicerContext, method: str):
        try:
            return self.accounting.admit(context.peer(), method)
        except ExpertCacheError as exc:
            self._log.log(
                logging.WARNING, f"refused:{method}", "refused %s from %s: %s", method, context.peer(), exc
            )
            _end(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))

    async def _first_message(self, context: grpc.aio.ServicerContext, method: str):
        timeout = self.accounting.limits.request_timeout_s
        try:
            message = await within(context.read(), timeout)
        except TimeoutError:
            self.stats.cut.labels("request_timeout").inc()
            self._log.log(
                logging.WARNING,
                f"timeout:{method}",
                "cut %s from %s: no request message within %g s",
                method,
                context.peer(),
                timeout,
            )
            _end(
                context,
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"no request message arrived within {timeout:g} s of the call's headers (request_timeout_s)",
            )
        if message is grpc.aio.EOF:
            _end(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{method} takes one request message; the call ended without one",
            )
        return message

    # -- asynchronous handlers (health) ---------------------------------------------------------
    def _counted_async(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        bridge = self
        if handler.unary_unary:
            inner = handler.unary_unary

            async def unary_unary(request, context):
                try:
                    ticket = await bridge._admit(context, method)
                except _Ended:
                    return None
                try:
                    return await inner(request, context)
                finally:
                    bridge.accounting.release(ticket)

            return grpc.unary_unary_rpc_method_handler(
                unary_unary, handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_stream and inspect.isasyncgenfunction(handler.unary_stream):
            inner_stream = handler.unary_stream

            async def unary_stream(request, context):
                try:
                    ticket = await bridge._admit(context, method)
                except _Ended:
                    return
                try:
                    async for response in inner_stream(request, context):
                        yield response
                finally:
                    bridge.accounting.release(ticket)

            return grpc.unary_stream_rpc_method_handler(
                unary_stream, handler.request_deserializer, handler.response_serializer
            )
        return handler

    # -- synchronous handlers --------------------------------------------------------------------
    def _bridged(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        unary_request = not handler.request_streaming
        behavior = _behavior(handler)
        bridge = self

        async def call(requests, context):
            try:
                return await serve(context)
            except _Ended:
                return None

        async def serve(context):
            loop = asyncio.get_running_loop()
            ticket = await bridge._admit(context, method)
            sync = SyncContext(context, loop)
            try:
                request = (
                    await bridge._first_message(context, method)
                    if unary_request
                    else _Requests(context, loop, sync)
                )
                if handler.response_streaming:
                    await bridge._stream(behavior, request, context, sync, method, loop)
                    return None
                try:
                    response = await loop.run_in_executor(bridge._pool, behavior, request, sync)
                except Aborted:
                    if sync.aborted is None:
                        raise
                    _set_status(context, *sync.aborted)
                    return None
                await context.write(response)
                return None
            finally:
                bridge.accounting.release(ticket)
                sync.end_soon()

        # Served as a request stream whatever the method's own arity, so that ``call`` starts at
        # the call's headers (the wire format of one request message is the same).
        return grpc.stream_stream_rpc_method_handler(
            call, handler.request_deserializer, handler.response_serializer
        )

    async def _stream(self, behavior, request, context, sync: SyncContext, method: str, loop) -> None:
        feed = LoopFeed(self._pool, loop, lambda: behavior(request, sync), sync.is_active)
        stall = self.accounting.limits.stream_stall_timeout_s
        watch = (
            _WriteWatch(loop, stall, lambda: self._stalled(context, sync, method, stall))
            if stall > 0
            else None
        )
        try:
            while True:
                try:
                    item = await feed.next(_END)
                except Aborted:
                    if sync.aborted is None:
                        raise
                    _set_status(context, *sync.aborted)
                    return
                except CallEnded:
                    return
                if item is _END:
                    return
                if watch is None:
                    await context.write(item)
                    continue
                watch.writing()
                await context.write(item)
                if watch.written():  # it took the client longer than the stall bound
                    _end(
                        context,
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"the client took no response for {stall:g} s (stream_stall_timeout_s): the stream was cancelled",
                    )
        finally:
            if watch is not None:
                watch.close()

    def _stalled(self, context, sync: SyncContext, method: str, stall: float) -> None:
        """The client has not taken a response for ``stall`` seconds: release what its call holds
        (for Generate: its request leaves the batch, its pins go), so that nothing else waits for
        it. No status can pass the responses it has not read, so the call stays counted (against
        the bounds of its address) until the client reads, cancels or loses its connection (the
        write in progress then ends, and the call with it); it holds no thread meanwhile."""
        self.stats.cut.labels("stall").inc()
        self._log.log(
            logging.WARNING,
            f"stall:{method}",
            "cut %s from %s: the client took no response for %g s (stream_stall_timeout_s); its request is cancelled",
            method,
            context.peer(),
            stall,
        )
        sync.end_soon()


class _WriteWatch:
    """The stall bound of one response stream, with one timer for the whole stream rather than a
    task and a timeout per response: ``writing`` before each write, ``written`` after it (True
    when the bound passed meanwhile: ``on_stall`` was called once, at the bound)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, stall: float, on_stall: Callable[[], None]) -> None:
        self._loop = loop
        self._stall = stall
        self._on_stall = on_stall
        self._since: float | None = None  # loop time the write in progress began
        self._stalled = False
        self._timer: asyncio.TimerHandle | None = None

    def writing(self) -> None:
        self._since = self._loop.time()
        if self._timer is None:
            self._timer = self._loop.call_at(self._since + self._stall, self._check)

    def written(self) -> bool:
        self._since = None
        return self._stalled

    def _check(self) -> None:
        self._timer = None
        since = self._since
        if since is None:  # no write in progress: the next one arms it again
            return
        due = since + self._stall
        if self._loop.time() >= due:
            self._stalled = True
            self._on_stall()
        else:  # a later write than the one it was armed for
            self._timer = self._loop.call_at(due, self._check)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def _set_status(context: grpc.aio.ServicerContext, code: grpc.StatusCode, details: str) -> None:
    """The status a handler's ``SyncContext.abort`` asked for, sent when the call returns."""
    context.set_code(code)
    context.set_details(details)


class Health:
    """The health statuses of one server, set from any thread (the servicer lives on the loop)."""

    def __init__(self, servicer: health_async.HealthServicer, loop: asyncio.AbstractEventLoop) -> None:
        self.servicer = servicer
        self._loop = loop

    def _run(self, coroutine) -> None:
        if self._loop.is_closed() or not self._loop.is_running():
            coroutine.close()
            return
        asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=10.0)

    def set(self, service: str, status) -> None:
        self._run(self.servicer.set(service, status))

    def enter_graceful_shutdown(self) -> None:
        self._run(self.servicer.enter_graceful_shutdown())


class LoopServer:
    """A ``grpc.aio`` server on an event loop thread of its own, with the synchronous
    ``grpc.Server`` methods the services call (``start``, ``stop(grace).wait()``,
    ``wait_for_termination``, ``add_*_port``, handler registration)."""

    def __init__(
        self,
        *,
        sync_interceptors: Sequence[grpc.ServerInterceptor],
        accounting: StreamAccounting,
        options: Iterable[tuple[str, object]],
        max_workers: int,
        name: str = "grpc",
    ) -> None:
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=f"{name}-handler")
        self.bridge = Bridge(sync_interceptors, self._pool, accounting)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"{name}-loop", daemon=True)
        self._thread.start()
        self._stopped = threading.Event()
        self._stopping = False
        options = list(options)

        async def make() -> grpc.aio.Server:
            return grpc.aio.server(interceptors=[self.bridge], options=options)

        self.aio = self._call(make())
        servicer = health_async.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, self.aio)
        self.health = Health(servicer, self._loop)

    @property
    def stats(self) -> TransportStats:
        return self.bridge.stats

    def _call(self, coroutine, timeout: float | None = 30.0):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=timeout)

    def _sync(self, fn, *args):
        async def run():
            return fn(*args)

        return self._call(run())

    # -- grpc.Server's surface ------------------------------------------------------------------
    def add_generic_rpc_handlers(self, handlers) -> None:
        self._sync(self.aio.add_generic_rpc_handlers, handlers)

    def add_registered_method_handlers(self, service_name, method_handlers) -> None:
        self._sync(self.aio.add_registered_method_handlers, service_name, method_handlers)

    def add_insecure_port(self, address: str) -> int:
        return self._sync(self.aio.add_insecure_port, address)

    def add_secure_port(self, address: str, credentials) -> int:
        return self._sync(self.aio.add_secure_port, address, credentials)

    def start(self) -> None:
        self._call(self.aio.start())

    def stop(self, grace: float | None) -> threading.Event:
        """Refuse new calls, give those in progress ``grace`` seconds, then cancel them; the
        event is set once the server and its loop are down."""
        if self._stopping:
            return self._stopped
        self._stopping = True

        def finish(_future=None) -> None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10.0)
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._stopped.set()

        future = asyncio.run_coroutine_threadsafe(self.aio.stop(grace), self._loop)
        future.add_done_callback(
            lambda f: threading.Thread(target=finish, name="grpc-stop", daemon=True).start()
        )
        return self._stopped

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        """True when ``timeout`` passed first (``grpc.Server``'s contract)."""
        return not self._stopped.wait(timeout)


def set_all(health: Health, service_names: Iterable[str], status) -> None:
    for name in [*service_names, ""]:
        health.set(name, status)


SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
