"""Hypothesis fuzzing of what a hostile client or a corrupted file feeds the services.

Each target either accepts its input or refuses it with the project's error (InvalidArgument,
DataLoss): no other exception (a crash) and no example past its deadline (a hang).

- request decoding and validation: arbitrary bytes as a GenerateRequest, then the engine's
  ``prepare`` on whatever decoded, and on structured requests with extreme values;
- the manifest loader: arbitrary bytes, arbitrary JSON, and valid manifests with one value
  replaced by arbitrary JSON;
- config loading: arbitrary strings for every numeric field of the compute config;
- EAM entries as the store hands them back: arbitrary bytes, and valid entries mutated.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from moe.inference.v1 import inference_pb2

from compute_svc.config import ComputeConfig
from compute_svc.engine.requests import PreparedRequest
from compute_svc.server import request_from_pb
from expertcache.config_loader import load_config
from expertcache.errors import DataLoss, InvalidArgument
from expertcache.manifest import StoreManifest
from predictor_svc.eam import EamShape, add_token, decode_eam, encode_eam, new_eam
from predictor_svc.errors import CorruptEntry
from tests.stores import valid_manifest_raw

FUZZ = settings(
    max_examples=150,
    deadline=10_000,  # ms per example: a hang fails the test (generous: CI machines are shared)
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5)
    ),
    max_leaves=20,
)


# -- requests ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(local_engine):
    return local_engine("mixtral")[0]


def _prepare(engine, pb: inference_pb2.GenerateRequest) -> None:
    try:
        assert isinstance(engine.requests.prepare(request_from_pb(pb)), PreparedRequest)
    except InvalidArgument as exc:
        assert str(exc)  # a refusal always says why


@FUZZ
@given(data=st.binary(max_size=512))
def test_fuzz_request_bytes(engine, data):
    try:
        pb = inference_pb2.GenerateRequest.FromString(data)
    except DecodeError:
        return  # the gRPC edge answers INVALID_ARGUMENT for these (test_hostile_input)
    _prepare(engine, pb)


finite_or_not = st.floats(allow_nan=True, allow_infinity=True)
uint32 = st.integers(0, 2**32 - 1)


@FUZZ
@given(
    token_ids=st.lists(uint32, max_size=40),
    text=st.text(max_size=64),
    max_new_tokens=uint32,
    temperature=finite_or_not,
    top_p=finite_or_not,
    top_k=uint32,
    repetition_penalty=finite_or_not,
    presence_penalty=finite_or_not,
    stop=st.lists(st.text(max_size=300), max_size=20),
    stop_token_ids=st.lists(uint32, max_size=5),
    request_id=st.text(max_size=300),
)
def test_fuzz_request_fields(engine, token_ids, text, max_new_tokens, temperature, top_p, top_k,
                             repetition_penalty, presence_penalty, stop, stop_token_ids, request_id):  # fmt: skip
    pb = inference_pb2.GenerateRequest(
        token_ids=token_ids,
        text=text,
        max_new_tokens=max_new_tokens,
        sampling=inference_pb2.SamplingParams(
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            repetition_penalty=repetition_penalty,
            presence_penalty=presence_penalty,
        ),
        stop=stop,
        stop_token_ids=stop_token_ids,
        request_id=request_id,
    )
    _prepare(engine, pb)


# -- manifests --------------------------------------------------------------------------------
def _load(data: bytes | str) -> None:
    try:
        StoreManifest.from_json(data, origin="fuzz/manifest.json")
    except DataLoss as exc:
        assert "fuzz/manifest.json" in str(exc)


@FUZZ
@given(data=st.binary(max_size=2048))
def test_fuzz_manifest_bytes(data):
    _load(data)


@FUZZ
@given(value=json_values)
def test_fuzz_manifest_json(value):
    _load(json.dumps(value))


def _paths(raw, prefix=()):
    yield prefix
    if isinstance(raw, dict):
        for k, v in raw.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(raw, list):
        for i, v in enumerate(raw):
            yield from _paths(v, (*prefix, i))


VALID = valid_manifest_raw()
PATHS = [p for p in _paths(VALID) if p]


@FUZZ
@given(path=st.sampled_from(PATHS), value=json_values)
def test_fuzz_manifest_one_value_replaced(path, value):
    raw = json.loads(json.dumps(VALID))
    target = raw
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value
    _load(json.dumps(raw))


# -- config -----------------------------------------------------------------------------------
NUMERIC = [f.name for f in dataclasses.fields(ComputeConfig) if f.type in ("int", "float", int, float)]


@FUZZ
@given(
    name=st.sampled_from(NUMERIC),
    value=st.text(max_size=30) | st.sampled_from(["nan", "inf", "-inf", "1e309"]),
)
def test_fuzz_config_numbers(name, value):
    try:
        config = load_config(ComputeConfig, cli={"store_dir": "s", name: value}, env={})
    except InvalidArgument as exc:
        assert name in str(exc) or "max_batched_tokens" in str(exc)
        return
    number = getattr(config, name)
    assert number == number and number not in (float("inf"), float("-inf"))


# -- EAM entries (what Redis or the embedded file hands the predictor back) -------------------
EAM_SHAPE = EamShape(layers=3, experts=8, top_k=2)


def _valid_entry() -> bytes:
    eam = new_eam(EAM_SHAPE)
    add_token(eam, np.array([[0, 1], [2, 3], [7, 4]]))
    return encode_eam(eam, 1)


def _decode(blob: bytes) -> None:
    try:
        eam, tokens = decode_eam(blob, EAM_SHAPE)
    except CorruptEntry as exc:
        assert str(exc)  # a refusal always says why
        return
    assert eam.shape == (EAM_SHAPE.layers, EAM_SHAPE.experts) and eam.dtype == np.uint32
    assert 0 <= tokens <= 0xFFFFFFFF


@FUZZ
@given(blob=st.binary(max_size=256))
def test_fuzz_eam_entry_bytes(blob):
    _decode(blob)


@FUZZ
@given(data=st.data())
def test_fuzz_eam_entry_mutated(data):
    """A valid entry with bytes flipped, truncated or extended: decoded whole or refused."""
    blob = bytearray(_valid_entry())
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(blob) - 1))
        blob[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(blob) + 8))
    _decode(bytes(blob[:cut]) + bytes(max(0, cut - len(blob))))
