"""Predictor wired end to end: real redis-server, predictor, cache daemon and compute processes.

A Generate reports its routing to the predictor (EAMC grows by one, hints reach the daemon's
board); a Redis outage and then a dead predictor never fail a Generate nor change its output.
"""

from __future__ import annotations

import functools

import grpc
import pytest
from moe.cache.v1 import cache_pb2, cache_pb2_grpc
from moe.predictor.v1 import predictor_pb2, predictor_pb2_grpc

from devtools.launch import start_compute, start_daemon, start_predictor
from devtools.redis_server import RedisServer
from tests import waiting
from tests.inference import greedy_tokens

pytestmark = pytest.mark.integration

PROMPT = list(range(5, 30))
POD = "pod-e2e"


def generate(address: str, request_id: str) -> list[int]:
    with grpc.insecure_channel(address) as channel:
        return greedy_tokens(channel, PROMPT, 8, timeout_s=120, request_id=request_id)


def predictor_stats(address: str) -> predictor_pb2.PredictorStats:
    with grpc.insecure_channel(address) as channel:
        return predictor_pb2_grpc.PredictorStub(channel).GetStats(predictor_pb2.GetStatsRequest(), timeout=10)


def daemon_stats(address: str) -> cache_pb2.CacheStats:
    with grpc.insecure_channel(address) as channel:
        return cache_pb2_grpc.ExpertCacheStub(channel).GetStats(cache_pb2.GetStatsRequest(), timeout=10)


wait_for = functools.partial(waiting.wait_for, timeout_s=30.0, poll_s=0.1)


def test_generate_feeds_the_predictor_and_survives_its_outages(tiny_store, tmp_path):
    tiny = tiny_store("mixtral")
    manifest = tiny.manifest
    budget = max(1, manifest.num_blobs // 4) * manifest.blob_bytes
    procs = []
    with RedisServer(tmp_path / "redis") as redis:
        try:
            predictor = start_predictor(tmp_path, redis_url=redis.url, extra=["--sync-interval-s", "0.2"])
            procs.append(predictor)
            wiring = ["--predictor-address", predictor.address, "--pod-name", POD]
            daemon = start_daemon(
                tiny.store, tmp_path, device="cpu", device_budget_bytes=budget, extra=wiring
            )
            procs.append(daemon)
            compute = start_compute(tiny.store, daemon, tmp_path, extra=wiring)
            procs.append(compute)
            before = predictor_stats(predictor.address).eamc_entries

            # 1. A Generate: its EAM enters the EAMC, its hints reach the daemon's board.
            baseline = generate(compute.address, "e2e-1")
            assert len(baseline) == 8
            stats = wait_for(
                lambda: (s := predictor_stats(predictor.address)).eamc_entries == before + 1 and s,
                "EAMC grown by one",
            )
            # 25 prompt tokens + 7 fed-back generated tokens.
            assert stats.observed_tokens >= len(PROMPT) + 7
            hints = wait_for(lambda: (h := daemon_stats(daemon.address).hints).batches > 0 and h, "hints")
            assert hints.hints > 0 and hints.subscribed

            # 2. Redis goes away: Generate still succeeds, same greedy output; the predictor
            #    counts the store errors (the finished EAM cannot be written).
            redis.stop()
            assert generate(compute.address, "e2e-2") == baseline
            wait_for(lambda: predictor_stats(predictor.address).store_errors > 0, "store errors counted")

            # 3. The predictor dies: Generate still succeeds, same output.
            predictor.popen.kill()
            predictor.popen.wait()
            assert generate(compute.address, "e2e-3") == baseline
            assert generate(compute.address, "e2e-4") == baseline
            assert compute.popen.poll() is None and daemon.popen.poll() is None
        finally:
            for proc in reversed(procs):
                proc.stop()
    compute_log = compute.log()
    assert compute_log.count("predictor 127.0.0.1") >= 1  # the outage was logged
    # Logged once per outage, not per token.
    assert compute_log.count("unreachable") <= 2
