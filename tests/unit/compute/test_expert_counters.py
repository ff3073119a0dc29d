"""What a decode step's native layers count (``ExpertRuntime.count_resident``): hits, and the
experts a span waited for in flight or demanded itself, which are misses, with their waits as stall
time."""

from __future__ import annotations

import pytest
import torch

from compute_svc.experts.arena import Arena
from compute_svc.experts.moe import ExpertRuntime
from expertcache.protocol import Tier
from tests.providers import LocalProvider


def test_a_span_counts_the_experts_it_waited_for_in_flight_as_misses_and_their_waits_as_stall(tiny_store):
    tiny = tiny_store("mixtral")
    manifest = tiny.manifest
    arena = Arena(torch.zeros(manifest.num_blobs, manifest.blob_bytes, dtype=torch.uint8))
    runtime = ExpertRuntime(LocalProvider(tiny.store, manifest, arena), arena, manifest.tensors)
    counters = runtime.counters
    runtime.count_resident(2, 6)  # every expert resident when its layer came
    assert (counters.layers, counters.hits, counters.misses, counters.stall_s) == (2, 6, 0, 0.0)
    assert counters.by_tier == {Tier.DEVICE: 6} and counters.acquire_waits == [0.0, 0.0]
    # 3 layers, 10 experts: 2 of them in flight, waited for in one layer (4 ms); and a wait in vain
    # of 2 ms at the layer the span stopped at (its acquire counts that layer).
    runtime.count_resident(3, 10, waited=2, waits=[0.004], lost_s=0.002)
    assert (counters.layers, counters.hits, counters.misses) == (5, 14, 2)
    assert counters.by_tier == {Tier.DEVICE: 14, Tier.UNKNOWN: 2}
    assert counters.acquire_waits == [0.0, 0.0, 0.0, 0.0, 0.004]
    assert counters.stall_s == pytest.approx(0.006)
    assert runtime.host_transfers == counters.host_transfers == 5
    # 2 layers, 8 experts: 3 demanded by the span itself (2 read from the store, 1 from the host
    # tier), in two layers that waited 3 and 5 ms for them: misses of their tiers, the waits stall.
    runtime.count_resident(2, 8, demanded=[Tier.STORE, Tier.HOST, Tier.STORE], waits=[0.003, 0.005])
    assert (counters.layers, counters.hits, counters.misses) == (7, 19, 5)
    assert counters.by_tier == {Tier.DEVICE: 19, Tier.UNKNOWN: 2, Tier.STORE: 2, Tier.HOST: 1}
    assert counters.acquire_waits[-2:] == [0.003, 0.005] and len(counters.acquire_waits) == 7
    assert counters.stall_s == pytest.approx(0.014)
