"""The OpenAI-compatible HTTP front door of compute: a Starlette app over the same ``Scheduler``
as the gRPC ``Inference`` service (no second engine).

::

    GET  /v1/models               the served checkpoint (its manifest's model id)
    POST /v1/completions          prompt text or token ids → text   (stream: SSE, ``data: [DONE]``)
    POST /v1/chat/completions     messages, the checkpoint's chat template → text
    GET  /health                  200 while serving, 503 otherwise (no token needed: for probes)

A request's life: the middleware counts it (``moe_compute_http_requests_total{route,status}``,
``moe_compute_http_request_duration_seconds{route}``), opens its span (the parent from a W3C
``traceparent`` header; the engine's Generate span becomes its child) and checks the bearer token
(``auth_token_file``, the gRPC services' token, compared in constant time). The body is read
within ``max_body_bytes`` (derived from the prompt limits, refused with 413 before parsing) and
``request_timeout_s``; ``compute_svc.openai_schema`` turns it into a ``GenerationRequest``, which
is submitted to the scheduler in a pool thread (tokenising is not done on the loop). A pool thread
then hands the request's events to the loop as they come; the loop writes them.

Bounds, the same as a Generate over gRPC: the engine's ``RequestLimits`` and the scheduler's
admission (``QueueFull`` → 429); at most ``http_max_requests`` generation requests at once (429
beyond); a client that disconnects cancels its request at once (its batch place and pins go);
one that does not read its stream for ``stream_stall_timeout_s`` has its request cancelled and its
connection closed, like gRPC's stalled stream.

Errors use OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: 400 naming the
field, 401 without the token, 404 for another model, 413 for a body too large, 429 when admission
refuses, 503 while draining or without the cache daemon, 504 past a deadline. An error after a
stream has begun is sent as one last ``data: {"error": ...}`` event (no ``[DONE]``).
"""

from __future__ import annotations

