"""The signals' per-version estimates in native code (``request_estimates``, ``next_use_layers``,
``idle_log_survival``, csrc/src/use_estimates.cc) against the numpy expressions they replace in
cache_daemon/decisions/use_estimates.py, bit for bit (``idle_log_survival`` to 1e-14: libm's
``log1p`` and numpy's may differ in the last bit): with and without hints (fresh, stale, a
weight of 0), with the routing transitions and with the learned model, where a next-visit estimate
exists and where it does not; and every argument a caller can get wrong is refused by name.
"""

from __future__ import annotations

import numpy as np
import pytest

from expertcache import native

N = 768


# -- the numpy expressions (UseEstimates and RequestSignals before the native pass) ----------------
def blended(history, history_long, w):
    w = np.float32(w)
    return (np.float32(1.0) - w) * history + w * history_long


def fresh_hints(token, hints, hint_token, ttl):
    fresh = (token - hint_token) <= ttl
    return np.where(fresh, hints, np.float32(0.0))


def with_hints(p, weight, has_hints, token, hints, hint_token, ttl):
    if weight > 0.0 and has_hints:
        h = fresh_hints(token, hints, hint_token, ttl)
        p = np.where(h > 0.0, (1.0 - weight) * p + weight * h, p).astype(np.float32)
    return p


def reference(rows, token, has_hints, lw, tw, hw, ttl, learned):
    history, history_long, next_p, hints, hint_token = rows
    hist = blended(history, history_long, lw)
    hint_args = (has_hints, token, hints, hint_token, ttl)
    long_run = with_hints(hist, hw, *hint_args)
    tw = np.float32(tw)
    blend = tw * next_p + (np.float32(1.0) - tw) * hist
    if learned:
        nxt = np.where(next_p >= 0.0, blend, with_hints(hist, hw, *hint_args))
    else:
        nxt = with_hints(np.where(next_p >= 0.0, blend, hist).astype(np.float32), hw, *hint_args)
    return long_run, nxt.astype(np.float32, copy=False)


def request_rows(seed: int):
    rng = np.random.default_rng(seed)
    history = rng.random(N, dtype=np.float32)
    history_long = rng.random(N, dtype=np.float32)
    next_p = rng.random(N, dtype=np.float32)
    next_p[rng.random(N) < 0.4] = -1.0  # layers not routed yet
    hints = rng.random(N, dtype=np.float32)
    hints[rng.random(N) < 0.5] = 0.0
    hint_token = rng.integers(0, 200, N).astype(np.int64)
    hint_token[rng.random(N) < 0.2] = np.iinfo(np.int64).min // 2  # never hinted
    return history, history_long, next_p, hints, hint_token


@pytest.mark.parametrize("learned", [False, True])
@pytest.mark.parametrize(
    ("has_hints", "hint_weight", "ttl"),
    [(True, 0.3, 64), (True, 0.3, 0), (False, 0.3, 64), (True, 0.0, 64), (True, 0.7, 1 << 30)],
)
@pytest.mark.parametrize(("long_weight", "transition_weight"), [(0.5, 1.0), (0.3, 0.6), (1.0, 0.25)])
def test_request_estimates_are_the_numpy_expressions_bit_for_bit(
    learned, has_hints, hint_weight, ttl, long_weight, transition_weight
):
    for seed in range(3):
        rows = request_rows(seed)
        token = 150
        want_long, want_next = reference(
            rows, token, has_hints, long_weight, transition_weight, hint_weight, ttl, learned
        )
        got_long = np.full(N, np.nan, np.float32)
        got_next = np.full(N, np.nan, np.float32)
        native.request_estimates(
            *rows,
            token,
            has_hints,
            long_weight,
            transition_weight,
            hint_weight,
            ttl,
            learned,
            got_long,
            got_next,
        )
        assert got_long.tobytes() == want_long.tobytes()
        assert got_next.tobytes() == want_next.tobytes()
        # Without out_next: the long-run row alone, the same.
        alone = np.full(N, np.nan, np.float32)
        native.request_estimates(
            *rows, token, has_hints, long_weight, transition_weight, hint_weight, ttl, learned, alone
        )
        assert alone.tobytes() == want_long.tobytes()


