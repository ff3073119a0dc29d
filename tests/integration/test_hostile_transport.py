"""Hostile clients at the transport, against real compute, daemon and predictor processes: HTTP/2
spoken by hand (``bench.hostile``), below what a gRPC library lets a client do.

- header-only streams (a call's HEADERS, never its request) hold no thread: health and a normal
  Generate answer while 120 of them are held, and each is ended with DEADLINE_EXCEEDED after
  ``request_timeout_s``; on the predictor, calls without the required token are refused at their
  headers, not after a request that never comes;
- streams whose client never reads are cut after ``stream_stall_timeout_s``: their requests leave
  the batch and their pins go, while health and other Generates are served; one client host
  holds at most its share of the batch and queue (``max_client_share``), so another host's
  Generate is never refused meanwhile;
- the per-address bound refuses with RESOURCE_EXHAUSTED naming it, and health keeps its own budget.

"Health answers" is measured against health's own latency before the attack, taken in the same
test on the machine as loaded then (``health_reference_s``), not against a fixed time.
"""

from __future__ import annotations

import statistics
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from moe.cache.v1 import cache_pb2, cache_pb2_grpc
from moe.inference.v1 import inference_pb2, inference_pb2_grpc
from moe.predictor.v1 import predictor_pb2, predictor_pb2_grpc

from bench.hostile import GENERATE, Attack
from tests.procs import free_port, start, start_compute, start_daemon

pytestmark = pytest.mark.integration

REQUEST_TIMEOUT_S = 3.0
STALL_S = 2.0
# Health under an attack answers within this many times its latency before it (a health held by
# the attack waits for the attack's streams to be cut: seconds, every time).
HEALTH_SLOWDOWN = 50


@pytest.fixture(scope="module")
def served(tiny_store, tmp_path_factory):
    tiny = tiny_store("mixtral")
    work = tmp_path_factory.mktemp("hostile")
    budget = tiny.manifest.num_blobs * tiny.manifest.blob_bytes
    daemon = start_daemon(tiny.store, work, device="cpu", device_budget_bytes=budget)
    extra = [
        "--request-timeout-s", str(REQUEST_TIMEOUT_S),
        "--stream-stall-timeout-s", str(STALL_S),
        "--max-streams-per-address", "200",
    ]  # fmt: skip
    compute = start_compute(tiny.store, daemon, work, extra=extra)
    channel = grpc.insecure_channel(compute.address)
    yield daemon, compute, channel
    channel.close()
    compute.stop()
    daemon.stop()


def health_s(channel) -> float:
    """Seconds a health Check of the whole server took (asserting SERVING)."""
    start_t = time.monotonic()
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    return time.monotonic() - start_t


def health_reference_s(channel, samples: int = 5) -> float:
    """Health's median latency before an attack: what its latency under the attack is held to."""
    return statistics.median(health_s(channel) for _ in range(samples))


def assert_health_unhindered(channel, reference_s: float, samples: int = 3) -> None:
    """The fastest of ``samples`` health Checks within HEALTH_SLOWDOWN x ``reference_s``: one slow
    Check is the machine, a health the attack holds is slow every time."""
    fastest = min(health_s(channel) for _ in range(samples))
    assert fastest < HEALTH_SLOWDOWN * reference_s, (
        f"health took {fastest * 1e3:.1f} ms under the attack, {reference_s * 1e3:.1f} ms before it"
    )


