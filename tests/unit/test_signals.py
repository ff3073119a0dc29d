"""ActivationSignals: positions, history, layer-ahead and hint staleness, next-use estimates."""

from __future__ import annotations

import numpy as np
import pytest

from cache_daemon.signals import ActivationSignals, SignalsConfig
from expertcache.keys import ExpertKey

L, E = 4, 8


def make(**kw) -> ActivationSignals:
    return ActivationSignals(L, E, config=SignalsConfig(**kw))


def test_entries_and_keys():
    s = make()
    assert s.entry_of(ExpertKey(2, 5)) == 2 * E + 5
    assert s.key_of(2 * E + 5) == ExpertKey(2, 5)
    with pytest.raises(ValueError, match=r"L4E0 is outside 4 layers x 8 experts"):
        s.entry_of(ExpertKey(4, 0))
    with pytest.raises(ValueError, match=r"num_layers and num_experts must be >= 1, got 0 and 8"):
        ActivationSignals(0, 8)


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match=r"SignalsConfig.hint_weight must be in \[0.0, 1.0\], got 2"):
        SignalsConfig(hint_weight=2)
    with pytest.raises(ValueError, match=r"SignalsConfig.history_half_life_tokens must be in"):
        SignalsConfig(history_half_life_tokens=0.0)
    with pytest.raises(
        ValueError, match=r"SignalsConfig.estimator must be one of \['hazard', 'ema'\], got 'x'"
    ):
        SignalsConfig(estimator="x")


def test_observe_moves_position_and_history():
    s = make(history_half_life_tokens=1.0, prior_weight=0.0)
    assert s.position == (-1, L - 1)
    v0 = s.version
    s.begin_request("r")
    s.observe(1, [2, 3], token=0)
    assert s.position == (0, 1) and s.step == 1 and s.version > v0
    assert sorted(s.needed.tolist()) == [E + 2, E + 3]
    h = s.history
    assert h[E + 2] == pytest.approx(0.5) and h[E + 4] == 0.0  # half-life 1 token: gain 1 - 0.5
    s.observe(1, [2], token=1)
    assert s.history[E + 2] == pytest.approx(0.75) and s.history[E + 3] == pytest.approx(0.25)
    assert s.last_use[E + 3] == 0 and s.uses[E + 2] == 2
    with pytest.raises(ValueError, match=r"layer 4 outside 0..3"):
        s.observe(4, [0], token=2)
    with pytest.raises(ValueError, match=r"experts \[9\] outside 0..7"):
        s.observe(0, [9], token=2)
    with pytest.raises(ValueError):
        s.history[0] = 1.0  # read-only view


def test_layer_distance():
    s = make()
    s.observe(1, [0], token=5)
    d = s.layer_distance()
    assert d[2 * E] == 1 and d[3 * E] == 2 and d[0] == 3 and d[E] == L


def test_layer_ahead_for_a_passed_layer_is_ignored():
    s = make()
    s.observe(2, [0], token=3)
    s.set_layer_ahead(2, [5], [0.9], token=3)  # the current layer: passed
    s.set_layer_ahead(1, [5], [0.9], token=3)  # before it
    assert s.layer_ahead_prediction() is None and not s.layer_ahead.any()
    s.set_layer_ahead(3, [5, 6], [0.7, 0.3], token=3)
    entries, scores, layer = s.layer_ahead_prediction()
    assert layer == 3 and entries.tolist() == [3 * E + 5, 3 * E + 6]
    assert s.layer_ahead[3 * E + 5] == pytest.approx(0.7)
    s.observe(3, [1], token=3)  # the predicted layer happens: the prediction goes stale
    assert s.layer_ahead_prediction() is None
    with pytest.raises(ValueError, match=r"layer-ahead experts \(2,\) and scores \(1,\) differ"):
        s.set_layer_ahead(0, [1, 2], [0.5], token=4)


def test_layer_ahead_overrides_next_visit_probability():
    s = make(layer_ahead_confidence=0.9, prior_weight=0.0, estimator="ema")
    s.observe(0, [1, 2], token=0)
    s.observe(1, [1, 2], token=0)
    before = s.use_probability().copy()
    s.set_layer_ahead(1, [3], [1.0], token=1)  # passed? no: (1, 1) > (0, 1)
    s.observe(0, [1], token=1)
    p = s.use_probability()
    assert p[E + 3] == pytest.approx(0.9)
    assert p[E + 1] == pytest.approx(s.long_run_probability()[E + 1] * 0.1)
    assert before[E + 3] == 0.0


