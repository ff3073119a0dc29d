"""The OpenAI-compatible HTTP API of a real compute process, called with the official ``openai``
client (and raw HTTP where the client hides what is checked): a cache daemon on a unix socket,
``python -m compute_svc`` with ``--http-listen-address`` and a bearer token, a tiny mixtral store.

The compute runs one request at a time with no queue (``--max-batch-size 1
--max-waiting-requests 0``), so that a request in progress makes the scheduler refuse the next
(429) and a cancelled one is seen to give its place back.
"""

from __future__ import annotations

import json
import signal
import socket
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest
from moe.cache.v1 import cache_pb2, cache_pb2_grpc
from moe.inference.v1 import inference_pb2, inference_pb2_grpc

from tests.procs import free_port, start_compute, start_daemon

pytestmark = pytest.mark.integration

TOKEN = "s3cret-http-token"
LIMIT = 1024
POSITIONS = 2048  # the tiny checkpoint's max_position_embeddings: max_total_tokens
SERVED = "tiny-mixtral"  # --served-model-name


@pytest.fixture(scope="module")
def served(tiny_store, tmp_path_factory):
    tiny = tiny_store("mixtral")
    work = tmp_path_factory.mktemp("http")
    token_file = work / "token"
    token_file.write_text(TOKEN)
    daemon = start_daemon(
        tiny.store,
        work,
        device="cpu",
        device_budget_bytes=max(1, tiny.manifest.num_blobs // 4) * tiny.manifest.blob_bytes,
    )
    http_port, metrics_port = free_port(), free_port()
    try:
        compute = start_compute(
            tiny.store,
            daemon,
            work,
            extra=[
                "--http-listen-address",
                f"127.0.0.1:{http_port}",
                "--metrics-port",
                str(metrics_port),
                "--auth-token-file",
                str(token_file),
                "--max-new-tokens-limit",
                str(LIMIT),
                "--served-model-name",
                SERVED,
                "--max-batch-size",
                "1",
                "--max-waiting-requests",
                "0",
                "--drain-timeout-s",
                "60",
            ],
        )
    except BaseException:
        daemon.stop()
        raise
    base = f"http://127.0.0.1:{http_port}"
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=TOKEN, max_retries=0, timeout=120)
    channel = grpc.insecure_channel(compute.address, options=[("grpc.enable_http_proxy", 0)])
    yield {
        "tiny": tiny,
        "daemon": daemon,
        "compute": compute,
        "base": base,
        "client": client,
        "channel": channel,
        "metrics": f"http://127.0.0.1:{metrics_port}/metrics",
    }
    client.close()
    channel.close()
    compute.stop()
    daemon.stop()


