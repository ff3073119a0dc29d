"""Transport security on real processes and sockets, with certificates made in the test.

One stack: a predictor serving mTLS with a bearer token; a cache daemon and two compute processes
that reach it with their client certificate and token (so the EAMC grows over mTLS); compute A
serves TLS with a token, compute B serves mTLS. A client without a certificate, with one from
another CA, without TLS or without the token is refused. A predictor whose certificate files are
replaced serves the new certificate to new connections without a restart.
"""

from __future__ import annotations

import functools
import os
import shutil

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from moe.cache.v1 import cache_pb2, cache_pb2_grpc
from moe.predictor.v1 import predictor_pb2, predictor_pb2_grpc

from devtools.launch import start_compute, start_daemon, start_predictor
from tests import waiting
from tests.certs import Pki
from tests.inference import greedy_tokens

pytestmark = pytest.mark.integration

PROMPT = list(range(5, 25))
TOKEN = "integration-token-5f1c"
wait_for = functools.partial(waiting.wait_for, timeout_s=30.0, poll_s=0.1)


def creds(pki: Pki, *, client_cert: bool = False) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=pki.ca_file.read_bytes(),
        private_key=pki.client_key.read_bytes() if client_cert else None,
        certificate_chain=pki.client_cert.read_bytes() if client_cert else None,
    )


def auth(token: str = TOKEN) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def generate(channel: grpc.Channel, metadata=None, request_id: str = "") -> list[int]:
    return greedy_tokens(channel, PROMPT, 4, timeout_s=60, request_id=request_id, metadata=metadata)


def predictor_stats(address: str, pki: Pki) -> predictor_pb2.PredictorStats:
    with grpc.secure_channel(address, creds(pki, client_cert=True)) as channel:
        stub = predictor_pb2_grpc.PredictorStub(channel)
        return stub.GetStats(predictor_pb2.GetStatsRequest(), timeout=10, metadata=auth())