def test_next_use_layers_is_the_numpy_expression_bit_for_bit():
    rng = np.random.default_rng(7)
    M, floor = 24, 1e-3
    distance = rng.integers(1, M + 2, N).astype(np.int64)
    p_next = rng.random(N, dtype=np.float32)
    p_long = rng.random(N, dtype=np.float32) * np.float32(0.01)  # many below the floor
    p_long[:3] = [0.0, np.nan, 1.0]
    p_next[3] = np.nan
    want = distance.astype(np.float64) + M * (1.0 - p_next.astype(np.float64)) / np.maximum(
        p_long.astype(np.float64), floor
    )
    got = np.empty(N, np.float64)
    native.next_use_layers(distance, p_next, p_long, M, floor, got)
    assert got.tobytes() == want.tobytes()


def idle_log_survival_numpy(distance, p_next, p_long, M, horizon):
    """UseEstimates.idle_log_survival's arithmetic in numpy (before the entries in use)."""

    def log_miss(p):
        return np.log1p(-np.clip(p.astype(np.float64), 0.0, 1.0 - 1e-9))

    d = distance.astype(np.float64)
    with np.errstate(invalid="ignore"):
        within = log_miss(p_next) + (horizon - d) / M * log_miss(p_long)
    return np.where(d > horizon, 0.0, within)


def test_idle_log_survival_is_the_numpy_expression():
    rng = np.random.default_rng(11)
    M, horizon = 24, 48.0
    distance = rng.integers(1, M + 2, N).astype(np.int64)  # M + 1: a dense layer's entries
    p_next = rng.random(N, dtype=np.float32)
    p_long = rng.random(N, dtype=np.float32)
    p_next[:4] = [0.0, 1.0, np.nan, -0.5]
    p_long[4:8] = [0.0, 1.0, np.nan, 2.0]
    want = idle_log_survival_numpy(distance, p_next, p_long, M, horizon)
    got = np.empty(N, np.float64)
    native.idle_log_survival(distance, p_next, p_long, M, horizon, got)
    np.testing.assert_allclose(got, want, rtol=1e-14, atol=0.0)
    assert np.isnan(got[2]) and np.isnan(got[6])
    assert np.isfinite(got[1]) and got[1] < -20.0  # a certain use is capped, not -inf
    # p_next 0: the tail alone (to rounding: the native build may fuse the multiply and add)
    assert got[0] == pytest.approx((horizon - distance[0]) / M * np.log1p(-np.float64(p_long[0])), rel=1e-14)


def test_idle_log_survival_ranks_a_likely_or_near_use_as_less_idle():
    M = 24
    distance = np.array([1, 23, 1, 1, 30], np.int64)
    p_next = np.array([0.5, 0.5, 0.1, 0.5, 0.9], np.float32)
    p_long = np.full(5, 0.5, np.float32)
    got = np.empty(5, np.float64)
    native.idle_log_survival(distance, p_next, p_long, M, 24.0, got)
    # the same chances, but layer 1 is visited twice within the horizon and layer 23 once
    assert got[0] < got[1]
    assert got[3] < got[2]  # likelier at the next visit
    assert got[4] == 0.0  # next visited beyond the horizon
    # 1 visit at p 0.5, then 23/24 of a visit at p 0.5
    assert got[0] == pytest.approx(np.log(0.5) * (1 + 23 / 24))


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"distance": np.zeros(N, np.int32)}, "distance must be a contiguous int64"),
        ({"p_next": np.zeros(N - 1, np.float32)}, "p_next must be a contiguous float32 array of 768"),
        ({"out": np.zeros(N, np.float32)}, "out must be a contiguous float64"),
        ({"moe_layers": 0}, "moe_layers must be >= 1"),
        ({"horizon": 0.0}, "horizon must be > 0 and finite"),
        ({"horizon": float("inf")}, "horizon must be > 0 and finite"),
    ],
)
def test_idle_log_survival_refuses_bad_arguments_by_name(over, message):
    args = {
        "distance": np.ones(N, np.int64),
        "p_next": np.zeros(N, np.float32),
        "p_long": np.ones(N, np.float32),
        "moe_layers": 24,
        "horizon": 48.0,
        "out": np.zeros(N, np.float64),
    }
    args.update(over)
    with pytest.raises(ValueError, match=message):
        native.idle_log_survival(**args)


