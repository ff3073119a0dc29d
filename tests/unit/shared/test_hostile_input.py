"""Hostile requests on real gRPC servers: undecodable bytes and out-of-bounds fields get
INVALID_ARGUMENT with a message naming what is wrong, and the server goes on serving.

Compute: the real Inference servicer and scheduler over the real engine (tiny Mixtral, experts
from an in-process provider) behind ``build_server``. Predictor: the real servicer and service.
"""

from __future__ import annotations

import dataclasses

import grpc
import pytest
from moe.inference.v1 import inference_pb2, inference_pb2_grpc
from moe.predictor.v1 import predictor_pb2, predictor_pb2_grpc

from compute_svc.engine.requests import MAX_REQUEST_ID_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from compute_svc.engine.scheduler import Scheduler
from compute_svc.server import SERVICE_NAME as INFERENCE
from compute_svc.server import InferenceServicer
from devtools.launch import free_port
from expertcache.grpc_server import build_server, set_serving
from predictor_svc.config import PredictorConfig
from predictor_svc.server import create_server
from predictor_svc.service import PredictorService
from predictor_svc.store import EmbeddedStore

PROMPT_BYTES_LIMIT = 2000


@pytest.fixture(scope="module")
def compute(local_engine):
    engine, _, tiny = local_engine("mixtral")
    engine.requests.limits = dataclasses.replace(engine.requests.limits, max_prompt_bytes=PROMPT_BYTES_LIMIT)
    scheduler = Scheduler(engine)
    scheduler.start()
    address = f"127.0.0.1:{free_port()}"
    server, health = build_server(
        address,
        [lambda s: inference_pb2_grpc.add_InferenceServicer_to_server(InferenceServicer(scheduler), s)],
        [INFERENCE],
        max_workers=8,
    )
    server.start()
    set_serving(health, [INFERENCE])
    channel = grpc.insecure_channel(address)
    yield channel, engine
    channel.close()
    server.stop(0).wait()
    scheduler.stop()


def _generate(channel, **fields) -> list[inference_pb2.GenerateResponse]:
    fields.setdefault("max_new_tokens", 2)
    request = inference_pb2.GenerateRequest(**fields)
    return list(inference_pb2_grpc.InferenceStub(channel).Generate(request, timeout=60))


def _refused(channel, **fields) -> str:
    with pytest.raises(grpc.RpcError) as err:
        _generate(channel, **fields)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    return err.value.details()


def test_undecodable_generate_is_invalid_argument(compute):
    channel, _ = compute
    raw = channel.unary_stream("/moe.inference.v1.Inference/Generate")
    for payload in (
        b"\xff" * 16,
        b"\x12\xff\xff\xff\xff\x0f",
        b"\x0a\x05ab",
    ):  # bad tag, huge length, truncated
        with pytest.raises(grpc.RpcError) as err:
            list(raw(payload, timeout=10))
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid protobuf message" in err.value.details()
    assert len(_generate(channel, token_ids=[1, 2, 3])) == 2  # still serving


def test_out_of_bounds_fields_name_the_field_and_limit(compute):
    channel, engine = compute
    vocab = engine.loaded.vocab_size
    limits = engine.requests.limits
    assert f"token_ids[1] = {2**32 - 1} is out of range [0, {vocab})" in _refused(
        channel, token_ids=[1, 2**32 - 1]
    )
    assert "max_new_tokens 0 is out of range" in _refused(channel, token_ids=[1], max_new_tokens=0)
    assert "max_new_tokens" in _refused(channel, token_ids=[1], max_new_tokens=limits.max_new_tokens + 1)
    too_many = list(range(1, 2)) * (limits.max_prompt_tokens + 1)
    assert "max_prompt_tokens" in _refused(channel, token_ids=too_many)
    assert "max_prompt_bytes" in _refused(channel, text="x" * (PROMPT_BYTES_LIMIT + 1))
    assert f"at most {MAX_STOP_STRINGS}" in _refused(
        channel, token_ids=[1], stop=["a"] * (MAX_STOP_STRINGS + 1)
    )
    assert "stop_token_ids" in _refused(channel, token_ids=[1], stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1))
    assert "stop_token_ids[0]" in _refused(channel, token_ids=[1], stop_token_ids=[vocab])
    assert "request_id" in _refused(channel, token_ids=[1], request_id="r" * (MAX_REQUEST_ID_CHARS + 1))
    for name, value in (("temperature", float("nan")), ("top_p", float("inf")), ("repetition_penalty", -1.0)):
        details = _refused(channel, token_ids=[1], sampling=inference_pb2.SamplingParams(**{name: value}))
        assert f"sampling.{name}" in details
    assert "only one of" in _refused(channel, token_ids=[1], text="hi")
    assert "prompt is empty" in _refused(channel)
    assert len(_generate(channel, token_ids=[1, 2, 3])) == 2  # still serving


@pytest.fixture
def predictor():
    service = PredictorService(PredictorConfig(), EmbeddedStore(), background=False)
    address = f"127.0.0.1:{free_port()}"
    server, _ = create_server(service, address, max_workers=4)
    channel = grpc.insecure_channel(address)
    yield channel
    channel.close()
    server.stop(0).wait()
    service.close()


def test_a_second_server_on_a_port_in_use_does_not_start():
    """Not sharing the port (SO_REUSEPORT): a client of the first would reach either one."""
    service = PredictorService(PredictorConfig(), EmbeddedStore(), background=False)
    address = f"127.0.0.1:{free_port()}"
    server, _ = create_server(service, address, max_workers=4)
    try:
        with pytest.raises(RuntimeError, match=f"Failed to bind to address {address}"):
            create_server(service, address, max_workers=4)
    finally:
        server.stop(0).wait()
        service.close()


def test_undecodable_predictor_requests_are_invalid_argument(predictor):
    observe = predictor.stream_unary("/moe.predictor.v1.Predictor/Observe")
    with pytest.raises(grpc.RpcError) as err:
        observe(iter([b"\xff\xff\xff"]), timeout=10)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "/moe.predictor.v1.Predictor/Observe" in err.value.details()
    stats = predictor.unary_unary("/moe.predictor.v1.Predictor/GetStats")
    with pytest.raises(grpc.RpcError) as err:
        stats(b"\x0a", timeout=10)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    reply = predictor_pb2_grpc.PredictorStub(predictor).GetStats(predictor_pb2.GetStatsRequest(), timeout=10)
    assert reply.store_kind == "embedded"


@pytest.mark.parametrize(
    ("cls", "field", "value"),
    [
        ("compute_svc.config.ComputeConfig", "acquire_timeout_s", "nan"),
        ("compute_svc.config.ComputeConfig", "daemon_connect_timeout_s", "inf"),
        ("predictor_svc.config.PredictorConfig", "min_score", "nan"),
        ("predictor_svc.config.PredictorConfig", "live_request_ttl_s", "-inf"),
    ],
)
def test_config_numbers_reject_nan_and_infinities(cls, field, value):
    import importlib

    from expertcache.config_loader import load_config
    from expertcache.errors import InvalidArgument

    module, _, name = cls.rpartition(".")
    config_cls = getattr(importlib.import_module(module), name)
    cli = {field: value, **({"store_dir": "s"} if name == "ComputeConfig" else {})}
    with pytest.raises(InvalidArgument, match=f"config field '{field}' = .* is not a finite number"):
        load_config(config_cls, cli=cli, env={})
