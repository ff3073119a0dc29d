"""The learned next-visit model: its arithmetic, its file, its features, its fit, and the signals
running it (cache_daemon.decisions.next_visit, replay.learn_next_visit)."""

from __future__ import annotations

import re

import numpy as np
import pytest
from safetensors.numpy import save as st_save

from cache_daemon.decisions.next_visit import (
    FORMAT,
    NextVisitModel,
    NextVisitModelError,
    bfloat16_round,
    read,
    tail_probability,
    window_start,
)
from cache_daemon.decisions.signals import ActivationSignals, SignalsConfig
from expertcache.layers import LayerMap
from replay import learn_next_visit as learn
from replay.learn_next_visit import features, histories, one_hot, within

CFG = SignalsConfig()


def _model(rng, layers=5, experts=6, window=3, **kw) -> NextVisitModel:
    w = rng.normal(0, 0.5, size=(layers, (window + 2) * experts, experts)).astype(np.float32)
    b = rng.normal(0, 0.5, size=(layers, experts)).astype(np.float32)
    args = {
        "short_half_life_tokens": CFG.history_half_life_tokens,
        "long_half_life_tokens": CFG.long_history_half_life_tokens,
        "history_start": CFG.prior_weight,
    }
    args.update(kw)
    return NextVisitModel(w, b, window, **args)


def _routes(rng, tokens, layers, experts, k=2) -> np.ndarray:
    return np.stack(
        [np.stack([rng.choice(experts, k, replace=False) for _ in range(layers)]) for _ in range(tokens)]
    )


def test_window_start_keeps_the_window_inside_the_layers():
    assert [window_start(j, 5, 3) for j in range(5)] == [0, 0, 1, 2, 2]
    assert [window_start(j, 5, 5) for j in range(5)] == [0] * 5
    assert [window_start(j, 5, 1) for j in range(5)] == [0, 1, 2, 3, 4]
    assert [window_start(j, 5, 4) for j in range(5)] == [0, 0, 1, 1, 1]


@pytest.mark.parametrize("window", [1, 3, 4, 5])
def test_native_step_records_the_routing_and_matches_the_numpy_arithmetic(window):
    rng = np.random.default_rng(window)
    m = _model(rng, window=window)
    L, E = m.num_layers, m.num_experts
    latest = np.zeros(L * E, np.float32)
    latest[rng.choice(L * E, 7, replace=False)] = 1.0
    for layer in range(L):
        ex = rng.choice(E, 2, replace=False).astype(np.int64)
        short, long = rng.random(E, dtype=np.float32), rng.random(E, dtype=np.float32)
        out = np.zeros(E, np.float32)
        m.step(layer, ex, latest, short, long, out)
        row = np.zeros(E, np.float32)
        row[ex] = 1.0
        assert np.array_equal(latest[layer * E : (layer + 1) * E], row)  # the layer's row replaced
        lo = m.window_start(layer)
        x = np.concatenate([latest[lo * E : (lo + window) * E], short, long])
        np.testing.assert_allclose(out, m.predict(layer, x), rtol=1e-5, atol=1e-6)


def test_native_step_refuses_bad_arguments():
    m = _model(np.random.default_rng(0))
    L, E = m.num_layers, m.num_experts
    latest, h, out = np.zeros(L * E, np.float32), np.zeros(E, np.float32), np.zeros(E, np.float32)
    with pytest.raises(ValueError, match=r"layer 5 outside 0..4"):
        m.step(5, np.array([0]), latest, h, h, out)
    with pytest.raises(ValueError, match=r"expert 6 outside 0..5"):
        m.step(0, np.array([6]), latest, h, h, out)
    with pytest.raises(ValueError, match=r"expert -1 outside 0..5"):
        m.step(0, np.array([-1]), latest, h, h, out)
    with pytest.raises(ValueError, match=r"latest must be a contiguous float32 array of 30 values"):
        m.step(0, np.array([0]), latest[:-1], h, h, out)
    with pytest.raises(ValueError, match=r"short_history must be a contiguous float32 array of 6 values"):
        m.step(0, np.array([0]), latest, h.astype(np.float64), h, out)
    assert not latest.any()  # nothing recorded by a refused call