def test_apply_lookahead_is_the_numpy_loop_bit_for_bit():
    rng = np.random.default_rng(3)
    E = 32
    p = rng.random(N, dtype=np.float32)
    p[5] = np.nan
    predictions = []
    for layer, precision in ((3, 0.8), (4, 0.61), (3, 0.3), (20, 1.0)):  # layer 3 twice: in order
        entries = layer * E + rng.choice(E, 4, replace=False).astype(np.int64)
        conf = rng.random(4)
        conf[0] = np.nan if layer == 20 else conf[0]
        predictions.append((layer, 1.0 - precision, entries, conf))
    entries = np.array([5, 7, 7, 9], np.int64)  # an entry twice: numpy reads both, the last write wins
    predictions.append((0, 1.0 - 0.5, entries, np.array([0.9, 0.2, 0.95, 0.0])))
    want = p.copy()
    for layer, keep, entries, conf in predictions:
        want[layer * E : (layer + 1) * E] *= keep
        want[entries] = np.maximum(want[entries], conf)
    got = p.copy()
    native.apply_lookahead(got, E, predictions)
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize(
    ("predictions", "message"),
    [
        ([(24, 0.5, np.array([0]), np.array([0.5]))], "predicted layer 24 outside 0..23"),
        ([(1, 0.5, np.array([N]), np.array([0.5]))], "entry 768 outside 0..767"),
        ([(1, 0.5, np.array([0], np.int32), np.array([0.5]))], "entries must be a contiguous int64"),
        ([(1, 0.5, np.array([0, 1]), np.array([0.5]))], "confidence must be a contiguous float64 array of 2"),
        ([(1, 0.5, np.array([0]))], "a prediction is \\(layer, keep, entries, confidence\\)"),
    ],
)
def test_apply_lookahead_refuses_bad_predictions_before_writing(predictions, message):
    p = np.ones(N, np.float32)
    good = (2, 0.5, np.array([64]), np.array([0.9]))
    with pytest.raises(ValueError, match=message):
        native.apply_lookahead(p, 32, [good, *predictions])
    assert (p == 1.0).all()  # the good one before it was not applied either
    with pytest.raises(ValueError, match="num_experts must divide the 768 entries"):
        native.apply_lookahead(p, 50, [good])


def _args(**over):
    rows = dict(
        zip(("history", "history_long", "next_p", "hints", "hint_token"), request_rows(0), strict=True)
    )
    args = {
        **rows,
        "token": 5,
        "has_hints": True,
        "long_weight": 0.5,
        "transition_weight": 1.0,
        "hint_weight": 0.3,
        "hint_ttl_tokens": 64,
        "learned": False,
        "out_long": np.empty(N, np.float32),
        "out_next": np.empty(N, np.float32),
    }
    args.update(over)
    return args