def short_generate(channel, within_s: float = 60.0) -> list:
    """A short greedy Generate, retried while the server says it is full (RESOURCE_EXHAUSTED)."""
    deadline = time.monotonic() + within_s
    stub = inference_pb2_grpc.InferenceStub(channel)
    while True:
        try:
            return list(
                stub.Generate(inference_pb2.GenerateRequest(text="hello", max_new_tokens=3), timeout=30)
            )
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def host_port(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


def test_header_only_streams_hold_nothing_and_end_after_the_request_timeout(served):
    _daemon, compute, channel = served
    reference_s = health_reference_s(channel)
    attack = Attack(*host_port(compute.address), GENERATE, connections=12, streams=10).start()
    try:
        assert attack.wait_held(120) == 120
        for _ in range(3):
            assert_health_unhindered(channel, reference_s)
            info = inference_pb2_grpc.InferenceStub(channel).GetModelInfo(
                inference_pb2.GetModelInfoRequest(), timeout=5
            )
            assert info.num_experts > 0
            events = short_generate(channel)
            assert len(events) == 3 and events[-1].finish_reason == inference_pb2.FINISH_REASON_LENGTH
        deadline = time.monotonic() + REQUEST_TIMEOUT_S + 10
        while attack.tally().statuses.get("4", 0) < 120 and time.monotonic() < deadline:
            time.sleep(0.1)
        tally = attack.tally()
        assert tally.statuses.get("4", 0) >= 120, tally  # DEADLINE_EXCEEDED, each re-opened stream too
        assert set(tally.statuses) == {"4"}, tally
    finally:
        attack.stop()
    assert "no request message within" in compute.log()


def test_unread_streams_are_cut_and_release_their_requests_and_pins(served):
    """100 unread streams from one client host (127.0.0.2) at the default max_client_share: it holds
    its share of the batch and queue (8 running + 32 waiting), the rest is refused at once, and
    another host's short Generate is served while the attack lasts, never refused."""
    daemon, compute, channel = served
    # 2,000 tokens: far more than an unread stream's buffers take (a stream's send buffer takes
    # some hundreds of these small events; a request that fits there whole ends "length", uncut).
    request = inference_pb2.GenerateRequest(text="hello there", max_new_tokens=2000, ignore_eos=True)
    reference_s = health_reference_s(channel)
    started = time.monotonic()
    assert len(short_generate(channel)) == 3
    generate_reference_s = time.monotonic() - started
    attack = Attack(
        *host_port(compute.address),
        GENERATE,
        connections=10,
        streams=10,
        message=request.SerializeToString(),
        window=64,
        reopen=False,  # refused ones are not opened again: what was admitted must all be released
        source="127.0.0.2",
    ).start()
    try:
        deadline = time.monotonic() + 20
        while attack.tally().statuses.get("8", 0) < 60 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert attack.tally().statuses.get("8", 0) >= 60, attack.tally()  # beyond its 40 places
        assert_health_unhindered(channel, reference_s)
        start_t = time.monotonic()
        events = short_generate(channel, within_s=0)  # refused once would raise
        took = time.monotonic() - start_t
        assert len(events) == 3
        assert took < 10.0 + 10 * generate_reference_s, (
            f"{took:.2f} s beside the attack; {generate_reference_s:.2f} s before it"
        )
        assert_health_unhindered(channel, reference_s)
        # Every unread stream is cut: nothing is left in the batch, nothing pinned.
        cache = cache_pb2_grpc.ExpertCacheStub(grpc.insecure_channel(daemon.address))
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if (
                compute.log().count("stopped (cancelled)") >= 40
                and cache.GetStats(cache_pb2.GetStatsRequest(), timeout=5).pinned == 0
            ):
                break
            time.sleep(0.2)
        assert compute.log().count("stopped (cancelled)") >= 40
        assert cache.GetStats(cache_pb2.GetStatsRequest(), timeout=5).pinned == 0
        assert "stream_stall_timeout_s" in compute.log()
        # A request is served as soon as it comes: as fast as before the attack, give or take.
        start_t = time.monotonic()
        assert len(short_generate(channel, within_s=5.0)) == 3
        took = time.monotonic() - start_t
        assert took < 10 * generate_reference_s, (
            f"{took:.2f} s; {generate_reference_s:.2f} s before the attack"
        )
    finally:
        attack.stop()


def test_the_per_address_bound_refuses_naming_it_and_health_keeps_its_budget(served):
    _daemon, compute, channel = served
    reference_s = health_reference_s(channel)
    attack = Attack(*host_port(compute.address), GENERATE, connections=3, streams=80).start()
    try:
        deadline = time.monotonic() + 10
        while attack.tally().statuses.get("8", 0) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert attack.tally().statuses.get("8", 0) > 0  # RESOURCE_EXHAUSTED beyond 200 streams
        assert_health_unhindered(channel, reference_s)
        with pytest.raises(grpc.RpcError) as info:
            list(
                inference_pb2_grpc.InferenceStub(channel).Generate(
                    inference_pb2.GenerateRequest(text="hello", max_new_tokens=1), timeout=10
                )
            )
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_streams_per_address" in info.value.details()
    finally:
        attack.stop()
    assert len(short_generate(channel)) == 3


def test_the_daemon_socket_is_bounded_the_same_way(served):
    daemon, _compute, _channel = served
    with grpc.insecure_channel(daemon.address) as ch:
        reference_s = health_reference_s(ch)
        attack = Attack(
            daemon.address, 0, "/moe.cache.v1.ExpertCache/GetStats", connections=4, streams=30
        ).start()
        try:
            assert attack.wait_held(120) == 120
            assert_health_unhindered(ch, reference_s)
            assert (
                cache_pb2_grpc.ExpertCacheStub(ch).GetStats(cache_pb2.GetStatsRequest(), timeout=5).demands
                >= 0
            )
        finally:
            attack.stop()


def test_the_predictor_refuses_tokenless_calls_at_their_headers(tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    address = f"127.0.0.1:{free_port()}"
    args = ["--listen-address", address, "--auth-token-file", str(token), "--request-timeout-s", "30"]
    predictor = start("predictor_svc", args, address, tmp_path / "predictor.log")
    path = "/moe.predictor.v1.Predictor/GetStats"
    ch = grpc.insecure_channel(address)
    reference_s = health_reference_s(ch)
    attack = Attack(*host_port(address), path, connections=12, streams=10).start()
    try:
        deadline = time.monotonic() + 10
        while attack.tally().statuses.get("16", 0) < 120 and time.monotonic() < deadline:
            time.sleep(0.05)
        # UNAUTHENTICATED at once: well before the 30 s request timeout.
        assert attack.tally().statuses.get("16", 0) >= 120, attack.tally()
        assert_health_unhindered(ch, reference_s)
        stats = predictor_pb2_grpc.PredictorStub(ch).GetStats(
            predictor_pb2.GetStatsRequest(),
            timeout=5,
            metadata=(("authorization", "Bearer s3cret-token"),),
        )
        assert stats is not None
    finally:
        attack.stop()
        ch.close()
        predictor.stop()


def test_the_predictor_answers_under_header_only_streams(tmp_path):
    address = f"127.0.0.1:{free_port()}"
    predictor = start("predictor_svc", ["--listen-address", address], address, tmp_path / "predictor.log")
    ch = grpc.insecure_channel(address)
    reference_s = health_reference_s(ch)
    attack = Attack(
        *host_port(address), "/moe.predictor.v1.Predictor/GetStats", connections=12, streams=10
    ).start()
    try:
        assert attack.wait_held(120) == 120
        for _ in range(3):
            assert_health_unhindered(ch, reference_s)
            predictor_pb2_grpc.PredictorStub(ch).GetStats(predictor_pb2.GetStatsRequest(), timeout=5)
            time.sleep(0.3)
    finally:
        attack.stop()
        ch.close()
        predictor.stop()
