"""The replay's clock: a load is usable no sooner than ``read_latency_s`` after its start (loads
in flight together overlap that latency; the link's rate still moves their bytes one after the
other) and holds its room in flight until then, and a prefetch decision runs ``decision_lag_s``
after the change that asked for it, on the state at its time, where a demand starts at once.
Hand-sized runs whose times are worked out in the comments."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from cache_daemon.decisions.scheduler import PrefetchConfig
from replay.simulator import Simulation, TimingModel

MS = 1e-3
BLOB = 1000


def timing(**kw) -> TimingModel:
    """A link moving one blob a millisecond; compute free unless given."""
    base = TimingModel(
        expert_bytes=BLOB,
        link_bytes_per_s=BLOB / MS,
        chunk_bytes=BLOB,
        attention_s=0.0,
        expert_s=0.0,
        layer_overhead_s=0.0,
        token_overhead_s=0.0,
        top_k=2,
        num_layers=2,
        name="test",
    )
    return replace(base, **kw)


def run(t: TimingModel, routes, *, lookahead=None, prefetch=True) -> tuple[float, Simulation]:
    routes = np.asarray(routes, np.int64)
    sim = Simulation(
        routes,
        np.full(routes.shape, 0.5, np.float32),
        np.array([0, len(routes)]),
        4,
        t,
        "activation-aware" if lookahead else "lru",
        1.0,  # every entry fits: only the clock is under test
        lookahead_accuracy=lookahead,
        max_inflight_bytes=8 * BLOB,
        prefetch_config=None if prefetch else PrefetchConfig(layer_ahead=False, eamc=False),
    )
    stats = sim.run()
    return stats.time_s / stats.tokens, sim


def test_a_layers_misses_overlap_their_read_latency_and_share_the_links_rate():
    routes = [[[0, 1], [2, 3]]]  # one token: two cold misses in each of two layers
    # The rate alone: each layer waits for two blobs one after the other, 2 ms.
    alone, _ = run(timing(), routes)
    assert alone == pytest.approx(4 * MS)
    # A 5 ms read latency: both of a layer's reads are usable 5 ms after they start, not 10.
    slow, _ = run(timing(read_latency_s=5 * MS), routes)
    assert slow == pytest.approx(10 * MS)
    # A latency shorter than the two transfers: the link's rate decides again.
    short, _ = run(timing(read_latency_s=1.5 * MS), routes)
    assert short == pytest.approx(4 * MS)


def test_a_lagged_decision_decides_on_the_state_at_its_time_and_a_demand_starts_at_once():
    routes = [[[0, 1], [2, 3]]]
    # Each layer's attention takes 10 ms; reads 1 ms of latency on a link this fast.
    t = timing(attention_s=10 * MS, link_bytes_per_s=BLOB / (0.01 * MS), read_latency_s=1 * MS)
    # Layer 0 at 10 ms: its demands are usable at 11; its lookahead for layer 1 (exact) is
    # prefetched at once and usable at 11 too, long before layer 1 starts at 21: no wait there.
    on_time, sim = run(t, routes, lookahead=(1.0,))
    assert sim.stats.prefetches == 2 and sim.stats.hits == 2
    assert on_time == pytest.approx(21 * MS, abs=0.05 * MS)
    # Decided 5 ms later (15 ms): started then, usable at 16, still before layer 1.
    lagged, sim = run(replace(t, decision_lag_s=5 * MS), routes, lookahead=(1.0,))
    assert sim.stats.prefetches == 2 and sim.stats.hits == 2
    assert lagged == pytest.approx(21 * MS, abs=0.05 * MS)
    # Decided 20 ms later (30 ms): layer 1 demanded its experts at 21 (usable at 22), so the
    # decision, on the state at its time, finds nothing left to prefetch.
    late, sim = run(replace(t, decision_lag_s=20 * MS), routes, lookahead=(1.0,))
    assert sim.stats.prefetches == 0 and sim.stats.hits == 0
    assert late == pytest.approx(22 * MS, abs=0.05 * MS)
    # The lag never touches a demand: without prefetch each layer waits its 1 ms latency.
    demand, _ = run(replace(t, decision_lag_s=20 * MS), routes, lookahead=(1.0,), prefetch=False)
    assert demand == pytest.approx(22 * MS, abs=0.05 * MS)


def test_a_load_holds_its_room_in_flight_until_it_is_usable():
    # Attention 1 ms a layer; loads usable 5 ms after their start, whatever the link's rate.
    routes = np.asarray([[[0, 1], [2, 3]]], np.int64)
    t = timing(attention_s=1 * MS, link_bytes_per_s=BLOB / (0.01 * MS), read_latency_s=5 * MS)

    def with_room(blobs: int) -> Simulation:
        sim = Simulation(
            routes,
            np.full(routes.shape, 0.5, np.float32),
            np.array([0, 1]),
            4,
            t,
            "activation-aware",
            1.0,
            lookahead_accuracy=(1.0,),
            max_inflight_bytes=blobs * BLOB,
        )
        sim.run()
        return sim

    # Room for four: layer 1's experts are prefetched with layer 0's demands at 1 ms, usable at
    # 6; layer 0 ends at 6, layer 1 starts at 7 and finds them: the token takes 7 ms.
    roomy = with_room(4)
    assert roomy.stats.prefetches == 2 and roomy.stats.late_prefetch_hits == 0
    assert roomy.stats.time_s == pytest.approx(7 * MS, abs=0.05 * MS)
    # Room for one: layer 0's demands hold it until they are usable at 6 (their bytes moved long
    # before), so one prefetch starts then, usable at 11, and holds the room in turn: layer 1 (at
    # 7) joins it and demands the other (usable at 12), and waits for both.
    tight = with_room(1)
    assert tight.stats.prefetches == 1 and tight.stats.late_prefetch_hits == 1
    assert tight.stats.time_s == pytest.approx(12 * MS, abs=0.05 * MS)
