"""The one routing-trace reader and writer (expertcache.trace): round trip, decode rows, bad files."""

from __future__ import annotations

import json

import numpy as np
import pytest

from expertcache.trace import RoutingTrace, TraceError, TraceRequest, read_trace, write_trace

META = {"num_layers": 2, "num_experts": 6, "top_k": 2, "model": "m"}


def _request(rows: int, prompt: int, seed: int) -> TraceRequest:
    rng = np.random.default_rng(seed)
    experts = np.stack([np.stack([rng.permutation(6)[:2] for _ in range(2)]) for _ in range(rows)])
    weights = np.full((rows, 2, 2), 0.5, np.float16)
    return TraceRequest(experts, weights, prompt, {"request_id": f"r{seed}"})


def test_round_trip_and_decode_rows(tmp_path):
    path = tmp_path / "sub" / "t.npz"
    a, b = _request(5, 2, 0), _request(3, 0, 1)
    write_trace(path, [a, b], META)
    assert not (tmp_path / "sub" / "t.npz.tmp").exists()
    trace = read_trace(path)
    assert isinstance(trace, RoutingTrace) and trace.has_gate_weights
    assert (trace.num_layers, trace.num_experts, trace.top_k, trace.num_requests) == (2, 6, 2, 2)
    assert trace.expert_ids.dtype == np.int8 and trace.meta["expert_ids_dtype"] == "int8"
    assert trace.rows(0) == (0, 5) and trace.decode_rows(0) == (2, 5) and trace.decode_rows(1) == (5, 8)
    np.testing.assert_array_equal(trace.request(1), b.experts)
    decode = trace.decode_only()
    assert decode.req_offsets.tolist() == [0, 3, 6] and not decode.decode_start.any()
    np.testing.assert_array_equal(decode.expert_ids[:3], a.experts[2:])
    assert decode.decode_only() is decode
    assert trace.model == "m"


def test_wide_models_are_int16(tmp_path):
    experts = np.array([[[150, 3]]])
    write_trace(
        tmp_path / "w.npz",
        [TraceRequest(experts, np.ones((1, 1, 2)))],
        {"num_layers": 1, "num_experts": 200, "top_k": 2},
    )
    trace = read_trace(tmp_path / "w.npz")
    assert trace.expert_ids.dtype == np.int16 and trace.expert_ids[0, 0, 0] == 150


def test_without_weights_reads_as_uniform(tmp_path):
    np.savez(
        tmp_path / "u.npz",
        expert_ids=np.zeros((2, 1, 4), np.int8),
        req_offsets=np.array([0, 2]),
        meta_json=json.dumps({"num_experts": 8}),
    )
    trace = read_trace(tmp_path / "u.npz")
    assert not trace.has_gate_weights and np.all(trace.gate_weights == 0.25)


def _write(path, **over):
    keys = {
        "expert_ids": np.zeros((3, 2, 2), np.int8),
        "req_offsets": np.array([0, 3]),
        "meta_json": json.dumps({"num_experts": 4}),
    }
    keys.update(over)
    np.savez(path, **{k: v for k, v in keys.items() if v is not None})
    return path


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"meta_json": None}, r"lacks \['meta_json'\]"),
        ({"meta_json": json.dumps({"experts": 4})}, "must give num_experts as an int in"),
        ({"meta_json": json.dumps([1])}, "meta_json must be a JSON object"),
        ({"expert_ids": np.zeros((3, 2), np.int8)}, r"expert_ids must be int \[rows, layers, top_k\]"),
        ({"expert_ids": np.full((3, 2, 2), 4, np.int8)}, r"expert_ids range 4..4 is outside 0..3"),
        ({"req_offsets": np.array([0, 2])}, "req_offsets must rise from 0 to 3"),
        ({"decode_start": np.array([4])}, "a decode_start lies outside its request's rows"),
        ({"decode_start": np.array([0, 0])}, r"decode_start must be int \[1\]"),
        ({"gate_weights": np.zeros((3, 2, 3), np.float16)}, r"gate_weights must be float \[3, 2, 2\]"),
        ({"meta_json": json.dumps({"num_experts": 1})}, "top_k 2 exceeds num_experts 1"),
    ],
)
def test_bad_files_are_named(tmp_path, over, message):
    path = _write(tmp_path / "bad.npz", **over)
    with pytest.raises(TraceError, match=message):
        read_trace(path)


def test_missing_and_garbage(tmp_path):
    with pytest.raises(TraceError, match="does not exist"):
        read_trace(tmp_path / "nope.npz")
    (tmp_path / "g.npz").write_bytes(b"not a zip")
    with pytest.raises(TraceError, match="is not a routing trace"):
        read_trace(tmp_path / "g.npz")
    np.save(tmp_path / "one.npy", np.zeros(3))
    with pytest.raises(TraceError, match="single .npy array"):
        read_trace(tmp_path / "one.npy")


def test_writer_refuses_what_does_not_fit(tmp_path):
    with pytest.raises(ValueError, match="trace meta lacks 'top_k'"):
        write_trace(tmp_path / "x.npz", [_request(1, 0, 0)], {"num_layers": 2, "num_experts": 6})
    with pytest.raises(ValueError, match=r"meta says \(3, 2\)"):
        write_trace(tmp_path / "x.npz", [_request(1, 0, 0)], {**META, "num_layers": 3})
    with pytest.raises(ValueError, match="at least one request"):
        write_trace(tmp_path / "x.npz", [], META)