def test_weights_are_held_at_bfloat16_precision():
    one = np.float32(1.0)
    x = np.array([1.0, 1 + 2.0**-8, 1 + 3 * 2.0**-8, -2.5, 1 + 2.0**-7], np.float32)
    # ties to even: 1 + 2^-8 is half an ulp (2^-7) above 1, 1 + 3 * 2^-8 half an ulp above 1 + 2^-7
    assert bfloat16_round(x).tolist() == [1.0, 1.0, 1 + 2.0**-6, -2.5, 1 + 2.0**-7]
    assert one == bfloat16_round(np.array([one]))[0]
    rng = np.random.default_rng(9)
    m = _model(rng)
    raw = rng.normal(size=m.weights.shape).astype(np.float32)
    m2 = NextVisitModel(
        raw,
        m.bias.copy(),
        m.window,
        **{k: getattr(m, k) for k in ("short_half_life_tokens", "long_half_life_tokens", "history_start")},
    )
    assert np.array_equal(m2.weights, bfloat16_round(raw)) and not np.array_equal(m2.weights, raw)
    assert np.abs(m2.weights - raw).max() <= np.abs(raw).max() * 2.0**-8


def test_bytes_round_trip():
    m = _model(np.random.default_rng(1), trained_on="t.npz requests 0:4")
    back = NextVisitModel.from_bytes(m.to_bytes())
    assert np.array_equal(back.weights, m.weights) and np.array_equal(back.bias, m.bias)
    assert (back.window, back.short_half_life_tokens, back.long_half_life_tokens, back.history_start) == (
        3,
        CFG.history_half_life_tokens,
        CFG.long_history_half_life_tokens,
        CFG.prior_weight,
    )
    assert back.trained_on == "t.npz requests 0:4"
    assert not back.weights.flags.writeable


def _with_head(m: NextVisitModel, rng, visits=3) -> NextVisitModel:
    hw = rng.normal(0, 0.5, size=m.weights.shape).astype(np.float32)
    hb = rng.normal(0, 0.5, size=m.bias.shape).astype(np.float32) + 1.0
    keep = {k: getattr(m, k) for k in ("short_half_life_tokens", "long_half_life_tokens", "history_start")}
    return NextVisitModel(
        m.weights, m.bias, m.window, **keep, horizon_weights=hw, horizon_bias=hb, horizon_visits=visits
    )


def test_tail_probability_inverts_the_chance_within_the_horizon():
    p = np.array([0.5, 0.0, 0.9, 0.5, 1.0], np.float32)
    w = np.array([0.75, 0.5, 0.9, 0.2, 1.0], np.float32)
    t = tail_probability(p, w, 3)
    assert t[0] == pytest.approx(1 - 0.5**0.5)  # (1 - 0.75) = 0.5 * (1 - t) ** 2
    assert t[1] == pytest.approx(1 - 0.5**0.5)
    assert t[2] == pytest.approx(0.0, abs=1e-6) and t[3] == 0.0  # no more than p_next: nothing after
    assert 0.0 <= t[4] <= 1.0  # a certain next use says nothing of the later ones, and stays a chance
    assert t.dtype == np.float32
    back = 1 - (1 - p[:2]) * (1 - t[:2]) ** 2
    np.testing.assert_allclose(back, w[:2], rtol=1e-6)


