"""Faults and hostile input against real processes (a cache daemon and a compute process):

- prompts beyond the model's positions or the configured limits are refused with the limit named,
  a huge token list included, before any work;
- a long prompt with a short deadline is stopped inside its prefill and does not hold the engine:
  a small request after it is served at once;
- overload is refused with RESOURCE_EXHAUSTED, never by making every caller time out;
- kill -9 of the daemon fails the request in flight with UNAVAILABLE, and once a daemon is back
  on the same socket compute re-attaches by itself: later requests succeed, no compute restart.
"""

from __future__ import annotations

import os
import re
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2
from moe.inference.v1 import inference_pb2, inference_pb2_grpc

from bench.predictor_memory import health  # the status, None while the call fails
from tests.procs import start_compute, start_daemon
from tests.waiting import wait_for

pytestmark = pytest.mark.integration

POSITIONS = 2048


def stub(channel) -> inference_pb2_grpc.InferenceStub:
    return inference_pb2_grpc.InferenceStub(channel)


def generate(channel, timeout=120, **fields):
    return list(stub(channel).Generate(inference_pb2.GenerateRequest(**fields), timeout=timeout))


@pytest.fixture(scope="module")
def served(tiny_store, tmp_path_factory):
    """A mixtral of 2,048 positions, a daemon holding a quarter of its experts, a compute process
    batching up to 4 requests, 32 tokens per step, 2 waiting at most."""
    tiny = tiny_store("mixtral")  # its config: max_position_embeddings 2048 (devtools.tiny)
    work = tmp_path_factory.mktemp("faults")
    budget = max(1, tiny.manifest.num_blobs // 4) * tiny.manifest.blob_bytes
    daemon = start_daemon(tiny.store, work, device="cpu", device_budget_bytes=budget)
    # One client address here: the per-client share is off, the global bounds are what is tested.
    extra = ["--max-batch-size", "4", "--max-batched-tokens", "32", "--max-waiting-requests", "2"]
    extra += ["--max-client-share", "1"]
    compute = start_compute(tiny.store, daemon, work, extra=extra)
    channel = grpc.insecure_channel(compute.address)
    yield tiny, daemon, compute, channel
    channel.close()
    compute.stop()
    daemon.stop()


def status_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def test_prompts_beyond_the_positions_are_refused_naming_the_limit(served):
    *_, channel = served
    code, details = status_of(lambda: generate(channel, token_ids=[1] * 3000, max_new_tokens=4))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"token_ids holds 3000 ids; this service takes at most {POSITIONS} prompt tokens" in details
    code, details = status_of(lambda: generate(channel, token_ids=[1] * 2040, max_new_tokens=16))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"prompt (2040 tokens) + max_new_tokens (16) = 2056 exceeds {POSITIONS}" in details


def test_millions_of_token_ids_are_refused_before_any_work(served):
    *_, channel = served
    started = time.monotonic()
    code, details = status_of(lambda: generate(channel, token_ids=[7] * 3_000_000, max_new_tokens=1))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "3000000 ids" in details
    assert time.monotonic() - started < 20
    code, details = status_of(lambda: generate(channel, text="word " * 400_000, max_new_tokens=1))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "text is 2000000 bytes" in details


def test_a_long_prompt_past_its_deadline_does_not_hold_the_engine(tiny_store, tmp_path):
    # 4 tokens per step: the 2,000-token prompt takes 500 steps, far longer than its deadline.
    tiny = tiny_store("mixtral")
    budget = max(1, tiny.manifest.num_blobs // 4) * tiny.manifest.blob_bytes
    daemon = start_daemon(tiny.store, tmp_path, device="cpu", device_budget_bytes=budget)
    compute = start_compute(
        tiny.store, daemon, tmp_path, extra=["--max-batch-size", "4", "--max-batched-tokens", "4"]
    )
    try:
        with grpc.insecure_channel(compute.address) as channel:
            # References: the small request alone, cold (its first forward) and warm (4 steps).
            alone = []
            for _ in range(2):
                started = time.monotonic()
                generate(channel, token_ids=[1, 2, 3], max_new_tokens=4, ignore_eos=True, timeout=30)
                alone.append(time.monotonic() - started)
            cold_s, warm_s = alone
            # The long prompt's deadline: ~10 steps' worth of its 500, ample to be admitted.
            deadline_s = 2.5 * warm_s
            long_call = stub(channel).Generate(
                inference_pb2.GenerateRequest(
                    token_ids=[5] * 2000, max_new_tokens=8, ignore_eos=True, request_id="long"
                ),
                timeout=deadline_s,
            )
            time.sleep(deadline_s + warm_s)  # its deadline has passed; its prefill is far from done
            replies = generate(
                channel,
                token_ids=[1, 2, 3],
                max_new_tokens=4,
                ignore_eos=True,
                timeout=30,
                request_id="small",
            )
            with pytest.raises(grpc.RpcError) as info:
                list(long_call)
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert len(replies) == 4
        # The long request left the engine at its deadline, before the small one finished (not a
        # time bound: a busy machine's timings say nothing), and never finished its prefill.
        # (Its deadline reaches the scheduler as the call's cancellation or as its own expiry.)
        log = compute.log()
        stopped = re.search(r"request 'long' stopped \((cancelled|expired)\)", log)
        assert stopped is not None, log
        assert stopped.start() < log.index("request small: ")
        assert re.search(
            r"request long: 2000 prompt \+ 0 generated tokens .* finish (cancelled|expired)", log
        )
    finally:
        compute.stop()
        daemon.stop()


def test_overload_is_refused_with_resource_exhausted(served):
    *_, channel = served
    calls = [
        stub(channel).Generate(
            inference_pb2.GenerateRequest(token_ids=[1, 2], max_new_tokens=200, ignore_eos=True), timeout=60
        )
        for _ in range(12)
    ]
    outcomes = []
    for call in calls:
        try:
            next(iter(call))
            outcomes.append("ok")
        except grpc.RpcError as exc:
            outcomes.append(exc.code())
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                assert "max_waiting_requests 2" in exc.details() and "retry later" in exc.details()
    for call in calls:
        call.cancel()
    assert outcomes.count("ok") == 6  # 4 batched + 2 waiting
    assert outcomes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 6


def test_kill_9_of_the_daemon_is_not_an_outage(tiny_store, tmp_path, capsys):
    tiny = tiny_store("mixtral")
    budget = max(1, tiny.manifest.num_blobs // 4) * tiny.manifest.blob_bytes
    daemon = start_daemon(tiny.store, tmp_path, device="cpu", device_budget_bytes=budget)
    compute = start_compute(tiny.store, daemon, tmp_path)
    try:
        with grpc.insecure_channel(compute.address) as channel:
            want = [r.token_id for r in generate(channel, token_ids=[4, 5, 6], max_new_tokens=6)]
            # A request in flight when the daemon dies fails with UNAVAILABLE.
            call = stub(channel).Generate(
                inference_pb2.GenerateRequest(token_ids=[4, 5, 6], max_new_tokens=2000, ignore_eos=True),
                timeout=60,
            )
            next(iter(call))
            os.kill(daemon.popen.pid, signal.SIGKILL)
            daemon.popen.wait()
            killed_at = time.monotonic()
            with pytest.raises(grpc.RpcError) as info:
                list(call)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            wait_for(
                lambda: health(compute.address) == health_pb2.HealthCheckResponse.NOT_SERVING, timeout_s=10
            )
            code, details = status_of(lambda: generate(channel, token_ids=[4, 5, 6], max_new_tokens=2))
            assert code == grpc.StatusCode.UNAVAILABLE and "retry shortly" in details
            # The daemon comes back on the same socket (a new process, a new arena).
            daemon = start_daemon(tiny.store, tmp_path, device="cpu", device_budget_bytes=budget)
            wait_for(lambda: health(compute.address) == health_pb2.HealthCheckResponse.SERVING, timeout_s=30)
            recovered_after = time.monotonic() - killed_at
            assert [r.token_id for r in generate(channel, token_ids=[4, 5, 6], max_new_tokens=6)] == want
        assert compute.popen.poll() is None  # the same compute process throughout
        with capsys.disabled():
            print(
                f"\ncompute serving again {recovered_after:.2f}s after kill -9 of the daemon (restart included)"
            )
    finally:
        compute.stop()
        daemon.stop()
