"""Redis secrets of the predictor against a real redis-server that requires a password.

The password comes from a file (a mounted Secret), an ACL user name may go with it, and neither
the password nor a password inside the URL ever shows in an error. ``rediss://`` verifies the
server against ``redis_tls_ca_file`` (run where redis-server was built with TLS).
"""

from __future__ import annotations

import grpc
import pytest
import redis

from expertcache.config_loader import load_config
from expertcache.errors import InvalidArgument
from expertcache.launch import free_port, start_predictor
from expertcache.redis_server import RedisServer
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


def test_rediss_verifies_the_server_against_the_ca(tmp_path):
    pki = Pki.create(tmp_path / "pki")
    tls_port = free_port()
    tls_args = [
        "--tls-port", str(tls_port),
        "--tls-cert-file", str(pki.server_cert),
        "--tls-key-file", str(pki.server_key),
        "--tls-ca-cert-file", str(pki.ca_file),
        "--tls-auth-clients", "no",
    ]  # fmt: skip
    try:
        server = RedisServer(tmp_path / "redis-tls", password=PASSWORD, extra_args=tls_args).start(
            timeout_s=5
        )
    except RuntimeError as exc:
        if "TLS" in str(exc) or "tls" in str(exc):
            pytest.skip(f"this redis-server was built without TLS: {str(exc)[-200:]}")
        raise
    try:
        url = f"rediss://127.0.0.1:{tls_port}/0"
        password_file = _password_file(tmp_path, PASSWORD)
        good = RedisOptions(password_file=password_file, tls_ca_file=str(pki.ca_file))
        assert open_store(url, redis=good).load("model-t")[0] == {}
        other = Pki.create(tmp_path / "other", "other-ca")
        wrong_ca = RedisOptions(password_file=password_file, tls_ca_file=str(other.ca_file))
        with pytest.raises(StoreUnavailable, match="(?i)certificate"):
            open_store(url, redis=wrong_ca).load("model-t")
    finally:
        server.stop()