def raw(served, method: str, path: str, body: dict | None = None, token: str | None = None):
    """(status, JSON body) of a plain HTTP request, without the client's retries or checks."""
    headers = {"content-type": "application/json"}
    if token:
        headers["authorization"] = f"Bearer {token}"
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(served["base"] + path, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def model_id(served) -> str:
    return served["client"].models.list().data[0].id


def pinned(served) -> int:
    with grpc.insecure_channel(served["daemon"].address) as channel:
        stats = cache_pb2_grpc.ExpertCacheStub(channel).GetStats(cache_pb2.GetStatsRequest(), timeout=10)
    return stats.pinned


def grpc_stream(served, **fields):
    stub = inference_pb2_grpc.InferenceStub(served["channel"])
    return stub.Generate(
        inference_pb2.GenerateRequest(**fields), timeout=120, metadata=[("authorization", f"Bearer {TOKEN}")]
    )


def wait_for(predicate, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_models_lists_the_served_checkpoint(served):
    models = served["client"].models.list().data
    assert [m.id for m in models] == [SERVED]
    assert models[0].object == "model"


def test_the_store_model_id_is_an_alias_of_the_served_name(served):
    """Clients written when /v1/models listed the store's model id go on working."""
    for name in (SERVED, served["tiny"].manifest.model_id):
        reply = served["client"].completions.create(model=name, prompt="hi", max_tokens=2)
        assert reply.usage.completion_tokens <= 2 and reply.model == name


def test_chat_without_max_tokens_gets_what_the_positions_leave(served):
    """The official client sends no max_tokens: the answer runs to the end of the model's positions
    (not the service's max_new_tokens_limit, which this prompt does not leave room for)."""
    reply = served["client"].chat.completions.create(
        model=SERVED,
        messages=[{"role": "user", "content": "Hello there " * 200}],
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert reply.usage.prompt_tokens + LIMIT > POSITIONS  # the old default would not fit
    assert reply.usage.completion_tokens == POSITIONS - reply.usage.prompt_tokens
    assert reply.choices[0].finish_reason == "length"
    # A prompt that leaves no room at all is refused, naming it.
    status, answer = raw(
        served, "POST", "/v1/completions", {"model": SERVED, "prompt": [5] * POSITIONS}, TOKEN
    )
    assert status == 400 and answer["error"]["param"] == "prompt"
    assert "leaves no room for a new token" in answer["error"]["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "ab\ud800cd"}, "prompt"),
        ({"messages": [{"role": "user", "content": "ab\ud800cd"}]}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]},
            "messages[0].content[0]",
        ),
    ],
)
def test_a_lone_surrogate_is_400_naming_the_field(served, body, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    status, answer = raw(served, "POST", path, {"model": SERVED, "max_tokens": 2, **body}, TOKEN)
    assert status == 400 and answer["error"]["param"] == param
    assert "is not valid Unicode: it holds a lone surrogate" in answer["error"]["message"]


def test_chat_completion_streams_with_the_chat_template(served):
    client = served["client"]
    stream = client.chat.completions.create(
        model=model_id(served),
        messages=[{"role": "user", "content": "Hello there"}],
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    content = [c for c in chunks if c.choices]
    assert content[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in content] == [None] * 7 + ["length"]
    assert chunks[-1].usage.completion_tokens == 8 and chunks[-1].usage.prompt_tokens > 3
    text = "".join(c.choices[0].delta.content for c in content)
    # The same messages through gRPC (where the same chat template applies) give the same text.
    replies = list(
        grpc_stream(
            served,
            messages=[inference_pb2.ChatMessage(role="user", content="Hello there")],
            max_new_tokens=8,
            ignore_eos=True,
        )
    )
    assert text == "".join(r.text for r in replies)
    assert chunks[-1].usage.prompt_tokens == replies[0].prompt_tokens


def test_completion_reports_usage_finish_reason_and_logprobs(served):
    reply = served["client"].completions.create(
        model=model_id(served),
        prompt="The quick brown fox",
        max_tokens=6,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 6
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 6 and reply.usage.prompt_tokens > 0
    assert len(choice.logprobs.token_logprobs) == 6 and all(v <= 0 for v in choice.logprobs.token_logprobs)
    assert "".join(choice.logprobs.tokens) == choice.text


def test_streamed_text_equals_grpc_generate_for_the_same_greedy_request(served):
    prompt = "Once upon a time"
    stream = served["client"].completions.create(
        model=model_id(served),
        prompt=prompt,
        max_tokens=24,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    http_text = "".join(c.choices[0].text for c in stream)
    grpc_text = "".join(r.text for r in grpc_stream(served, text=prompt, max_new_tokens=24, ignore_eos=True))
    assert http_text == grpc_text and http_text


def test_seeded_sampling_repeats(served):
    def sample() -> str:
        return (
            served["client"]
            .completions.create(
                model=model_id(served), prompt="abc", max_tokens=12, temperature=1.0, top_p=0.9, seed=7
            )
            .choices[0]
            .text
        )

    assert sample() == sample()


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"max_tokens": LIMIT + 1}, "max_tokens", f"'max_tokens' {LIMIT + 1} is out of range [1, {LIMIT}]"),
        ({"temperature": 3}, "temperature", "'temperature' 3 is out of range [0, 2]"),
        ({"n": 2}, "n", "'n' must be 1"),
        ({"prompt": ""}, "prompt", "'prompt' is empty"),
        ({"prompt": [1, 320]}, "prompt", "token_ids[1] = 320 is out of range [0, 320)"),
        ({"stop": ["x" * 300]}, "stop", "stop holds a string longer than 256 characters"),
        ({"prompt": [5] * 1100, "max_tokens": 1000}, "max_tokens", "= 2100 exceeds 2048 (max_total_tokens"),
        ({"temperature": 10**400}, "temperature", "is out of range [0, 2]"),
        ({"top_p": -(10**400)}, "top_p", "is out of range (0, 1]"),
    ],
)
def test_bad_request_is_400_naming_the_field(served, fields, param, message):
    body = {"model": model_id(served), "prompt": "hi", "max_tokens": 4, **fields}
    with pytest.raises(openai.BadRequestError) as info:
        served["client"].completions.create(**body)
    assert info.value.status_code == 400
    assert info.value.body["param"] == param and message in info.value.body["message"]
    assert info.value.body["type"] == "invalid_request_error"


