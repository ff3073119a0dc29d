"""expertcache.security and the shared gRPC edge: settings checks, the bearer token, undecodable
requests, reflection off by default. Real gRPC servers (``build_server``) on real loopback ports."""

from __future__ import annotations

import logging
import os

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from devtools.launch import free_port
from expertcache.config_loader import load_config
from expertcache.errors import InvalidArgument
from expertcache.grpc_server import build_server, set_serving
from expertcache.security import (
    CertificateFiles,
    ClientSecurity,
    ServerSecurity,
    WatchedToken,
    read_secret,
    read_token,
    redact_url,
)
from tests.certs import Pki

SERVICE = "test.Echo"


def _echo_handler():
    def say(request: bytes, context) -> bytes:
        return b"echo:" + request

    def collect(requests, context) -> bytes:
        return b"+".join(requests)

    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Say": grpc.unary_unary_rpc_method_handler(say),
            "Collect": grpc.stream_unary_rpc_method_handler(collect),
        },
    )


def _health_bytes(_: bytes) -> bytes:
    return _


@pytest.fixture
def serve():
    servers = []

    def start(security: ServerSecurity | None = None, *, reflection: bool = False, register=None) -> str:
        address = f"127.0.0.1:{free_port()}"
        server, health = build_server(
            address,
            register or [lambda s: s.add_generic_rpc_handlers((_echo_handler(),))],
            [SERVICE],
            max_workers=4,
            security=security,
            reflection_enabled=reflection,
        )
        server.start()
        set_serving(health, [SERVICE])
        servers.append(server)
        return address

    yield start
    for server in servers:
        server.stop(0).wait()


def _say(channel: grpc.Channel, payload: bytes = b"hi", metadata=None) -> bytes:
    return channel.unary_unary(f"/{SERVICE}/Say")(payload, timeout=5, metadata=metadata)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return Pki.create(tmp_path_factory.mktemp("pki"))


# -- settings checks ---------------------------------------------------------------------------
def test_server_settings_name_the_bad_field(pki, tmp_path):
    with pytest.raises(InvalidArgument, match="'tls_cert_file' is set but 'tls_key_file' is not"):
        ServerSecurity(tls_cert_file=str(pki.server_cert)).check()
    with pytest.raises(InvalidArgument, match="'tls_key_file' is set but 'tls_cert_file' is not"):
        ServerSecurity(tls_key_file=str(pki.server_key)).check()
    with pytest.raises(InvalidArgument, match="'tls_client_ca_file' \\(mTLS\\) needs TLS"):
        ServerSecurity(tls_client_ca_file=str(pki.ca_file)).check()
    # The client's key with the server's certificate: not a pair.
    with pytest.raises(InvalidArgument, match="not a matching PEM certificate and private key"):
        ServerSecurity(tls_cert_file=str(pki.server_cert), tls_key_file=str(pki.client_key)).check()
    with pytest.raises(InvalidArgument, match="does not exist"):
        ServerSecurity(tls_cert_file=str(tmp_path / "nope.crt"), tls_key_file=str(pki.server_key)).check()
    garbage = tmp_path / "garbage.pem"
    garbage.write_bytes(b"\x00\x01 not pem")
    with pytest.raises(InvalidArgument, match="'tls_client_ca_file' .*not a PEM CA"):
        ServerSecurity(
            tls_cert_file=str(pki.server_cert),
            tls_key_file=str(pki.server_key),
            tls_client_ca_file=str(garbage),
        ).check()
    empty = tmp_path / "empty-token"
    empty.write_text("\n")
    with pytest.raises(InvalidArgument, match="'auth_token_file': the token file .* is empty"):
        ServerSecurity(auth_token_file=str(empty)).check()
    ServerSecurity(
        tls_cert_file=str(pki.server_cert),
        tls_key_file=str(pki.server_key),
        tls_client_ca_file=str(pki.ca_file),
    ).check()