import asyncio
import contextvars
import hmac
import json
import logging
import secrets
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from compute_svc.errors import (
    Cancelled,
    DeadlineExceeded,
    ExpertCacheError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from compute_svc.metrics import ComputeMetrics
from compute_svc.openai_schema import (
    ApiError,
    ApiRequest,
    Completion,
    chat_request,
    completion_request,
    invalid,
    model_list,
)
from compute_svc.scheduler import RequestHandle, Scheduler
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


@dataclass(frozen=True)
class HttpLimits:
    """What one HTTP request and all of them together may hold (from the service's config)."""

    max_body_bytes: int  # a request body; larger ones are refused (413) before parsing
    max_requests: int  # generation requests in progress at once; one more gets 429
    request_timeout_s: float  # the body must arrive within this (0: no limit)
    stream_stall_timeout_s: float  # an SSE event the client does not take within this ends it (0: no limit)

    @staticmethod
    def body_bytes(max_prompt_bytes: int, max_prompt_tokens: int) -> int:
        """The largest body a prompt within the engine's limits can take: its text with every byte
        escaped, or its token ids written out, plus the rest of the JSON."""
        return (
            max(max_prompt_bytes * JSON_ESCAPE_FACTOR, max_prompt_tokens * TOKEN_ID_CHARS)
            + BODY_OVERHEAD_BYTES
        )


def error_of(exc: ExpertCacheError) -> ApiError:
    """A domain error as OpenAI's HTTP status and error type."""
    message = str(exc)
    if isinstance(exc, InvalidArgument):
        return ApiError(400, message, type_="invalid_request_error")
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


class _Stalled(Exception):  # noqa: N818 - what happened to the stream
    def __init__(self, seconds: float) -> None:
        super().__init__(f"the client took no event for {seconds:g} s (stream_stall_timeout_s)")
        self.seconds = seconds


class HttpApi:
    """The app and what it needs: the scheduler, the model's id, the token, the bounds."""

    def __init__(
        self,
        scheduler: Scheduler,
        *,
        model_id: str,
        limits: HttpLimits,
        metrics: ComputeMetrics,
        token: WatchedToken | None = None,
        serving: Callable[[], bool] | None = None,
        pool_threads: int = 32,
    ) -> None:
        self.scheduler = scheduler
        self.model_id = model_id
        self.limits = limits
        self.metrics = metrics
        self._token = token
        self._serving = serving or (lambda: scheduler.serving)
        self._created = int(time.time())
        self._active = 0  # generation requests in progress (read and written on the loop only)
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
            self.metrics.record_http(route, status, time.perf_counter() - started)

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
        return JSONResponse(model_list(self.model_id, self._created))

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, completion_request, "cmpl")

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat_request, "chatcmpl")

    async def _generate(self, request: Request, parse, prefix: str) -> Response:
        if self._active >= self.limits.max_requests:
            self.metrics.http_refused.labels(limit="http_max_requests").inc()
            return error_response(
                ApiError(
                    429,
                    f"this server holds its maximum of {self.limits.max_requests} HTTP generation requests "
                    "(http_max_requests): retry later, with backoff",
                    type_="rate_limit_error",
                    code="rate_limit_exceeded",
                )
            )
        self._active += 1
        handed_off = False
        try:
            body = await self._body(request)
            request_id = f"{prefix}-{secrets.token_hex(12)}"
            api_request: ApiRequest = parse(
                body,
                max_new_tokens_limit=self.scheduler.engine.requests.limits.max_new_tokens,
                request_id=request_id,
            )
            if api_request.model != self.model_id:
                raise ApiError(
                    404,
                    f"the model {api_request.model!r} does not exist here: this server serves {self.model_id!r}",
                    type_="invalid_request_error",
                    param="model",
                    code="model_not_found",
                )
            loop = asyncio.get_running_loop()
            context = contextvars.copy_context()  # the request's span: the engine's Generate parent
            handle = await loop.run_in_executor(
                self._pool, context.run, self.scheduler.submit, api_request.generation
            )
            # A pool thread hands the request's events to the loop as they come.
            events = LoopFeed(self._pool, loop, lambda: handle)
            completion = Completion(api_request, request_id)
            if api_request.stream:
                handed_off = True
                return _Counted(self, _Stream(self, handle, events, completion))
            return await self._whole(request, handle, events, completion)
        except ApiError as exc:
            return error_response(exc)
        except ExpertCacheError as exc:
            return error_response(error_of(exc))
        finally:
            if not handed_off:
                self._active -= 1

    def release(self) -> None:
        self._active -= 1

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

    async def _body(self, request: Request) -> object:
        """The JSON body, read within ``max_body_bytes`` and ``request_timeout_s``."""
        limit = self.limits.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            raise self._too_large(declared)
        chunks, size = [], 0

        async def read() -> None:
            nonlocal size
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise self._too_large(f"more than {limit}")
                chunks.append(chunk)

        timeout = self.limits.request_timeout_s
        try:
            await within(read(), timeout)
        except TimeoutError:
            self.metrics.http_cut.labels(reason="request_timeout").inc()
            raise ApiError(
                408,
                f"the request body did not arrive within {timeout:g} s (request_timeout_s)",
                type_="invalid_request_error",
                code="request_timeout",
            ) from None
        try:
            return json.loads(b"".join(chunks))
        except (ValueError, RecursionError) as exc:
            raise invalid(None, f"the request body is not valid JSON: {exc}") from None

    def _too_large(self, size: str) -> ApiError:
        self.metrics.http_refused.labels(limit="max_body_bytes").inc()
        return ApiError(
            413,
            f"the request body is {size} bytes; this server takes at most {self.limits.max_body_bytes} "
            "(derived from max_prompt_bytes and max_prompt_tokens)",
            type_="invalid_request_error",
            code="request_too_large",
        )

    def stalled(self, scope: Scope, seconds: float) -> None:
        self.metrics.http_cut.labels(reason="stall").inc()
        client = scope.get("client")
        self._log.log(
            logging.WARNING,
            "stall",
            "cut %s from %s: the client took no event for %g s (stream_stall_timeout_s); its request is cancelled",
            scope["path"],
            f"{client[0]}:{client[1]}" if client else "?",
            seconds,
        )


class _Counted(Response):
    """A streaming answer that gives its place among ``http_max_requests`` back when it ends."""

    def __init__(self, api: HttpApi, inner: Response) -> None:
        self._api = api
        self._inner = inner

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self._inner(scope, receive, send)
        finally:
            self._api.release()
