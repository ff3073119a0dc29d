"""The HTTP API's pieces without a server: OpenAI bodies → GenerationRequest, answers, the bounds,
and a stalled SSE reader (its request cancelled, like gRPC's stalled stream)."""

from __future__ import annotations

import asyncio
import json

import pytest

from compute_svc.engine.generation import FinishReason, TokenEvent, TokenStats
from compute_svc.engine.requests import ChatMessage
from compute_svc.engine.scheduler import _DONE, RequestHandle
from compute_svc.http.api import HttpLimits, _Stream, error_of
from compute_svc.http.openai_schema import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    ZERO_SEED,
    ApiError,
    Completion,
    chat_request,
    completion_request,
)
from compute_svc.metrics import ComputeMetrics
from expertcache.aio_bridge import LoopFeed
from expertcache.errors import InvalidArgument, ResourceExhausted, Unavailable
from tests.asgi import asgi_call


def completion(**body):
    return completion_request({"model": "m", "prompt": "hi", **body}, max_new_tokens_limit=64, request_id="r")


def chat(**body):
    messages = body.pop("messages", [{"role": "user", "content": "hi"}])
    return chat_request({"model": "m", "messages": messages, **body}, max_new_tokens_limit=64, request_id="r")


def test_completion_fields_map_onto_the_generation_request():
    req = completion(prompt=[5, 6, 7], max_tokens=9, temperature=0.5, top_p=0.8, seed=3, stop=["x", "yz"])
    g = req.generation
    assert (g.token_ids, g.text, g.max_new_tokens, g.stop, g.request_id) == (
        (5, 6, 7),
        "",
        9,
        ("x", "yz"),
        "r",
    )
    assert (g.sampling.temperature, g.sampling.top_p, g.sampling.seed) == (0.5, 0.8, 3)
    defaults = completion().generation
    assert defaults.max_new_tokens == COMPLETIONS_DEFAULT_MAX_TOKENS and defaults.text == "hi"
    assert (
        defaults.sampling.temperature == 1.0 and defaults.sampling.seed == 0
    )  # OpenAI's default; fresh seed
    assert completion(seed=0).generation.sampling.seed == ZERO_SEED  # a seed like any other, not "fresh"
    assert completion(stop="end").generation.stop == ("end",)


def test_chat_content_parts_and_defaults():
    req = chat(
        messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    )
    assert req.generation.messages == (ChatMessage("user", "ab"),)
    assert req.chat and req.generation.max_new_tokens == 64  # the service's limit
    assert chat(max_completion_tokens=5).generation.max_new_tokens == 5
    assert chat(logprobs=True).generation.logprobs


@pytest.mark.parametrize(
    ("build", "param", "message"),
    [
        (lambda: completion(model=""), "model", "'model' is required"),
        (lambda: completion(prompt=None), "prompt", "'prompt' must be"),
        (lambda: completion(max_tokens=65), "max_tokens", "'max_tokens' 65 is out of range [1, 64]"),
        (lambda: completion(max_tokens="3"), "max_tokens", "'max_tokens' must be an integer"),
        (lambda: completion(top_p=0), "top_p", "'top_p' 0 is out of range (0, 1]"),
        (lambda: completion(temperature=float("nan")), "temperature", "'temperature' must be a number"),
        (lambda: completion(stop=["a"] * 5), "stop", "at most 4"),
        (lambda: completion(stop=[""]), "stop", "empty string"),
        (lambda: completion(logprobs=2), "logprobs", "not supported"),
        (lambda: completion(n=3), "n", "'n' must be 1"),
        (lambda: completion(frequency_penalty=1), "frequency_penalty", "not supported"),
        (lambda: completion(tools=[{"type": "function"}]), "tools", "not supported"),
        (lambda: completion(stream="yes"), "stream", "must be a boolean"),
        (lambda: chat(messages=[]), "messages", "non-empty list"),
        (lambda: chat(messages=[{"content": "x"}]), "messages[0]", "string 'role'"),
        (
            lambda: chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
            "messages[0].content[0]",
            "text",
        ),
        (lambda: chat(top_logprobs=2), "top_logprobs", "not supported"),
    ],
)
def test_bad_fields_are_400_naming_the_field(build, param, message):
    with pytest.raises(ApiError) as info:
        build()
    assert info.value.status == 400 and info.value.param == param and message in info.value.message
    assert set(info.value.body()["error"]) == {"message", "type", "param", "code"}