def test_client_settings_name_the_prefixed_field(pki, tmp_path):
    with pytest.raises(
        InvalidArgument, match="'predictor_tls_cert_file' is set but 'predictor_tls_key_file'"
    ):
        ClientSecurity(tls_cert_file=str(pki.client_cert), field_prefix="predictor_").check()
    with pytest.raises(InvalidArgument, match="'predictor_auth_token_file': cannot read"):
        ClientSecurity(auth_token_file=str(tmp_path / "missing"), field_prefix="predictor_").check()
    assert ClientSecurity(tls_ca_file=str(pki.ca_file)).tls
    assert not ClientSecurity().tls


def test_service_configs_check_security_fields(pki, tmp_path):
    from cache_daemon.config import DaemonConfig
    from compute_svc.config import ComputeConfig
    from predictor_svc.config import PredictorConfig

    assert ComputeConfig().listen_address == "127.0.0.1:50051"
    assert ComputeConfig().reflection is False and PredictorConfig().reflection is False
    with pytest.raises(InvalidArgument, match="'tls_cert_file' is set but 'tls_key_file'"):
        load_config(ComputeConfig, cli={"store_dir": "s", "tls_cert_file": str(pki.server_cert)}, env={})
    with pytest.raises(
        InvalidArgument, match="'predictor_tls_key_file' is set but 'predictor_tls_cert_file'"
    ):
        load_config(
            ComputeConfig, cli={"store_dir": "s", "predictor_tls_key_file": str(pki.client_key)}, env={}
        )
    with pytest.raises(InvalidArgument, match="'predictor_tls_cert_file' is set but"):
        load_config(
            DaemonConfig, cli={"store_dir": "s", "predictor_tls_cert_file": str(pki.client_cert)}, env={}
        )
    with pytest.raises(InvalidArgument, match="not a matching"):
        load_config(
            PredictorConfig,
            cli={"tls_cert_file": str(pki.client_cert), "tls_key_file": str(pki.server_key)},
            env={},
        )
    # Env spelling of the contract: EXPERTCACHE_<SERVICE>_<FIELD>.
    config = load_config(
        PredictorConfig,
        env={
            "EXPERTCACHE_PREDICTOR_TLS_CERT_FILE": str(pki.server_cert),
            "EXPERTCACHE_PREDICTOR_TLS_KEY_FILE": str(pki.server_key),
            "EXPERTCACHE_PREDICTOR_REFLECTION": "true",
        },
        env_prefix="EXPERTCACHE_PREDICTOR_",
    )
    assert ServerSecurity.from_config(config).tls and config.reflection


def test_tokens_and_secrets_are_read_strictly(tmp_path):
    path = tmp_path / "token"
    path.write_text("  s3cret-token\n")
    assert read_token(str(path)) == b"s3cret-token"
    path.write_text("two words")
    with pytest.raises(InvalidArgument, match="printable ASCII without spaces"):
        read_token(str(path))
    path.write_text("pass word with spaces\n")
    assert read_secret(str(path), "redis_password_file") == "pass word with spaces"
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(InvalidArgument, match="'redis_password_file': .* is not UTF-8"):
        read_secret(str(path), "redis_password_file")


def test_redact_url_hides_only_the_password():
    assert redact_url("redis://user:hunter2@db:6379/0") == "redis://user:***@db:6379/0"
    assert redact_url("rediss://:hunter2@db/1") == "rediss://:***@db/1"
    assert redact_url("redis://db:6379/0") == "redis://db:6379/0"
    assert "hunter2" not in redact_url("redis://:hunter2@[::1]:6379")


