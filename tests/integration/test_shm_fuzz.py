"""A compute client writing random bytes into all the shared memory it can write, while another
compute process decodes through the same daemon: the other's output still equals transformers',
and the daemon keeps serving (issue "Nothing a client does stops the service", part C).

Before the shared memory was split (one table file every client mapped read-write, the daemon
re-reading its sizes and slots from it) four bytes written there crashed the daemon or made two
experts share one slot."""

from __future__ import annotations

import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from moe.cache.v1 import cache_pb2, cache_pb2_grpc
from transformers import AutoModelForCausalLM

from bench.shm_hostile import RegionFuzz
from tests.inference import generate_replies
from tests.procs import start_compute, start_daemon
from tests.waiting import wait_for

pytestmark = pytest.mark.integration

PROMPT = list(range(5, 40))
NEW_TOKENS = 12


def test_a_client_scribbling_on_shared_memory_changes_nothing_for_another(tiny_store, tmp_path):
    tiny = tiny_store("mixtral")
    plain = AutoModelForCausalLM.from_pretrained(tiny.checkpoint).eval()
    with torch.no_grad():
        want = plain.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False)
    want = want[0, len(PROMPT) :].tolist()
    manifest = tiny.manifest
    # A quarter of the experts fit: every token evicts, so the attacker's pins are in the way.
    daemon = start_daemon(
        tiny.store,
        tmp_path,
        device="cpu",
        device_budget_bytes=max(1, manifest.num_blobs // 4) * manifest.blob_bytes,
    )
    compute = fuzz = None
    try:
        compute = start_compute(tiny.store, daemon, tmp_path)
        fuzz = RegionFuzz(daemon.address.removeprefix("unix://"), reattach_s=1.0).start()
        try:
            wait_for(
                lambda: fuzz.attaches >= 1 and fuzz.bytes_written > 0, "the attacker attached", timeout_s=30
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the attacker's errors: {fuzz.errors}") from None
        # At least three requests, and on until the attacker has attached again (a new region).
        generations, deadline = 0, time.monotonic() + 120
        while generations < 3 or fuzz.attaches < 2:
            assert time.monotonic() < deadline, (generations, fuzz.attaches, fuzz.errors)
            replies = generate_replies(compute.address, PROMPT, NEW_TOKENS)
            assert [r.token_id for r in replies] == want
            generations += 1
        fuzz.stop()
        assert not fuzz.writable, f"a client could map {fuzz.writable} writable"
        # The daemon goes on serving: health, stats, and the compute client's next request.
        with grpc.insecure_channel(daemon.address) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            cache_pb2_grpc.ExpertCacheStub(channel).GetStats(cache_pb2.GetStatsRequest(), timeout=10)
        assert [r.token_id for r in generate_replies(compute.address, PROMPT, NEW_TOKENS)] == want
        assert daemon.popen.poll() is None
        log = daemon.log()

        assert "Traceback" not in log and "Fatal Python error" not in log, log[-4000:]
    finally:
        if fuzz is not None:
            fuzz.stop()
        if compute is not None:
            compute.stop()
        daemon.stop()
