"""Hostile clients and unlucky operators, against a real predictor and a real redis-server: one
client's duplicate request ids do not break anybody else's reporting, a Redis that restarts
empty gets the predictor's memory back, the predictor is ready only once it has loaded."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from moe.predictor.v1 import predictor_pb2, predictor_pb2_grpc

from devtools.launch import REPO, free_port
from devtools.redis_server import RedisServer
from tests.predictors import MODEL, E, K, L, register, start_predictor, stub, wait_stats

TOKENS = 6


def msg(request_id: str, t: int, *, nonce: str = "", done: bool = False, shift: int = 0):
    return predictor_pb2.Activation(
        request_id=request_id,
        model_id=MODEL,
        pod="pod-a",
        token_index=t,
        experts=[(shift + j) % E for _layer in range(L) for j in range(K)],
        top_k=K,
        request_done=done,
        request_nonce=nonce,
    )


def run(request_id: str, *, nonce: str = "", shift: int = 0) -> list:
    return [msg(request_id, t, nonce=nonce, done=t == TOKENS - 1, shift=shift) for t in range(TOKENS)]


def interleave(*runs: list) -> list:
    out = []
    for i in range(max(len(r) for r in runs)):
        out.extend(r[i] for r in runs if i < len(r))
    return out


@pytest.fixture
def redis_server(tmp_path):
    with RedisServer(tmp_path / "redis") as server:
        yield server


def test_duplicate_request_ids_leave_every_other_request_complete(tmp_path, redis_server):
    """Client A (IPv4) and client B (IPv6) both use the request ids r0..r4 and "dup"; A also
    runs "dup" twice at once with two nonces (a retry through the reporter) and once reuses one
    key with token indices going back (a broken client). Only that one request is refused: every
    other request of both clients is observed whole and inserted."""
    port = free_port()
    proc = start_predictor(
        tmp_path, "--redis-url", redis_server.url, "--eamc-capacity", "64", address=f"[::]:{port}"
    )
    v4, v6 = f"127.0.0.1:{port}", f"[::1]:{port}"
    try:
        register(v4)
        ids = [f"r{i}" for i in range(5)]
        broken = [msg("dupx", t) for t in range(3)] + [msg("dupx", 0, shift=1)]  # goes back: refused
        broken += [msg("dupx", t, done=t == TOKENS - 1) for t in range(3, TOKENS)]  # then ignored
        a_messages = interleave(
            *(run(r) for r in ids), run("dup", nonce="n1"), run("dup", nonce="n2", shift=2), broken
        )
        b_messages = interleave(*(run(r, shift=3) for r in ids), run("dup", shift=3))
        summaries: dict[str, predictor_pb2.ObserveSummary] = {}

        def observe(name: str, address: str, messages: list) -> None:
            summaries[name] = stub(address).Observe(iter(messages), timeout=30)

        threads = [
            threading.Thread(target=observe, args=("a", v4, a_messages)),
            threading.Thread(target=observe, args=("b", v6, b_messages)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        a, b = summaries["a"], summaries["b"]
        # A: 5 + 2 whole requests, the broken one's first 3 tokens; its 4 later messages refused.
        assert (a.activations, a.requests_done) == (7 * TOKENS + 3, 7), a
        assert (a.activations_refused, a.requests_refused) == (4, 1), a
        assert "INVALID_ARGUMENT: Activation.token_index = 0 does not follow" in a.first_refusal
        assert (b.activations, b.requests_done, b.activations_refused) == (6 * TOKENS, 6, 0), b
        s = wait_stats(proc, lambda s: s.entries_inserted == 13 and s.eamc_entries == 13)
        assert s.observed_tokens == 13 * TOKENS + 3
        assert s.requests_done == 13 and s.live_requests == 0 and s.live_bytes == 0
        assert dict(s.refused) == {"token_index": 1, "after_refusal": 3}
        client = redis.Redis.from_url(redis_server.url)
        try:
            assert client.hlen(f"expertcache:eamc:{MODEL}:entries") == 13
        finally:
            client.close()
    finally:
        proc.stop()


def test_a_refused_request_ends_its_hints_not_the_stream(tmp_path):
    """The subscriber of a refused request gets its done marker; hints carry the nonce."""
    proc = start_predictor(tmp_path, "--embedded-path", str(tmp_path / "eamc.bin"))
    try:
        register(proc.address)
        channel = grpc.insecure_channel(proc.address)
        hints = predictor_pb2_grpc.PredictorStub(channel).SubscribeHints(
            predictor_pb2.SubscribeHintsRequest(model_id=MODEL, pod="pod-a"), timeout=20
        )
        time.sleep(0.3)
        out_of_range = msg("x", 1, nonce="n9")
        out_of_range.experts[0] = E
        summary = stub(proc.address).Observe(
            iter([msg("x", 0, nonce="n9"), out_of_range, msg("y", 0, done=True)]), timeout=10
        )
        assert (summary.activations, summary.requests_refused, summary.requests_done) == (2, 1, 1)
        seen = []
        for batch in hints:
            seen.append((batch.request_id, batch.request_nonce, batch.request_done))
            if ("x", "n9", True) in seen and ("y", "", True) in seen:
                break
        hints.cancel()
        channel.close()
        # Its hints carry the nonce (a batch of hints not yet taken may be merged into the done
        # marker that follows it: the subscriber always gets the latest of a request).
        assert {nonce for request_id, nonce, _done in seen if request_id == "x"} == {"n9"}
    finally:
        proc.stop()


def test_register_model_needs_the_token_where_one_is_configured(tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    proc = start_predictor(
        tmp_path, "--embedded-path", str(tmp_path / "eamc.bin"), "--auth-token-file", str(token)
    )
    try:
        with pytest.raises(grpc.RpcError) as info:
            register(proc.address)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED

        ok = predictor_pb2_grpc.PredictorStub(grpc.insecure_channel(proc.address)).RegisterModel(
            predictor_pb2.RegisterModelRequest(model_id=MODEL, num_moe_layers=L, num_experts=E, top_k=K),
            metadata=[("authorization", "Bearer s3cret-token")],
            timeout=10,
        )
        assert ok.created
    finally:
        proc.stop()


def health_status(address: str) -> int:
    channel = grpc.insecure_channel(address)
    try:
        return (
            health_pb2_grpc.HealthStub(channel)
            .Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            .status
        )
    finally:
        channel.close()


def restart_empty(server: RedisServer) -> None:
    """The Redis loses everything: stopped, its files deleted, started again on its port."""
    server.stop()
    shutil.rmtree(server.data_dir / "appendonlydir", ignore_errors=True)
    for leftover in [*server.data_dir.glob("*.aof"), *server.data_dir.glob("*.rdb")]:
        leftover.unlink()
    server.start()


def test_a_redis_restarted_empty_gets_the_eamc_and_the_registry_back(tmp_path, redis_server):
    proc = start_predictor(tmp_path, "--redis-url", redis_server.url, "--eamc-capacity", "64")
    client = redis.Redis.from_url(redis_server.url)
    try:
        register(proc.address)  # registered at run time (not configured): only the store has it
        for i in range(5):
            stub(proc.address).Observe(iter(run(f"r{i}", shift=i)), timeout=10)
        wait_stats(proc, lambda s: s.eamc_entries == 5)
        before = sorted(client.hvals(f"expertcache:eamc:{MODEL}:entries"))
        run_id = client.info("server")["run_id"]
        restart_empty(redis_server)
        # A new, empty server (the predictor may refill it before we look, so its emptiness is
        # not asserted: restart_empty deleted its files).
        assert client.info("server")["run_id"] != run_id
        deadline = time.monotonic() + 60
        while client.hlen(f"expertcache:eamc:{MODEL}:entries") < 5 or not client.hgetall(
            "expertcache:models"
        ):
            assert time.monotonic() < deadline, proc.log()[-3000:]
            time.sleep(0.05)
        assert {k.decode(): v.decode() for k, v in client.hgetall("expertcache:models").items()} == {
            MODEL: f"{L}x{E}x{K}"
        }
        # The very entries (blobs) it had, rebuilt from memory; its own index kept them all along.
        assert sorted(client.hvals(f"expertcache:eamc:{MODEL}:entries")) == before
        s = wait_stats(proc, lambda s: not s.store_degraded)
        assert s.eamc_entries == 5
        # And it goes on: a new request lands in the refilled collection.
        stub(proc.address).Observe(iter(run("after", shift=3)), timeout=10)
        wait_stats(proc, lambda s: s.eamc_entries == 6)
        assert client.hlen(f"expertcache:eamc:{MODEL}:entries") == 6
    finally:
        client.close()
        proc.stop()


def test_serving_only_once_the_eamc_is_loaded(tmp_path, redis_server):
    """A restart over a large EAMC: health answers NOT_SERVING until every entry is loaded."""
    from predictor_svc.eam import encode_eam
    from predictor_svc.store.redis_store import RedisStore

    layers, experts, entries = 64, 512, 600  # 600 entries of 128 KiB: about 79 MB to load
    store = RedisStore(redis_server.url, log_len=8)
    try:
        store.register_model("big", f"{layers}x{experts}x2", 16)
        import numpy as np

        rng = np.random.default_rng(0)
        for _ in range(entries):
            eam = rng.integers(0, 5, size=(layers, experts), dtype=np.uint32)
            store.insert("big", encode_eam(eam, 10), entries, None)
    finally:
        store.close()
    address = f"127.0.0.1:{free_port()}"
    args = ["--listen-address", address, "--redis-url", redis_server.url, "--eamc-capacity", str(entries)]
    log = open(tmp_path / "predictor.log", "wb")  # noqa: SIM115 - owned by the process
    popen = subprocess.Popen([sys.executable, "-m", "predictor_svc", *args], stdout=log, stderr=log, cwd=REPO)
    try:
        deadline = time.monotonic() + 60
        saw_not_serving = False
        while True:
            assert time.monotonic() < deadline and popen.poll() is None, (
                tmp_path / "predictor.log"
            ).read_text()
            try:
                status = health_status(address)
            except grpc.RpcError:
                time.sleep(0.01)
                continue
            if status == health_pb2.HealthCheckResponse.SERVING:
                break
            saw_not_serving = True
        s = stub(address).GetStats(predictor_pb2.GetStatsRequest(), timeout=5)
        assert s.eamc_entries == entries, s
        assert saw_not_serving
    finally:
        popen.terminate()
        popen.wait(20)
        log.close()