def test_the_horizon_head_gives_the_tail_from_the_same_window():
    rng = np.random.default_rng(4)
    m = _with_head(_model(rng, window=3), rng)
    assert m.has_horizon and not _model(rng).has_horizon
    L, E = m.num_layers, m.num_experts
    latest = np.zeros(L * E, np.float32)
    for layer in range(L):
        ex = rng.choice(E, 2, replace=False).astype(np.int64)
        short, long = rng.random(E, dtype=np.float32), rng.random(E, dtype=np.float32)
        out, tail = np.zeros(E, np.float32), np.full(E, -1.0, np.float32)
        m.step(layer, ex, latest, short, long, out, tail)
        lo = m.window_start(layer)
        x = np.concatenate([latest[lo * E : (lo + m.window) * E], short, long])
        want = tail_probability(m.predict(layer, x), m.predict_within(layer, x), 3)
        np.testing.assert_allclose(tail, want, rtol=1e-4, atol=1e-5)
        assert ((tail >= 0) & (tail <= 1)).all()
    with pytest.raises(ValueError, match="visits must be >= 2, got 1"):
        m._native_horizon.tail(0, latest, short, long, out, 1, tail)
    with pytest.raises(ValueError, match="p_next must be a contiguous float32 array of 6 values"):
        m._native_horizon.tail(0, latest, short, long, out[:-1], 3, tail)
    back = NextVisitModel.from_bytes(m.to_bytes())
    assert back.horizon_visits == 3 and np.array_equal(back.horizon_weights, m.horizon_weights)
    assert np.array_equal(back.horizon_bias, m.horizon_bias)
    without = NextVisitModel.from_bytes(_model(rng).to_bytes())  # a file of before the head
    assert not without.has_horizon and without.horizon_visits == 0
    with pytest.raises(NextVisitModelError, match="this next-visit model has no horizon head"):
        without.predict_within(0, np.zeros(5 * 6))
    tail = np.full(6, -1.0, np.float32)
    without.step(
        0,
        np.array([1]),
        np.zeros(30, np.float32),
        np.zeros(6, np.float32),
        np.zeros(6, np.float32),
        np.zeros(6, np.float32),
        tail,
    )
    assert (tail == -1.0).all()  # no head: no tail written


def test_signals_take_the_tail_from_the_horizon_head_where_it_has_one():
    rng = np.random.default_rng(12)
    L, E = 5, 6
    headed = _with_head(_model(rng, layers=L, experts=E, window=3), rng)
    s = ActivationSignals(L, E, next_visit_model=headed)
    s.begin_request("r")
    routes = _routes(rng, 3, L, E)
    for t in range(2):
        for layer in range(L):
            s.observe(layer, routes[t, layer], token=t)
    s.observe(0, routes[2, 0], token=2)
    req_tail = s._current.tail_p
    tail, long_run = s.tail_probability(), s.long_run_probability()
    assert (req_tail >= 0).all()  # every layer estimated once routed
    np.testing.assert_array_equal(tail, np.maximum(req_tail, long_run))  # the larger of the two
    assert (req_tail > long_run).any() and (req_tail < long_run).any()  # each wins somewhere
    p_next, d = s.use_probability(), s.layer_distance()
    idle = s.idle_log_survival()
    e = 2 * E + 1
    want = np.log1p(-float(p_next[e])) + (2 * L - d[e]) / L * np.log1p(-float(tail[e]))
    assert idle[e] == pytest.approx(want, rel=1e-9)
    # A new request: no layer estimated yet, so its long-run estimate stands in.
    s.begin_request("q")
    s.observe(0, routes[0, 0], token=0, request_id="q")
    r_row, q_row = s.request_probabilities()
    q_tail = s.tail_probability()
    r_tail = max(req_tail[3 * E], r_row[3 * E])
    assert q_tail[3 * E] == pytest.approx(1 - (1 - r_tail) * (1 - q_row[3 * E]), rel=1e-5)
    # Without the head (or without a model) the tail is the long-run estimate itself.
    plain = ActivationSignals(L, E, next_visit_model=_model(rng, layers=L, experts=E, window=3))
    plain.begin_request("r")
    plain.observe(0, routes[0, 0], token=0)
    assert plain.tail_probability() is plain.long_run_probability()
    s.set_next_visit_model(None)
    assert (s._requests["r"].tail_p == -1.0).all()  # the old model's estimates dropped


