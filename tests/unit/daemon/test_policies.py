"""Eviction policies behind one interface: registry, pinning, determinism, churn, formulas."""

from __future__ import annotations

import random

import numpy as np
import pytest

from cache_daemon.decisions.policy import (
    POLICIES,
    ActivationAwarePolicy,
    EvictionPolicy,
    LFUPolicy,
    LRUPolicy,
    MoEInfinityPolicy,
    PolicyShape,
    make_policy,
)
from cache_daemon.decisions.signals import ActivationSignals, SignalsConfig
from expertcache.keys import ExpertKey
from replay.belady import NEVER, BeladyPolicy, FutureUses
from replay.oracle import NextTokenOraclePolicy
from replay.policies import REFERENCE_POLICIES, REPLAY_POLICIES, make_replay_policy

L, E, K = 3, 6, 2
SHAPE = PolicyShape(L, E)


def routes(tokens: int = 40, seed: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack(
        [np.stack([rng.choice(E, K, replace=False) for _ in range(L)]) for _ in range(tokens)]
    ).astype(np.int16)


def build(name: str, r: np.ndarray | None = None) -> tuple[EvictionPolicy, ActivationSignals]:
    sig = ActivationSignals(L, E)
    return make_replay_policy(name, SHAPE, sig, routes() if r is None else r), sig


def use_routed(
    policy: EvictionPolicy, resident: set[ExpertKey], layer: int, experts, after=lambda: None
) -> None:
    """Layer ``layer`` routed ``experts``: each resident one is accessed, the others inserted
    (and added to ``resident``); ``after`` runs after each."""
    for x in experts:
        key = ExpertKey(layer, int(x))
        if key in resident:
            policy.on_access(key)
        else:
            policy.on_insert(key)
            resident.add(key)
        after()


def drive(name: str, seed: int, steps: int = 200) -> list[list[ExpertKey]]:
    """Random insert/access/remove churn with hints and routing; returns every victim choice."""
    r = routes()
    policy, sig = build(name, r)
    rng = random.Random(seed)
    resident: set[ExpertKey] = set()
    pinned: set[ExpertKey] = set()
    chosen = []
    step = 0
    for token in range(len(r)):
        sig.set_hints([(layer, rng.randrange(E), rng.random()) for layer in range(L)], token)
        for layer in range(L):
            sig.observe(layer, r[token, layer], token)
            use_routed(policy, resident, layer, r[token, layer])
            if rng.random() < 0.3 and resident:
                gone = rng.choice(sorted(resident))
                policy.on_remove(gone)
                resident.discard(gone)
                pinned.discard(gone)
            if rng.random() < 0.3 and resident:
                pinned.add(rng.choice(sorted(resident)))
            victims = policy.choose_victims(3, lambda k: k in resident and k not in pinned)
            assert len(set(victims)) == len(victims)
            assert not (set(victims) & pinned), "a pinned expert was chosen"
            assert set(victims) <= resident
            assert len(victims) == min(3, len(resident - pinned))
            assert len(policy) == len(resident)
            chosen.append(victims)
            for v in victims[:1]:
                policy.on_remove(v)
                resident.discard(v)
            step += 1
            if step >= steps:
                return chosen
    return chosen


@pytest.mark.parametrize("name", sorted(REPLAY_POLICIES))
def test_pinned_never_chosen_and_churn(name):
    drive(name, seed=3)


@pytest.mark.parametrize("name", sorted(REPLAY_POLICIES))
def test_deterministic(name):
    assert drive(name, seed=5) == drive(name, seed=5)


@pytest.mark.parametrize("name", sorted(REPLAY_POLICIES))
def test_nothing_evictable_and_zero(name):
    policy, sig = build(name)
    sig.observe(0, [0, 1], 0)
    for e in range(3):
        policy.on_insert(ExpertKey(0, e))
    assert policy.choose_victims(2, lambda k: False) == []
    assert policy.choose_victims(0, lambda k: True) == []
    policy.on_remove(ExpertKey(2, 5))  # unknown: ignored
    policy.on_access(ExpertKey(2, 5))  # untracked: ignored
    assert len(policy) == 3


def test_registry_and_errors():
    assert set(POLICIES) == {"lru", "lfu", "moe-infinity", "activation-aware"}  # what a daemon runs
    assert tuple(REFERENCE_POLICIES) == ("belady", "oracle-next-token")
    assert REPLAY_POLICIES == (*POLICIES, *REFERENCE_POLICIES)
    policy = make_policy("lru")  # the old call still works
    assert isinstance(policy, LRUPolicy) and policy.name == "lru"
    assert make_policy("lru") is not policy  # a fresh object per tier
    with pytest.raises(
        ValueError,
        match=r"unknown eviction policy 'fifo'; known policies: activation-aware, lfu, lru, moe-infinity$",
    ):
        make_policy("fifo")
    for name in REFERENCE_POLICIES:  # the replay's own: a daemon does not know them
        with pytest.raises(ValueError, match=rf"unknown eviction policy '{name}'"):
            make_policy(name, SHAPE, ActivationSignals(L, E))
    with pytest.raises(
        ValueError,
        match=r"unknown eviction policy 'fifo'; known policies: lru, lfu, moe-infinity, activation-aware, "
        r"belady, oracle-next-token$",
    ):
        make_replay_policy("fifo", SHAPE, ActivationSignals(L, E), routes())
    with pytest.raises(ValueError, match=r"belady is the offline optimum: trace replay only"):
        BeladyPolicy(SHAPE, ActivationSignals(L, E))
    with pytest.raises(ValueError, match=r"oracle-next-token knows the future: trace replay only"):
        NextTokenOraclePolicy(SHAPE, ActivationSignals(L, E))
    with pytest.raises(ValueError, match=r"horizon_tokens must be >= 1, got 0"):
        NextTokenOraclePolicy(
            SHAPE, ActivationSignals(L, E), future=FutureUses(routes(), E), horizon_tokens=0
        )
    with pytest.raises(ValueError, match=r"policy 'activation-aware' needs ActivationSignals"):
        make_policy("activation-aware", SHAPE)
    with pytest.raises(
        ValueError, match=r"policy 'lfu' needs the model shape \(PolicyShape\) or ActivationSignals"
    ):
        make_policy("lfu")
    with pytest.raises(ValueError, match=r"signals are 4 x 6 but the policy shape is 3 x 6"):
        make_policy("lfu", SHAPE, ActivationSignals(4, E))
    with pytest.raises(ValueError, match=r"PolicyShape needs num_layers >= 1"):
        PolicyShape(0, 3)
    with pytest.raises(ValueError, match=r"L3E0 is outside 3 layers x 6 experts"):
        make_policy("lfu", SHAPE).on_insert(ExpertKey(3, 0))
    for cls in REFERENCE_POLICIES.values():
        with pytest.raises(ValueError, match=r"FutureUses is 3 x 7 but the policy shape is 3 x 6"):
            cls(SHAPE, ActivationSignals(L, E), future=FutureUses(routes(), 7))


def test_lfu_counts_and_recency_ties():
    lfu = LFUPolicy(SHAPE)
    a, b, c = ExpertKey(0, 0), ExpertKey(0, 1), ExpertKey(1, 2)
    for k in (a, b, c):
        lfu.on_insert(k)
    lfu.on_access(a)
    lfu.on_access(a)
    lfu.on_access(c)
    assert lfu.count(0) == 3 and lfu.count(1) == 1 and lfu.count(E + 2) == 2
    assert lfu.choose_victims(3, lambda k: True) == [b, c, a]
    lfu.on_access(b)  # b: 2 uses, more recent than c
    assert lfu.choose_victims(3, lambda k: True) == [c, b, a]
    lfu.on_remove(a)
    lfu.on_insert(a)  # counts survive eviction
    assert lfu.count(0) == 4


def test_moe_infinity_formulas_exactly():
    sig = ActivationSignals(L, E)
    pol = MoEInfinityPolicy(SHAPE, sig)
    sig.observe(0, [0, 1], token=0)
    sig.set_hints([(0, 2, 0.5), (1, 3, 0.2), (2, 4, 0.9)], token=0)
    keys = [ExpertKey(0, 2), ExpertKey(1, 3), ExpertKey(2, 4), ExpertKey(2, 5)]
    for k in keys:
        pol.on_insert(k)
    eps = pol.epsilon
    expect = [(0.5 + eps) * 1.0, (0.2 + eps) * (1 - 1 / 3), (0.9 + eps) * (1 - 2 / 3), eps * (1 - 2 / 3)]
    assert pol.keep_value(keys) == pytest.approx(expect)
    assert pol.choose_victims(4, lambda k: True) == [keys[3], keys[1], keys[2], keys[0]]
    # Prefetch score of layer i > l (here l = 0): p * (1 - (i - l)/L); passed layers 0.
    scores = pol.prefetch_scores(0.7)
    assert (scores == pol.prefetch_scores(1.0)).all()  # the paper's rank, not the bar
    assert scores[E + 3] == pytest.approx(0.2 * (1 - 1 / 3))
    assert scores[2 * E + 4] == pytest.approx(0.9 * (1 - 2 / 3))
    assert scores[2] == 0.0
    assert pol.prefetch_horizon_layers == L


def test_belady_picks_the_furthest_next_use():
    r = np.array([[[0, 1]], [[2, 0]], [[1, 3]], [[0, 2]]], np.int16)  # 4 tokens, 1 layer, top-2
    fut = FutureUses(r, 4)
    assert fut.next_use(0).tolist() == [0, 0, 1, 2]
    sig = ActivationSignals(1, 4)
    pol = BeladyPolicy(PolicyShape(1, 4), sig, future=fut)
    for e in range(4):
        pol.on_insert(ExpertKey(0, e))
    sig.observe(0, [2, 0], token=1)  # step 1: next uses 0 -> 1 (now), 1 -> 2, 2 -> 1 (now), 3 -> 2
    nu = pol.next_use()
    assert nu.tolist() == [1, 2, 1, 2]
    sig.observe(0, [1, 3], token=2)
    assert pol.next_use().tolist() == [3, 2, 3, 2]
    sig.observe(0, [0, 2], token=3)
    assert pol.next_use().tolist() == [3, NEVER, 3, NEVER]
    victims = pol.choose_victims(2, lambda k: k.expert not in (0, 2))
    assert sorted(victims) == [ExpertKey(0, 1), ExpertKey(0, 3)]
    with pytest.raises(ValueError, match=r"FutureUses asked for step 0 after step 3"):
        fut.next_use(0)
    with pytest.raises(ValueError, match=r"routes must be \[tokens, layers, top_k\]"):
        FutureUses(np.zeros((3, 2)), 4)
    with pytest.raises(ValueError, match=r"routes hold experts outside 0..3"):
        FutureUses(np.full((1, 1, 1), 4), 4)


def test_oracle_next_token_exact_within_the_horizon_estimate_beyond():
    # 1 layer x 4 experts, top-1: expert 1 next at token 2, expert 2 at token 4, 0 and 3 never.
    r = np.array([[[0]], [[3]], [[1]], [[0]], [[2]]], np.int16)
    sig = ActivationSignals(1, 4, config=SignalsConfig(history_half_life_tokens=1.0))
    oracle = NextTokenOraclePolicy(PolicyShape(1, 4), sig, future=FutureUses(r, 4), horizon_tokens=1)
    online = ActivationAwarePolicy(PolicyShape(1, 4), sig)
    for pol in (oracle, online):
        for e in range(4):
            pol.on_insert(ExpertKey(0, e))
    sig.observe(0, [0], token=0)
    sig.observe(0, [3], token=1)  # position: token 1; horizon = 1 token = 1 layer step
    est = online.next_use()
    nu = oracle.next_use()
    assert nu[1] == 1.0  # used at token 2: exact, one step away
    assert nu[3] == 0.0  # in use now
    for e in (0, 2):  # not used within the horizon: the online estimate pushed past it
        assert nu[e] == pytest.approx(est[e] + 1)
    assert oracle.choose_victims(1, lambda k: k.expert != 3) != [ExpertKey(0, 1)]
    # With a horizon covering the whole trace it orders exactly like Belady.
    sig2 = ActivationSignals(1, 4)
    far = NextTokenOraclePolicy(PolicyShape(1, 4), sig2, future=FutureUses(r, 4), horizon_tokens=10)
    bel = BeladyPolicy(PolicyShape(1, 4), sig2, future=FutureUses(r, 4))
    for pol in (far, bel):
        for e in range(4):
            pol.on_insert(ExpertKey(0, e))
    sig2.observe(0, [0], token=0)
    assert far.choose_victims(3, lambda k: True)[:1] == bel.choose_victims(3, lambda k: True)[:1]
    assert far.next_use()[[1, 2]].tolist() == [2.0, 4.0]


def test_activation_aware_evicts_the_least_likely_used_soon():
    sig = ActivationSignals(L, E, config=SignalsConfig(history_half_life_tokens=1.0))
    pol = ActivationAwarePolicy(SHAPE, sig)
    sig.begin_request("r")
    for t in range(4):
        for layer in range(L):
            sig.observe(layer, [0, 1], t)
    hot_next, cold_next, hot_far = ExpertKey(1, 0), ExpertKey(1, 5), ExpertKey(0, 1)
    sig.observe(0, [2, 3], 4)  # position (4, 0)
    for k in (hot_next, cold_next, hot_far):
        pol.on_insert(k)
    order = pol.choose_victims(3, lambda k: True)
    assert order[0] == cold_next  # never used in this request
    assert order.index(hot_far) < order.index(hot_next)  # same habit, layer 0 comes round last
    # Speculative prefetch: the entries at least as likely to be used as the scheduler's bar.
    p = sig.use_probability()
    assert p[E] > 0.7 > p[E + 5]
    assert pol.prefetch_scores(0.7)[E] > 0 and pol.prefetch_scores(0.7)[E + 5] == 0
    assert pol.prefetch_scores(float(p[E]) + 1e-6)[E] == 0  # the bar moved: not cached across bars
    assert (pol.prefetch_scores(0.0) > 0).all()


def test_activation_aware_evicts_the_likeliest_idle_not_the_latest_expected_use():
    sig = ActivationSignals(L, E)
    pol = ActivationAwarePolicy(SHAPE, sig)
    sig.begin_request("r")
    sig.observe(0, [0, 1], token=0)
    keys = [ExpertKey(1, 0), ExpertKey(1, 1), ExpertKey(2, 0)]
    for k in keys:
        pol.on_insert(k)
    # A: likely at its next visit, then rarely (expected next use far off, but used soon);
    # B: unlikely at its next visit, then often (expected next use nearer, but idle for now).
    a, b, c = (k.entry(E) for k in keys)
    idle = np.zeros(L * E)
    idle[a], idle[b], idle[c] = np.log(0.5), np.log(0.9), np.log(0.2)
    next_use = np.zeros(L * E)
    next_use[a], next_use[b], next_use[c] = 600.0, 80.0, 10.0
    sig.idle_log_survival = lambda: idle  # the signals' two estimates, disagreeing
    sig.next_use_layers = lambda: next_use
    assert pol.choose_victims(3, lambda k: True) == [keys[1], keys[0], keys[2]]
    assert pol.keep_value([keys[0], keys[1]]).tolist() == [-np.log(0.5), -np.log(0.9)]
    # Speculative prefetch still goes soonest expected use first.
    assert pol.next_use()[a] == 600.0


@pytest.mark.parametrize("name", POLICIES)
def test_seed_for_a_runtime_switch_keeps_everyone(name):
    old, sig = build("lru")
    keys = [ExpertKey(layer, e) for layer in range(L) for e in range(2)]
    for k in keys:
        old.on_insert(k)
    new = make_policy(name, SHAPE, sig)
    new.seed(keys)
    assert len(new) == len(keys)
    assert sorted(new.choose_victims(len(keys), lambda k: True)) == sorted(keys)
    assert sorted(new.rank(keys)) == sorted(keys)


def fresh_victim_order(policy) -> np.ndarray:
    """The victim order recomputed from the policy's state, bypassing its cache."""
    entries = np.flatnonzero(policy._resident)
    if entries.size == 0:
        return entries
    return entries[np.lexsort((policy._tiebreak(entries), policy._keep_scores(entries)))]


@pytest.mark.parametrize("name", sorted(n for n in REPLAY_POLICIES if n != "lru"))
def test_cached_victim_order_follows_every_change(name):
    # The vectorised policies sort once per state (policy changes and signals version): through
    # churn, hints, routing and removals the cached order always equals a fresh one, and a repeat
    # call with nothing changed returns the same array without sorting again.
    r = routes()
    policy, sig = build(name, r)
    rng = random.Random(8)
    resident: set[ExpertKey] = set()

    def check() -> None:
        assert np.array_equal(policy.victim_order(), fresh_victim_order(policy))

    for token in range(len(r)):
        sig.set_hints([(layer, rng.randrange(E), rng.random()) for layer in range(L)], token)
        check()
        for layer in range(L):
            sig.observe(layer, r[token, layer], token)
            check()
            use_routed(policy, resident, layer, r[token, layer], after=check)
            if rng.random() < 0.4 and resident:
                gone = rng.choice(sorted(resident))
                policy.on_remove(gone)
                resident.discard(gone)
                check()
            order = policy.victim_order()
            assert policy.victim_order() is order and not order.flags.writeable
            absent = [ExpertKey(i, j) for i in range(L) for j in range(E) if ExpertKey(i, j) not in resident]
            if absent:
                policy.on_remove(absent[0])  # not resident: nothing changed, nothing re-sorted
                assert policy.victim_order() is order
