"""``expertcache health``, the probes' command, against real gRPC servers on real sockets:

- exit 0 and ``ADDR: SERVING`` on stdout when the server (or the named service) is SERVING;
- exit 1 naming the status when it answers NOT_SERVING, and when it does not know the service;
- exit 2 when nothing listens (no socket file; a closed TCP port) or the arguments are wrong;
- over TLS (a CA file), with a client certificate for mTLS, and with a bearer token from a file.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tests.procs import free_port

pytestmark = pytest.mark.integration

SERVICE = "moe.inference.v1.Inference"


def run_health(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "expertcache.cli", "health", *args], capture_output=True, text=True, timeout=60
    )


class TokenCheck(grpc.ServerInterceptor):
    """Refuses every call without ``authorization: Bearer <token>`` (UNAUTHENTICATED)."""

    def __init__(self, token: str) -> None:
        self.token = token

    def intercept_service(self, continuation, details):
        if dict(details.invocation_metadata).get("authorization") == f"Bearer {self.token}":
            return continuation(details)

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

        return grpc.unary_unary_rpc_method_handler(deny)


def serve(address: str, *, credentials=None, interceptors=()):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), interceptors=list(interceptors))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    if credentials is None:
        server.add_insecure_port(address)
    else:
        server.add_secure_port(address, credentials)
    server.start()
    return server, servicer


@pytest.fixture
def unix_server(tmp_path):
    socket = tmp_path / "daemon.sock"
    server, servicer = serve(f"unix://{socket}")
    yield f"unix://{socket}", servicer
    server.stop(0)


def test_serving_not_serving_and_unknown_service(unix_server):
    address, servicer = unix_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    servicer.set(SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
    result = run_health("--address", address)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{address}: SERVING\n"
    result = run_health("--address", address, "--service", SERVICE)
    assert result.returncode == 1
    assert result.stderr.strip() == f"expertcache health: {address} (service {SERVICE!r}): NOT_SERVING"
    result = run_health("--address", address, "--service", "no.Such")
    assert result.returncode == 1 and "does not know this service" in result.stderr


def test_nothing_listening_exits_2_saying_so(tmp_path):
    missing = tmp_path / "gone.sock"
    result = run_health("--address", f"unix://{missing}")
    assert result.returncode == 2
    assert f"no socket at {missing}" in result.stderr
    result = run_health("--address", f"127.0.0.1:{free_port()}", "--timeout-s", "2")
    assert result.returncode == 2 and "unreachable" in result.stderr


def test_usage_errors_exit_2(tmp_path, unix_server):
    address, _ = unix_server
    result = run_health("--address", "127.0.0.1:1", "--tls-cert-file", "c.pem")
    assert result.returncode == 2 and "--tls-cert-file and --tls-key-file go together" in result.stderr
    result = run_health("--address", address, "--tls-ca-file", str(tmp_path / "ca.pem"))
    assert result.returncode == 2 and "not to a unix socket" in result.stderr
    result = run_health("--address", "127.0.0.1:1", "--tls-ca-file", str(tmp_path / "none.pem"))
    assert result.returncode == 2 and f"cannot read the CA file {tmp_path / 'none.pem'}" in result.stderr
    result = run_health("--address", address, "--timeout-s", "0")
    assert result.returncode == 2 and "--timeout-s must be > 0" in result.stderr


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """A CA, a server certificate for the name ``expertcache.test`` and a client certificate."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: no certificates for the TLS checks")
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test-ca",
             "-keyout", "ca.key", "-out", "ca.crt", cwd=d)  # fmt: skip
    for name, cn in (("server", "expertcache.test"), ("client", "probe")):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={cn}", "-keyout", f"{name}.key",
                 "-out", f"{name}.csr", cwd=d)  # fmt: skip
        (d / f"{name}.ext").write_text(f"subjectAltName=DNS:{cn}\n")
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                 "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.crt", cwd=d)  # fmt: skip
    return d


def test_tls_mtls_and_a_bearer_token(pki, tmp_path):
    port = free_port()
    credentials = grpc.ssl_server_credentials(
        [((pki / "server.key").read_bytes(), (pki / "server.crt").read_bytes())],
        root_certificates=(pki / "ca.crt").read_bytes(),
        require_client_auth=True,
    )
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    server, servicer = serve(
        f"127.0.0.1:{port}", credentials=credentials, interceptors=[TokenCheck("s3cret")]
    )
    try:
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        address = f"127.0.0.1:{port}"
        tls = ["--tls-ca-file", str(pki / "ca.crt"), "--tls-server-name", "expertcache.test"]
        mtls = [*tls, "--tls-cert-file", str(pki / "client.crt"), "--tls-key-file", str(pki / "client.key")]
        result = run_health("--address", address, *mtls, "--auth-token-file", str(token))
        assert result.returncode == 0, result.stderr
        assert result.stdout == f"{address}: SERVING\n"
        # Without the token: the server's refusal, exit 1 with its status.
        result = run_health("--address", address, *mtls)
        assert result.returncode == 1 and "UNAUTHENTICATED" in result.stderr, result.stderr
        # Without the client certificate the handshake fails: unreachable.
        result = run_health("--address", address, *tls, "--auth-token-file", str(token), "--timeout-s", "3")
        assert result.returncode == 2, result.stderr
        # Plaintext against a TLS port: unreachable too.
        result = run_health("--address", address, "--timeout-s", "3")
        assert result.returncode == 2
        token.write_text("")
        result = run_health("--address", address, *mtls, "--auth-token-file", str(token))
        assert result.returncode == 2 and "is empty" in result.stderr
    finally:
        server.stop(0)
