"""The predictor as real processes (``python -m predictor_svc``) on real sockets, with a real
redis-server: shared EAMC between replicas, restarts, a Redis outage, the embedded store's
save/load, and gRPC error statuses."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from moe.predictor.v1 import predictor_pb2

from devtools.launch import Proc, free_port
from devtools.redis_server import RedisServer
from tests import predictors
from tests.predictors import MODEL, SHAPE, K, L, first_hints, request, stats, stub, wait_stats


def start_predictor(work_dir: Path, *extra: str, **kwargs) -> Proc:
    """A predictor configured with MODEL's shape."""
    return predictors.start_predictor(work_dir, "--model-shapes", SHAPE, *extra, **kwargs)


@pytest.fixture
def redis_server(tmp_path):
    with RedisServer(tmp_path / "redis") as server:
        yield server


def test_bad_activation_and_subscription_are_invalid_argument(tmp_path):
    """A bad activation ends its request's reporting (summary names it), not its stream."""
    proc = start_predictor(tmp_path, "--embedded-path", str(tmp_path / "eamc.bin"))
    try:
        bad = predictor_pb2.Activation(
            request_id="r", model_id=MODEL, token_index=0, experts=[0, 1, 2], top_k=K
        )
        summary = stub(proc).Observe(iter([bad]), timeout=10)
        assert (summary.activations, summary.activations_refused, summary.requests_refused) == (0, 1, 1)
        assert summary.first_refusal.startswith("INVALID_ARGUMENT: ")
        assert f"Activation.experts has 3 entries but model '{MODEL}' is registered with {L} layers" in (
            summary.first_refusal
        )
        out_of_range = predictor_pb2.Activation(
            request_id="r2", model_id=MODEL, token_index=0, experts=[0, 9] * L, top_k=K
        )
        summary = stub(proc).Observe(iter([out_of_range]), timeout=10)
        assert summary.requests_refused == 1
        assert "INVALID_ARGUMENT: Activation.experts[1] = 9 is out of range" in summary.first_refusal
        with pytest.raises(grpc.RpcError) as info:
            list(stub(proc).SubscribeHints(predictor_pb2.SubscribeHintsRequest(pod="p"), timeout=10))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "SubscribeHintsRequest.model_id is empty" in info.value.details()
        # The predictor still serves after rejecting them.
        summary = stub(proc).Observe(request("ok", 3), timeout=10)
        assert (summary.activations, summary.requests_done) == (3, 1)
        assert stats(proc).store_kind == "embedded"
    finally:
        proc.stop()


def test_embedded_store_saved_on_sigterm_and_loaded_on_restart(tmp_path):
    path = tmp_path / "data" / "eamc.bin"
    proc = start_predictor(tmp_path, "--embedded-path", str(path))
    try:
        stub(proc).Observe(request("a", 4), timeout=10)
        stub(proc).Observe(request("b", 6, alternate=True), timeout=10)
        wait_stats(proc, lambda s: s.eamc_entries == 2 and s.entries_inserted == 2)
    finally:
        assert proc.stop() == 0
    assert path.is_file() and path.stat().st_size > 0
    assert "embedded EAMC saved to" in proc.log()
    again = start_predictor(tmp_path, "--embedded-path", str(path), name="predictor2")
    try:
        loaded = wait_stats(again, lambda s: s.eamc_entries == 2)
        assert loaded.models[0].model_id == MODEL and loaded.entries_inserted == 0
    finally:
        again.stop()


def test_two_replicas_share_one_eamc_and_a_restart_loses_nothing(tmp_path, redis_server):
    a = start_predictor(tmp_path, "--redis-url", redis_server.url, name="a")
    b = start_predictor(tmp_path, "--redis-url", redis_server.url, name="b")
    try:
        assert stats(a).store_kind == "redis"
        # Control: with an empty EAMC, B hints exactly the experts the request used so far.
        before = first_hints(b, "ctl", lambda: stub(b).Observe(request("ctl", 1, done=False), timeout=10))
        assert all(experts == {0, 1} for experts in before.values()), before
        # A request observed on A (alternating 0,1 / 2,3) enters the shared EAMC ...
        stub(a).Observe(request("seen-on-a", 8, alternate=True), timeout=10)
        wait_stats(a, lambda s: s.entries_inserted == 1)
        # ... B sees it after its sync ...
        wait_stats(b, lambda s: s.eamc_entries == 1)
        # ... and it shapes B's hints: the matched entry adds experts 2, 3 to a request that has
        # only used 0, 1 so far.
        after = first_hints(b, "new", lambda: stub(b).Observe(request("new", 1, done=False), timeout=10))
        assert all({2, 3} & experts for experts in after.values()), after
        # A restart of A loses no entry: it reloads the collection from Redis.
        address = a.address
        assert a.stop() == 0
        a = start_predictor(tmp_path, "--redis-url", redis_server.url, address=address, name="a2")
        wait_stats(a, lambda s: s.eamc_entries == 1)
        stub(a).Observe(request("second", 4), timeout=10)
        wait_stats(b, lambda s: s.eamc_entries == 2)
    finally:
        a.stop()
        b.stop()


def test_redis_outage_degrades_but_observe_and_hints_go_on(tmp_path, redis_server):
    proc = start_predictor(tmp_path, "--redis-url", redis_server.url)
    try:
        stub(proc).Observe(request("before", 4, alternate=True), timeout=10)
        wait_stats(proc, lambda s: s.eamc_entries == 1)
        redis_server.stop()
        # Not finished: a request's done marker replaces the hints the subscriber has not taken yet.
        hints = first_hints(
            proc, "during", lambda: stub(proc).Observe(request("during", 4, done=False), timeout=10)
        )
        assert hints  # predicted from memory while Redis is down
        stub(proc).Observe(request("during-done", 4), timeout=10)  # one to insert while Redis is down
        down = wait_stats(proc, lambda s: s.store_errors > 0 and s.store_degraded and s.inserts_pending == 1)
        assert down.eamc_entries == 1 and down.requests_done == 2
        assert "predicting from memory" in proc.log()
        redis_server.start()
        up = wait_stats(proc, lambda s: s.inserts_pending == 0 and s.eamc_entries == 2, timeout_s=20)
        assert not up.store_degraded and up.entries_inserted == 2
        assert "EAMC store is back" in proc.log()
    finally:
        proc.stop()


def test_unreachable_redis_at_start_starts_degraded(tmp_path):
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    proc = start_predictor(tmp_path, "--redis-url", url)
    try:
        summary = stub(proc).Observe(request("r", 3), timeout=10)
        assert summary.requests_done == 1
        s = wait_stats(proc, lambda s: s.store_errors > 0 and s.inserts_pending == 1)
        assert s.store_degraded and s.store_kind == "redis"
    finally:
        assert proc.stop() == 0
