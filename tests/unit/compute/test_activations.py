"""The activation reporter against a real gRPC Predictor servicer on a real socket.

The engine is the real one (tiny Mixtral, experts from an in-memory arena); the predictor is a
small recording servicer of ``moe.predictor.v1.Predictor`` defined here, so these tests need no
predictor process.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest
import torch
from moe.predictor.v1 import predictor_pb2, predictor_pb2_grpc

from compute_svc.engine.activations import ActivationReporter, RoutingCapture, StepRouting
from compute_svc.engine.requests import GenerationRequest
from devtools.launch import free_port

PROMPT = tuple(range(5, 25))  # 20 tokens
NEW_TOKENS = 6


class RecordingPredictor(predictor_pb2_grpc.PredictorServicer):
    """Keeps every Activation it receives; ``delay_s`` makes it a slow consumer."""

    def __init__(self, delay_s: float = 0.0, refuse: str = "") -> None:
        self.delay_s = delay_s
        self.refuse = refuse  # non-empty: RegisterModel answers RESOURCE_EXHAUSTED with it
        self.messages: list[predictor_pb2.Activation | predictor_pb2.RegisterModelRequest] = []
        self.cond = threading.Condition()

    def RegisterModel(self, request, context):  # noqa: N802 - gRPC method name
        with self.cond:
            self.messages.append(request)
            self.cond.notify_all()
        if self.refuse:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, self.refuse)
        return predictor_pb2.RegisterModelResponse(
            model_id=request.model_id,
            num_moe_layers=request.num_moe_layers,
            num_experts=request.num_experts,
            top_k=request.top_k,
            created=True,
        )

    def Observe(self, request_iterator, context):  # noqa: N802 - gRPC method name
        accepted = 0
        for message in request_iterator:
            if self.delay_s:
                time.sleep(self.delay_s)
            with self.cond:
                self.messages.append(message)
                self.cond.notify_all()
            accepted += 1
        return predictor_pb2.ObserveSummary(activations=accepted)

    def of(self, request_id: str) -> list[predictor_pb2.Activation]:
        with self.cond:
            return [m for m in self.messages if getattr(m, "request_id", None) == request_id]

    def wait_done(self, request_id: str, timeout_s: float = 10.0) -> list[predictor_pb2.Activation]:
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while not any(
                getattr(m, "request_id", None) == request_id and m.request_done for m in self.messages
            ):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"request_done of {request_id!r} never arrived")
                self.cond.wait(left)
        return self.of(request_id)


def serve(servicer: RecordingPredictor, port: int) -> grpc.Server:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    predictor_pb2_grpc.add_PredictorServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server


@pytest.fixture
def engine(local_engine):
    engine, provider, tiny = local_engine("mixtral", limit=64)
    yield engine, tiny
    if engine.reporter is not None:
        engine.reporter.close(flush_timeout_s=0.5)


def make_reporter(tiny, port: int, queue_tokens: int = 4096) -> ActivationReporter:
    manifest = tiny.manifest
    return ActivationReporter(
        f"127.0.0.1:{port}",
        manifest.model_id,
        "pod-a",
        manifest.top_k,
        queue_tokens,
        num_experts=manifest.num_experts,
        num_moe_layers=len(manifest.moe_layers),
    )


def generate(engine, request_id: str, **kwargs) -> list[int]:
    kwargs.setdefault("token_ids", PROMPT)
    kwargs.setdefault("max_new_tokens", NEW_TOKENS)
    request = GenerationRequest(request_id=request_id, ignore_eos=True, **kwargs)
    return [e.token_id for e in engine.generate(engine.requests.prepare(request))]


def test_capture_stacks_layers_in_manifest_order_and_splits_requests():
    from compute_svc.experts.moe import StepSegment

    capture = RoutingCapture([1, 3])
    capture.begin()
    one = [StepSegment("r", 0, 1, 7, 1)]
    capture(3, torch.tensor([[4, 5]]), torch.tensor([[0.6, 0.4]]))
    assert capture.take(one, with_weights=False) == []  # layer 1 never routed
    capture(1, torch.tensor([[0, 2]]), torch.tensor([[0.9, 0.1]]))
    capture(3, torch.tensor([[4, 5]]), torch.tensor([[0.6, 0.4]]))
    (step,) = capture.take(one, with_weights=True)
    assert step.experts.tolist() == [[[0, 2], [4, 5]]]  # [T=1, L=2, K=2]
    assert step.weights.shape == (1, 2, 2)
    assert step.first_token == 7 and step.request_id == "r"
    # A step of two requests: a decode token of "a" (position 9) and a 2-token prompt chunk of "b".
    capture(1, torch.tensor([[0, 1], [2, 3], [4, 5]]), None)
    capture(3, torch.tensor([[6, 7], [0, 2], [1, 3]]), None)
    a, b = capture.take([StepSegment("a", 0, 1, 9, 3), StepSegment("b", 1, 2, 0, 0)], with_weights=False)
    assert (a.request_id, a.first_token, a.experts.tolist()) == ("a", 9, [[[0, 1], [6, 7]]])
    assert (b.request_id, b.first_token, b.experts.tolist()) == ("b", 0, [[[2, 3], [0, 2]], [[4, 5], [1, 3]]])
    assert a.weights is None


def test_every_token_arrives_in_order_with_request_done(engine):
    engine, tiny = engine
    baseline = generate(engine, "baseline")
    port = free_port()
    predictor = RecordingPredictor()
    server = serve(predictor, port)
    try:
        seen: list[tuple[int, torch.Tensor]] = []  # what the runtime routed, per layer call
        capture = RoutingCapture(tiny.manifest.moe_layers)

        def observe(layer, top_k_index, top_k_weights):
            seen.append((layer, top_k_index.clone()))
            capture(layer, top_k_index, top_k_weights)

        reporter = make_reporter(tiny, port)
        engine.enable_routing(capture, reporter)
        engine.runtime.routing_observer = observe
        assert generate(engine, "req-1") == baseline  # reporting never changes the output
        messages = predictor.wait_done("req-1")
    finally:
        server.stop(0)

    manifest = tiny.manifest
    layers, top_k = len(manifest.moe_layers), manifest.top_k
    tokens = [m for m in messages if not m.request_done]
    # Prompt tokens 0..19, then the 5 fed-back generated tokens (the 6th is never fed back).
    assert [m.token_index for m in tokens] == list(range(len(PROMPT) + NEW_TOKENS - 1))
    assert messages[-1].request_done and not messages[-1].experts
    assert sum(m.request_done for m in messages) == 1
    for m in tokens:
        assert (m.model_id, m.pod, m.top_k, m.num_moe_layers) == (manifest.model_id, "pod-a", top_k, layers)
        assert m.num_experts == manifest.num_experts
        assert len(m.experts) == layers * top_k
    # The experts reported are exactly those the router chose: prefill's forward first ([P, K]
    # per layer), then one [1, K] per layer per decode step.
    per_forward = [seen[i : i + layers] for i in range(0, len(seen), layers)]
    rows = []
    for forward in per_forward:
        assert [layer for layer, _ in forward] == list(manifest.moe_layers)
        rows.extend(
            torch.stack([idx for _, idx in forward], dim=1).reshape(forward[0][1].shape[0], -1).tolist()
        )
    assert [list(m.experts) for m in tokens] == rows
    assert reporter.counters.dropped_tokens == 0


def test_absent_predictor_drops_and_never_fails_generation(engine):
    engine, tiny = engine
    baseline = generate(engine, "baseline")
    reporter = make_reporter(tiny, free_port(), queue_tokens=30)  # nothing listens there
    engine.enable_routing(RoutingCapture(tiny.manifest.moe_layers), reporter)
    for i in range(3):  # 3 x 25 routed tokens against a 30-token queue nobody drains
        assert generate(engine, f"req-{i}") == baseline
    assert reporter.counters.dropped_tokens > 0
    assert reporter.queued_tokens <= 30
    assert reporter.counters.sent_tokens == 0
    assert reporter.counter_values()["moe_compute_activations_dropped"] == reporter.counters.dropped_tokens


def test_slow_predictor_makes_the_queue_drop_instead_of_blocking(engine):
    engine, tiny = engine
    port = free_port()
    predictor = RecordingPredictor()
    release = threading.Event()
    inner = predictor.Observe

    def stalled(request_iterator, context):
        release.wait(30)  # a predictor that stops reading: the stream's window fills up
        return inner(request_iterator, context)

    predictor.Observe = stalled
    # No BDP probing: the stream's receive window stays at its 64 KiB start, so a few hundred
    # KiB of activations are enough to make the sender wait on the predictor.
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=[("grpc.http2.bdp_probe", 0)])
    predictor_pb2_grpc.add_PredictorServicer_to_server(predictor, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    try:
        reporter = make_reporter(tiny, port, queue_tokens=256)
        engine.enable_routing(RoutingCapture(tiny.manifest.moe_layers), reporter)
        queued_max = 0
        original = reporter.on_step

        def on_step(step):
            nonlocal queued_max
            original(step)
            queued_max = max(queued_max, reporter.queued_tokens)

        reporter.on_step = on_step
        long_prompt = tuple(5 + i % 300 for i in range(240))
        requests = 0
        while reporter.counters.dropped_tokens == 0 and requests < 60:
            out = generate(engine, f"slow-{requests}", token_ids=long_prompt, max_new_tokens=2)
            assert len(out) == 2  # every request completes while the predictor reads nothing
            requests += 1
        # The queue stayed within its bound and the overflow was dropped, not waited for.
        assert reporter.counters.dropped_tokens > 0, f"no drop after {requests} requests"
        assert queued_max <= 256
        release.set()
        messages = predictor.wait_done("slow-0", timeout_s=20)
        assert [m.token_index for m in messages if not m.request_done] == list(range(241))
    finally:
        release.set()
        server.stop(0)


def test_reporting_resumes_after_a_predictor_restart(engine):
    engine, tiny = engine
    port = free_port()
    first = RecordingPredictor()
    server = serve(first, port)
    reporter = make_reporter(tiny, port)
    engine.enable_routing(RoutingCapture(tiny.manifest.moe_layers), reporter)
    generate(engine, "before")
    assert len(first.wait_done("before")) == len(PROMPT) + NEW_TOKENS  # tokens + the done message
    server.stop(0).wait()

    baseline = generate(engine, "during")  # the predictor is down: generation goes on
    assert len(baseline) == NEW_TOKENS

    second = RecordingPredictor()
    server = serve(second, port)
    try:
        generate(engine, "after")
        messages = second.wait_done("after", timeout_s=20)
        assert [m.token_index for m in messages if not m.request_done] == list(
            range(len(PROMPT) + NEW_TOKENS - 1)
        )
        assert reporter.counters.outages >= 1
    finally:
        server.stop(0)


def test_reporter_rejects_an_empty_queue():
    with pytest.raises(ValueError, match="queue_tokens must be >= 1, got 0"):
        ActivationReporter("127.0.0.1:1", "m", "p", 2, 0)


def _step(request_id: str, first: int, tokens: int, layers: int = 2, top_k: int = 2) -> StepRouting:
    experts = torch.arange(tokens * layers * top_k, dtype=torch.int64).reshape(tokens, layers, top_k) % 4
    return StepRouting(request_id, first, experts, None)


def test_the_model_is_registered_before_any_activation_is_streamed():
    port = free_port()
    predictor = RecordingPredictor()
    server = serve(predictor, port)
    reporter = ActivationReporter(f"127.0.0.1:{port}", "m", "pod-a", 2, 64, num_experts=4, num_moe_layers=2)
    try:
        reporter.on_step(_step("r", 0, 3))
        reporter.on_request_end("r")
        predictor.wait_done("r")
        with predictor.cond:
            first = predictor.messages[0]
        assert isinstance(first, predictor_pb2.RegisterModelRequest)
        assert (first.model_id, first.num_moe_layers, first.num_experts, first.top_k) == ("m", 2, 4, 2)
        assert [m.token_index for m in predictor.of("r")] == [0, 1, 2, 3]
    finally:
        reporter.close(flush_timeout_s=0.5)
        server.stop(0)


def test_a_refused_registration_streams_nothing_and_counts_an_outage():
    port = free_port()
    predictor = RecordingPredictor(refuse="max_models=16 reached")
    server = serve(predictor, port)
    reporter = ActivationReporter(f"127.0.0.1:{port}", "m", "pod-a", 2, 64, num_experts=4, num_moe_layers=2)
    try:
        reporter.on_step(_step("r", 0, 2))
        deadline = time.monotonic() + 10
        while reporter.counters.outages == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert reporter.counters.outages == 1 and not reporter.counters.connected
        with predictor.cond:
            assert predictor.messages and all(
                isinstance(m, predictor_pb2.RegisterModelRequest) for m in predictor.messages
            )
    finally:
        reporter.close(flush_timeout_s=0.2)
        server.stop(0)


def test_a_request_id_used_twice_is_two_requests_to_the_predictor(engine):
    """A client's retry reuses its request_id while the first run still goes: compute gives the
    second run its own routing id, and the reporter a nonce per run (the same on all its
    messages and its request_done), so the predictor never sees one request's tokens go back."""
    engine, tiny = engine
    first = engine.start(
        engine.requests.prepare(GenerationRequest(request_id="dup", token_ids=PROMPT, max_new_tokens=2))
    )
    second = engine.start(
        engine.requests.prepare(GenerationRequest(request_id="dup", token_ids=PROMPT, max_new_tokens=2))
    )
    assert first.routing_id == "dup" and second.routing_id.startswith("dup#")
    engine.finish(first, "stop")
    third = engine.start(
        engine.requests.prepare(GenerationRequest(request_id="dup", token_ids=PROMPT, max_new_tokens=2))
    )
    assert third.routing_id == "dup"  # free again once the first finished
    engine.finish(second, "stop")
    engine.finish(third, "stop")

    port = free_port()
    predictor = RecordingPredictor()
    server = serve(predictor, port)
    reporter = make_reporter(tiny, port)
    try:
        layers, top_k = len(tiny.manifest.moe_layers), tiny.manifest.top_k
        experts = torch.zeros((2, layers, top_k), dtype=torch.int64)
        for _run in range(2):  # the same id, one run after the other, tokens from 0 each time
            reporter.on_step(StepRouting("again", 0, experts, None))
            reporter.on_request_end("again")
        deadline = time.monotonic() + 10
        while sum(m.request_done for m in predictor.of("again")) < 2:
            assert time.monotonic() < deadline, predictor.of("again")
            time.sleep(0.01)
    finally:
        reporter.close(flush_timeout_s=0.5)
        server.stop(0)
    messages = predictor.of("again")
    nonces = [m.request_nonce for m in messages]
    assert len(messages) == 6 and all(nonces)
    assert nonces[0] == nonces[1] == nonces[2] != nonces[3] == nonces[4] == nonces[5]
    assert [m.token_index for m in messages] == [0, 1, 2, 0, 1, 2]
    assert [m.request_done for m in messages] == [False, False, True, False, False, True]
