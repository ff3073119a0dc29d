"""A compute process's life in a pod, against real processes (a cache daemon, a compute process):

- it is ready (health SERVING, as a whole and for the Inference service) only once it serves,
  i.e. once the store is attached and the dense weights are loaded; ``expertcache health`` (the
  exec probe's command) says so with its exit status;
- SIGTERM (the kubelet stopping the pod) turns health NOT_SERVING at once and refuses new
  Generates with UNAVAILABLE, while the streams in progress run to their end; the process then
  exits 0;
- a stream still running after ``drain_timeout_s`` is stopped with UNAVAILABLE, and the process
  exits within that bound instead of waiting for the kubelet's SIGKILL;
- the drain does not depend on the daemon's history: after live budget shrinks and a daemon
  restart (it boots with the shrunk budget of its ConfigMap) every stream in progress finishes;
  and streams a drain cannot finish (the daemon hangs) end with UNAVAILABLE and a retry hint,
  never CANCELLED, even while their step waits for experts.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from moe.cache.v1 import cache_pb2, cache_pb2_grpc
from moe.inference.v1 import inference_pb2, inference_pb2_grpc

from tests.daemons import start_live_daemon, tiers
from tests.kubelet import KubeletVolume
from tests.procs import start_compute, start_daemon
from tests.waiting import wait_for

pytestmark = pytest.mark.integration

TOKENS = 1000  # about 20 s on the tiny model here: the checks during the drain take well under 1 s


def health(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as channel:
        try:
            return (
                health_pb2_grpc.HealthStub(channel)
                .Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
                .status
            )
        except grpc.RpcError:
            return -1


def health_cli(address: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "expertcache.cli", "health", "--address", address, *extra],
        capture_output=True,
        text=True,
        timeout=60,
    )


class Stream:
    """One Generate consumed on a thread: its events, and its error if it ends with one."""

    def __init__(self, address: str, max_new_tokens: int, request_id: str = "long") -> None:
        self.channel = grpc.insecure_channel(address)
        self.events: list = []
        self.error: grpc.RpcError | None = None
        self.first = threading.Event()
        request = inference_pb2.GenerateRequest(
            token_ids=[5, 6, 7], max_new_tokens=max_new_tokens, ignore_eos=True, request_id=request_id
        )
        self._call = inference_pb2_grpc.InferenceStub(self.channel).Generate(request, timeout=300)
        self.thread = threading.Thread(target=self._consume, daemon=True)
        self.thread.start()

    def _consume(self) -> None:
        try:
            for event in self._call:
                self.events.append(event)
                self.first.set()
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            self.first.set()
            self.channel.close()


@pytest.fixture
def stack(tiny_store, tmp_path):
    tiny = tiny_store("mixtral")
    budget = tiny.manifest.num_blobs * tiny.manifest.blob_bytes  # every expert: no misses to wait on
    daemon = start_daemon(tiny.store, tmp_path, device="cpu", device_budget_bytes=budget)
    procs = []

    def start(drain_timeout_s: float):
        compute = start_compute(
            tiny.store, daemon, tmp_path, extra=["--drain-timeout-s", str(drain_timeout_s)]
        )
        procs.append(compute)
        return compute

    yield daemon, start
    for proc in procs:
        proc.stop()
    daemon.stop()


def test_ready_only_when_serving_and_the_health_command_says_so(stack):
    daemon, start = stack
    result = health_cli(daemon.address)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"{daemon.address}: SERVING"
    compute = start(drain_timeout_s=5)
    for service in ("", "moe.inference.v1.Inference"):
        assert health(compute.address, service) == health_pb2.HealthCheckResponse.SERVING
    result = health_cli(compute.address, "--service", "moe.inference.v1.Inference")
    assert result.returncode == 0 and "SERVING" in result.stdout, result.stderr
    result = health_cli(compute.address, "--service", "no.such.Service")
    assert result.returncode == 1
    assert "does not know this service" in result.stderr


def test_sigterm_drains_the_streams_in_progress(stack):
    _, start = stack
    compute = start(drain_timeout_s=120)
    stream = Stream(compute.address, max_new_tokens=TOKENS)
    assert stream.first.wait(120) and stream.events, stream.error
    compute.popen.send_signal(signal.SIGTERM)
    wait_for(lambda: "stopping: draining" in compute.log(), "SIGTERM handled", timeout_s=30)
    # Health is NOT_SERVING while the stream goes on (the readiness probe takes the pod out).
    assert health(compute.address) == health_pb2.HealthCheckResponse.NOT_SERVING
    assert stream.thread.is_alive(), "the stream ended before the checks: make it longer"
    result = health_cli(compute.address)
    assert result.returncode == 1 and "NOT_SERVING" in result.stderr, (result.stdout, result.stderr)
    # A new Generate is refused at once, naming why.
    with grpc.insecure_channel(compute.address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            list(
                inference_pb2_grpc.InferenceStub(channel).Generate(
                    inference_pb2.GenerateRequest(token_ids=[1], max_new_tokens=2), timeout=30
                )
            )
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "shutting down" in info.value.details()
    assert stream.thread.is_alive(), "the stream ended before the checks: make it longer"
    stream.thread.join(180)
    assert stream.error is None, stream.error
    assert len(stream.events) == TOKENS
    assert stream.events[-1].finish_reason == inference_pb2.FINISH_REASON_LENGTH
    assert compute.popen.wait(60) == 0, compute.log()
    assert "drain complete" in compute.log()


def test_a_stream_beyond_the_drain_timeout_is_stopped_and_the_process_exits(stack):
    _, start = stack
    compute = start(drain_timeout_s=1)
    stream = Stream(compute.address, max_new_tokens=1900)
    assert stream.first.wait(120) and stream.events, stream.error
    signalled = time.monotonic()
    compute.popen.send_signal(signal.SIGTERM)
    assert compute.popen.wait(60) == 0, compute.log()
    exited_after = time.monotonic() - signalled
    stream.thread.join(30)
    assert stream.error is not None and stream.error.code() == grpc.StatusCode.UNAVAILABLE, stream.error
    assert "shutting down" in stream.error.details()
    assert 0 < len(stream.events) < 1900
    assert exited_after < 30, exited_after
    assert "cut off after 1s" in compute.log()


def device_slots(daemon) -> int:
    with grpc.insecure_channel(daemon.address) as channel:
        stats = cache_pb2_grpc.ExpertCacheStub(channel).GetStats(cache_pb2.GetStatsRequest(), timeout=10)
    return tiers(stats)[cache_pb2.TIER_DEVICE].capacity_slots


def generates(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            replies = inference_pb2_grpc.InferenceStub(channel).Generate(
                inference_pb2.GenerateRequest(token_ids=[4, 5, 6], max_new_tokens=4, ignore_eos=True),
                timeout=30,
            )
            return len(list(replies)) == 4
        except grpc.RpcError:
            return False


def test_sigterm_after_budget_shrinks_and_a_daemon_restart_drains_every_stream(tiny_store, tmp_path):
    """The reported run: live budget edits, the daemon restarted (booting with the shrunk budget
    of its ConfigMap), then SIGTERM with 4 streams in progress: all 4 finish."""
    tiny = tiny_store("mixtral")
    blob, blobs = tiny.manifest.blob_bytes, tiny.manifest.num_blobs
    volume = KubeletVolume(tmp_path / "config", "daemon.yaml", f"device_budget_bytes: {blobs * blob}\n")
    ceiling = ("--device-budget-max-bytes", str(blobs * blob))
    daemon = start_live_daemon(tiny.store, volume.path, tmp_path, *ceiling)
    compute = None
    try:
        compute = start_compute(tiny.store, daemon, tmp_path, extra=["--drain-timeout-s", "120"])
        assert generates(compute.address)
        quarter = max(2, blobs // 4)
        volume.write(f"device_budget_bytes: {quarter * blob}\n")
        wait_for(lambda: device_slots(daemon) == quarter, "the live shrink", timeout_s=15)
        assert generates(compute.address)
        daemon.popen.kill()
        daemon.popen.wait()
        daemon = start_live_daemon(tiny.store, volume.path, tmp_path, *ceiling, log="daemon-restarted.log")
        wait_for(lambda: generates(compute.address), "compute re-attached", timeout_s=60, poll_s=0.2)
        assert device_slots(daemon) == quarter  # booted with the edited budget
        volume.write(f"device_budget_bytes: {blob}\n")  # and shrunk again, live: every layer misses
        wait_for(lambda: device_slots(daemon) == 1, "the second live shrink", timeout_s=15)
        tokens = 48
        streams = [Stream(compute.address, tokens, request_id=f"s{i}") for i in range(4)]
        for stream in streams:
            assert stream.first.wait(120) and stream.events, stream.error
        signalled = time.monotonic()
        compute.popen.send_signal(signal.SIGTERM)
        for stream in streams:
            stream.thread.join(180)
            assert stream.error is None, (stream.error, compute.log()[-4000:])
            assert len(stream.events) == tokens
            assert stream.events[-1].finish_reason == inference_pb2.FINISH_REASON_LENGTH
        assert compute.popen.wait(60) == 0, compute.log()
        assert "drain complete" in compute.log()
        assert daemon.popen.poll() is None
        print(
            f"\ndrained 4 streams in {time.monotonic() - signalled:.1f}s after budget shrinks and a restart"
        )
    finally:
        if compute is not None:
            compute.stop()
        daemon.stop()


def test_streams_a_drain_cannot_finish_end_unavailable_with_a_retry_hint(tiny_store, tmp_path):
    """The daemon hangs (SIGSTOP) with a 1-slot budget: every step waits for experts that never
    come, so the drain is cut off inside that wait; the streams end UNAVAILABLE, not CANCELLED."""
    tiny = tiny_store("mixtral")
    daemon = start_daemon(tiny.store, tmp_path, device="cpu", device_budget_bytes=tiny.manifest.blob_bytes)
    compute = None
    stopped = False
    try:
        compute = start_compute(tiny.store, daemon, tmp_path, extra=["--drain-timeout-s", "2"])
        streams = [Stream(compute.address, 1900, request_id=f"s{i}") for i in range(4)]
        for stream in streams:
            assert stream.first.wait(120) and stream.events, stream.error
        daemon.popen.send_signal(signal.SIGSTOP)
        stopped = True
        signalled = time.monotonic()
        compute.popen.send_signal(signal.SIGTERM)
        assert compute.popen.wait(60) == 0, compute.log()
        exited_after = time.monotonic() - signalled
        for stream in streams:
            stream.thread.join(30)
            assert stream.error is not None, "a stream finished although the daemon was stopped"
            assert stream.error.code() == grpc.StatusCode.UNAVAILABLE, (stream.error, compute.log()[-4000:])
            assert "shutting down" in stream.error.details()
            assert "retry on another replica" in stream.error.details()
        assert exited_after < 20, exited_after
        assert "cut off after 2s" in compute.log()
    finally:
        if stopped:
            daemon.popen.send_signal(signal.SIGCONT)
        if compute is not None:
            compute.stop()
        daemon.stop()
