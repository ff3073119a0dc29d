"""ActivationSignals: positions, history, lookahead by depth and its precision, hint staleness,
per-request state combined over live requests, next-use estimates, the pluggable estimator."""

from __future__ import annotations

import numpy as np
import pytest

from cache_daemon.decisions.lookahead import PRIOR_BUCKET_EDGES
from cache_daemon.decisions.policy.base import PolicyShape
from cache_daemon.decisions.policy.lru import LRUPolicy
from cache_daemon.decisions.scheduler import PrefetchClass, PrefetchConfig, PrefetchScheduler
from cache_daemon.decisions.signals import ActivationSignals, LayerPrediction, SignalsConfig
from expertcache.keys import ExpertKey
from expertcache.layers import LayerMap
from replay.hazard import MAX_RECENCY, HazardEstimator, HazardTable, recency_bucket

L, E = 4, 8


def make(estimator=None, **kw) -> ActivationSignals:
    return ActivationSignals(L, E, config=SignalsConfig(**kw), estimator=estimator)


def pred(layer, depth, experts, scores=None):
    scores = [0.5] * len(experts) if scores is None else scores
    return LayerPrediction(layer, depth, np.asarray(experts), np.asarray(scores, np.float32))


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


def test_observe_moves_position_and_history():
    s = make(history_half_life_tokens=1.0, prior_weight=0.0, long_history_weight=0.0)
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
    with pytest.raises(ValueError, match=r"layer 4 is not a MoE layer of \[0, 1, 2, 3\]"):
        s.observe(4, [0], token=2)
    with pytest.raises(ValueError, match=r"experts \[9\] outside 0..7"):
        s.observe(0, [9], token=2)
    with pytest.raises(ValueError):
        s.history[0] = 1.0  # read-only view


def test_history_blends_a_short_and_a_long_half_life():
    s = make(
        history_half_life_tokens=1.0,
        long_history_half_life_tokens=2.0,
        long_history_weight=0.25,
        prior_weight=0.0,
    )
    s.observe(0, [1], token=0)
    s.observe(0, [2], token=1)
    short = 0.5 * 0.5  # used once, one token ago, half-life 1
    long = (1 - 0.5**0.5) * 0.5**0.5  # the same with half-life 2
    assert s.history[1] == pytest.approx(0.75 * short + 0.25 * long, rel=1e-5)


def test_layer_distance_counts_moe_layers_only():
    s = make()
    s.observe(1, [0], token=5)
    d = s.layer_distance()
    assert d[2 * E] == 1 and d[3 * E] == 2 and d[0] == 3 and d[E] == L
    # DeepSeek-like: decoder layer 0 is dense. Distances skip it; its entries are never visited.
    dense = ActivationSignals(4, E, layer_map=LayerMap((1, 2, 3)))
    dense.observe(3, [0], token=0)
    dd = dense.layer_distance()
    assert dd[E] == 1 and dd[2 * E] == 2 and dd[3 * E] == 3 and dd[0] == 4
    assert dense.step == 2  # token 0, MoE layer index 2
    with pytest.raises(ValueError, match="layer 0 is not a MoE layer"):
        dense.observe(0, [1], token=1)


def test_lookahead_by_depth_staleness_and_nearer_wins():
    s = make(lookahead_prior_precision=0.5)
    s.observe(2, [0], token=3)
    s.set_lookahead([pred(2, 1, [5]), pred(1, 1, [5])], token=3)  # the current layer and one before: passed
    assert s.lookahead() == []
    s.set_lookahead([pred(3, 1, [5, 6], [0.7, 0.3]), pred(0, 2, [1])], token=3)  # layer 0 of token 3: passed
    [(layer, depth, entries, scores)] = s.lookahead()
    assert (layer, depth, entries.tolist()) == (3, 1, [3 * E + 5, 3 * E + 6])
    s.set_lookahead([pred(0, 2, [1])], token=4)  # the next token's layer 0, two MoE layers on
    assert [(la[0], la[1]) for la in s.lookahead()] == [(3, 1), (0, 2)]  # nearest first
    s.set_lookahead([pred(0, 3, [2])], token=4)  # a deeper guess never replaces a nearer one
    assert s.lookahead()[1][2].tolist() == [1]
    s.observe(3, [5, 1], token=3)  # the predicted layer happens: scored, then gone
    assert [la[0] for la in s.lookahead()] == [0]
    # One of two predicted experts was routed: precision of depth 1 moves from the prior (0.5)
    # towards 0.5 — and a perfect depth-2 prediction moves towards 1.
    assert s.precision(1) == pytest.approx(0.5)
    s.observe(0, [1, 7], token=4)
    assert s.precision(2) > 0.5
    with pytest.raises(ValueError, match=r"lookahead experts \(2,\) and scores \(1,\) differ"):
        s.set_lookahead([pred(1, 1, [1, 2], [0.5])], token=4)
    with pytest.raises(ValueError, match="lookahead depth must be >= 1, got 0"):
        s.set_lookahead([pred(1, 0, [1])], token=4)


