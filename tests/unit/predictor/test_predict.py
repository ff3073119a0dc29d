"""RequestPredictor: shapes, ranges, history on repeated routing, EAMC on a known request."""

from __future__ import annotations

import numpy as np
import pytest
from numpy.testing import assert_allclose

from predictor_svc.eam import EamShape, add_token, decode_eam, new_eam
from predictor_svc.eamc import Eamc
from predictor_svc.predict import PredictionConfig, RequestPredictor, predict_request
from predictor_svc.store import EmbeddedStore

SHAPE = EamShape(layers=4, experts=8, top_k=2)


def random_request(rng, tokens: int) -> np.ndarray:
    """int [T, L, K]: each layer draws from its own skewed preference."""
    prefs = rng.dirichlet(np.full(SHAPE.experts, 0.3), size=SHAPE.layers)
    out = np.empty((tokens, SHAPE.layers, SHAPE.top_k), dtype=np.int64)
    for t in range(tokens):
        for layer in range(SHAPE.layers):
            out[t, layer] = rng.choice(SHAPE.experts, SHAPE.top_k, replace=False, p=prefs[layer])
    return out


def eam_of(request: np.ndarray) -> np.ndarray:
    eam = new_eam(SHAPE)
    for token in request:
        add_token(eam, token)
    return eam


def filled_eamc(rng, n: int = 12) -> tuple[Eamc, list[np.ndarray]]:
    eamc = Eamc(EmbeddedStore(), "m", SHAPE, capacity=64)
    requests = [random_request(rng, 30) for _ in range(n)]
    for r in requests:
        eamc.insert(eam_of(r), len(r))
    return eamc, requests


def test_shapes_and_ranges():
    rng = np.random.default_rng(0)
    eamc, _ = filled_eamc(rng)
    pred = RequestPredictor(eamc, SHAPE, PredictionConfig())
    for token in random_request(rng, 5):
        pred.observe(token)
        for source in ("eamc", "history", "combined"):
            s = pred.scores(source)
            assert s.shape == (4, 8) and s.dtype == np.float32
            assert s.min() >= 0 and s.max() <= 1
    assert pred.tokens == 5
    assert len(pred.top(2, 3, "combined")) == 3


def test_repeated_routing_is_predicted_perfectly_by_history():
    pred = RequestPredictor(None, SHAPE, PredictionConfig())
    token = np.array([[0, 1], [2, 3], [4, 5], [6, 7]])
    for _ in range(4):
        pred.observe(token)
        for layer in range(4):
            assert sorted(pred.top(layer, 2, "history")) == sorted(token[layer])
            assert sorted(pred.top(layer, 2, "combined")) == sorted(token[layer])
    assert_allclose(pred.scores("history")[0, :2], 1.0)


def test_eamc_containing_the_request_predicts_it():
    rng = np.random.default_rng(1)
    eamc, requests = filled_eamc(rng)
    target = requests[5]
    pred = RequestPredictor(eamc, SHAPE, PredictionConfig(top_n=1))
    for token in target[:3]:
        pred.observe(token)
    truth = eam_of(target) / len(target)
    assert_allclose(pred.scores("eamc"), truth, rtol=1e-5, atol=1e-6)
    for layer in range(4):
        ranked = np.sort(truth[layer])
        if ranked[-2] > ranked[-3]:  # the top 2 are unambiguous
            assert set(pred.top(layer, 2, "eamc")) == set(np.argsort(-truth[layer])[:2])


def test_partial_token_extends_the_match():
    rng = np.random.default_rng(2)
    eamc, requests = filled_eamc(rng)
    pred = RequestPredictor(eamc, SHAPE, PredictionConfig(top_n=1))
    first = requests[7][0].copy()
    first[2:] = -1  # only layers 0-1 of the first token seen
    pred.observe(first)
    assert pred.tokens == 0
    before = pred.scores("eamc")
    sims = eamc.similarities(eam_of(requests[7][:1]) * np.array([[1], [1], [0], [0]]), 2)
    best_id = eamc.ids()[int(np.argmax(sims))]  # matched on layers 0-1 of one token only
    best_eam, tokens = decode_eam(eamc.store.load("m")[0][best_id], SHAPE)
    assert_allclose(before, best_eam / tokens, rtol=1e-5, atol=1e-6)
    pred.observe(requests[7][0])  # the token completes
    assert pred.tokens == 1 and pred._partial is None