@pytest.mark.parametrize(
    ("over", "message"),
    [
        (
            {"history_long": np.zeros(N - 1, np.float32)},
            "history_long must be a contiguous float32 array of 768",
        ),
        ({"next_p": np.zeros(N, np.float64)}, "next_p must be a contiguous float32"),
        ({"hints": np.zeros(2 * N, np.float32)[::2]}, "hints must be a contiguous float32"),
        ({"hint_token": np.zeros(N, np.int32)}, "hint_token must be a contiguous int64"),
        ({"history": np.zeros((2, N), np.float32)}, "history must be 1-D"),
        ({"out_long": np.zeros(N - 1, np.float32)}, "out_long must be a contiguous float32 array of 768"),
        ({"out_next": np.zeros(N, np.float64)}, "out_next must be a contiguous float32"),
        ({"long_weight": 1.5}, "long_weight must be in \\[0, 1\\]"),
        ({"transition_weight": float("nan")}, "transition_weight must be in \\[0, 1\\]"),
        ({"hint_weight": -0.1}, "hint_weight must be in \\[0, 1\\]"),
        ({"hint_ttl_tokens": -1}, "hint_ttl_tokens must be >= 0"),
    ],
)
def test_request_estimates_refuses_bad_arguments_by_name(over, message):
    args = _args(**over)
    out_long = args["out_long"]
    before = out_long.copy()
    with pytest.raises(ValueError, match=message):
        native.request_estimates(**args)
    if out_long.shape == before.shape:
        assert out_long.tobytes() == before.tobytes()  # nothing written


def test_request_estimates_refuses_a_read_only_output():
    out = np.empty(N, np.float32)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="out_long must be writable"):
        native.request_estimates(**_args(out_long=out))


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"distance": np.zeros(N, np.int32)}, "distance must be a contiguous int64"),
        ({"p_long": np.zeros(N - 1, np.float32)}, "p_long must be a contiguous float32 array of 768"),
        ({"out": np.zeros(N, np.float32)}, "out must be a contiguous float64"),
        ({"moe_layers": 0}, "moe_layers must be >= 1"),
        ({"floor": 0.0}, "floor must be > 0"),
    ],
)
def test_next_use_layers_refuses_bad_arguments_by_name(over, message):
    args = {
        "distance": np.ones(N, np.int64),
        "p_next": np.zeros(N, np.float32),
        "p_long": np.ones(N, np.float32),
        "moe_layers": 24,
        "floor": 1e-3,
        "out": np.zeros(N, np.float64),
    }
    args.update(over)
    with pytest.raises(ValueError, match=message):
        native.next_use_layers(**args)


def test_victim_order_is_numpy_lexsort_over_the_resident_entries():
    rng = np.random.default_rng(11)
    for trial in range(20):
        resident = rng.random(N) < 0.3
        next_use = rng.integers(0, 30, N).astype(np.float64)  # many ties: the stamp decides
        next_use[rng.random(N) < 0.05] = 0.0  # in use now (-0.0 against 0.0 keeps the stamp's order)
        if trial % 2:
            next_use[rng.random(N) < 0.02] = np.nan
        stamp = rng.integers(0, 50, N).astype(np.int64)  # ties here too: ascending entries decide
        entries = np.flatnonzero(resident)
        want = entries[np.lexsort((stamp[entries].astype(np.float64), -next_use[entries]))]
        got = native.victim_order(resident, next_use, stamp)
        assert got.dtype == np.int64 and got.tolist() == want.tolist()
    assert native.victim_order(np.zeros(N, bool), np.zeros(N), np.zeros(N, np.int64)).size == 0


@pytest.mark.parametrize(
    ("resident", "next_use", "stamp", "message"),
    [
        (np.zeros(N, np.uint8), np.zeros(N), np.zeros(N, np.int64), "resident must be a contiguous bool"),
        (
            np.zeros(N, bool),
            np.zeros(N - 1),
            np.zeros(N, np.int64),
            "next_use must be a contiguous float64 array of 768",
        ),
        (np.zeros(N, bool), np.zeros(N), np.zeros(N, np.int32), "stamp must be a contiguous int64"),
    ],
)
def test_victim_order_refuses_bad_arguments_by_name(resident, next_use, stamp, message):
    with pytest.raises(ValueError, match=message):
        native.victim_order(resident, next_use, stamp)
