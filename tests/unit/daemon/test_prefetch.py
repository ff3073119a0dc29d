"""PrefetchScheduler and PrefetchQueue: (deadline, confidence) order, depths turned off by their
measured precision, pre-emption, the bytes-in-flight bound, staleness, protection."""

from __future__ import annotations

import numpy as np
import pytest

from cache_daemon.decisions.policy import PolicyShape, make_policy
from cache_daemon.decisions.scheduler import (
    PrefetchClass,
    PrefetchConfig,
    PrefetchQueue,
    PrefetchScheduler,
    PrefetchStart,
    QueuedLoad,
)
from cache_daemon.decisions.signals import ActivationSignals, LayerPrediction, SignalsConfig
from expertcache.keys import ExpertKey

L, E = 4, 8
BLOB = 10


class FakeTier:
    """A TierState over plain sets: ``capacity`` slots, some resident, some pinned, a queue."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.resident: set[ExpertKey] = set()
        self.pinned: set[ExpertKey] = set()
        self.queue = PrefetchQueue(BLOB)

    @property
    def free_slots(self) -> int:
        return self.capacity - len(self.resident) - len(self.queue)

    def is_resident(self, key):
        return key in self.resident

    def evictable(self, key):
        return key in self.resident and key not in self.pinned

    def apply(self, starts: list[PrefetchStart], policy) -> None:
        for s in starts:
            if s.victim is not None:
                assert self.evictable(s.victim)
                self.resident.discard(s.victim)
                policy.on_remove(s.victim)
            self.queue.add(QueuedLoad(s.key, s.cls, s.score, s.depth))

    def finish(self, key, policy) -> None:
        self.queue.remove(key)
        self.resident.add(key)
        policy.on_insert(key)


def setup(policy="activation-aware", capacity=8, inflight=10 * BLOB, precision=0.9, **cfg):
    sig = ActivationSignals(
        L,
        E,
        config=SignalsConfig(
            prior_weight=0.0, history_half_life_tokens=1.0, lookahead_prior_precision=precision
        ),
    )
    pol = make_policy(policy, PolicyShape(L, E), sig)
    sched = PrefetchScheduler(
        sig, pol, blob_bytes=BLOB, max_inflight_bytes=inflight, config=PrefetchConfig(**cfg)
    )
    return sig, pol, sched, FakeTier(capacity)


def ahead(sig, token, *preds):
    sig.set_lookahead(
        [
            LayerPrediction(layer, depth, np.asarray(ex), np.asarray(sc, np.float32))
            for layer, depth, ex, sc in preds
        ],
        token,
    )


def fill(tier: FakeTier, pol, keys) -> None:
    for k in keys:
        tier.resident.add(k)
        pol.on_insert(k)


def test_nearest_layer_first_then_likeliest():
    sig, pol, sched, tier = setup(horizon_layers=3)
    sig.begin_request("r")
    for t in range(3):
        for layer in range(L):
            sig.observe(layer, [0, 1], t)  # a strong habit: experts 0 and 1 everywhere
    sig.observe(0, [0, 1], 3)
    ahead(sig, 3, (3, 3, [5], [0.9]), (1, 1, [5, 6], [0.4, 0.6]))
    starts = sched.decide(tier)
    # Deadline first, whatever the class: layer 1 (1 away, lookahead), then layer 2 (2 away: the
    # history's habit, class EAMC), then layer 3 (3 away, lookahead at depth 3). A predicted
    # layer's other experts keep only 1 - precision of their estimate: experts 0 and 1 of layer
    # 1 are no candidates. Within a layer, equally likely predictions go by router score.
    assert [(s.key, s.cls, s.depth) for s in starts] == [
        (ExpertKey(1, 6), PrefetchClass.LAYER_AHEAD, 1),
        (ExpertKey(1, 5), PrefetchClass.LAYER_AHEAD, 1),
        (ExpertKey(2, 0), PrefetchClass.EAMC, 0),
        (ExpertKey(2, 1), PrefetchClass.EAMC, 0),
        (ExpertKey(3, 5), PrefetchClass.LAYER_AHEAD, 3),
    ]
    assert all(s.victim is None for s in starts)  # free slots first


def _candidates_under(bar: float) -> set[tuple[int, PrefetchClass]]:
    """The candidates under the bar ``bar`` when layer 1's lookahead guesses experts 0 and 5 with a
    precision of 0.8 (its prior) and the request's habit is experts 0 and 1 at every layer (use
    probability 0.94 at layers 2 and 3)."""
    sig, _pol, sched, _tier = setup(horizon_layers=3, precision=0.8, min_probability=bar)
    sig.begin_request("r")
    for t in range(3):
        for layer in range(L):
            sig.observe(layer, [0, 1], t)
    sig.observe(0, [0, 1], 3)
    ahead(sig, 3, (1, 1, [0, 5], [0.6, 0.4]))
    return {(c.entry, c.cls) for c in sched.candidates()}


def test_one_bar_gates_lookahead_guesses_and_speculative_prefetch_alike():
    la, eamc = PrefetchClass.LAYER_AHEAD, PrefetchClass.EAMC
    habits = {(2 * E, eamc), (2 * E + 1, eamc), (3 * E, eamc), (3 * E + 1, eamc)}
    assert _candidates_under(0.7) == {(E, la), (E + 5, la)} | habits
    # Above the guesses' precision they go, and expert 0 of layer 1 (its use probability is its
    # guess's, 0.8) does not come back as class EAMC: a bar of one class alone let it.
    assert _candidates_under(0.85) == habits
    assert _candidates_under(0.95) == set()  # above the habits' 0.94 too
    # At 0 every entry of the layers ahead, each once (layer 1's guesses in their own class).
    assert sorted(e for e, _cls in _candidates_under(0.0)) == list(range(E, L * E))


def test_a_depth_below_min_probability_is_not_prefetched():
    sig, pol, sched, tier = setup(min_probability=0.5)
    sig.observe(0, [0], 0)
    ahead(sig, 0, (2, 2, [3], [0.9]))
    assert [s.key for s in sched.decide(tier)] == [ExpertKey(2, 3)]
    # Depth 2 keeps guessing wrong: its measured precision falls, and it stops being prefetched,
    # while its predictions are still scored (it comes back if they improve).
    for t in range(1, 40):
        ahead(sig, t, (2, 2, [3], [0.9]))
        for layer in range(L):
            sig.observe(layer, [0], t)
    assert sig.precision(2) < 0.5 and not sched.depth_enabled(2)
    sig.observe(0, [0], 40)
    ahead(sig, 40, (2, 2, [4], [0.9]))
    assert all(s.cls is not PrefetchClass.LAYER_AHEAD for s in sched.decide(FakeTier(8)))
    sig2, _pol, sched2, _ = setup(max_depth=1)
    assert sched2.depth_enabled(1) and not sched2.depth_enabled(2)


def test_a_depth_whose_prefetches_go_unused_is_cut_and_tried_again_later():
    sig, pol, sched, tier = setup(min_usefulness=0.5, usefulness_half_life=16.0)
    sig.observe(0, [0], 0)
    ahead(sig, 0, (1, 1, [3], [0.9]), (2, 2, [4], [0.9]))
    assert sched.usefulness(1) == sched.usefulness(2) == 1.0  # an optimistic prior: tried first
    assert [(s.key, s.depth) for s in sched.decide(tier)] == [(ExpertKey(1, 3), 1), (ExpertKey(2, 4), 2)]
    # Depth 2's prefetches are evicted unused, depth 1's are used: depth 2 is cut, depth 1 is not.
    for _ in range(12):
        sched.record_outcome(2, used=False)
        sched.record_outcome(1, used=True)
    sched.record_outcome(0, used=False)  # class EAMC is tracked apart, as depth 0
    assert sched.usefulness(2) == pytest.approx(4 / 16) and sched.usefulness(1) == 1.0
    assert sched.usefulness(0) == pytest.approx(4 / 5)
    assert [(s.key, s.depth) for s in sched.decide(FakeTier(8))] == [(ExpertKey(1, 3), 1)]
    # The counts forget (per signal change) back towards the prior: the depth is tried again.
    for t in range(1, 12):
        for layer in range(L):
            sig.observe(layer, [0], t)
    sig.observe(0, [0], 12)
    ahead(sig, 12, (1, 1, [3], [0.9]), (2, 2, [4], [0.9]))
    assert sched.usefulness(2) > 0.5
    assert (ExpertKey(2, 4), 2) in [(s.key, s.depth) for s in sched.decide(FakeTier(8))]


def test_bytes_in_flight_bound():
    sig, pol, sched, tier = setup(inflight=3 * BLOB, eamc=False)
    sig.observe(0, [0], 0)
    ahead(sig, 0, (1, 1, [1, 2, 3, 4], [0.9, 0.8, 0.7, 0.6]))
    tier.queue.add(QueuedLoad(ExpertKey(3, 7), PrefetchClass.DEMAND))  # 10 bytes already in flight
    starts = sched.decide(tier)
    assert len(starts) == 2
    tier.apply(starts, pol)
    assert sched.decide(tier) == []  # at the bound: nothing until a load finishes
    tier.finish(starts[0].key, pol)
    third = sched.decide(tier)
    assert len(third) == 1 and third[0].key not in {s.key for s in starts}


def test_demand_preempts_prefetch_and_the_queue_orders_cancellations():
    sig, pol, sched, tier = setup(capacity=3)
    sig.observe(0, [0], 0)
    ahead(sig, 0, (1, 1, [1, 2], [0.9, 0.5]))
    sig.set_hints([(2, 3, 0.95)], 0)
    fill(tier, pol, [ExpertKey(0, 0)])
    tier.pinned.add(ExpertKey(0, 0))
    starts = sched.decide(tier)
    assert [s.key for s in starts] == [ExpertKey(1, 1), ExpertKey(1, 2)]  # 2 free slots
    tier.apply(starts, pol)
    q = tier.queue
    q.get(ExpertKey(1, 1)).score = 0.9
    q.get(ExpertKey(1, 2)).score = 0.5
    # A demand short of slots may take the slot of a queued prefetch, lowest class/score first.
    assert [ld.key for ld in q.cancel_candidates()] == [ExpertKey(1, 2), ExpertKey(1, 1)]
    assert q.promote(ExpertKey(1, 1)) is not None  # a demand joins L1E1: no longer cancellable
    assert q.promote(ExpertKey(1, 1)) is None and q.prefetching() == 1
    assert [ld.key for ld in q.cancel_candidates()] == [ExpertKey(1, 2)]
    assert q.cancel_candidates(keep={ExpertKey(1, 2)}) == []
    q.remove(ExpertKey(1, 2))  # dropped, never awaited
    assert q.inflight_bytes == BLOB
    # A demanded key is never started as a prefetch nor displaced.
    sched.on_demand(ExpertKey(2, 3))
    assert all(s.key != ExpertKey(2, 3) for s in sched.decide(tier))
    with pytest.raises(ValueError, match="L1E1 is already loading"):
        q.add(QueuedLoad(ExpertKey(1, 1), PrefetchClass.EAMC))


def test_cancel_order_eamc_before_layer_ahead_deep_before_near_unstarted_first():
    q = PrefetchQueue(BLOB)
    near = q.add(QueuedLoad(ExpertKey(1, 1), PrefetchClass.LAYER_AHEAD, 0.9, 1))
    deep = q.add(QueuedLoad(ExpertKey(3, 1), PrefetchClass.LAYER_AHEAD, 0.9, 3))
    eamc = q.add(QueuedLoad(ExpertKey(2, 1), PrefetchClass.EAMC, 0.99))
    started = q.add(QueuedLoad(ExpertKey(2, 2), PrefetchClass.EAMC, 0.1, started=True))
    q.add(QueuedLoad(ExpertKey(0, 0), PrefetchClass.DEMAND))
    assert q.cancel_candidates() == [eamc, deep, near, started]
    assert eamc.prefetch is PrefetchClass.EAMC and q.get(ExpertKey(0, 0)).prefetch is None


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


def test_never_displaces_an_expert_predicted_sooner_or_pinned():
    sig, pol, sched, tier = setup(capacity=2, eamc=False)
    sig.observe(0, [0], 0)
    fill(tier, pol, [ExpertKey(1, 1), ExpertKey(2, 2)])
    tier.pinned.add(ExpertKey(2, 2))
    # L1E1 resident and predicted for the next layer; L3E3 is predicted two layers later.
    ahead(sig, 0, (1, 1, [1], [0.9]), (3, 3, [3], [0.9]))
    assert sched.decide(tier) == []  # the only unpinned resident is needed sooner
    tier.pinned.clear()
    starts = sched.decide(tier)  # L2E2 is predicted nowhere: it may go for L3E3
    assert [(s.key, s.victim) for s in starts] == [(ExpertKey(3, 3), ExpertKey(2, 2))]


def test_lookahead_for_a_passed_layer_is_ignored():
    sig, pol, sched, tier = setup()
    sig.observe(0, [0], 5)
    ahead(sig, 5, (1, 1, [3], [0.9]))
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
    # lru has no speculative strategy: only lookahead.
    sig2, pol2, sched2, tier2 = setup(policy="lru", capacity=8)
    for layer in range(L):
        sig2.observe(layer, [0, 1], 0)
    assert sched2.decide(tier2) == []
    ahead(sig2, 1, (0, 1, [4], [0.8]))
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
    with pytest.raises(ValueError, match=r"PrefetchConfig.min_probability must be in \[0.0, 1.0\], got 2"):
        PrefetchConfig(min_probability=2)
    with pytest.raises(ValueError, match=r"PrefetchConfig.min_usefulness must be in \[0.0, 1.0\], got -0.1"):
        PrefetchConfig(min_usefulness=-0.1)
    with pytest.raises(ValueError, match=r"PrefetchConfig.usefulness_half_life must be in \[1.0, "):
        PrefetchConfig(usefulness_half_life=0.5)
    with pytest.raises(ValueError, match=r"blob_bytes must be >= 1, got 0"):
        PrefetchQueue(0)