def test_empty_request_uses_the_collection_mean():
    rng = np.random.default_rng(3)
    eamc, requests = filled_eamc(rng, n=4)
    pred = RequestPredictor(eamc, SHAPE, PredictionConfig(top_n=64))
    mean = np.mean([eam_of(r) / 30 for r in requests], axis=0)
    assert_allclose(pred.scores("eamc"), mean, rtol=1e-5, atol=1e-6)
    assert_allclose(pred.scores("combined"), mean, rtol=1e-5, atol=1e-6)  # no history yet
    assert not pred.scores("history").any()


def test_batched_request_prediction_equals_the_live_predictor():
    rng = np.random.default_rng(4)
    eamc, _ = filled_eamc(rng)
    config = PredictionConfig(top_n=3, sharpness=2.0, history_decay=0.6, history_weight=0.4)
    request = random_request(rng, 9)
    batch = predict_request(eamc, SHAPE, config, request)
    live = RequestPredictor(eamc, SHAPE, config)
    for t, token in enumerate(request):
        for source in ("eamc", "history", "combined"):
            assert_allclose(batch[source][t], live.scores(source), rtol=1e-5, atol=1e-6)
        live.observe(token)


def test_validation_messages():
    pred = RequestPredictor(None, SHAPE, PredictionConfig())
    with pytest.raises(ValueError, match=r"token_experts must be \[4, 2\], got \(4, 3\)"):
        pred.observe(np.zeros((4, 3), dtype=np.int64))
    with pytest.raises(ValueError, match="unknown prediction source 'nope'"):
        pred.scores("nope")
    with pytest.raises(ValueError, match=r"layer must be in \[0, 4\), got 4"):
        pred.top(4, 2)
    with pytest.raises(ValueError, match=r"k must be in \[1, 8\], got 0"):
        pred.top(0, 0)
    with pytest.raises(ValueError, match=r"history_decay must be in \(0, 1\), got 1.0"):
        PredictionConfig(history_decay=1.0)
    with pytest.raises(ValueError, match="top_n must be >= 1"):
        PredictionConfig(top_n=0)


def test_bench_runs_on_any_trace_in_the_format(tmp_path):
    """bench.predict_bench on a small synthetic trace (with prefill rows) writes sane figures."""
    import json

    from bench.predict_bench import main

    rng = np.random.default_rng(5)
    requests = [random_request(rng, n) for n in (12, 1, 9, 15)]
    trace = tmp_path / "t.npz"
    offsets = np.cumsum([0] + [len(r) for r in requests])
    meta = {"model": "synthetic", "num_layers": 4, "num_experts": 8, "top_k": 2}
    np.savez(
        trace,
        expert_ids=np.concatenate(requests).astype(np.int8),
        gate_weights=np.full((offsets[-1], 4, 2), 0.5, np.float16),
        req_offsets=offsets.astype(np.int64),
        decode_start=np.array([2, 0, 3, 0], np.int32),
        meta_json=np.array(json.dumps(meta)),
        req_meta_json=np.array("[]"),
    )
    out = tmp_path / "predict.json"
    main(["--trace", str(trace), "--out", str(out), "--cost-sizes", "20", "--cost-queries", "3"])
    result = json.loads(out.read_text())
    q = result["quality"]
    assert result["shape"] == {"layers": 4, "experts": 8, "top_k": 2}
    assert q["tokens"] == 37 - 5 and q["eamc_entries_at_end"] == 4
    for source in ("eamc", "history", "combined"):
        assert 0 <= q[source]["precision_at_k"] <= 1 and len(q[source]["per_layer_precision_at_k"]) == 4
        assert q[source]["precision_at_k"] == pytest.approx(q[source]["recall_at_k"])
    assert q["history"]["precision_at_k"] > 0.25  # skewed per-layer preferences: above chance (2/8)
    cost = result["matching_cost_us"]["20"]
    assert (
        cost["similarities_median_us"] > 0
        and cost["match_median_us"] > 0
        and cost["match_cold_median_us"] > 0
    )
    with pytest.raises(SystemExit):
        main(["--trace", str(trace), "--out", str(out), "--cost-queries", "1"])