def test_a_malformed_horizon_head_is_refused_by_name():
    rng = np.random.default_rng(8)
    m = _model(rng)
    keep = {k: getattr(m, k) for k in ("short_half_life_tokens", "long_half_life_tokens", "history_start")}
    w, b = m.weights.copy(), m.bias.copy()
    cases = [
        ({"horizon_weights": w}, "horizon_weights and horizon_bias come together"),
        (
            {"horizon_weights": w, "horizon_bias": b, "horizon_visits": 1},
            r"horizon_visits must be an integer in \[2, 64\], got 1",
        ),
        ({"horizon_weights": w, "horizon_bias": b, "horizon_visits": 65}, "got 65"),
        (
            {"horizon_weights": w[:2], "horizon_bias": b, "horizon_visits": 4},
            r"horizon head \(2, 30, 6\) / \(5, 6\) does not match the model.s \(5, 30, 6\)",
        ),
        (
            {"horizon_weights": w.astype(np.float64), "horizon_bias": b, "horizon_visits": 4},
            "horizon_weights must be float32",
        ),
        (
            {"horizon_weights": w, "horizon_bias": np.full_like(b, np.inf), "horizon_visits": 4},
            "horizon_bias holds non-finite",
        ),
    ]
    for kw, message in cases:
        with pytest.raises(NextVisitModelError, match=message):
            NextVisitModel(m.weights, m.bias, m.window, **keep, **kw)
    W2, B2 = np.zeros((2, 3 * 4, 4), np.float32), np.zeros((2, 4), np.float32)
    base = {"weights": W2, "bias": B2}
    with pytest.raises(NextVisitModelError, match="horizon_weights and horizon_bias come together"):
        NextVisitModel.from_bytes(st_save({**base, "horizon_bias": B2}, metadata=_meta(horizon_visits="4")))
    with pytest.raises(
        NextVisitModelError,
        match="metadata horizon_visits must be an integer beside the horizon head, got None",
    ):
        NextVisitModel.from_bytes(
            st_save({**base, "horizon_weights": W2, "horizon_bias": B2}, metadata=_meta())
        )
    with pytest.raises(NextVisitModelError, match="got '-3'"):
        NextVisitModel.from_bytes(
            st_save({**base, "horizon_weights": W2, "horizon_bias": B2}, metadata=_meta(horizon_visits="-3"))
        )


def _meta(**kw) -> dict:
    meta = {
        "format": FORMAT,
        "window": "1",
        "short_half_life_tokens": "4.0",
        "long_half_life_tokens": "32.0",
        "history_start": "0.5",
    }
    meta.update(kw)
    return {k: v for k, v in meta.items() if v is not None}


W = np.zeros((2, 3 * 4, 4), np.float32)
B = np.zeros((2, 4), np.float32)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"not a model", r"not a safetensors file"),
        (st_save({"weights": W, "bias": B}, metadata=_meta(format="other/1")), r"format is 'other/1'"),
        (st_save({"weights": W}, metadata=_meta()), r"missing tensors \['bias'\]"),
        (st_save({"weights": W, "bias": B}, metadata=_meta(window=None)), r"metadata 'window' missing"),
        (st_save({"weights": W, "bias": B}, metadata=_meta(window="x")), r"metadata: could not convert"),
        (st_save({"weights": W, "bias": B}, metadata=_meta(window="1.5")), r"window must be an integer"),
        (st_save({"weights": W, "bias": B}, metadata=_meta(window="2")), r"12 inputs per layer, expected"),
        (
            st_save({"weights": W, "bias": B}, metadata=_meta(window="3")),
            r"window must be in \[1, 2\] layers",
        ),
        (st_save({"weights": W, "bias": B[:1]}, metadata=_meta()), r"bias \(1, 4\) does not match"),
        (st_save({"weights": W[0], "bias": B}, metadata=_meta()), r"weights must be 3-D"),
        (
            st_save({"weights": W.astype(np.float16), "bias": B}, metadata=_meta()),
            r"weights must be float32, got float16",
        ),
        (
            st_save({"weights": np.full_like(W, np.nan), "bias": B}, metadata=_meta()),
            r"weights holds non-finite values",
        ),
        (
            st_save({"weights": W, "bias": B}, metadata=_meta(short_half_life_tokens="0")),
            r"short_half_life_tokens must be > 0",
        ),
        (st_save({"weights": W, "bias": B}, metadata=_meta(history_start="2")), r"history_start must be in"),
        (
            st_save({"weights": np.full_like(W, np.finfo(np.float32).max), "bias": B}, metadata=_meta()),
            r"weights overflow bfloat16",
        ),
    ],
)
def test_malformed_bytes_are_refused_by_name(data, message):
    with pytest.raises(NextVisitModelError, match=message):
        NextVisitModel.from_bytes(data)