def test_hints_expire_after_ttl_and_replace_per_layer():
    s = make(hint_ttl_tokens=2, hint_weight=0.5, prior_weight=0.0, estimator="ema")
    s.observe(0, [0], token=0)
    s.set_hints([(1, 3, 0.8), (1, 4, 0.6), (2, 1, 0.5)], token=0)
    assert s.hints[E + 3] == pytest.approx(0.8)
    assert s.long_run_probability()[E + 3] == pytest.approx(0.4)  # 0.5 * 0 + 0.5 * 0.8
    s.set_hints([(1, 5, 0.9)], token=0)  # layer 1 replaced; layer 2 kept
    assert s.hints[E + 3] == 0.0 and s.hints[E + 5] == pytest.approx(0.9) and s.hints[2 * E + 1] > 0
    s.set_hints([], token=0, layers=[2])  # a layer sent with no hints drops its old ones
    assert s.hints[2 * E + 1] == 0.0
    s.observe(0, [0], token=2)
    assert s.hints[E + 5] == pytest.approx(0.9)  # 2 tokens old: still fresh
    s.observe(0, [0], token=3)
    assert s.hints[E + 5] == 0.0  # stale
    with pytest.raises(ValueError, match=r"layer 9 outside 0..3"):
        s.set_hints([(1, 1, 0.5), (9, 0, 1.0)], token=3)
    assert s.hints[E + 1] == 0.0  # nothing applied from a bad batch
    with pytest.raises(ValueError, match=r"L1E8 is outside 4 layers x 8 experts"):
        s.set_hints([(1, 8, 0.5)], token=3)


@pytest.mark.parametrize("estimator", ["hazard", "ema"])
def test_next_use_orders_like_belady_would_guess(estimator):
    s = make(prior_weight=0.0, estimator=estimator)
    s.begin_request("r")
    for t in range(3):
        for layer in range(L):
            s.observe(layer, [1, 2], token=t)
    s.observe(0, [1, 2], token=3)
    nu = s.next_use_layers()
    assert nu[1] == 0.0 and nu[2] == 0.0  # in use now
    # A frequently used entry of the next layer comes before one never used.
    assert nu[E + 1] < nu[E + 5]
    # Same probability: the nearer layer first.
    assert nu[E + 1] < nu[3 * E + 1]
    assert np.all(np.isfinite(nu))


def test_begin_request_restarts_history_from_the_prior():
    s = make(prior_weight=0.5)
    s.begin_request("a")
    for t in range(5):
        s.observe(0, [1], token=t)
    s.set_hints([(0, 2, 0.5)], token=4)
    s.end_request("a")
    assert s.request_id is None and not s.hints.any()
    s.begin_request("b")
    assert s.request_id == "b"
    assert 0 < s.history[1] < 0.5  # prior * weight: the model-wide habit, damped
    assert s.uses[1] == 0


def test_hazard_table_learns_from_visits_only():
    s = make(estimator="hazard", hazard_prior_count=1.0)
    s.begin_request("r")
    # Expert 1 of every layer is used on every token; expert 5 never.
    for t in range(30):
        for layer in range(L):
            s.observe(layer, [1, 2 + t % 3], token=t)
    p = s.use_probability()
    assert p[E + 1] > 0.8  # recency 1, frequent: learnt near-certain
    assert p[E + 5] < 0.2  # cold in this request
    nu = s.next_use_layers()
    assert nu[E + 1] < nu[E + 5]
    # Waits follow the recursion W(d) = (1 - h(d)) (1 + W(d + 1)).
    from cache_daemon.signals import MAX_RECENCY, HazardTable, recency_bucket

    tab = HazardTable(prior_count=4.0)
    tab.base_rate = 0.25
    tab.refresh()
    assert np.allclose(tab.hazard, 0.25)
    assert tab.wait[0, 0, MAX_RECENCY + 1] == pytest.approx(0.75 / 0.25)
    assert tab.wait[0, 0, 1] == pytest.approx(0.75 * (1 + tab.wait[0, 0, 2]))
    assert recency_bucket(np.array([1, 2, 3, 4, 5, 64, 65, 1000])).tolist() == [0, 1, 2, 2, 3, 6, 7, 7]
