"""The trace recorder writes the shared routing-trace format from the real generation path."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

from compute_svc.engine.activations import RoutingCapture, StepRouting
from compute_svc.engine.requests import GenerationRequest
from compute_svc.engine.trace_recorder import TraceRecorder
from expertcache.trace import read_trace

PROMPTS = (tuple(range(5, 17)), tuple(range(40, 47)))  # 12 and 7 tokens
NEW_TOKENS = (5, 3)


def meta_of(manifest) -> dict:
    return {
        "model": manifest.model_id,
        "num_layers": len(manifest.moe_layers),
        "num_experts": manifest.num_experts,
        "top_k": manifest.top_k,
    }


def test_two_requests_through_the_engine_match_the_router(local_engine, tmp_path):
    engine, _, tiny = local_engine("mixtral", limit=64)
    manifest = tiny.manifest
    layers, top_k = len(manifest.moe_layers), manifest.top_k
    path = tmp_path / "trace.npz"
    recorder = TraceRecorder(path, meta_of(manifest), every_requests=100)
    capture = RoutingCapture(manifest.moe_layers)
    engine.enable_routing(capture, recorder=recorder)
    seen_experts: list[torch.Tensor] = []  # [T, K] per layer call, in call order
    seen_weights: list[torch.Tensor] = []

    def observe(layer, top_k_index, top_k_weights):
        seen_experts.append(top_k_index.clone())
        seen_weights.append(top_k_weights.clone())
        capture(layer, top_k_index, top_k_weights)

    engine.runtime.routing_observer = observe
    for i, (prompt, new) in enumerate(zip(PROMPTS, NEW_TOKENS, strict=True)):
        request = GenerationRequest(token_ids=prompt, max_new_tokens=new, ignore_eos=True, request_id=f"r{i}")
        assert len(list(engine.generate(engine.requests.prepare(request)))) == new
    recorder.close()

    z = np.load(path, allow_pickle=False)
    rows = [len(p) + n - 1 for p, n in zip(PROMPTS, NEW_TOKENS, strict=True)]  # last token not fed back
    assert z["expert_ids"].dtype == np.int8
    assert z["expert_ids"].shape == (sum(rows), layers, top_k)
    assert z["gate_weights"].dtype == np.float16
    assert z["gate_weights"].shape == z["expert_ids"].shape
    assert z["req_offsets"].dtype == np.int64
    assert z["req_offsets"].tolist() == [0, rows[0], rows[0] + rows[1]]
    assert z["decode_start"].dtype == np.int32
    assert z["decode_start"].tolist() == [len(p) for p in PROMPTS]
    meta = json.loads(str(z["meta_json"]))
    assert meta["expert_ids_dtype"] == "int8"
    assert (meta["num_layers"], meta["num_experts"], meta["top_k"]) == (layers, manifest.num_experts, top_k)
    req_meta = json.loads(str(z["req_meta_json"]))
    assert [m["request_id"] for m in req_meta] == ["r0", "r1"]
    assert [m["finish"] for m in req_meta] == ["length", "length"]
    assert [m["prompt_len"] for m in req_meta] == [len(p) for p in PROMPTS]

    # Expert ids (and weights) equal what the router handed the runtime, forward by forward.
    forwards = [seen_experts[i : i + layers] for i in range(0, len(seen_experts), layers)]
    weights = [seen_weights[i : i + layers] for i in range(0, len(seen_weights), layers)]
    expected = torch.cat([torch.stack(f, dim=1) for f in forwards]).numpy()
    expected_w = torch.cat([torch.stack(w, dim=1) for w in weights]).to(torch.float16).numpy()
    np.testing.assert_array_equal(z["expert_ids"], expected.astype(np.int8))
    np.testing.assert_array_equal(z["gate_weights"], expected_w)
    assert not (tmp_path / "trace.npz.tmp").exists()

    # The one trace reader reads it as it reads the shared traces.
    trace = read_trace(path)
    assert trace.num_experts == manifest.num_experts
    assert trace.expert_ids.shape == z["expert_ids"].shape


def _step(request_id: str, first: int, experts: list) -> StepRouting:
    e = torch.tensor(experts, dtype=torch.int64)  # [T, L, K]
    return StepRouting(request_id, first, e, torch.full(e.shape, 0.5))


def test_wide_models_use_int16_and_files_appear_every_n_requests(tmp_path):
    path = tmp_path / "sub" / "wide.npz"
    recorder = TraceRecorder(path, {"num_layers": 1, "num_experts": 200, "top_k": 2}, every_requests=2)
    recorder.on_step(_step("a", 0, [[[150, 3]], [[199, 0]]]), prompt_tokens=2)
    recorder.on_request_end("a", "eos")
    assert not path.exists()  # one request < every_requests
    recorder.on_step(_step("b", 0, [[[1, 2]]]), prompt_tokens=1)
    recorder.on_request_end("b", "cancelled")
    deadline = time.monotonic() + 10
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    z = np.load(path, allow_pickle=False)
    assert z["expert_ids"].dtype == np.int16
    assert z["expert_ids"][:, 0, 0].tolist() == [150, 199, 1]
    assert json.loads(str(z["meta_json"]))["expert_ids_dtype"] == "int16"
    recorder.on_step(_step("c", 0, [[[7, 8]]]), prompt_tokens=1)  # still live at close: left out
    recorder.on_request_end("never-started", "cancelled")  # nothing recorded: no entry
    recorder.close()
    z = np.load(path, allow_pickle=False)
    assert z["req_offsets"].tolist() == [0, 2, 3]
    assert [m["request_id"] for m in json.loads(str(z["req_meta_json"]))] == ["a", "b"]


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="trace meta lacks 'top_k'"):
        TraceRecorder(tmp_path / "t.npz", {"num_layers": 1, "num_experts": 2})
    with pytest.raises(ValueError, match="every_requests must be >= 1, got 0"):
        TraceRecorder(tmp_path / "t.npz", {"num_layers": 1, "num_experts": 2, "top_k": 1}, every_requests=0)
    recorder = TraceRecorder(tmp_path / "t.npz", {"num_layers": 1, "num_experts": 2, "top_k": 1})
    with pytest.raises(ValueError, match="needs the router weights"):
        recorder.on_step(StepRouting("x", 0, torch.zeros(1, 1, 1, dtype=torch.int64), None), prompt_tokens=1)
    recorder.close()