@pytest.fixture(scope="module")
def stack(tiny_store, tmp_path_factory):
    work = tmp_path_factory.mktemp("tls")
    pki = Pki.create(work / "pki")
    token = work / "token"
    token.write_text(TOKEN + "\n")
    tiny = tiny_store("mixtral")
    budget = max(1, tiny.manifest.num_blobs // 4) * tiny.manifest.blob_bytes
    server_tls = ["--tls-cert-file", str(pki.server_cert), "--tls-key-file", str(pki.server_key)]
    procs = []
    try:
        predictor = start_predictor(
            work,
            extra=[*server_tls, "--tls-client-ca-file", str(pki.ca_file), "--auth-token-file", str(token)],
            credentials=creds(pki, client_cert=True),
        )
        procs.append(predictor)
        to_predictor = [
            "--predictor-address",
            predictor.address,
            "--pod-name",
            "pod-tls",
            "--predictor-tls-ca-file",
            str(pki.ca_file),
            "--predictor-tls-cert-file",
            str(pki.client_cert),
            "--predictor-tls-key-file",
            str(pki.client_key),
            "--predictor-auth-token-file",
            str(token),
        ]
        daemon = start_daemon(tiny.store, work, device="cpu", device_budget_bytes=budget, extra=to_predictor)
        procs.append(daemon)
        compute_tls = start_compute(
            tiny.store,
            daemon,
            work,
            extra=[*server_tls, "--auth-token-file", str(token), *to_predictor],
            credentials=creds(pki),
            log_name="compute-tls.log",
        )
        procs.append(compute_tls)
        compute_mtls = start_compute(
            tiny.store,
            daemon,
            work,
            extra=[*server_tls, "--tls-client-ca-file", str(pki.ca_file)],
            credentials=creds(pki, client_cert=True),
            log_name="compute-mtls.log",
        )
        procs.append(compute_mtls)
        yield {
            "pki": pki,
            "other": Pki.create(work / "other-pki", "other-ca"),
            "work": work,
            "predictor": predictor,
            "daemon": daemon,
            "tls": compute_tls,
            "mtls": compute_mtls,
        }
    finally:
        for proc in reversed(procs):
            proc.stop()


def _code(fn) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        fn()
    return err.value.code()


def test_generate_over_tls_with_token(stack):
    pki, address = stack["pki"], stack["tls"].address
    with grpc.secure_channel(address, creds(pki)) as channel:
        tokens = generate(channel, auth(), "tls-1")
        assert len(tokens) == 4
        # The token is required over TLS as well.
        with pytest.raises(grpc.RpcError) as missing:
            generate(channel)
        assert missing.value.code() is grpc.StatusCode.UNAUTHENTICATED
        assert "missing bearer token" in missing.value.details()
        assert _code(lambda: generate(channel, auth("wrong"))) is grpc.StatusCode.UNAUTHENTICATED
        # Probes need no token.
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    # A plaintext client cannot talk to a TLS server.
    with grpc.insecure_channel(address) as plain:
        assert _code(lambda: generate(plain, auth())) is grpc.StatusCode.UNAVAILABLE
    # A client that trusts another CA refuses the server's certificate.
    with grpc.secure_channel(address, creds(stack["other"])) as wrong_ca:
        assert _code(lambda: generate(wrong_ca, auth())) is grpc.StatusCode.UNAVAILABLE


def test_cli_takes_the_security_options(stack, capsys):
    from expertcache.cli import main

    pki, address = stack["pki"], stack["tls"].address
    token = str(stack["work"] / "token")
    assert (
        main(["info", "--address", address, "--tls-ca-file", str(pki.ca_file), "--auth-token-file", token])
        == 0
    )
    assert '"model_type"' in capsys.readouterr().out
    assert main(["info", "--address", address, "--tls-ca-file", str(pki.ca_file)]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    assert main(["info", "--address", address, "--tls-cert-file", str(pki.client_cert)]) == 2
    assert "is set but" in capsys.readouterr().err


def test_cli_generate_verifies_the_certificate_against_tls_server_name(stack, capsys):
    """The chart's test hook reaches compute by its Service name, which the certificate may not
    list: --tls-server-name names the one it does (tls.serverName), as for ``health``."""
    from expertcache.cli import main

    pki, address = stack["pki"], stack["tls"].address
    tls = ["--tls-ca-file", str(pki.ca_file), "--auth-token-file", str(stack["work"] / "token")]
    generate = ["generate", "--address", address, "--token-ids", "5,6,7", "--max-new-tokens", "2"]
    # The certificate lists localhost: verified against that name, the stream runs.
    assert main([*generate, "--ignore-eos", *tls, "--tls-server-name", "localhost"]) == 0
    assert "[2 tokens in" in capsys.readouterr().err
    # Against a name it does not list, the handshake fails: the name is the one verified.
    assert main([*generate, "--timeout-s", "5", *tls, "--tls-server-name", "other.example"]) == 2
    assert "UNAVAILABLE" in capsys.readouterr().err
    # Without TLS there is no certificate to name.
    assert main([*generate, "--tls-server-name", "localhost"]) == 2
    assert "--tls-server-name needs --tls-ca-file" in capsys.readouterr().err


def test_generate_over_mtls_refuses_clients_without_a_certificate(stack):
    pki, address = stack["pki"], stack["mtls"].address
    with grpc.secure_channel(address, creds(pki, client_cert=True)) as channel:
        assert len(generate(channel, request_id="mtls-1")) == 4
    with grpc.secure_channel(address, creds(pki)) as no_cert:
        assert _code(lambda: generate(no_cert)) is grpc.StatusCode.UNAVAILABLE
    other = stack["other"]
    foreign = grpc.ssl_channel_credentials(
        root_certificates=pki.ca_file.read_bytes(),  # trusts the server...
        private_key=other.client_key.read_bytes(),  # ...but presents a certificate of another CA
        certificate_chain=other.client_cert.read_bytes(),
    )
    with grpc.secure_channel(address, foreign) as channel:
        assert _code(lambda: generate(channel)) is grpc.StatusCode.UNAVAILABLE


def test_clients_reach_the_predictor_over_mtls_with_token(stack):
    pki, predictor = stack["pki"], stack["predictor"]
    with grpc.secure_channel(stack["tls"].address, creds(pki)) as channel:
        generate(channel, auth(), "tls-feeds-predictor")
    # compute's reporter got through: the finished request entered the EAMC.
    wait_for(lambda: predictor_stats(predictor.address, pki).requests_done >= 1, "EAM reported over mTLS")

    # the daemon's hint subscription got through.
    def subscribed() -> bool:
        with grpc.insecure_channel(stack["daemon"].address) as channel:
            stub = cache_pb2_grpc.ExpertCacheStub(channel)
            return stub.GetStats(cache_pb2.GetStatsRequest(), timeout=10).hints.subscribed

    wait_for(subscribed, "the daemon's hint stream over mTLS")
    # The predictor itself refuses a client with a certificate but without the token.
    with grpc.secure_channel(predictor.address, creds(pki, client_cert=True)) as channel:
        stub = predictor_pb2_grpc.PredictorStub(channel)
        assert _code(lambda: stub.GetStats(predictor_pb2.GetStatsRequest(), timeout=10)) is (
            grpc.StatusCode.UNAUTHENTICATED
        )


def test_rotated_certificate_is_served_without_restart(stack, tmp_path):
    first, second = Pki.create(tmp_path / "first", "first-ca"), Pki.create(tmp_path / "second", "second-ca")
    live = tmp_path / "live"
    live.mkdir()
    for name in ("tls.crt", "tls.key"):
        shutil.copy(first.dir / name, live / name)
    predictor = start_predictor(
        tmp_path,
        extra=["--tls-cert-file", str(live / "tls.crt"), "--tls-key-file", str(live / "tls.key")],
        credentials=creds(first),
        log_name="predictor-rotation.log",
    )
    try:

        def stats_with(pki: Pki) -> predictor_pb2.PredictorStats:
            with grpc.secure_channel(predictor.address, creds(pki)) as channel:
                return predictor_pb2_grpc.PredictorStub(channel).GetStats(
                    predictor_pb2.GetStatsRequest(), timeout=10
                )

        stats_with(first)
        assert _code(lambda: stats_with(second)) is grpc.StatusCode.UNAVAILABLE
        # Rotate as a Secret update would: new files renamed into place.
        for name in ("tls.key", "tls.crt"):
            shutil.copy(second.dir / name, live / f".{name}.new")
            os.replace(live / f".{name}.new", live / name)
        stats_with(second)  # a new connection gets the new certificate
        assert _code(lambda: stats_with(first)) is grpc.StatusCode.UNAVAILABLE
        assert predictor.popen.poll() is None
    finally:
        predictor.stop()
    assert "TLS certificate files changed: reloaded" in predictor.log()
