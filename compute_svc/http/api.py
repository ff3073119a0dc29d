"""The OpenAI-compatible HTTP front door of compute: a Starlette app over the same ``Scheduler``
as the gRPC ``Inference`` service (no second engine).

Routes, a request's life, its bounds (those of a Generate over gRPC) and the errors:
docs/compute.md."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import hmac
import json
import logging
import secrets
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from compute_svc.engine.scheduler import RequestHandle, Scheduler
from compute_svc.errors import (
    Cancelled,
    DeadlineExceeded,
    ExpertCacheError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from compute_svc.http.guard import TRANSPORT_KEY
from compute_svc.http.openai_schema import (
    ApiError,
    ApiRequest,
    Completion,
    ServedModel,
    chat_request,
    completion_request,
    invalid,
    model_list,
)
from compute_svc.metrics import ComputeMetrics
from expertcache import telemetry
from expertcache.aio_bridge import LoopFeed, within
from expertcache.logs import RateLimitedLog
from expertcache.security import WatchedToken

logger = logging.getLogger(__name__)

ROUTES = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/health")
BODY_OVERHEAD_BYTES = 64 << 10  # the JSON around a prompt: field names, options, message roles
JSON_ESCAPE_FACTOR = 6  # a prompt byte may be sent as "\u00XX"
TOKEN_ID_CHARS = 8  # a token id in a JSON list: up to 7 digits and a comma
_REFUSAL_LOG_INTERVAL_S = 10.0
# What a stream may have written that its client has not taken before its writes block: the
# socket's send buffer (the kernel doubles it) and the transport's own.
STREAM_SEND_BUFFER = 32 << 10
STREAM_UNSENT_BYTES = 32 << 10
BODY_BUDGET_MIN_BYTES = 16 << 20
CLIENT_GONE = 499  # what a request whose client disconnected is counted as (nobody gets it)


@dataclass(frozen=True)
class HttpLimits:
    """What one HTTP request and all of them together may hold (from the service's config)."""

    max_body_bytes: int  # a request body; larger ones are refused (413) before parsing
    max_requests: int  # generation requests in progress at once; one more gets 429
    request_timeout_s: float  # the body must arrive within this (0: no limit)
    stream_stall_timeout_s: float  # a stream its client does not read for this long ends (0: no limit)
    max_requests_per_client: int = 0  # of max_requests, from one client address (0: no bound)
    body_budget_bytes: int = 0  # request bodies read or parsed at once (0: ``body_budget``'s default)

    @property
    def body_budget(self) -> int:
        """Bytes of request bodies read or being parsed at once, all requests together; by
        default two of the largest (parsing a body takes several times its size), at least
        16 MiB. A body is never refused by it, only made to wait."""
        if self.body_budget_bytes:
            return max(self.body_budget_bytes, self.max_body_bytes)
        return max(2 * self.max_body_bytes, BODY_BUDGET_MIN_BYTES)

    @staticmethod
    def body_bytes(max_prompt_bytes: int, max_prompt_tokens: int) -> int:
        """The largest body a prompt within the engine's limits can take: its text with every byte
        escaped, or its token ids written out, plus the rest of the JSON."""
        return (
            max(max_prompt_bytes * JSON_ESCAPE_FACTOR, max_prompt_tokens * TOKEN_ID_CHARS)
            + BODY_OVERHEAD_BYTES
        )


def error_of(exc: ExpertCacheError) -> ApiError:
    """A domain error as OpenAI's HTTP status and error type; an invalid argument's ``param`` is
    the field at fault, the engine's name for it (``GenerationRequest``) written as the body's."""
    message = str(exc)
    if isinstance(exc, InvalidArgument):
        field = {"max_new_tokens": "max_tokens", "token_ids": "prompt", "text": "prompt"}.get(
            exc.field, exc.field
        )
        return ApiError(400, message, type_="invalid_request_error", param=field)
    if isinstance(exc, ResourceExhausted):
        return ApiError(429, message, type_="rate_limit_error", code="rate_limit_exceeded")
    if isinstance(exc, Unavailable):
        return ApiError(503, message, type_="service_unavailable", code="service_unavailable")
    if isinstance(exc, DeadlineExceeded):
        return ApiError(504, message, type_="timeout", code="deadline_exceeded")
    if isinstance(exc, NotFound):
        return ApiError(404, message, type_="invalid_request_error", code="not_found")
    if isinstance(exc, Cancelled):
        return ApiError(499, message, type_="cancelled", code="cancelled")
    return ApiError(500, message, type_="server_error", code="internal_error")


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def _sse(data: dict | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


async def _watch_disconnect(receive: Receive, handle: RequestHandle) -> None:
    """Cancel ``handle`` when the client goes away (its batch place and pins go at once)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            handle.cancel()
            return


class _Stream(Response):
    """The SSE answer of a streaming request: an event per token, then ``data: [DONE]``."""

    media_type = "text/event-stream"

    def __init__(self, api: HttpApi, handle: RequestHandle, events: LoopFeed, completion: Completion) -> None:
        # Not Response.__init__: its empty body would declare content-length 0.
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-request-id": completion.id})
        self._api = api
        self._handle = handle
        self._events = events
        self._completion = completion

    async def _send(self, send: Send, body: bytes, more: bool = True) -> None:
        message = {"type": "http.response.body", "body": body, "more_body": more}
        stall = self._api.limits.stream_stall_timeout_s
        try:
            await within(send(message), stall)
        except TimeoutError:
            raise _Stalled(stall) from None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handle = self._handle
        bound_unsent(scope.get("extensions", {}).get(TRANSPORT_KEY))
        watcher = asyncio.ensure_future(_watch_disconnect(receive, handle))
        completion = self._completion
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            while True:
                try:
                    event = await self._events.next()
                except ExpertCacheError as exc:
                    if handle.cancelled:
                        return  # the client is gone: nobody to tell
                    await self._send(send, _sse(error_of(exc).body()), more=False)
                    return
                if event is None:
                    break
                completion.add(event)
                await self._send(send, _sse(completion.chunk(event)))
            if completion.request.include_usage:
                await self._send(send, _sse(completion.usage_chunk()))
            await self._send(send, _sse("[DONE]"), more=False)
        except _Stalled as stalled:
            # Returning with the response unfinished makes the server close the connection.
            self._api.stalled(scope, stalled.seconds)
        finally:
            handle.cancel()  # a finished request is unaffected
            watcher.cancel()


def bound_unsent(transport) -> None:
    """Bound what ``transport`` (a stream's connection) may hold that its client has not taken:
    its socket's send buffer and its own buffer, so that the stream's writes block (and its
    stall is seen) once the client stops reading."""
    if transport is None:
        return
    transport.set_write_buffer_limits(high=STREAM_UNSENT_BYTES)
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, STREAM_SEND_BUFFER)
        except OSError:
            pass  # not a socket that has one: the transport's bound alone


class _Stalled(Exception):  # noqa: N818 - what happened to the stream
    def __init__(self, seconds: float) -> None:
        super().__init__(f"the client took no event for {seconds:g} s (stream_stall_timeout_s)")
        self.seconds = seconds


class HttpApi:
    """The app and what it needs: the scheduler, the served model (a plain name: no aliases), the
    token, the bounds."""

    def __init__(
        self,
        scheduler: Scheduler,
        *,
        model: ServedModel | str,
        limits: HttpLimits,
        metrics: ComputeMetrics,
        token: WatchedToken | None = None,
        serving: Callable[[], bool] | None = None,
        pool_threads: int = 32,
    ) -> None:
        self.scheduler = scheduler
        self.model = model if isinstance(model, ServedModel) else ServedModel(model)
        self.limits = limits
        self.metrics = metrics
        self._token = token
        self._serving = serving or (lambda: scheduler.serving)
        self._created = int(time.time())
        # Generation requests in progress, all and per client address (on the loop only).
        self._active = 0
        self._active_of: dict[str, int] = {}
        self._body_bytes = 0  # request bodies being read or parsed (on the loop only)
        self._body_room: asyncio.Condition | None = None  # made on the loop, at the first wait
        self._pool = ThreadPoolExecutor(max_workers=pool_threads, thread_name_prefix="compute-http")
        self._log = RateLimitedLog(logger, _REFUSAL_LOG_INTERVAL_S)
        routes = [
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
        ]
        self._app = Starlette(routes=routes)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- the middleware: metrics, span, token ----------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        path = scope["path"]
        route = path if path in ROUTES else "other"
        started = time.perf_counter()
        status = 500

        async def send_counted(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            if telemetry.ENABLED:
                await self._traced(scope, receive, send_counted, route)
            else:
                await self._checked(scope, receive, send_counted)
        finally:
            self.metrics.http.record(route, status, time.perf_counter() - started)

    async def _traced(self, scope: Scope, receive: Receive, send: Send, route: str) -> None:
        headers = {
            k.decode("latin-1"): v.decode("latin-1")
            for k, v in scope["headers"]
            if k in (b"traceparent", b"tracestate")
        }
        parent = telemetry.extract(headers)
        status = {}

        async def send_seen(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        with telemetry.tracer().start_as_current_span(
            f"{scope['method']} {route}",
            context=parent,
            kind=telemetry.SpanKind.SERVER,
            attributes={
                "http.request.method": scope["method"],
                "http.route": route,
                "url.path": scope["path"],
            },
        ) as span:
            await self._checked(scope, receive, send_seen)
            if "code" in status:
                span.set_attribute("http.response.status_code", status["code"])

    async def _checked(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._token is not None and scope["path"].startswith("/v1/"):
            problem = self._auth_problem(scope)
            if problem is not None:
                self._log.log(logging.WARNING, problem, "refused %s: %s", scope["path"], problem)
                error = ApiError(401, problem, type_="invalid_request_error", code="invalid_api_key")
                await error_response(error)(scope, receive, send)
                return
        await self._app(scope, receive, send)

    def _auth_problem(self, scope: Scope) -> str | None:
        values = [v for k, v in scope["headers"] if k == b"authorization"]
        if not values:
            return "missing bearer token: send the header 'Authorization: Bearer <token>' (this server has auth_token_file set)"
        value = values[0].decode("latin-1")
        if len(values) > 1 or value[:7].lower() != "bearer ":
            return "malformed Authorization header: expected one 'Bearer <token>'"
        given = value[7:].strip().encode("latin-1")
        if not hmac.compare_digest(given, self._token.get()):
            return "invalid bearer token"
        return None

    # -- routes -----------------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        if self._serving():
            return JSONResponse({"status": "serving"})
        return JSONResponse({"status": "not_serving"}, status_code=503)

    async def models(self, request: Request) -> Response:
        return JSONResponse(model_list(self.model.name, self._created))

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, completion_request, "cmpl")

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat_request, "chatcmpl")

    async def _generate(self, request: Request, parse, prefix: str) -> Response:
        client = request.client.host if request.client else "?"
        refusal = self._refusal(client)
        if refusal is not None:
            return error_response(refusal)
        self._active += 1
        self._active_of[client] = self._active_of.get(client, 0) + 1
        handed_off = False
        try:
            request_id = f"{prefix}-{secrets.token_hex(12)}"
            limit = self.scheduler.engine.requests.limits.max_new_tokens
            api_request: ApiRequest = await self._parsed(
                request, functools.partial(parse, max_new_tokens_limit=limit, request_id=request_id)
            )
            if not self.model.named_by(api_request.model):
                raise ApiError(
                    404,
                    f"the model {api_request.model!r} does not exist here: this server serves {self.model.name!r}",
                    type_="invalid_request_error",
                    param="model",
                    code="model_not_found",
                )
            loop = asyncio.get_running_loop()
            context = contextvars.copy_context()  # the request's span: the engine's Generate parent
            submit = functools.partial(self.scheduler.submit, api_request.generation, client=client)
            handle = await loop.run_in_executor(self._pool, context.run, submit)
            # A pool thread hands the request's events to the loop as they come.
            events = LoopFeed(self._pool, loop, lambda: handle)
            completion = Completion(api_request, request_id)
            if api_request.stream:
                handed_off = True
                return _Counted(self, _Stream(self, handle, events, completion), client)
            return await self._whole(request, handle, events, completion)
        except ApiError as exc:
            return error_response(exc)
        except ExpertCacheError as exc:
            return error_response(error_of(exc))
        except ClientDisconnect:
            # Gone before its body arrived: nobody to answer, nothing to log.
            self.metrics.http.cut.labels(reason="client_disconnect").inc()
            return Response(status_code=CLIENT_GONE)
        finally:
            if not handed_off:
                self.release(client)

    def _refusal(self, client: str) -> ApiError | None:
        """429 when the server, or this client address, holds its maximum of requests."""
        per_client = self.limits.max_requests_per_client
        if self._active >= self.limits.max_requests:
            limit, message = (
                "http_max_requests",
                (
                    f"this server holds its maximum of {self.limits.max_requests} HTTP generation requests "
                    "(http_max_requests): retry later, with backoff"
                ),
            )
        elif per_client and self._active_of.get(client, 0) >= per_client:
            limit, message = (
                "max_requests_per_client",
                (
                    f"the client {client} holds its maximum of {per_client} HTTP generation requests "
                    "(max_client_share of http_max_requests): retry later, with backoff"
                ),
            )
        else:
            return None
        self.metrics.http.refused.labels(limit=limit).inc()
        return ApiError(429, message, type_="rate_limit_error", code="rate_limit_exceeded")

    def release(self, client: str) -> None:
        self._active -= 1
        left = self._active_of.get(client, 0) - 1
        if left > 0:
            self._active_of[client] = left
        else:
            self._active_of.pop(client, None)

    async def _whole(
        self, request: Request, handle: RequestHandle, events: LoopFeed, completion: Completion
    ) -> Response:
        watcher = asyncio.ensure_future(_watch_disconnect(request.receive, handle))
        try:
            while (event := await events.next()) is not None:
                completion.add(event)
        finally:
            handle.cancel()
            watcher.cancel()
        return JSONResponse(completion.whole(), headers={"x-request-id": completion.id})

    async def _parsed(self, request: Request, parse) -> ApiRequest:
        """The body read within ``max_body_bytes``, ``request_timeout_s`` and the bodies' byte
        budget, then decoded and ``parse``d in a pool thread (a large body's JSON is never
        decoded on the event loop, and no more of them at once than the budget holds)."""
        limit = self.limits.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            raise self._too_large(declared)
        share = int(declared) if declared is not None else limit
        timeout = self.limits.request_timeout_s
        loop = asyncio.get_running_loop()
        started = loop.time()
        await self._take_budget(share, timeout)
        try:
            chunks, size = [], 0

            async def read() -> None:
                nonlocal size
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise self._too_large(f"more than {limit}")
                    chunks.append(chunk)

            left = timeout - (loop.time() - started) if timeout > 0 else 0
            try:
                await within(read(), max(left, 1e-3) if timeout > 0 else 0)
            except TimeoutError:
                raise self._timed_out(timeout) from None
            body = b"".join(chunks)
            chunks.clear()
            return await loop.run_in_executor(self._pool, _decode_and_parse, body, parse)
        finally:
            self._give_budget(share)

    async def _take_budget(self, size: int, timeout: float) -> None:
        """Hold ``size`` bytes of the bodies' budget, waiting for them within ``timeout`` (408)."""
        budget = self.limits.body_budget
        if self._body_bytes + size <= budget:
            self._body_bytes += size
            return
        if self._body_room is None:
            self._body_room = asyncio.Condition()
        async with self._body_room:
            try:
                await within(self._body_room.wait_for(lambda: self._body_bytes + size <= budget), timeout)
            except TimeoutError:
                raise self._timed_out(timeout) from None
            self._body_bytes += size

    def _give_budget(self, size: int) -> None:
        self._body_bytes -= size
        if self._body_room is not None:
            room = self._body_room

            async def notify() -> None:
                async with room:
                    room.notify_all()

            asyncio.ensure_future(notify())

    def _timed_out(self, timeout: float) -> ApiError:
        self.metrics.http.cut.labels(reason="request_timeout").inc()
        return ApiError(
            408,
            f"the request body did not arrive within {timeout:g} s (request_timeout_s)",
            type_="invalid_request_error",
            code="request_timeout",
        )

    def _too_large(self, size: str) -> ApiError:
        self.metrics.http.refused.labels(limit="max_body_bytes").inc()
        return ApiError(
            413,
            f"the request body is {size} bytes; this server takes at most {self.limits.max_body_bytes} "
            "(derived from max_prompt_bytes and max_prompt_tokens)",
            type_="invalid_request_error",
            code="request_too_large",
        )

    def stalled(self, scope: Scope, seconds: float) -> None:
        self.metrics.http.cut.labels(reason="stall").inc()
        client = scope.get("client")
        self._log.log(
            logging.WARNING,
            "stall",
            "cut %s from %s: the client took no event for %g s (stream_stall_timeout_s); its request is cancelled",
            scope["path"],
            f"{client[0]}:{client[1]}" if client else "?",
            seconds,
        )


def _decode_and_parse(body: bytes, parse) -> ApiRequest:
    """A body's JSON, then ``parse`` of it (in a pool thread)."""
    try:
        decoded = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise invalid(None, f"the request body is not valid JSON: {exc}") from None
    del body
    return parse(decoded)


class _Counted(Response):
    """A streaming answer that gives its place among ``http_max_requests`` back when it ends."""

    def __init__(self, api: HttpApi, inner: Response, client: str) -> None:
        self._api = api
        self._inner = inner
        self._client = client

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self._inner(scope, receive, send)
        finally:
            self._api.release(self._client)