def test_precision_is_a_running_estimate_per_depth():
    s = make(precision_half_life=4.0, lookahead_prior_precision=0.5)
    for t in range(40):
        s.set_lookahead([pred(1, 1, [1, 2])], token=t)  # always right
        s.set_lookahead([pred(2, 2, [5, 6])], token=t)  # always wrong
        s.observe(0, [0], token=t)
        s.observe(1, [1, 2], token=t)
        s.observe(2, [1, 2], token=t)
        s.observe(3, [1, 2], token=t)
    assert s.precision(1) > 0.9 and s.precision(2) < 0.1
    assert s.precision(3) == pytest.approx(0.5)  # never scored: the prior
    assert set(s.precisions()) == {1, 2}


def test_lookahead_overrides_next_visit_probability_by_depth_precision():
    s = make(prior_weight=0.0, lookahead_prior_precision=0.8)
    s.observe(0, [1, 2], token=0)
    s.observe(1, [1, 2], token=0)
    before = s.use_probability().copy()
    s.set_lookahead([pred(1, 1, [3], [1.0])], token=1)
    s.observe(0, [1], token=1)
    p = s.use_probability()
    assert p[E + 3] == pytest.approx(0.8)
    # The layer's other experts keep 1 - precision of their estimate for the next visit.
    assert p[E + 1] == pytest.approx(s.request_next_probabilities()[0][E + 1] * 0.2)
    assert before[E + 3] < before[E + 1]  # before it: never used, less likely than a used one


def test_hints_expire_after_ttl_and_replace_per_layer():
    s = make(hint_ttl_tokens=2, hint_weight=0.5, prior_weight=0.0)
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
    with pytest.raises(ValueError, match=r"hint for layer 9 outside 0..3"):
        s.set_hints([(1, 1, 0.5), (9, 0, 1.0)], token=3)
    assert s.hints[E + 1] == 0.0  # nothing applied from a bad batch
    with pytest.raises(ValueError, match=r"L1E8 is outside 4 layers x 8 experts"):
        s.set_hints([(1, 8, 0.5)], token=3)


def test_next_use_orders_like_belady_would_guess():
    for estimator in (None, HazardEstimator(prior_count=8.0)):
        s = make(estimator=estimator, prior_weight=0.0)
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


def test_idle_log_survival_is_the_chance_of_going_unused_over_the_horizon():
    s = make(prior_weight=0.0, eviction_horizon_tokens=1.5)  # 1.5 * L layer steps
    s.begin_request("r")
    for t in range(3):
        for layer in range(L):
            s.observe(layer, [1, 2], token=t)
    s.observe(1, [1, 3], token=3)  # position (3, 1)
    idle = s.idle_log_survival()
    assert idle[E + 1] == -np.inf and idle[E + 3] == -np.inf  # in use now
    p_next, p_long, d = s.use_probability(), s.long_run_probability(), s.layer_distance()
    horizon = 1.5 * L
    for entry in (2 * E + 2, 0 * E + 2, 2 * E + 5):
        want = np.log1p(-float(p_next[entry])) + (horizon - d[entry]) / L * np.log1p(-float(p_long[entry]))
        assert idle[entry] == pytest.approx(want, rel=1e-12)
    # A habitually used entry is likelier used soon than one never used, so less idle.
    assert idle[2 * E + 2] < idle[2 * E + 5]
    assert np.all(idle <= 0.0)
    # An entry whose next visit lies beyond the horizon is idle for certain (log 1 = 0).
    short = make(prior_weight=0.0, eviction_horizon_tokens=0.5)  # 2 of the 4 layers ahead
    short.begin_request("r")
    for layer in range(L):
        short.observe(layer, [1, 2], token=0)
    short.observe(0, [1, 2], token=1)
    near = short.idle_log_survival()
    assert near[1 * E + 1] < 0.0 and near[2 * E + 1] < 0.0  # 1 and 2 layers ahead
    assert near[3 * E + 1] == 0.0  # 3 layers ahead
    with pytest.raises(ValueError, match=r"SignalsConfig.eviction_horizon_tokens must be in"):
        SignalsConfig(eviction_horizon_tokens=0.0)


def test_requests_have_their_own_state_and_combine():
    s = make(prior_weight=0.5, history_half_life_tokens=1.0)
    s.begin_request("a")
    for t in range(5):
        s.observe(0, [1], token=t, request_id="a")
    s.set_hints([(0, 2, 0.5)], token=4, request_id="a")
    assert s.live_requests == ("a",)
    s.begin_request("b")
    assert s.request_id == "b" and 0 < s.history[1] < 0.5  # prior * weight: the model-wide habit, damped
    s.observe(0, [3], token=0, request_id="b")
    # Two live requests: an entry either may use is likelier than for each alone.
    pa, pb = s.request_probabilities()
    p = s.long_run_probability()
    assert p[1] == pytest.approx(1 - (1 - pa[1]) * (1 - pb[1]), rel=1e-5)
    assert p[1] > max(pa[1], pb[1]) and p[3] >= pb[3] * (1 - 1e-6)
    assert s.hints[2] == pytest.approx(0.5)  # a's hint, still fresh
    s.end_request("a")
    assert s.live_requests == ("b",) and not s.hints.any()
    s.end_request("b")
    assert s.request_id is None and s.live_requests == ()
    # Routing that names no request (or an unknown one) starts it.
    s.observe(1, [0], token=0)
    assert s.live_requests == ("",)


