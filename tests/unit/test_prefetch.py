"""PrefetchScheduler: class order, pre-emption, the bytes-in-flight bound, staleness, protection."""

from __future__ import annotations

import pytest

from cache_daemon.policy import PolicyShape, make_policy
from cache_daemon.prefetch import PrefetchClass, PrefetchConfig, PrefetchScheduler, PrefetchStart
from cache_daemon.signals import ActivationSignals, SignalsConfig
from expertcache.keys import ExpertKey

L, E = 4, 8
BLOB = 10


class FakeTier:
    """A TierState over plain sets: ``capacity`` slots, some resident, some loading, some pinned."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.resident: set[ExpertKey] = set()
        self.loading: set[ExpertKey] = set()
        self.pinned: set[ExpertKey] = set()

    @property
    def free_slots(self) -> int:
        return self.capacity - len(self.resident) - len(self.loading)

    @property
    def inflight_bytes(self) -> int:
        return len(self.loading) * BLOB

    def is_resident(self, key):
        return key in self.resident

    def is_loading(self, key):
        return key in self.loading

    def evictable(self, key):
        return key in self.resident and key not in self.pinned

    def apply(self, starts: list[PrefetchStart], policy) -> None:
        for s in starts:
            if s.victim is not None:
                assert self.evictable(s.victim)
                self.resident.discard(s.victim)
                policy.on_remove(s.victim)
            self.loading.add(s.key)


def setup(policy="activation-aware", capacity=8, inflight=10 * BLOB, **cfg):
    sig = ActivationSignals(
        L, E, config=SignalsConfig(prior_weight=0.0, history_half_life_tokens=1.0, estimator="ema")
    )
    pol = make_policy(policy, PolicyShape(L, E), sig)
    sched = PrefetchScheduler(
        sig, pol, blob_bytes=BLOB, max_inflight_bytes=inflight, config=PrefetchConfig(**cfg)
    )
    return sig, pol, sched, FakeTier(capacity)


def fill(tier: FakeTier, pol, keys) -> None:
    for k in keys:
        tier.resident.add(k)
        pol.on_insert(k)


def test_layer_ahead_comes_before_eamc_and_by_score():
    sig, pol, sched, tier = setup()
    sig.begin_request("r")
    for t in range(3):
        for layer in range(L):
            sig.observe(layer, [0, 1], t)  # a strong habit: experts 0 and 1 everywhere
    sig.observe(0, [0, 1], 3)
    sig.set_layer_ahead(1, [5, 6], [0.4, 0.6], 3)
    starts = sched.decide(tier)
    classes = [s.cls for s in starts]
    assert classes[:2] == [PrefetchClass.LAYER_AHEAD] * 2
    assert [s.key for s in starts[:2]] == [ExpertKey(1, 6), ExpertKey(1, 5)]
    assert PrefetchClass.EAMC in classes[2:]
    assert classes == sorted(classes)
    assert all(s.victim is None for s in starts)  # free slots first
    assert set(sched.queued()) == {s.key for s in starts}


def test_bytes_in_flight_bound():
    sig, pol, sched, tier = setup(inflight=3 * BLOB)
    sig.observe(0, [0], 0)
    sig.set_layer_ahead(1, [1, 2, 3, 4], [0.9, 0.8, 0.7, 0.6], 0)
    tier.loading.add(ExpertKey(3, 7))  # 10 bytes already in flight
    starts = sched.decide(tier)
    assert [s.key for s in starts] == [ExpertKey(1, 1), ExpertKey(1, 2)]
    tier.apply(starts, pol)
    assert sched.decide(tier) == []  # at the bound: nothing until a load finishes
    tier.loading.discard(ExpertKey(1, 1))
    tier.resident.add(ExpertKey(1, 1))
    sched.on_done(ExpertKey(1, 1))
    assert [s.key for s in sched.decide(tier)] == [ExpertKey(1, 3)]


def test_demand_preempts_prefetch():
    sig, pol, sched, tier = setup(capacity=3)
    sig.observe(0, [0], 0)
    sig.set_layer_ahead(1, [1, 2], [0.9, 0.5], 0)
    sig.set_hints([(2, 3, 0.95)], 0)
    tier.resident.add(ExpertKey(0, 0))
    pol.on_insert(ExpertKey(0, 0))
    tier.pinned.add(ExpertKey(0, 0))
    starts = sched.decide(tier)
    assert [s.key for s in starts] == [ExpertKey(1, 1), ExpertKey(1, 2)]  # 2 free slots
    tier.apply(starts, pol)
    # A demand short of slots may take the slot of a queued prefetch, lowest class/score first.
    assert sched.cancel_candidates(tier) == [ExpertKey(1, 2), ExpertKey(1, 1)]
    sched.on_demand(ExpertKey(1, 1))  # a demand joins the load of L1E1: no longer cancellable
    assert sched.cancel_candidates(tier) == [ExpertKey(1, 2)]
    tier.loading.discard(ExpertKey(1, 2))
    sched.on_dropped(ExpertKey(1, 2))  # dropped, never awaited
    assert sched.cancelled == 1 and ExpertKey(1, 2) not in sched.queued()
    # A demanded key is never started as a prefetch nor displaced.
    sched.on_demand(ExpertKey(2, 3))
    assert all(s.key != ExpertKey(2, 3) for s in sched.decide(tier))


def test_cancel_order_eamc_before_layer_ahead():
    sig, pol, sched, tier = setup(capacity=10)
    sig.begin_request("r")
    for t in range(3):
        for layer in range(L):
            sig.observe(layer, [0, 1], t)
    sig.observe(0, [0, 1], 3)
    sig.set_layer_ahead(1, [5], [0.99], 3)
    starts = sched.decide(tier)
    tier.apply(starts, pol)
    order = sched.cancel_candidates(tier)
    assert order[-1] == ExpertKey(1, 5)  # the layer-ahead load is cancelled last
    assert sched.queued()[order[0]][0] == PrefetchClass.EAMC


def test_stale_hint_never_displaces_a_needed_expert():
    sig, pol, sched, tier = setup(policy="moe-infinity", capacity=4)
    sig.observe(0, [0], 0)
    sig.set_hints([(3, 7, 1.0), (1, 7, 1.0)], 0)
    # Much later: those hints are stale. Layer 2 routes to L2E1, L2E2 (the policy's lowest keep
    # values: (0 + eps) * (1 - 2/4)).
    sig.observe(2, [1, 2], 100)
    needed = [ExpertKey(2, 1), ExpertKey(2, 2)]
    fill(tier, pol, [*needed, ExpertKey(1, 1), ExpertKey(0, 1)])
    assert not sig.hints.any()
    assert sched.decide(tier) == []
    # A fresh hint may displace an unneeded expert but never the experts routed now, even when
    # the tier would allow it and the policy ranks them lowest.
    sig.set_hints([(3, 7, 1.0)], 100)
    assert pol.choose_victims(1, tier.evictable)[0] in needed
    starts = sched.decide(tier)
    assert [s.key for s in starts] == [ExpertKey(3, 7)]
    assert starts[0].victim == ExpertKey(1, 1)


def test_never_displaces_a_higher_scored_layer_ahead_prediction_or_pinned():
    sig, pol, sched, tier = setup(capacity=2)
    sig.observe(0, [0], 0)
    fill(tier, pol, [ExpertKey(1, 1), ExpertKey(1, 2)])
    tier.pinned.add(ExpertKey(1, 2))
    sig.set_layer_ahead(1, [1, 3], [0.9, 0.5], 0)  # L1E1 resident and predicted higher than L1E3
    assert sched.decide(tier) == []  # the only unpinned resident is the better prediction
    tier.pinned.clear()
    sig.set_layer_ahead(1, [1, 3], [0.3, 0.5], 0)  # now L1E3 scores higher than L1E1
    starts = sched.decide(tier)
    assert len(starts) == 1 and starts[0].key == ExpertKey(1, 3)
    assert starts[0].victim in (ExpertKey(1, 1), ExpertKey(1, 2))


def test_layer_ahead_for_a_passed_layer_is_ignored():
    sig, pol, sched, tier = setup()
    sig.observe(0, [0], 5)
    sig.set_layer_ahead(1, [3], [0.9], 5)
    sig.observe(1, [0], 5)
    sig.observe(2, [0], 5)  # layer 1 has passed
    assert all(s.key != ExpertKey(1, 3) for s in sched.decide(tier))


def test_speculation_must_beat_its_victim_and_policies_without_it_do_not_speculate():
    sig, pol, sched, tier = setup(capacity=2)
    sig.begin_request("r")
    for t in range(4):
        for layer in range(L):
            sig.observe(layer, [0, 1], t)
    sig.observe(0, [0, 1], 4)
    fill(tier, pol, [ExpertKey(1, 0), ExpertKey(1, 1)])  # both hot for the next layer
    assert sched.decide(tier) == []  # no candidate beats a hot resident
    # lru has no speculative strategy: only layer-ahead.
    sig2, pol2, sched2, tier2 = setup(policy="lru", capacity=8)
    for layer in range(L):
        sig2.observe(layer, [0, 1], 0)
    assert sched2.decide(tier2) == []
    sig2.set_layer_ahead(0, [4], [0.8], 1)
    assert [s.key for s in sched2.decide(tier2)] == [ExpertKey(0, 4)]


def test_policy_switch_and_errors():
    sig, pol, sched, tier = setup()
    lru = make_policy("lru")
    sched.set_policy(lru)
    assert sched.policy is lru
    with pytest.raises(ValueError, match=r"blob_bytes must be >= 1, got 0"):
        PrefetchScheduler(sig, pol, blob_bytes=0, max_inflight_bytes=1)
    with pytest.raises(ValueError, match=r"max_inflight_bytes must be >= 0, got -1"):
        PrefetchScheduler(sig, pol, blob_bytes=1, max_inflight_bytes=-1)
    with pytest.raises(ValueError, match=r"PrefetchConfig.horizon_layers must be in \[1, 65536\], got 0"):
        PrefetchConfig(horizon_layers=0)
