"""The predictor defends itself (issue 14 §3), as real processes on real sockets with a real
redis-server: shapes come from the model registry, every configured limit is refused with its
status and a message naming it, nothing of a refused call is stored, a legit model keeps being
served, and the registry survives a restart."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import redis
from moe.predictor.v1 import predictor_pb2, predictor_pb2_grpc

from devtools.launch import Proc, free_port
from devtools.redis_server import RedisServer
from tests import predictors
from tests.predictors import MODEL, E, K, L, first_hints, register, stats, stub, wait_stats

ENTRY_BYTES = 24 + 4 * L * E  # one EAM entry of MODEL: header + uint32 cells
CAPACITY = 8


def start_predictor(work_dir: Path, *extra: str, **kwargs) -> Proc:
    """A predictor whose EAMC holds CAPACITY entries (unless ``extra`` says otherwise)."""
    return predictors.start_predictor(work_dir, "--eamc-capacity", str(CAPACITY), *extra, **kwargs)


def refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


class Refusal:
    """The first refusal of an Observe stream, as its summary reports it (a refused message
    ends its request's reporting, not the stream)."""

    def __init__(self, summary: predictor_pb2.ObserveSummary) -> None:
        assert summary.requests_refused >= 1, f"nothing was refused: {summary}"
        name, _, self._details = summary.first_refusal.partition(": ")
        self._code = getattr(grpc.StatusCode, name)

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def observe_refused(address: str, messages) -> Refusal:
    return Refusal(stub(address).Observe(messages, timeout=10))


def activation(
    request_id: str, t: int, *, model: str = MODEL, experts=None, done: bool = False, alternate=False
):
    base = 2 if alternate and t % 2 else 0
    return predictor_pb2.Activation(
        request_id=request_id,
        model_id=model,
        pod="pod-a",
        token_index=t,
        experts=experts if experts is not None else [base + j for _layer in range(L) for j in range(K)],
        top_k=K,
        request_done=done,
    )


def request(request_id: str, tokens: int, *, done: bool = True, alternate: bool = False, model: str = MODEL):
    for t in range(tokens):
        yield activation(request_id, t, done=done and t == tokens - 1, alternate=alternate, model=model)


@pytest.fixture
def redis_server(tmp_path):
    with RedisServer(tmp_path / "redis") as server:
        yield server


def test_registration_limits_are_refused_with_their_status_and_nothing_is_stored(tmp_path, redis_server):
    big = 16 * 16  # cells of a 16 x 16 model: reserves CAPACITY * (24 + 4 * 256) bytes
    budget = CAPACITY * ENTRY_BYTES + CAPACITY * (24 + 4 * big) + 300  # MODEL, one 16x16 and a 1x2 fit
    proc = start_predictor(
        tmp_path,
        "--redis-url",
        redis_server.url,
        "--max-models",
        "3",
        "--max-eamc-bytes",
        str(budget),
    )
    client = redis.Redis.from_url(redis_server.url)
    try:
        first = register(proc.address)
        assert first.created and (first.num_moe_layers, first.num_experts, first.top_k) == (L, E, K)
        assert register(proc.address).created is False  # idempotent

        err = refused(lambda: register(proc.address, MODEL, L, E + 1, K))
        assert err.code() == grpc.StatusCode.ALREADY_EXISTS
        assert f"model '{MODEL}' is registered as {L}x{E}x{K}" in err.details()
        err = refused(lambda: register(proc.address, "deep", 257, 8, 2))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "num_moe_layers = 257 (model 'deep') exceeds the limit max_layers=256" in err.details()
        err = refused(lambda: register(proc.address, "wide", 4, 1025, 2))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "num_experts = 1025 (model 'wide') exceeds the limit max_experts=1024" in err.details()
        err = refused(lambda: register(proc.address, "../../etc", 4, 8, 2))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "model_id" in err.details()
        err = refused(lambda: register(proc.address, "zero", 0, 8, 2))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "RegisterModelRequest.num_moe_layers is 0" in err.details()

        assert register(proc.address, "m16a", 16, 16, 2).created
        err = refused(lambda: register(proc.address, "m16b", 16, 16, 2))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"max_eamc_bytes={budget}" in err.details() and "model 'm16b' (16x16x2)" in err.details()
        assert register(proc.address, "small", 1, 2, 1).created  # 3 models: the limit
        err = refused(lambda: register(proc.address, "fourth", 1, 2, 1))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "the limit max_models=3" in err.details()

        # Requests naming an unregistered model, or disagreeing with the registered shape, are refused.
        err = observe_refused(proc.address, request("x", 2, model="m16b"))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "Activation.model_id 'm16b' is not registered" in err.details()
        huge = predictor_pb2.Activation(
            request_id="h",
            model_id="never",
            token_index=0,
            experts=[10**9] * 100_000,
            top_k=1,
            num_experts=10**9 + 1,
        )
        err = observe_refused(proc.address, iter([huge]))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        err = refused(
            lambda: list(
                stub(proc.address).SubscribeHints(
                    predictor_pb2.SubscribeHintsRequest(model_id="never", pod="p"), timeout=10
                )
            )
        )
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "SubscribeHintsRequest.model_id 'never' is not registered" in err.details()
        err = observe_refused(proc.address, iter([activation("y", 0, experts=[0, 9] * L)]))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"Activation.experts[1] = 9 is out of range: model '{MODEL}' has {E} experts" in err.details()
        err = observe_refused(proc.address, iter([activation("y2", 0, experts=[0, 1] * (L + 1))]))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (
            f"Activation.experts has {2 * (L + 1)} entries but model '{MODEL}' is registered" in err.details()
        )

        s = wait_stats(proc, lambda s: len(s.models) == 3)
        assert sorted(m.model_id for m in s.models) == ["m16a", "small", MODEL]
        assert s.live_requests == 0 and s.live_bytes == 0 and s.eamc_entries == 0
        assert s.eamc_reserved_bytes == CAPACITY * ENTRY_BYTES + CAPACITY * (24 + 4 * big) + CAPACITY * (
            24 + 8
        )
        assert dict(s.refused) == {
            "bad_shape": 2,
            "max_layers": 1,
            "max_experts": 1,
            "max_eamc_bytes": 1,
            "max_models": 1,
            "unregistered_model": 3,
            "out_of_range": 1,
            "after_refusal": 1,  # the second message of the refused request "x"
        }
        # Redis holds the registry and nothing of any refused model.
        assert {k.decode(): v.decode() for k, v in client.hgetall("expertcache:models").items()} == {
            MODEL: f"{L}x{E}x{K}",
            "m16a": "16x16x2",
            "small": "1x2x1",
        }
        stored = {k.decode().split(":")[2] for k in client.keys("expertcache:eamc:*")}
        assert stored <= {MODEL, "m16a", "small"}, stored

        # Not corrupted: the legit model's EAMC still takes entries and shapes hints.
        before = first_hints(proc, "ctl", lambda: stub(proc.address).Observe(request("ctl", 1, done=False)))
        assert all(experts == {0, 1} for experts in before.values()), before
        stub(proc.address).Observe(request("seen", 8, alternate=True), timeout=10)
        s = wait_stats(proc, lambda s: s.eamc_entries == 1)
        assert s.eamc_bytes == ENTRY_BYTES
        after = first_hints(proc, "new", lambda: stub(proc.address).Observe(request("new", 1, done=False)))
        assert all({2, 3} & experts for experts in after.values()), after
    finally:
        client.close()
        proc.stop()


def test_registry_survives_a_restart_with_redis_and_with_the_embedded_store(tmp_path, redis_server):
    proc = start_predictor(tmp_path, "--redis-url", redis_server.url, name="r1")
    address = proc.address
    try:
        assert register(address).created
        stub(address).Observe(request("a", 3), timeout=10)
        wait_stats(proc, lambda s: s.eamc_entries == 1)
    finally:
        assert proc.stop() == 0
    proc = start_predictor(tmp_path, "--redis-url", redis_server.url, address=address, name="r2")
    try:  # no RegisterModel this time: the registry came back from Redis
        s = wait_stats(proc, lambda s: s.eamc_entries == 1)
        assert [(m.model_id, m.num_moe_layers, m.num_experts, m.top_k) for m in s.models] == [
            (MODEL, L, E, K)
        ]
        assert stub(address).Observe(request("b", 2), timeout=10).requests_done == 1
        assert register(address).created is False
    finally:
        proc.stop()

    path = tmp_path / "eamc.bin"
    proc = start_predictor(tmp_path, "--embedded-path", str(path), name="e1")
    try:
        assert register(proc.address, "emb", 2, 4, 1).created
    finally:
        assert proc.stop() == 0
    proc = start_predictor(tmp_path, "--embedded-path", str(path), name="e2")
    try:
        s = stats(proc)
        assert [(m.model_id, m.num_moe_layers, m.num_experts, m.top_k) for m in s.models] == [
            ("emb", 2, 4, 1)
        ]
        err = refused(lambda: register(proc.address, "emb", 2, 5, 1))
        assert err.code() == grpc.StatusCode.ALREADY_EXISTS
    finally:
        proc.stop()


def test_registration_disabled_serves_only_configured_models(tmp_path):
    proc = start_predictor(
        tmp_path,
        "--embedded-path",
        str(tmp_path / "eamc.bin"),
        "--no-allow-registration",
        "--model-shapes",
        f"{MODEL}={L}x{E}x{K}",
    )
    try:
        assert register(proc.address).created is False  # configured: registered at start
        err = refused(lambda: register(proc.address, "other", 2, 4, 1))
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "allow_registration=false" in err.details() and "'other'" in err.details()
        assert stub(proc.address).Observe(request("r", 2), timeout=10).requests_done == 1
        assert dict(stats(proc).refused) == {"registration_disabled": 1}
    finally:
        proc.stop()


def test_per_client_live_caps_refuse_one_client_and_not_another(tmp_path):
    """Two clients: one over IPv4 loopback, one over IPv6 loopback (the predictor tells clients
    apart by peer address). The first reaching its caps does not stop the second."""
    port = free_port()
    per_request = 2048 + 20 * L * E  # live_request_bytes of MODEL
    proc = start_predictor(
        tmp_path,
        "--embedded-path",
        str(tmp_path / "eamc.bin"),
        "--max-client-live-requests",
        "3",
        "--max-client-live-bytes",
        str(10 * per_request),
        address=f"[::]:{port}",
    )
    v4, v6 = f"127.0.0.1:{port}", f"[::1]:{port}"
    try:
        register(v4)
        stub(v4).Observe(iter([activation(f"a{i}", 0) for i in range(3)]), timeout=10)
        err = observe_refused(v4, iter([activation("a3", 0)]))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "already has 3 live requests, the limit max_client_live_requests=3" in err.details()
        # Tokens of its open requests still pass; another client is not affected.
        stub(v4).Observe(iter([activation("a0", 1)]), timeout=10)
        stub(v6).Observe(iter([activation(f"b{i}", 0) for i in range(3)]), timeout=10)
        s = stats(proc)
        assert s.live_requests == 6 and s.live_bytes == 6 * per_request
        # Finishing requests frees the client's room.
        stub(v4).Observe(iter([activation("a0", 2, done=True)]), timeout=10)
        # a3's reporting ended with its refusal (its messages ignored until its request_done);
        # a new request fits.
        assert stub(v4).Observe(iter([activation("a3", 1)]), timeout=10).activations_refused == 1
        assert stub(v4).Observe(iter([activation("a4", 0)]), timeout=10).activations == 1
        assert dict(stats(proc).refused) == {"client_live_requests": 1, "after_refusal": 1}
    finally:
        proc.stop()

    proc = start_predictor(
        tmp_path,
        "--embedded-path",
        str(tmp_path / "eamc2.bin"),
        "--max-client-live-bytes",
        str(2 * per_request + 10),
        name="bytes",
    )
    try:
        register(proc.address)
        stub(proc.address).Observe(iter([activation("a", 0), activation("b", 0)]), timeout=10)
        err = observe_refused(proc.address, iter([activation("c", 0)]))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"beyond max_client_live_bytes={2 * per_request + 10}" in err.details()
        assert stats(proc).live_requests == 2
    finally:
        proc.stop()


def test_pending_inserts_and_subscribers_are_bounded(tmp_path):
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens: every insert stays pending
    eam_bytes = 4 * L * E
    proc = start_predictor(
        tmp_path,
        "--redis-url",
        url,
        "--model-shapes",
        f"{MODEL}={L}x{E}x{K}",
        "--max-pending-insert-bytes",
        str(2 * eam_bytes),
        "--max-subscribers",
        "1",
    )
    try:
        for r in range(4):
            stub(proc.address).Observe(request(f"r{r}", 2), timeout=10)
        s = wait_stats(proc, lambda s: s.requests_done == 4)
        assert (s.inserts_pending, s.pending_insert_bytes, s.inserts_dropped) == (2, 2 * eam_bytes, 2)
        channel = grpc.insecure_channel(proc.address)
        first = predictor_pb2_grpc.PredictorStub(channel).SubscribeHints(
            predictor_pb2.SubscribeHintsRequest(model_id=MODEL, pod="p"), timeout=10
        )
        wait_stats(proc, lambda s: s.subscribers == 1)
        err = refused(
            lambda: list(
                stub(proc.address).SubscribeHints(
                    predictor_pb2.SubscribeHintsRequest(model_id=MODEL, pod="q"), timeout=10
                )
            )
        )
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "the limit max_subscribers=1" in err.details()
        first.cancel()
        channel.close()
    finally:
        proc.stop()


def test_redis_holds_at_most_the_capacity_and_a_log_of_the_same_length(tmp_path, redis_server):
    proc = start_predictor(tmp_path, "--redis-url", redis_server.url)
    client = redis.Redis.from_url(redis_server.url)
    try:
        register(proc.address)
        for r in range(3 * CAPACITY):
            stub(proc.address).Observe(request(f"r{r}", 2, alternate=r % 2 == 1), timeout=10)
        wait_stats(proc, lambda s: s.entries_inserted == 3 * CAPACITY)
        assert client.hlen(f"expertcache:eamc:{MODEL}:entries") == CAPACITY
        assert client.xlen(f"expertcache:eamc:{MODEL}:log") == CAPACITY  # trimmed to eamc_capacity
        s = stats(proc)
        assert s.eamc_entries == CAPACITY and s.eamc_bytes == CAPACITY * ENTRY_BYTES
    finally:
        client.close()
        proc.stop()


def test_compute_and_daemon_register_their_model_on_connect(tiny_store, tmp_path):
    """Real daemon and compute, each pointed at its own predictor that knows no model: each
    registers the manifest's shape before streaming (the daemon's hint stream then opens)."""
    from devtools.launch import start_compute, start_daemon  # noqa: PLC0415
    from devtools.launch import start_predictor as launch_predictor  # noqa: PLC0415

    tiny = tiny_store("mixtral")
    manifest = tiny.manifest
    budget = max(1, manifest.num_blobs // 4) * manifest.blob_bytes
    expected = [(manifest.model_id, len(manifest.moe_layers), manifest.num_experts, manifest.top_k)]
    procs = []

    def shapes(s):
        return [(m.model_id, m.num_moe_layers, m.num_experts, m.top_k) for m in s.models]

    try:
        for_daemon = launch_predictor(tmp_path, log_name="p-daemon.log")
        procs.append(for_daemon)
        for_compute = launch_predictor(tmp_path, embedded_path=tmp_path / "c.bin", log_name="p-compute.log")
        procs.append(for_compute)
        daemon = start_daemon(
            tiny.store,
            tmp_path,
            device="cpu",
            device_budget_bytes=budget,
            extra=["--predictor-address", for_daemon.address, "--pod-name", "pod-reg"],
        )
        procs.append(daemon)
        s = wait_stats(for_daemon, lambda s: s.subscribers == 1, timeout_s=60)
        assert shapes(s) == expected and dict(s.refused) == {}
        procs.append(
            start_compute(
                tiny.store,
                daemon,
                tmp_path,
                extra=["--predictor-address", for_compute.address, "--pod-name", "pod-reg"],
            )
        )
        s = wait_stats(for_compute, lambda s: len(s.models) == 1, timeout_s=60)
        assert shapes(s) == expected and dict(s.refused) == {}
    finally:
        for proc in reversed(procs):
            proc.stop()


def test_one_client_cannot_fill_the_model_registry(tmp_path):
    port = free_port()
    proc = start_predictor(
        tmp_path,
        "--embedded-path", str(tmp_path / "eamc.bin"),
        "--max-client-models", "2",
        address=f"[::]:{port}",
    )  # fmt: skip
    v4, v6 = f"127.0.0.1:{port}", f"[::1]:{port}"
    try:
        assert register(v4, "a", 1, 2, 1).created and register(v4, "b", 1, 2, 1).created
        err = refused(lambda: register(v4, "c", 1, 2, 1))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "has registered 2 models, the limit max_client_models=2: model 'c'" in err.details()
        assert register(v4, "a", 1, 2, 1).created is False  # re-registering costs nothing
        assert register(v6, "c", 1, 2, 1).created  # another client still can
        s = stats(proc)
        assert sorted(m.model_id for m in s.models) == ["a", "b", "c"]
        assert dict(s.refused) == {"client_models": 1}
    finally:
        proc.stop()