def test_domain_errors_get_openai_statuses():
    assert error_of(InvalidArgument("x")).status == 400
    assert error_of(ResourceExhausted("x")).status == 429
    assert error_of(Unavailable("x")).status == 503


def event(i: int, text: str, finish=None, prompt=None, logprob=None) -> TokenEvent:
    return TokenEvent(i, 100 + i, text, 0.01, TokenStats(), finish, prompt, logprob)


def test_completion_answers_whole_and_as_chunks():
    req = completion(logprobs=0)
    c = Completion(req, "cmpl-1")
    c.add(event(0, "Hel", prompt=4, logprob=-0.5))
    c.add(event(1, "lo", FinishReason.EOS, logprob=-1.0))
    whole = c.whole()
    assert whole["choices"][0]["text"] == "Hello" and whole["choices"][0]["finish_reason"] == "stop"
    assert whole["usage"] == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}
    assert whole["choices"][0]["logprobs"] == {
        "tokens": ["Hel", "lo"],
        "token_logprobs": [-0.5, -1.0],
        "top_logprobs": None,
        "text_offset": [0, 3],
    }
    streamed = chat(stream=True)
    s = Completion(streamed, "chatcmpl-1")
    s.add(event(0, "a", prompt=2))
    first = s.chunk(event(0, "a", prompt=2))
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "a"}
    s.add(event(1, "b", FinishReason.LENGTH))
    last = s.chunk(event(1, "b", FinishReason.LENGTH))
    assert last["choices"][0] == {
        "index": 0,
        "delta": {"content": "b"},
        "logprobs": None,
        "finish_reason": "length",
    }


def test_body_limit_covers_an_escaped_prompt_or_its_token_ids():
    assert HttpLimits.body_bytes(1 << 20, 1000) == 6 * (1 << 20) + (64 << 10)
    assert HttpLimits.body_bytes(1000, 1 << 20) == 8 * (1 << 20) + (64 << 10)


class _Prepared:
    class request:  # noqa: N801 - stands for a GenerationRequest
        request_id = "r"
        deadline = None


class _Api:
    def __init__(self, stall_s: float) -> None:
        self.limits = HttpLimits(
            max_body_bytes=1 << 20, max_requests=4, request_timeout_s=0, stream_stall_timeout_s=stall_s
        )
        self.metrics = ComputeMetrics()
        self.stalls = []

    def stalled(self, scope, seconds):
        self.metrics.http.cut.labels(reason="stall").inc()
        self.stalls.append(seconds)


def test_stalled_reader_is_cut_and_its_request_cancelled():
    """The client takes the headers and the first event, then reads nothing: after
    stream_stall_timeout_s its request is cancelled (batch place and pins go) and the stream ends."""

    async def run():
        from concurrent.futures import ThreadPoolExecutor

        # No scheduler here: the handle's cancel ends its events as the scheduler's step would.
        handle = RequestHandle(_Prepared(), lambda: handle._put(_DONE))
        for i in range(3):
            handle._put(event(i, "x"))
        pool = ThreadPoolExecutor(2)
        events = LoopFeed(pool, asyncio.get_running_loop(), lambda: handle)
        api = _Api(0.2)
        sent = []
        never = asyncio.Event()

        async def send(message):
            sent.append(message)
            if message["type"] == "http.response.body" and len(sent) > 2:
                await never.wait()  # the client's window is full: the write never completes

        async def receive():
            await never.wait()

        stream = _Stream(api, handle, events, Completion(completion(stream=True), "cmpl-1"))
        await asyncio.wait_for(stream({"type": "http", "path": "/v1/completions"}, receive, send), 5)
        pool.shutdown(wait=False, cancel_futures=True)
        return handle, api, sent

    handle, api, sent = asyncio.run(run())
    assert handle.cancelled
    assert api.stalls == [0.2] and api.metrics.value("moe_compute_http_cut_total", reason="stall") == 1
    assert sent[0]["status"] == 200 and dict(sent[0]["headers"])[b"content-type"].startswith(
        b"text/event-stream"
    )
    assert b"content-length" not in dict(sent[0]["headers"])
    assert json.loads(sent[1]["body"][6:])["choices"][0]["text"] == "x"


class _Limits:
    max_new_tokens = 64