def test_read_names_the_file(tmp_path):
    with pytest.raises(NextVisitModelError, match=r"next-visit model .*nope.safetensors: No such file"):
        read(tmp_path / "nope.safetensors")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x00" * 16)
    with pytest.raises(
        NextVisitModelError, match=r"next-visit model .*bad.safetensors: not a safetensors file"
    ):
        read(bad)
    good = tmp_path / "m.safetensors"
    learn.write(_model(np.random.default_rng(2)), good)
    assert read(good).num_layers == 5
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_features_are_what_the_signals_feed_the_model():
    """Training and serving see the same inputs: the signals' next-visit estimate after each
    observe equals the model applied to ``features`` of the same request (histories starting at
    the signals' start, zero for a fresh daemon)."""
    rng = np.random.default_rng(3)
    L, E, T = 5, 6, 12
    for window in (2, 5):
        m = _model(rng, layers=L, experts=E, window=window)
        routes = _routes(rng, T, L, E)
        y = one_hot(routes, E)
        decays = tuple(
            0.5 ** (1 / h) for h in (CFG.history_half_life_tokens, CFG.long_history_half_life_tokens)
        )
        ha, hb = histories(y, np.zeros((L, E), np.float32), decays)
        sig = ActivationSignals(L, E, next_visit_model=m)
        sig.begin_request("r")
        req = sig._request("r")
        for t in range(T - 1):
            for j in range(L):
                sig.observe(j, routes[t, j], t, request_id="r")
                x, target = features(y, ha, hb, j, window)
                np.testing.assert_allclose(
                    req.next_p[j * E : (j + 1) * E], m.predict(j, x[t]), rtol=1e-5, atol=1e-6
                )
                assert np.array_equal(target[t], y[t + 1, j])


def test_signals_use_the_model_in_moe_order_and_refuse_a_mismatch():
    rng = np.random.default_rng(4)
    m = _model(rng, layers=3, experts=4, window=3)
    # Decoder layers 0 and 2 dense: MoE layers 1, 3, 4 are the model's 0, 1, 2.
    layer_map = LayerMap((1, 3, 4), 5)
    sig = ActivationSignals(5, 4, layer_map=layer_map, next_visit_model=m)
    sig.observe(1, [2], 0)
    sig.observe(3, [0], 0)
    req = sig._request(None)
    h = (1 - 0.5 ** (1 / CFG.history_half_life_tokens)) * np.eye(4, dtype=np.float32)[0]
    hl = (1 - 0.5 ** (1 / CFG.long_history_half_life_tokens)) * np.eye(4, dtype=np.float32)[0]
    x = np.concatenate(
        [np.eye(4, dtype=np.float32)[2], np.eye(4, dtype=np.float32)[0], np.zeros(4, np.float32), h, hl]
    )
    np.testing.assert_allclose(req.next_p[3 * 4 : 4 * 4], m.predict(1, x), rtol=1e-5, atol=1e-6)
    p = sig.use_probability()
    np.testing.assert_allclose(
        p[3 * 4 : 4 * 4], m.predict(1, x), rtol=1e-5, atol=1e-6
    )  # not blended with hints
    with pytest.raises(
        ValueError, match=r"next-visit model is for 3 MoE layers x 4 experts, the model served has 5 x 4"
    ):
        ActivationSignals(5, 4, next_visit_model=m)
    with pytest.raises(
        ValueError, match=r"fitted with history half-lives 8 / 32 tokens and start 0.5; the signals use 4"
    ):
        ActivationSignals(
            5, 4, layer_map=layer_map, next_visit_model=_model(rng, 3, 4, 3, short_half_life_tokens=8.0)
        )


