"""The native routing-transition table (``TransitionTable``, csrc/src/transitions.cc) against the
formulas of its header computed in numpy: counts with their decay (growing units, rescaled), the
next-visit probabilities (naive Bayes over the previous experts, shrunk to the base rate, the
history as a soft prior, k * softmax capped at 1); and every argument a caller can get wrong is
refused with a message that names it, leaving the counts as they were.
"""

from __future__ import annotations

import numpy as np
import pytest
from numpy.testing import assert_allclose

from expertcache import _native

EPS = 1e-3


class Reference:
    """The header's formulas, decaying every count per visit (what the growing units stand for)."""

    def __init__(self, layers, experts, prior, beta, half_life):
        self.E, self.a, self.beta = experts, prior, beta
        self.decay = 0.5 ** (1.0 / half_life)
        self.pairs = np.zeros((layers, experts, experts))
        self.frm = np.zeros((layers, experts))
        self.to = np.zeros((layers, experts))
        self.visits = np.zeros(layers)

    def update(self, layer, prev, cur):
        d = self.decay
        self.pairs[layer] *= d
        self.frm[layer] *= d
        self.to[layer] *= d
        self.visits[layer] = self.visits[layer] * d + 1
        self.pairs[layer][np.ix_(prev, cur)] += 1
        self.frm[layer][prev] += 1
        self.to[layer][cur] += 1

    def predict(self, layer, prev, history):
        E, a = self.E, self.a
        k = max(len(prev), 1)
        base = (self.to[layer] + a) / (self.visits[layer] + a * E / k)
        score = (1 - len(prev)) * np.log(base)
        for p in prev:
            score = score + np.log((self.pairs[layer][p] + a * base) / (self.frm[layer][p] + a))
        score = score + self.beta * np.log(history.astype(np.float64) + EPS)
        x = np.exp(score - score.max())
        return np.minimum(k * x / x.sum(), 1.0)


@pytest.mark.parametrize("beta", [0.0, 0.25, 1.0])
def test_step_matches_the_formulas_over_a_random_stream(beta):
    L, E, K = 3, 16, 4
    rng = np.random.default_rng(7)
    table = _native.TransitionTable(L, E, 4.0, beta, 50.0)
    ref = Reference(L, E, 4.0, beta, 50.0)
    last: dict[int, np.ndarray] = {}
    out = np.empty(E, np.float32)
    for step in range(600):
        layer = step % L
        # A sticky stream: each expert tends to follow itself, so the transitions carry signal.
        prev = last.get(layer)
        cur = rng.choice(E, K, replace=False) if prev is None or rng.random() < 0.3 else np.roll(prev, 1)
        cur = np.asarray(cur, np.int64)
        history = rng.random(E).astype(np.float32)
        history_long = rng.random(E).astype(np.float32)
        table.step(layer, prev, cur, history, history_long, 0.3, out)
        if prev is not None:
            ref.update(layer, prev, cur)
        want = ref.predict(layer, cur, 0.7 * history + 0.3 * history_long)
        assert_allclose(out, want, rtol=2e-4, atol=1e-6)
        assert out.sum() <= K + 1e-4 and out.max() <= 1.0
        last[layer] = cur
    assert table.visits(0) == pytest.approx(ref.visits[0], rel=1e-6)


def test_a_learned_transition_dominates_and_an_unseen_one_says_nothing():
    E = 4
    table = _native.TransitionTable(1, E, 1.0, 0.0, 1e9)
    flat = np.full(E, 0.5, np.float32)
    before = table.predict(0, np.array([1]), flat)
    assert_allclose(before, 0.25, rtol=1e-6)  # nothing learned: the base rate, k / E
    out = np.empty(E, np.float32)
    for _ in range(10):
        table.step(0, np.array([1]), np.array([2]), flat, flat, 0.0, out)
    after = table.predict(0, np.array([1]), flat)
    assert after[2] > 0.8 and after.argmax() == 2
    # Expert 0 was never routed before a visit: its row is the base rate, which favours 2 (seen 10
    # times as a successor) only as much as the base rate does.
    unseen = table.predict(0, np.array([0]), flat)
    assert unseen[2] < after[2] and unseen.argmax() == 2


def test_counts_fade_with_the_half_life_and_survive_rescaling():
    table = _native.TransitionTable(1, 2, 1.0, 0.0, 1.0)  # each visit halves the older ones
    out = np.empty(2, np.float32)
    hist = np.zeros(2, np.float32)
    for _ in range(200):  # the unit grows by 2 per visit: rescaled several times past 1e30
        table.step(0, np.array([0]), np.array([0]), hist, hist, 0.0, out)
    assert table.visits(0) == pytest.approx(2.0, rel=1e-6)  # 1 + 1/2 + 1/4 + ...
    for _ in range(4):
        table.step(0, np.array([0]), np.array([1]), hist, hist, 0.0, out)
    # The recent visits dominate: 0 -> 1 now, though 0 -> 0 was counted 200 times.
    assert out[1] > out[0]


def test_bad_arguments_are_refused_by_name_and_change_nothing():
    E = 4
    table = _native.TransitionTable(2, E, 1.0, 0.25, 10.0)
    hist = np.zeros(E, np.float32)
    out = np.empty(E, np.float32)
    table.step(0, np.array([1]), np.array([2]), hist, hist, 0.0, out)
    visits = table.visits(0)
    one = np.array([0])
    cases = [
        ((5, None, one, hist, hist, 0.5, out), r"layer 5 outside 0..1"),
        ((0, np.array([4]), one, hist, hist, 0.5, out), r"previous expert 4 outside 0..3"),
        ((0, None, np.array([-1]), hist, hist, 0.5, out), r"current expert -1 outside 0..3"),
        (
            (0, None, np.arange(5) % 4, hist, hist, 0.5, out),
            r"current names 5 experts, more than the layer's 4",
        ),
        (
            (0, None, one, np.zeros(3, np.float32), hist, 0.5, out),
            r"history must be a contiguous float32 array of 4",
        ),
        ((0, None, one, hist.astype(np.float64), hist, 0.5, out), r"history must be a contiguous float32"),
        (
            (0, None, one, hist, np.zeros(5, np.float32), 0.5, out),
            r"history_long must be a contiguous float32",
        ),
        ((0, None, one, hist, hist, 1.5, out), r"long_weight must be in \[0, 1\], got 1.5"),
        ((0, None, one, hist, hist, 0.5, np.empty(8, np.float32)[::2]), r"out must be a contiguous float32"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            table.step(*args)
    frozen = np.empty(E, np.float32)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match=r"out must be writable"):
        table.step(0, None, one, hist, hist, 0.5, frozen)
    assert table.visits(0) == visits
    with pytest.raises(ValueError, match=r"layers and experts must be >= 1"):
        _native.TransitionTable(0, E, 1.0, 0.0, 1.0)
    for args, message in [
        ((1, E, 0.0, 0.0, 1.0), r"prior_count must be > 0"),
        ((1, E, 1.0, -1.0, 1.0), r"history_exponent must be >= 0"),
        ((1, E, 1.0, 0.0, 0.0), r"half_life_visits must be > 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            _native.TransitionTable(*args)