# -- the bearer token on a real server ----------------------------------------------------------
def test_token_auth_accepts_the_token_and_refuses_others(serve, tmp_path):
    token = tmp_path / "token"
    token.write_text("tok-1\n")
    address = serve(ServerSecurity(auth_token_file=str(token)))
    with grpc.insecure_channel(address) as channel:
        with pytest.raises(grpc.RpcError) as missing:
            _say(channel)
        assert missing.value.code() is grpc.StatusCode.UNAUTHENTICATED
        assert "missing bearer token" in missing.value.details()
        with pytest.raises(grpc.RpcError) as wrong:
            _say(channel, metadata=[("authorization", "Bearer tok-2")])
        assert wrong.value.code() is grpc.StatusCode.UNAUTHENTICATED
        assert wrong.value.details() == "invalid bearer token"
        with pytest.raises(grpc.RpcError) as malformed:
            _say(channel, metadata=[("authorization", "Basic tok-1")])
        assert "malformed authorization" in malformed.value.details()
        assert _say(channel, metadata=[("authorization", "Bearer tok-1")]) == b"echo:hi"
        # Streaming calls are guarded too.
        with pytest.raises(grpc.RpcError) as stream:
            channel.stream_unary(f"/{SERVICE}/Collect")(iter([b"a"]), timeout=5)
        assert stream.value.code() is grpc.StatusCode.UNAUTHENTICATED
        # Probes need no token.
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING

    # The client side adds the token to every call, unary and streaming.
    client = ClientSecurity(auth_token_file=str(token)).channel(address)
    try:
        assert _say(client) == b"echo:hi"
        assert client.stream_unary(f"/{SERVICE}/Collect")(iter([b"a", b"b"]), timeout=5) == b"a+b"
    finally:
        client.close()


def test_rotated_token_file_is_picked_up(serve, tmp_path):
    token = tmp_path / "token"
    token.write_text("old-token")
    address = serve(ServerSecurity(auth_token_file=str(token)))
    with grpc.insecure_channel(address) as channel:
        assert _say(channel, metadata=[("authorization", "Bearer old-token")]) == b"echo:hi"
        replacement = tmp_path / "token.new"
        replacement.write_text("new-token")
        os.replace(replacement, token)  # an atomic swap, as a Secret update is
        with pytest.raises(grpc.RpcError) as old:
            _say(channel, metadata=[("authorization", "Bearer old-token")])
        assert old.value.code() is grpc.StatusCode.UNAUTHENTICATED
        assert _say(channel, metadata=[("authorization", "Bearer new-token")]) == b"echo:hi"


def test_watched_token_keeps_the_last_good_token(tmp_path, caplog):
    token = tmp_path / "token"
    token.write_text("good")
    watched = WatchedToken(str(token), "auth_token_file")
    token.write_text("")
    with caplog.at_level(logging.ERROR):
        assert watched.get() == b"good"
    assert "keeping the previous token" in caplog.text


# -- hostile bytes ------------------------------------------------------------------------------
@pytest.mark.parametrize("payload", [b"\xff\xff\xff\xff", b"\x0a\xff\xff\xff\xff\x0f", b"\x08"])
def test_undecodable_request_is_invalid_argument(serve, payload):
    from moe.inference.v1 import inference_pb2, inference_pb2_grpc

    class Inference(inference_pb2_grpc.InferenceServicer):
        def GetModelInfo(self, request, context):  # noqa: N802
            return inference_pb2.ModelInfo(model_type="x")

    address = serve(register=[lambda s: inference_pb2_grpc.add_InferenceServicer_to_server(Inference(), s)])
    with grpc.insecure_channel(address) as channel:
        raw = channel.unary_unary("/moe.inference.v1.Inference/GetModelInfo")
        with pytest.raises(grpc.RpcError) as err:
            raw(payload, timeout=5)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid protobuf message" in err.value.details()
        assert "/moe.inference.v1.Inference/GetModelInfo" in err.value.details()
        # A well-formed request still works on the same server.
        ok = inference_pb2_grpc.InferenceStub(channel).GetModelInfo(
            inference_pb2.GetModelInfoRequest(), timeout=5
        )
        assert ok.model_type == "x"


def test_reflection_only_when_asked(serve):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    def list_services(address: str):
        with grpc.insecure_channel(address) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            replies = stub.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
            )
            return [s.name for r in replies for s in r.list_services_response.service]

    with pytest.raises(grpc.RpcError) as off:
        list_services(serve())
    assert off.value.code() is grpc.StatusCode.UNIMPLEMENTED
    assert SERVICE in list_services(serve(reflection=True))


