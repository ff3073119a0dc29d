"""Redis secrets of the predictor against a real redis-server that requires a password.

The password comes from a file (a mounted Secret), an ACL user name may go with it, and neither
the password nor a password inside the URL ever shows in an error. ``rediss://`` verifies the
server against ``redis_tls_ca_file`` (through a TLS terminator in front of the same redis-server).
"""

from __future__ import annotations

import socket
import ssl
import threading

import grpc
import pytest
import redis

from devtools.launch import start_predictor
from devtools.redis_server import RedisServer
from expertcache.config_loader import load_config
from expertcache.errors import InvalidArgument
from predictor_svc.config import PredictorConfig
from predictor_svc.errors import StoreUnavailable
from predictor_svc.store import RedisOptions, open_store
from tests.certs import Pki

pytestmark = pytest.mark.integration

PASSWORD = "p4ss word#with:odd/chars"


@pytest.fixture(scope="module")
def locked_redis(tmp_path_factory):
    with RedisServer(tmp_path_factory.mktemp("redis-auth"), password=PASSWORD) as server:
        admin = redis.Redis(host="127.0.0.1", port=server.port, password=PASSWORD)
        admin.execute_command("ACL", "SETUSER", "eamc", "on", ">eamc-pass", "~expertcache:*", "+@all")
        admin.close()
        yield server


def _password_file(tmp_path, text: str) -> str:
    path = tmp_path / "redis-password"
    path.write_text(text + "\n")
    return str(path)


def test_without_the_password_the_store_is_refused(locked_redis):
    store = open_store(locked_redis.url)
    with pytest.raises(StoreUnavailable, match="(?i)auth"):
        store.load("model-a")


def test_password_file_opens_the_store(locked_redis, tmp_path):
    store = open_store(locked_redis.url, redis=RedisOptions(password_file=_password_file(tmp_path, PASSWORD)))
    entries, cursor = store.load("model-a")
    assert entries == {} and cursor


def test_acl_user_and_password(locked_redis, tmp_path):
    good = RedisOptions(username="eamc", password_file=_password_file(tmp_path, "eamc-pass"))
    assert open_store(locked_redis.url, redis=good).load("model-b")[0] == {}
    bad = RedisOptions(username="eamc", password_file=_password_file(tmp_path, "not-it"))
    with pytest.raises(StoreUnavailable) as err:
        open_store(locked_redis.url, redis=bad).load("model-b")
    assert "not-it" not in str(err.value)


def test_password_in_the_url_never_shows_in_errors(locked_redis):
    url = f"redis://:wrong-secret@127.0.0.1:{locked_redis.port}/0"
    with pytest.raises(StoreUnavailable) as err:
        open_store(url).load("model-c")
    assert "wrong-secret" not in str(err.value)
    assert ":***@" in str(err.value)


def test_config_checks_redis_secrets(tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(InvalidArgument, match="'redis_password_file': the secret file .* is empty"):
        load_config(
            PredictorConfig, cli={"redis_url": "redis://db", "redis_password_file": str(empty)}, env={}
        )
    with pytest.raises(
        InvalidArgument, match="'redis_tls_ca_file' is set but 'redis_url' does not start with rediss://"
    ):
        load_config(
            PredictorConfig, cli={"redis_url": "redis://:pw@db", "redis_tls_ca_file": str(empty)}, env={}
        )
    with pytest.raises(InvalidArgument) as err:
        load_config(
            PredictorConfig, cli={"redis_url": "redis://:hunter2@db", "redis_tls_ca_file": str(empty)}, env={}
        )
    assert "hunter2" not in str(err.value)
    with pytest.raises(
        InvalidArgument, match="'redis_password_file' / 'redis_username' are set but 'redis_url' is empty"
    ):
        load_config(PredictorConfig, cli={"redis_username": "eamc"}, env={})


def test_predictor_process_uses_the_password_file(locked_redis, tmp_path):
    from moe.predictor.v1 import predictor_pb2, predictor_pb2_grpc

    proc = start_predictor(
        tmp_path,
        redis_url=locked_redis.url,
        extra=["--redis-password-file", _password_file(tmp_path, PASSWORD)],
    )
    try:
        with grpc.insecure_channel(proc.address) as channel:
            stats = predictor_pb2_grpc.PredictorStub(channel).GetStats(
                predictor_pb2.GetStatsRequest(), timeout=10
            )
        assert stats.store_kind == "redis"
        assert not stats.store_degraded and stats.store_errors == 0
    finally:
        proc.stop()
    assert PASSWORD not in proc.log()


class TlsTerminator:
    """TLS in front of the real redis-server (the bundled one is built without TLS): each
    connection's handshake is real, then bytes are copied both ways to Redis's plain port."""

    def __init__(self, backend_port: int, cert: str, key: str) -> None:
        self._ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._ctx.load_cert_chain(cert, key)
        self._backend_port = backend_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.handshake_failures = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            tls = self._ctx.wrap_socket(conn, server_side=True)
        except (ssl.SSLError, OSError):
            self.handshake_failures += 1
            conn.close()
            return
        backend = socket.create_connection(("127.0.0.1", self._backend_port))

        def pump(src: socket.socket, dst: socket.socket) -> None:
            try:
                while data := src.recv(65536):
                    dst.sendall(data)
            except OSError:
                pass
            finally:
                for s in (src, dst):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

        threading.Thread(target=pump, args=(backend, tls), daemon=True).start()
        pump(tls, backend)

    def close(self) -> None:
        self._listener.close()


def test_rediss_verifies_the_server_against_the_ca(locked_redis, tmp_path):
    pki = Pki.create(tmp_path / "pki")
    proxy = TlsTerminator(locked_redis.port, str(pki.server_cert), str(pki.server_key))
    try:
        url = f"rediss://127.0.0.1:{proxy.port}/0"
        password_file = _password_file(tmp_path, PASSWORD)
        good = RedisOptions(password_file=password_file, tls_ca_file=str(pki.ca_file))
        assert open_store(url, redis=good).load("model-t")[0] == {}
        other = Pki.create(tmp_path / "other", "other-ca")
        wrong_ca = RedisOptions(password_file=password_file, tls_ca_file=str(other.ca_file))
        with pytest.raises(StoreUnavailable, match="(?i)certificate verify failed"):
            open_store(url, redis=wrong_ca).load("model-t")
        # Through the config: a rediss:// predictor config with the CA file is accepted.
        config = load_config(
            PredictorConfig,
            cli={
                "redis_url": url,
                "redis_tls_ca_file": str(pki.ca_file),
                "redis_password_file": password_file,
            },
            env={},
        )
        assert open_store(config.redis_url, redis=RedisOptions.from_config(config)).load("model-u")[0] == {}
    finally:
        proxy.close()