def test_live_requests_are_bounded():
    s = make(max_live_requests=2)
    for r in ("a", "b", "c"):
        s.observe(0, [0], token=0, request_id=r)
    assert s.live_requests == ("b", "c")


def test_hazard_estimator_learns_from_visits_only():
    s = make(estimator=HazardEstimator(prior_count=1.0))
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
    tab = HazardTable(prior_count=4.0)
    tab.base_rate = 0.25
    tab.refresh()
    assert np.allclose(tab.hazard, 0.25)
    assert tab.wait[0, 0, MAX_RECENCY + 1] == pytest.approx(0.75 / 0.25)
    assert tab.wait[0, 0, 1] == pytest.approx(0.75 * (1 + tab.wait[0, 0, 2]))
    assert recency_bucket(np.array([1, 2, 3, 4, 5, 64, 65, 1000])).tolist() == [0, 1, 2, 2, 3, 6, 7, 7]


def test_transitions_learned_across_requests_sharpen_the_next_visit():
    """Layer 0 routes 1 then 2 in every request: after a few requests, a request that just routed
    expert 1 there expects expert 2 at the next visit, far above what its history alone says; the
    long-run estimate (visits after the next) stays the history's."""

    def run(transition_weight: float) -> ActivationSignals:
        s = make(prior_weight=0.0, transition_weight=transition_weight)
        for r in range(6):
            s.begin_request(f"r{r}")
            for t, ex in enumerate([[1], [2], [1], [2]]):
                s.observe(0, ex, token=t)
            s.end_request(f"r{r}")
        s.begin_request("new")
        s.observe(0, [2], token=0)
        s.observe(0, [1], token=1)
        s.observe(1, [0], token=1)  # on to the next layer: layer 0's experts are not in use now
        return s

    on, off = run(1.0), run(0.0)
    assert on.use_probability()[2] > 0.7 and off.use_probability()[2] < 0.3
    assert on.long_run_probability()[2] == pytest.approx(off.long_run_probability()[2])
    assert on.use_probability()[1] < 0.5 * on.use_probability()[2]  # 1 is followed by 2, not by 1
    # Expert 2's next use comes sooner than expert 1's (used more recently), the other way round
    # without the transitions.
    assert on.next_use_layers()[2] < on.next_use_layers()[1]
    assert off.next_use_layers()[2] > off.next_use_layers()[1]
    # A layer the request has not routed yet keeps its history.
    assert on.use_probability()[2 * E + 3] == pytest.approx(on.long_run_probability()[2 * E + 3])


def test_lookahead_precision_is_kept_per_prior_bucket():
    """Guesses of an expert the request was not expected to use (prior bucket 0) are wrong here,
    guesses of its habitual expert right: each bucket's precision is measured apart, a new guess
    gets its bucket's as its confidence, and the scheduler drops guesses below min_probability."""
    s = make(prior_weight=0.0, transition_weight=0.0, long_history_weight=0.0, history_half_life_tokens=1.0)
    for t in range(40):
        s.observe(0, [1], token=t)  # layer 0 always routes expert 1: its history is high
        s.set_lookahead([pred(1, 1, [1, 6])], token=t)  # 1: a habit (right); 6: never used (wrong)
        s.observe(1, [1], token=t)
    b_habit, b_new = s._current.prior_buckets([E + 1, E + 6], long_weight=0.0, use_next=False)
    assert b_new == 0 and b_habit == len(PRIOR_BUCKET_EDGES)
    assert s.precision(1) == pytest.approx(0.5, abs=0.05)
    assert s.precision(1, b_habit) > 0.9 and s.precision(1, b_new) < 0.1
    s.observe(0, [1], token=40)
    s.set_lookahead([pred(1, 1, [1, 6])], token=40)
    [conf] = s.lookahead_confidence()
    assert conf.tolist() == pytest.approx([s.precision(1, b_habit), s.precision(1, b_new)])
    p = s.use_probability()
    assert p[E + 1] > 0.9 and p[E + 6] < 0.1
    # The scheduler (the depth's precision, 0.5, above its min_probability here) takes the habitual
    # guess and drops the other (its bucket's precision below min_probability).
    policy = LRUPolicy(PolicyShape(L, E))
    sched = PrefetchScheduler(
        s, policy, blob_bytes=1, max_inflight_bytes=8, config=PrefetchConfig(eamc=False, min_probability=0.3)
    )
    got = {(c.entry, c.cls) for c in sched.candidates()}
    assert got == {(E + 1, PrefetchClass.LAYER_AHEAD)}