# -- certificate files ---------------------------------------------------------------------------
def test_certificate_files_reload_only_a_good_pair(pki, tmp_path, caplog):
    work = Pki.create(tmp_path / "work")
    files = CertificateFiles(str(work.server_cert), str(work.server_key))
    assert files.fetch() is None  # unchanged
    # Half a rotation: a new certificate, the old key. Refused, the old pair kept.
    work.server_cert.write_bytes(pki.server_cert.read_bytes())
    with caplog.at_level(logging.ERROR):
        assert files.fetch() is None
    assert "cannot be used, keeping the previous ones" in caplog.text
    # The key arrives: the new pair is loaded.
    work.server_key.write_bytes(pki.server_key.read_bytes())
    assert files.fetch() is not None
    assert files.reloads == 1
    assert files.fetch() is None


def test_refused_calls_are_logged_once_per_reason_per_interval(serve, tmp_path, caplog):
    token = tmp_path / "token"
    token.write_text("tok-1\n")
    address = serve(ServerSecurity(auth_token_file=str(token)))
    with (
        caplog.at_level(logging.WARNING, logger="expertcache.security"),
        grpc.insecure_channel(address) as channel,
    ):
        for _ in range(50):  # a client retrying a wrong token in a loop
            with pytest.raises(grpc.RpcError) as wrong:
                _say(channel, metadata=[("authorization", "Bearer tok-2")])
            assert wrong.value.code() is grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError):
            _say(channel)  # another reason: its own line
    refusals = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused ")]
    assert refusals == [
        f"refused /{SERVICE}/Say: invalid bearer token",
        f"refused /{SERVICE}/Say: missing bearer token: send metadata 'authorization: Bearer <token>' "
        "(this server has auth_token_file set)",
    ]


def _whoami_handler():
    """Say answers with the caller's certificate common name and the bearer token it sent."""

    def say(request: bytes, context) -> bytes:
        names = context.auth_context().get("x509_common_name") or [b""]
        token = dict(context.invocation_metadata()).get("authorization", "")
        return names[0] + b"|" + token.encode()

    return grpc.method_handlers_generic_handler(SERVICE, {"Say": grpc.unary_unary_rpc_method_handler(say)})


def test_client_picks_up_rotated_certificates_and_token_at_the_next_call(serve, pki, tmp_path, caplog):
    """The predictor clients' channel (ClientSecurity.channel, what compute's reporter and the
    daemon's hint subscriber use): a rotated client certificate, and a rotated token, are what
    the very next call presents; a half-written pair is refused and the previous one kept."""
    address = serve(
        ServerSecurity(str(pki.server_cert), str(pki.server_key), str(pki.ca_file)),
        register=[lambda s: s.add_generic_rpc_handlers((_whoami_handler(),))],
    )
    cert, key, token = tmp_path / "client.crt", tmp_path / "client.key", tmp_path / "token"
    cert.write_bytes(pki.client_cert.read_bytes())
    key.write_bytes(pki.client_key.read_bytes())
    token.write_text("token-1")
    security = ClientSecurity(str(pki.ca_file), str(cert), str(key), str(token), "predictor_")
    with security.channel(address) as channel:
        assert _say(channel) == b"client|Bearer token-1"
        # A Secret update: new files written beside, then swapped in.
        pki.issue("client-2", tmp_path / "new.crt", tmp_path / "new.key", server=False)
        (tmp_path / "new-token").write_text("token-2")
        os.replace(tmp_path / "new.key", key)
        os.replace(tmp_path / "new.crt", cert)
        os.replace(tmp_path / "new-token", token)
        assert _say(channel) == b"client-2|Bearer token-2"
        # Half-written: a certificate without its key. The previous pair goes on.
        pki.issue("client-3", tmp_path / "c3.crt", tmp_path / "c3.key", server=False)
        os.replace(tmp_path / "c3.crt", cert)
        with caplog.at_level(logging.ERROR, logger="expertcache.security"):
            assert _say(channel) == b"client-2|Bearer token-2"
        assert "TLS client files changed but cannot be used" in caplog.text
        os.replace(tmp_path / "c3.key", key)  # the rest of the rotation arrives
        assert _say(channel) == b"client-3|Bearer token-2"