def _coupled(rng, n: int, tokens: int, layers: int = 3, experts: int = 8) -> list[np.ndarray]:
    """Top-1 routing where layer 2 at token t + 1 repeats layer 0 at token t, the rest random:
    only another layer's routing tells layer 2's next expert."""
    out = []
    for _ in range(n):
        r = rng.integers(0, experts, size=(tokens, layers, 1))
        r[1:, 2] = r[:-1, 0]
        out.append(r)
    return out


def test_fit_learns_what_another_layer_tells():
    model = learn.fit(_coupled(np.random.default_rng(0), 6, 60), 8, l2=0.0, iterations=50)
    assert model.weights.shape == (3, 5 * 8, 8) and model.window == 3
    hits = total = 0
    for req in _coupled(np.random.default_rng(1), 2, 40):
        y = one_hot(req, 8)
        ha, hb = histories(y, np.full((3, 8), CFG.prior_weight / 8, np.float32), model.decays())
        x, _ = features(y, ha, hb, 2, model.window)
        q = model.predict(2, x)
        hits += int((q.argmax(1) == req[1:, 2, 0]).sum())
        total += len(q)
    assert hits / total > 0.9  # a layer's own history says 1 in 8


def test_fit_learns_the_horizon_head_beside_the_next_visit():
    # Top-1, 1 layer x 8 experts: each request cycles through 3 experts, one a token, so the
    # next visit routes the next of the cycle and the next 3 visits all three.
    rng = np.random.default_rng(2)
    reqs = []
    for _ in range(8):
        cycle = rng.choice(8, 3, replace=False)
        reqs.append(np.array([[[cycle[t % 3]]] for t in range(40)]))
    model = learn.fit(reqs, 8, l2=0.0, iterations=80, horizon_visits=3)
    assert model.has_horizon and model.horizon_visits == 3
    y = one_hot(reqs[0], 8)
    ha, hb = histories(y, np.full((1, 8), CFG.prior_weight / 8, np.float32), model.decays())
    x, _ = features(y, ha, hb, 0, model.window)
    cycle = set(reqs[0][:3, 0, 0].tolist())
    q = model.predict_within(0, x[5:30])
    inside = q[:, sorted(cycle)].mean()
    outside = np.delete(q, sorted(cycle), axis=1).mean()
    assert inside > 0.8 and outside < 0.2
    assert within(y, 0, 3)[0].sum() == 3 and within(y, 0, 3)[-1].sum() == 1  # the request's end: 1 token left
    assert not learn.fit(reqs[:2], 8, iterations=2, horizon_visits=0).has_horizon
    with pytest.raises(ValueError, match=r"horizon_visits must be 0 or in \[2, 64\], got 1"):
        learn.fit(reqs[:2], 8, horizon_visits=1)


def test_fit_refuses_what_it_cannot_learn_from():
    with pytest.raises(ValueError, match="no request of 2 tokens or more"):
        learn.fit([np.zeros((1, 2, 1), np.int64)], 4)
    with pytest.raises(ValueError, match=r"window must be in \[1, 2\] layers, got 3"):
        learn.fit([np.zeros((4, 2, 1), np.int64)], 4, window=3)
    with pytest.raises(ValueError, match=r"iterations in \[1, 10000\], got 0.0001 and 0"):
        learn.fit([np.zeros((4, 2, 1), np.int64)], 4, iterations=0)
    with pytest.raises(ValueError, match="requests disagree on the number of MoE layers"):
        learn.fit([np.zeros((4, 2, 1), np.int64), np.zeros((4, 3, 1), np.int64)], 4)


def _trace(path, rng, requests=4, tokens=12, layers=3, experts=8):
    from expertcache.trace import TraceRequest, write_trace

    reqs = []
    for r in _coupled(rng, requests, tokens, layers, experts):
        prompt = rng.integers(0, experts, size=(3, layers, 1))
        rows = np.concatenate([prompt, r])
        reqs.append(TraceRequest(rows, np.ones(rows.shape, np.float32), decode_start=3))
    write_trace(path, reqs, {"num_layers": layers, "num_experts": experts, "top_k": 1})
    return path