def test_without_the_token_is_401_and_health_needs_none(served):
    bad = openai.OpenAI(base_url=f"{served['base']}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.models.list()
    assert info.value.status_code == 401 and info.value.body["message"] == "invalid bearer token"
    status, reply = raw(served, "POST", "/v1/completions", {"model": "x", "prompt": "a"})
    assert status == 401
    assert reply["error"]["message"].startswith("missing bearer token")
    assert set(reply["error"]) == {"message", "type", "param", "code"}
    assert raw(served, "GET", "/health") == (200, {"status": "serving"})


def test_unknown_model_is_404(served):
    with pytest.raises(openai.NotFoundError) as info:
        served["client"].completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert info.value.code == "model_not_found" and info.value.body["param"] == "model"


def test_refused_admission_is_429(served):
    # A gRPC Generate holds the only place in the batch (no queue): the HTTP request is refused by
    # the same scheduler.
    holder = grpc_stream(served, token_ids=list(range(5, 30)), max_new_tokens=LIMIT - 30, ignore_eos=True)
    next(holder)
    try:
        with pytest.raises(openai.RateLimitError) as info:
            served["client"].completions.create(model=model_id(served), prompt="hi", max_tokens=2)
        assert info.value.status_code == 429 and "max_waiting_requests" in info.value.message
    finally:
        holder.cancel()


def test_disconnect_mid_stream_cancels_the_request_and_pins_return_to_0(served):
    client = served["client"]
    wait_for(lambda: _completes(served), "the batch place of the previous test")
    stream = client.completions.create(
        model=model_id(served),
        prompt="A long story",
        max_tokens=LIMIT - 16,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    cancelled_before = cancelled(served)
    received = 0
    for _chunk in stream:
        received += 1
        if received == 3:
            break
    stream.close()  # the connection goes: the server sees the disconnect
    wait_for(lambda: pinned(served) == 0, "pinned == 0 after the disconnect")
    # The request left the batch: the next one is admitted long before the first could have ended.
    started = time.monotonic()
    wait_for(lambda: _completes(served), "a request admitted after the disconnect", timeout_s=10)
    assert time.monotonic() - started < 10
    assert pinned(served) == 0
    assert cancelled(served) == cancelled_before + 1


def cancelled(served) -> float:
    """moe_compute_requests_total{finish_reason="cancelled"} of the compute's /metrics."""
    metrics = urllib.request.urlopen(served["metrics"], timeout=10).read().decode()
    for line in metrics.splitlines():
        if line.startswith('moe_compute_requests_total{finish_reason="cancelled"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _completes(served) -> bool:
    try:
        served["client"].completions.create(model=model_id(served), prompt="x", max_tokens=1)
    except openai.RateLimitError:
        return False
    return True


def test_metrics_count_requests_by_route_and_status(served):
    metrics = urllib.request.urlopen(served["metrics"], timeout=10).read().decode()
    assert 'moe_compute_http_requests_total{route="/v1/completions",status="200"}' in metrics
    assert 'moe_compute_http_requests_total{route="/v1/completions",status="400"}' in metrics
    assert 'moe_compute_http_requests_total{route="/v1/models",status="401"}' in metrics
    assert 'moe_compute_http_request_duration_seconds_count{route="/v1/chat/completions"}' in metrics


def test_body_too_large_is_413_before_parsing(served):
    with socket.create_connection(("127.0.0.1", int(served["base"].rsplit(":", 1)[1]))) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer "
            + TOKEN.encode()
            + b"\r\ncontent-type: application/json\r\ncontent-length: 999999999\r\n\r\n"
        )
        sock.settimeout(10)
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    head, body = reply.decode().split("\r\n\r\n", 1)
    assert head.startswith("HTTP/1.1 413")
    assert json.loads(body)["error"]["code"] == "request_too_large"


def test_draining_is_503_for_requests_and_health(served):
    """Last: stops the compute. SIGTERM drains: the stream in progress goes on, new requests get 503."""
    holder = grpc_stream(served, token_ids=list(range(5, 30)), max_new_tokens=LIMIT - 30, ignore_eos=True)
    next(holder)
    served["compute"].popen.send_signal(signal.SIGTERM)
    wait_for(lambda: raw(served, "GET", "/health")[0] == 503, "health 503 while draining")
    with pytest.raises(openai.InternalServerError) as info:
        served["client"].completions.create(model=model_id(served), prompt="hi", max_tokens=2)
    assert info.value.status_code == 503 and "shutting down" in info.value.message
    holder.cancel()