class _Scheduler:
    """Records the span current where the engine would take its Generate span's parent."""

    def __init__(self) -> None:
        self.engine = type("Engine", (), {"requests": type("RequestCheck", (), {"limits": _Limits()})()})()
        self.parent = None
        self.serving = True

    def submit(self, request, client=None):
        from opentelemetry import trace

        self.parent = trace.get_current_span().get_span_context()
        # No scheduler here: the handle's cancel ends its events as the scheduler's step would.
        handle = RequestHandle(_Prepared(), lambda: handle._put(_DONE))
        handle._put(event(0, "ok", FinishReason.LENGTH, prompt=1))
        from compute_svc.engine.scheduler import _DONE

        handle._put(_DONE)
        return handle


def test_the_http_span_continues_the_callers_trace_and_parents_the_generate():
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from compute_svc.http.api import HttpApi
    from expertcache import telemetry

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    telemetry.install(provider)
    scheduler = _Scheduler()
    api = HttpApi(scheduler, model="m", limits=_Api(0).limits, metrics=ComputeMetrics())
    try:
        trace_id, caller = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
        status, body = asgi_call(
            api,
            "POST",
            "/v1/completions",
            {"model": "m", "prompt": "hi", "max_tokens": 1},
            [(b"traceparent", f"00-{trace_id}-{caller}-01".encode())],
        )
    finally:
        api.close()
        telemetry.shutdown()
    assert status == 200 and json.loads(body)["choices"][0]["text"] == "ok"
    (span,) = exporter.get_finished_spans()
    assert span.name == "POST /v1/completions" and span.attributes["http.response.status_code"] == 200
    assert format(span.context.trace_id, "032x") == trace_id and format(span.parent.span_id, "016x") == caller
    # What the engine's Generate span takes as its parent: the HTTP span, in the submit's pool thread.
    assert scheduler.parent.span_id == span.context.span_id
    assert api.metrics.value("moe_compute_http_requests_total", route="/v1/completions", status="200") == 1


def test_bodies_wait_for_the_byte_budget_and_are_parsed_off_the_event_loop(monkeypatch):
    """Budget 2,000 bytes, bodies of 900: two are read at once, the third waits until one is
    parsed; every body is decoded and parsed in a pool thread, never on the event loop's."""
    import threading

    import compute_svc.http.api as http_api
    from compute_svc.http.api import HttpApi

    parsed_on: list[str] = []
    real = http_api.completion_request

    def parse(body, **kw):
        parsed_on.append(threading.current_thread().name)
        return real(body, **kw)

    monkeypatch.setattr(http_api, "completion_request", parse)
    limits = HttpLimits(
        max_body_bytes=1000,
        max_requests=8,
        request_timeout_s=30,
        stream_stall_timeout_s=0,
        body_budget_bytes=2000,
    )
    api = HttpApi(_Scheduler(), model="m", limits=limits, metrics=ComputeMetrics())

    async def run():
        body = json.dumps({"model": "m", "prompt": "x" * 800, "max_tokens": 1}).encode()
        gates = [asyncio.Event() for _ in range(3)]
        reading: list[int] = []
        statuses: list[int] = []

        def post(i):
            sent = False

            async def receive():
                nonlocal sent
                if not sent:
                    reading.append(i)  # this request's body is being read: it holds its share
                    await gates[i].wait()
                    sent = True
                    return {"type": "http.request", "body": body, "more_body": False}
                await asyncio.Event().wait()

            async def send(message):
                if message["type"] == "http.response.start":
                    statuses.append(message["status"])

            scope = {
                "type": "http",
                "method": "POST",
                "path": "/v1/completions",
                "raw_path": b"/v1/completions",
                "root_path": "",
                "query_string": b"",
                "headers": [(b"content-length", str(len(body)).encode())],
                "client": ("127.0.0.1", i),
                "server": ("127.0.0.1", 8080),
            }
            return asyncio.ensure_future(api(scope, receive, send))

        tasks = [post(i) for i in range(3)]
        for _ in range(20):
            await asyncio.sleep(0.01)
        assert sorted(reading) == [0, 1]  # the third waits for the budget
        gates[0].set()
        gates[2].set()
        for _ in range(200):
            if len(reading) == 3:
                break
            await asyncio.sleep(0.01)
        assert sorted(reading) == [0, 1, 2]  # the first one's bytes came back to the budget
        gates[1].set()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        return statuses, threading.current_thread().name

    try:
        statuses, loop_thread = asyncio.run(run())
    finally:
        api.close()
    assert statuses == [200, 200, 200]
    assert len(parsed_on) == 3 and loop_thread not in parsed_on
    assert api._body_bytes == 0