def test_cli_fits_a_trace_and_writes_a_model_the_signals_take(tmp_path, capsys):
    trace = _trace(tmp_path / "t.npz", np.random.default_rng(5))
    out = tmp_path / "nv.safetensors"
    assert (
        learn.main(["--trace", str(trace), "--out", str(out), "--requests", "1:4", "--iterations", "5"]) == 0
    )
    printed = capsys.readouterr().out
    assert "learning from requests 1..3 of" in printed and "(36 tokens, 3 MoE layers x 8 experts)" in printed
    assert "layer 3/3" in printed and f"wrote {out}" in printed
    model = read(out)
    assert (model.num_layers, model.num_experts, model.window) == (3, 8, 3)
    assert model.trained_on == "t.npz requests 1:4"
    assert model.horizon_visits == learn.DEFAULT_HORIZON_VISITS
    ActivationSignals(3, 8, next_visit_model=model)  # fits the signals it was fitted for
    plain = tmp_path / "plain.safetensors"
    assert (
        learn.main(["--trace", str(trace), "--out", str(plain), "--iterations", "2", "--horizon-visits", "0"])
        == 0
    )
    assert not read(plain).has_horizon


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--requests", "3:9"], r"--requests '3:9' must be A:B with 0 <= A < B <= 4"),
        (["--requests", "x"], r"--requests must be A:B \(request indices\), got 'x'"),
        (["--window", "4"], r"window must be in \[1, 3\] layers, got 4"),
        (["--iterations", "0"], r"iterations in \[1, 10000\]"),
        (["--horizon-visits", "1"], r"horizon_visits must be 0 or in \[2, 64\], got 1"),
    ],
)
def test_cli_refuses_bad_arguments_with_exit_2(tmp_path, capsys, args, message):
    trace = _trace(tmp_path / "t.npz", np.random.default_rng(6))
    assert learn.main(["--trace", str(trace), "--out", str(tmp_path / "m.safetensors"), *args]) == 2
    assert re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "m.safetensors").exists()


def test_cli_names_a_missing_trace_or_output_directory(tmp_path, capsys):
    assert learn.main(["--trace", str(tmp_path / "none.npz"), "--out", str(tmp_path / "m")]) == 2
    assert "none.npz" in capsys.readouterr().err
    trace = _trace(tmp_path / "t.npz", np.random.default_rng(7))
    assert learn.main(["--trace", str(trace), "--out", str(tmp_path / "no" / "m")]) == 2
    err = capsys.readouterr().err
    assert "--out: directory" in err and err.rstrip().endswith("does not exist")


def test_a_model_swapped_in_or_out_drops_the_old_estimates_and_the_transitions_take_over():
    rng = np.random.default_rng(8)
    m = _model(rng, layers=3, experts=4, window=3)
    sig = ActivationSignals(3, 4)
    sig.observe(0, [1], 0, request_id="r")
    sig.observe(0, [2], 1, request_id="r")  # the transitions' estimate of layer 0
    req = sig._request("r")
    assert (req.next_p[:4] >= 0).all()
    version = sig.version
    sig.set_next_visit_model(m)
    assert sig.version > version and (req.next_p == -1).all() and req.latest.shape == (12,)
    sig.observe(1, [3], 1, request_id="r")
    assert (req.next_p[4:8] >= 0).all() and req.latest[4 + 3] == 1.0
    with pytest.raises(ValueError, match="next-visit model is for 2 MoE layers"):
        sig.set_next_visit_model(_model(rng, layers=2, experts=4, window=2))
    assert sig.next_visit_model is m  # nothing changed by a refused swap
    sig.set_next_visit_model(None)
    assert req.latest.size == 0 and (req.next_p == -1).all()
    sig.observe(0, [1], 2, request_id="r")  # the transitions again, from the kept last routing
    assert (req.next_p[:4] >= 0).all()
