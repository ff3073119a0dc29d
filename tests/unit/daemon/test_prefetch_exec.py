"""The daemon executing prefetches: a real store, a real shm arena, the real native reader and
slot table, the real scheduler and policies, the Residency's own prefetch worker.

Invariants checked: a pinned (or needed) expert is never evicted or overwritten by prefetch; a
demand pre-empts prefetch (joins and promotes a queued prefetch of its key; cancels queued
prefetches when short of slots); a stale hint never displaces a needed expert; a policy switch
at runtime loses nothing; compute's prediction messages reach the signals.
"""

from __future__ import annotations

import functools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from cache_daemon.decisions.policy import PolicyShape, make_policy
from cache_daemon.decisions.signals import ActivationSignals, LayerPrediction, SignalsConfig
from cache_daemon.errors import ChecksumMismatch
from cache_daemon.hints import Hint, HintBatch, HintBoard
from cache_daemon.metrics import DaemonMetrics
from cache_daemon.residency import Residency, table_entries
from cache_daemon.tiers import HostTier, StoreReader, Tier
from cache_daemon.tiers.device import MemfdArena
from cache_daemon.tiers.store import Priority
from expertcache.errors import InvalidArgument
from expertcache.keys import ExpertKey
from expertcache.layers import LayerMap
from expertcache.native import SlotTable, TableState
from expertcache.prom import value
from tests import waiting
from tests.residencies import harnesses
from tests.slot_tables import compute_handle
from tests.stores import blob_of, corrupt, write_store
from tests.threads import run_in_threads

L1, L3 = 1, 3  # the synthetic store's MoE layers (6 experts each); layer 3 is 2 steps after layer 1


class Harness:
    """A prefetching Residency over a synthetic store (its prefetch worker running)."""

    def __init__(
        self,
        tmp_path: Path,
        *,
        slots: int,
        policy: str = "lru",
        max_inflight_bytes: int = 0,
        hint_ttl_tokens: int = 64,
        reader_threads: int = 4,
    ) -> None:
        tmp_path.mkdir(parents=True, exist_ok=True)
        self.root = tmp_path / "store"
        self.manifest = write_store(self.root)
        m = self.manifest
        self.metrics = DaemonMetrics()
        self.store = StoreReader(self.root, m, self.metrics, io_threads=reader_threads)
        self.arena = MemfdArena(slots, m.blob_bytes, daemon_id="prefetch")
        self.host = HostTier(0, m.blob_bytes, make_policy("lru"), self.metrics)
        self.table = SlotTable.create("expertcache-prefetch", table_entries(m), slots, 4)
        self.signals = ActivationSignals(
            m.num_layers,
            m.num_experts,
            config=SignalsConfig(hint_ttl_tokens=hint_ttl_tokens),
            layer_map=LayerMap(tuple(m.moe_layers), m.num_layers),
        )
        self.residency = Residency(
            m,
            self.arena,
            self.store,
            self.host,
            self.policy(policy),
            self.metrics,
            table=self.table,
            acquire_timeout_s=5.0,
            signals=self.signals,
            prefetch=True,
            max_inflight_bytes=max_inflight_bytes,
        )
        # Hint batches are pushed to the residency as they arrive, as in the daemon.
        self.board = HintBoard(on_batch=self.residency.intake.apply_hints)

    def policy(self, name: str):
        return make_policy(
            name, PolicyShape(self.manifest.num_layers, self.manifest.num_experts), self.signals
        )

    def state(self, layer: int, expert: int) -> TableState:
        return self.residency.describe(ExpertKey(layer, expert)).state

    def load(self, layer: int, *experts: int) -> dict[ExpertKey, int]:
        """Demand ``experts`` and release them: resident, unpinned. key -> slot."""
        s = self.residency.open_session("loader")
        got = {x.key: x.slot for x in self.residency.acquire(s, layer, list(experts))}
        self.residency.close_session(s)
        return got

    def slot_bytes(self, slot: int) -> bytes:
        return bytes(self.arena.slots[slot].numpy())

    def blob(self, key: ExpertKey) -> bytes:
        return blob_of(self.root, self.manifest, key)

    def count(self, counter, kind: str = "layer_ahead") -> int:
        return int(value(counter, kind))

    def close(self) -> None:
        self.store.resume()
        self.residency.shutdown()
        self.store.close()
        self.host.close()
        self.arena.close()


@pytest.fixture
def make(tmp_path):
    yield from harnesses(tmp_path, Harness)


wait_for = functools.partial(waiting.wait_for, poll_s=0.002)


def ahead(r: Residency, token: int, layer: int, experts, scores, depth: int = 1) -> None:
    """Compute's LayerAhead with one prediction (``depth`` MoE layers early)."""
    r.intake.layer_ahead(token, [LayerPrediction(layer, depth, experts, scores)])


def entry(h: Harness, key: ExpertKey) -> int:
    return key.layer * h.manifest.num_experts + key.expert


def test_layer_ahead_prediction_is_prefetched_and_its_use_counted(make):
    h = make(slots=4)
    r = h.residency
    r.intake.begin_request("req")
    r.intake.observe("req", 0, L1, [0, 1])
    ahead(r, 0, L3, [2, 4], [0.8, 0.6])
    wait_for(lambda: h.state(L3, 2) is TableState.RESIDENT and h.state(L3, 4) is TableState.RESIDENT)
    assert h.count(h.metrics.prefetch_started) == 2
    for e in (2, 4):  # mirrored in the shared table: compute pins it without any RPC
        key = ExpertKey(L3, e)
        info = r.describe(key)
        assert info.prefetched and info.pins == 0
        assert (h.table.state(entry(h, key)), h.table.slot(entry(h, key))) == (TableState.RESIDENT, info.slot)
        assert h.slot_bytes(info.slot) == h.blob(key)
    # A demand for a prefetched expert is a device hit and counts as a used prefetch.
    s = r.open_session("compute")
    (ready,) = r.acquire(s, L3, [2])
    assert ready.source is Tier.DEVICE
    r.release(s, [ready.key])
    assert h.count(h.metrics.prefetch_used) == 1 and not r.describe(ready.key).prefetched
    scheduler = r.scheduler  # the daemon's decisions hear every outcome
    assert scheduler.usefulness(1) == 1.0  # one used, none wasted yet
    # Evicting the other one unused counts it wasted: accuracy = used / (used + wasted) = 1/2.
    r.configure_prefetch(enabled=False, max_inflight_bytes=0)
    h.load(L1, 0, 1, 3)  # 2 free slots + 1 victim: LRU picks L3E4 (L3E2 was used since)
    assert h.state(L3, 4) is TableState.ABSENT and h.state(L3, 2) is TableState.RESIDENT
    assert h.count(h.metrics.prefetch_wasted) == 1
    assert scheduler.usefulness(1) == pytest.approx((1 + 4) / (2 + 4))  # the scheduler heard both
    assert value(h.metrics.signals, "route") == 1 and value(h.metrics.signals, "layer_ahead") == 1


def test_pinned_experts_are_never_evicted_by_prefetch(make):
    h = make(slots=2)
    r = h.residency
    a = r.open_session("a")
    (held,) = r.acquire(a, L1, [0])  # a Demand pin
    shm_key, shm_slot = next(iter(h.load(L1, 1).items()))
    compute = compute_handle(h.table, r.claim_client().index)
    assert compute.try_pin_many([entry(h, shm_key)]) == [shm_slot]  # a compute shm pin
    before = {held.slot: h.slot_bytes(held.slot), shm_slot: h.slot_bytes(shm_slot)}

    r.intake.observe("req", 5, L1, [2])  # the pinned ones are no longer even needed now
    ahead(r, 5, L3, [0, 1, 2], [0.9, 0.9, 0.9])
    assert r.run_prefetch() == 0
    assert h.count(h.metrics.prefetch_started) == 0
    for slot, data in before.items():
        assert h.slot_bytes(slot) == data
    assert r.slot_owner(held.slot) == held.key and r.slot_owner(shm_slot) == shm_key

    # The shm pin goes: that slot may now be displaced, the Demand-pinned one still never.
    compute.unpin_many([entry(h, shm_key)])
    r.run_prefetch()
    wait_for(lambda: h.state(L3, 0) is TableState.RESIDENT)
    assert h.state(L1, 1) is TableState.ABSENT
    assert r.slot_owner(held.slot) == held.key and h.slot_bytes(held.slot) == before[held.slot]
    assert r.describe(held.key).pins == 1
    assert h.count(h.metrics.prefetch_wasted) == 0  # L1E1 was demanded, not prefetched
    r.close_session(a)


def test_demand_joins_a_queued_prefetch_and_promotes_it_to_demand_priority(make):
    h = make(slots=4, reader_threads=1)
    r = h.residency
    h.store.pause()  # reads stay queued in the native reader until resumed
    r.intake.observe("req", 0, L1, [0])
    ahead(r, 0, L3, [4, 5], [0.9, 0.8])
    wait_for(lambda: h.store.reader_stats()["queued"] == 2)
    for e in (4, 5):
        info = r.describe(ExpertKey(L3, e))
        assert info.state is TableState.LOADING and info.load_priority is Priority.LAYER_AHEAD
    s = r.open_session("compute")
    waiter = ThreadPoolExecutor(1).submit(lambda: list(r.acquire(s, L3, [5])))
    wait_for(lambda: h.count(h.metrics.prefetch_promoted) == 1)
    assert r.describe(ExpertKey(L3, 5)).load_priority is Priority.DEMAND
    assert r.describe(ExpertKey(L3, 4)).load_priority is Priority.LAYER_AHEAD
    h.store.resume()
    (ready,) = waiter.result(5)
    assert ready.key == ExpertKey(L3, 5) and ready.source is Tier.STORE
    assert h.slot_bytes(ready.slot) == h.blob(ready.key)
    wait_for(lambda: h.state(L3, 4) is TableState.RESIDENT)
    # One read per key: the demand joined the prefetch's read rather than starting another.
    assert h.store.reader_stats()["completed"] == 2
    assert h.count(h.metrics.prefetch_used) == 1
    r.close_session(s)


def test_a_prefetch_read_reaches_the_reader_from_the_thread_that_decided_it(make):
    """No hop to an I/O thread before the disk starts: while the residency's lock is held (no I/O
    thread can take a load then), the decision's reads are already in the native reader's queue."""
    h = make(slots=4)
    r = h.residency
    h.store.pause()
    with r._cond:  # the residency's lock: every I/O thread's step takes it
        r.intake.observe("req", 0, L1, [0])
        ahead(r, 0, L3, [4, 5], [0.9, 0.8])
        r.run_prefetch()
        assert h.count(h.metrics.prefetch_started) == 2
        assert h.store.reader_stats()["submitted"] == 2
        assert {r.describe(ExpertKey(L3, e)).load_priority for e in (4, 5)} == {Priority.LAYER_AHEAD}
    h.store.resume()
    wait_for(lambda: h.state(L3, 4) is TableState.RESIDENT and h.state(L3, 5) is TableState.RESIDENT)
    for e in (4, 5):
        key = ExpertKey(L3, e)
        assert h.slot_bytes(r.describe(key).slot) == h.blob(key)
    assert h.store.reader_stats()["completed"] == 2


def test_a_prefetch_whose_read_cannot_be_submitted_frees_its_slot(make):
    h = make(slots=4)
    r = h.residency
    h.store.close()  # the reader refuses every read from now on
    r.intake.observe("req", 0, L1, [0])
    ahead(r, 0, L3, [4], [0.9])  # the worker decides it
    wait_for(lambda: h.count(h.metrics.prefetch_started) == 1)
    wait_for(lambda: h.state(L3, 4) is TableState.ABSENT)
    assert h.table.state(entry(h, ExpertKey(L3, 4))) == TableState.ABSENT
    assert r.slots.free == 4  # nothing left LOADING: the slot is free again
    time.sleep(0.2)
    assert h.count(h.metrics.prefetch_started) == 1  # not started again and again while it fails
    ahead(r, 0, L3, [4], [0.9])  # the next change of the signals tries it again, once
    wait_for(lambda: h.count(h.metrics.prefetch_started) == 2)
    time.sleep(0.2)
    assert h.count(h.metrics.prefetch_started) == 2 and r.slots.free == 4


def test_store_reads_into_their_slots_are_published_by_the_worker_without_io_threads(make):
    """A load read from the store straight into its slot needs no I/O thread: with both pools shut
    down, a prefetch and a demand still land, published by the worker thread when their reads
    complete, and a read that fails its checksum fails its load and frees its slot."""
    h = make(slots=4)
    r = h.residency
    r._loads._loader._prefetch_pool.shutdown(wait=True)
    r._loads._loader._pool.shutdown(wait=True)
    r.intake.observe("req", 0, L1, [0])
    ahead(r, 0, L3, [4], [0.9])
    wait_for(lambda: h.state(L3, 4) is TableState.RESIDENT, "the prefetch published")
    assert h.slot_bytes(r.describe(ExpertKey(L3, 4)).slot) == h.blob(ExpertKey(L3, 4))
    s = r.open_session("compute")
    (ready,) = list(r.acquire(s, L1, [2]))
    assert h.slot_bytes(ready.slot) == h.blob(ExpertKey(L1, 2))
    r.release(s, [ExpertKey(L1, 2)])
    corrupt(h.root, h.manifest, ExpertKey(L1, 3))
    with pytest.raises(ChecksumMismatch, match=f"expert {ExpertKey(L1, 3)}"):
        list(r.acquire(s, L1, [3]))
    assert h.state(L1, 3) is TableState.ABSENT and r.stats().loading == 0
    assert value(h.metrics.checksum_failures) == 1


def count_decisions(r: Residency) -> list[int]:
    """Counts the scheduler's decide calls from now on (a one-element list)."""
    calls, decide = [0], r.scheduler.decide

    def counted(state):
        calls[0] += 1
        return decide(state)

    r.scheduler.decide = counted
    return calls


def test_a_landed_load_decides_again_only_when_the_last_decision_lacked_room(make):
    """A load landing frees room in flight and changes no candidate: after a decision that went
    through all its candidates the worker does not decide again for it; after one cut short by
    the room in flight (one blob here), it does, and starts the next candidate."""
    h = make(slots=4)
    r = h.residency
    r.configure_prefetch(enabled=True, max_inflight_bytes=h.manifest.blob_bytes)  # one load in flight
    prefetcher = r._prefetcher

    def idle() -> bool:  # the worker sleeps with nothing to decide
        return prefetcher._sleeping and not prefetcher._dirty

    r.intake.observe("req", 0, L1, [0])
    wait_for(idle)  # its decision taken
    calls = count_decisions(r)
    ahead(r, 0, L3, [2, 4], [0.8, 0.6])
    wait_for(lambda: h.state(L3, 2) is TableState.RESIDENT and h.state(L3, 4) is TableState.RESIDENT)
    wait_for(idle)
    time.sleep(0.1)
    # the signal's decision (room for L3E2 only), the landing of L3E2's (starts L3E4); L3E4's
    # landing finds the last decision settled: no third
    assert calls[0] == 2
    assert h.count(h.metrics.prefetch_started) == 2


def test_demand_short_of_slots_cancels_queued_prefetches(make):
    h = make(slots=2)
    r = h.residency
    h.store.pause()
    r.intake.observe("req", 0, L1, [0])
    ahead(r, 0, L3, [0, 1], [0.9, 0.5])
    wait_for(lambda: h.state(L3, 0) is TableState.LOADING and h.state(L3, 1) is TableState.LOADING)
    # A load is LOADING before its pool thread hands the read to the reader: wait until both reads
    # sit queued in the paused reader, the state this test is about (on a busy machine the demand
    # could otherwise drop a prefetch whose read was never submitted, and no read is cut short).
    wait_for(lambda: h.store.reader_stats()["queued"] == 2, "both prefetch reads queued in the paused reader")
    s = r.open_session("compute")
    waiter = ThreadPoolExecutor(1).submit(lambda: list(r.acquire(s, L1, [2])))
    # Both slots hold prefetch loads nobody pins: the demand cancels one (the lowest score) and
    # takes its slot without waiting for its read; the other prefetch goes on.
    wait_for(lambda: h.count(h.metrics.prefetch_cancelled) == 1)
    wait_for(lambda: h.state(L1, 2) is TableState.LOADING)
    assert h.state(L3, 1) is TableState.ABSENT and h.state(L3, 0) is TableState.LOADING
    h.store.resume()
    (ready,) = waiter.result(5)
    assert ready.key == ExpertKey(L1, 2) and h.slot_bytes(ready.slot) == h.blob(ready.key)
    wait_for(lambda: h.state(L3, 0) is TableState.RESIDENT)
    assert h.store.reader_stats()["cancelled"] == 1
    assert r.describe(ExpertKey(L3, 1)).generation == 0  # its read was cut short: no load completed
    assert h.table.state(entry(h, ExpertKey(L3, 1))) == TableState.ABSENT
    r.close_session(s)


def test_a_demand_waiting_for_slots_is_never_overtaken_by_prefetch(make):
    h = make(slots=2)
    r = h.residency
    a = r.open_session("a")
    pinned = list(r.acquire(a, L1, [0, 1]))  # every slot pinned
    b = r.open_session("b")
    waiter = ThreadPoolExecutor(1).submit(lambda: list(r.acquire(b, L1, [2])))
    wait_for(lambda: r.stats().demands_waiting == 1)  # b waits for a slot
    r.intake.observe("req", 0, L1, [0, 1])
    ahead(r, 0, L3, [3], [0.99])
    r.release(a, [pinned[0].key])  # one slot comes free: it must go to b, not to the prefetch
    (ready,) = waiter.result(5)
    assert ready.slot == pinned[0].slot
    assert h.count(h.metrics.prefetch_started) == 0
    r.close_session(a)
    r.close_session(b)


def test_a_stale_hint_never_displaces_a_needed_expert(make):
    h = make(slots=3, policy="moe-infinity", hint_ttl_tokens=2)
    r = h.residency
    layer3 = h.manifest.moe_layers.index(L3)  # hints name MoE layer indices
    r.intake.begin_request("req")
    r.intake.observe("req", 0, L1, [0, 1])
    needed = h.load(L1, 0, 1)  # resident, unpinned, routed at the current position
    h.board.apply(HintBatch("req", tuple(Hint(layer3, e, 1.0) for e in range(6))))  # wakes the worker
    # A fresh hint fills the free slot, and displaces nothing needed.
    wait_for(lambda: h.count(h.metrics.prefetch_started, "eamc") == 1)
    wait_for(lambda: r.stats().loading == 0)
    assert all(h.state(k.layer, k.expert) is TableState.RESIDENT for k in needed)
    assert r.run_prefetch() == 0
    # Tokens pass: the hints go stale (older than hint_ttl_tokens) and are never acted on.
    for token in (1, 2, 3, 4):
        r.intake.observe("req", token, L1, [0, 1])
    assert r.run_prefetch() == 0
    assert h.count(h.metrics.prefetch_started, "eamc") == 1
    for key, slot in needed.items():
        assert r.slot_owner(slot) == key and h.slot_bytes(slot) == h.blob(key)


def test_policy_switch_at_runtime_keeps_residents_pins_and_hits(make):
    h = make(slots=4)
    r = h.residency
    a = r.open_session("a")
    held = list(r.acquire(a, L1, [0, 1]))
    loaded = h.load(L3, 2, 3)
    residents = {(k, r.describe(k).slot) for k in [x.key for x in held] + list(loaded)}
    r.set_policy(h.policy("activation-aware"))
    assert r.policy.name == "activation-aware" and len(r.policy) == 4
    assert {(k, r.describe(k).slot) for k, _ in residents} == residents
    assert all(r.describe(x.key).pins == 1 for x in held)
    s = r.open_session("b")
    hits = list(r.acquire(s, L3, [2, 3]))
    assert {x.source for x in hits} == {Tier.DEVICE}
    r.close_session(s)
    with pytest.raises(ValueError, match="reads other ActivationSignals"):
        r.set_policy(
            make_policy("moe-infinity", PolicyShape(h.manifest.num_layers, 6), ActivationSignals(4, 6))
        )
    r.close_session(a)


def test_the_channels_arrays_are_checked_as_lists_are(make):
    """The shared-memory channel's records carry int64 / float32 arrays (read without numpy calls
    per expert): checked as the Demand stream's lists are, to the same values and messages."""
    intake = make(slots=2).residency.intake
    for experts in ([4, 2, 4], np.array([4, 2, 4], np.int64), np.array([4, 2, 4], np.uint8)):
        got = intake.check_route("r1", 7, L1, experts)
        assert (got.experts.dtype, got.experts.tolist()) == (np.int64, [2, 4])
        # The first expert out of range in the record's order is the one named.
        bad = type(experts)([3, 7, 9]) if isinstance(experts, list) else np.array([3, 7, 9], experts.dtype)
        with pytest.raises(
            InvalidArgument, match=r"Route for layer 1 names expert 7; the store has experts 0..5$"
        ):
            intake.check_route("r1", 7, L1, bad)
    with pytest.raises(InvalidArgument, match=r"names expert -1; "):
        intake.check_route("r1", 7, L1, np.array([2, -1, 9], np.int64))
    for experts, scores in (
        ([5, 0], [0.5, 1.5]),
        (np.array([5, 0], np.int64), np.array([0.5, 1.5], np.float32)),
    ):
        [pred] = intake.check_layer_ahead(7, [LayerPrediction(L3, 1, experts, scores)]).predictions
        assert (pred.experts.dtype, pred.experts.tolist(), pred.scores.dtype, pred.scores.tolist()) == (
            np.int64,
            [5, 0],  # in the prediction's order
            np.float32,
            [0.5, 1.0],
        )
        twice = np.array([5, 5], np.int64) if isinstance(experts, np.ndarray) else [5, 5]
        with pytest.raises(InvalidArgument, match=r"for layer 3 names an expert twice: \[5, 5\]"):
            intake.check_layer_ahead(7, [LayerPrediction(L3, 1, twice, scores)])
    # A float array is read as the lists are (each value through int()).
    assert intake.check_route("r1", 7, L1, np.array([3.0, 1.0])).experts.tolist() == [1, 3]


def test_prediction_messages_reach_the_signals_and_bad_ones_name_the_value(make):
    h = make(slots=2)
    r = h.residency
    r.configure_prefetch(enabled=False, max_inflight_bytes=0)
    r.intake.begin_request("r1")
    assert h.signals.request_id == "r1"
    r.intake.observe("r1", 7, L1, [4, 2, 4])  # duplicates (several tokens of a prefill) are merged
    assert h.signals.position == (7, L1)
    assert sorted(h.signals.needed.tolist()) == [entry(h, ExpertKey(L1, 2)), entry(h, ExpertKey(L1, 4))]
    ahead(r, 7, L3, [5], [0.75])
    [(layer, depth, entries, scores)] = h.signals.lookahead()
    assert (entries.tolist(), scores.tolist(), layer, depth) == ([entry(h, ExpertKey(L3, 5))], [0.75], L3, 1)
    r.intake.observe("r2", 0, L3, [1])  # a Route of another request: its RequestBegin was lost
    assert h.signals.request_id == "r2"
    r.intake.end_request("r2")
    assert h.signals.request_id is None
    with pytest.raises(InvalidArgument, match=r"Route names layer 2, which is not a MoE layer .*\[1, 3\]"):
        r.intake.observe("r2", 1, 2, [0])
    with pytest.raises(
        InvalidArgument,
        match=r"LayerAhead prediction at depth 1 for layer 3 names expert 6; the store has experts 0..5",
    ):
        ahead(r, 1, L3, [6], [0.5])
    with pytest.raises(
        InvalidArgument, match=r"LayerAhead prediction at depth 1 for layer 3 has 2 experts but 1 scores"
    ):
        ahead(r, 1, L3, [0, 1], [0.5])
    with pytest.raises(InvalidArgument, match=r"scores must be finite probabilities, got \[nan\]"):
        ahead(r, 1, L3, [0], [float("nan")])
    ahead(r, 8, L3, [0, 1], [1.0000001, -0.25])  # rounding / bias-corrected scores: clamped
    assert h.signals.lookahead()[0][3].tolist() == [1.0, 0.0]
    with pytest.raises(InvalidArgument, match=r"for layer 3 names an expert twice: \[0, 0\]"):
        ahead(r, 1, L3, [0, 0], [0.5, 0.5])
    with pytest.raises(
        InvalidArgument, match=r"LayerAhead depth 3 is outside 1..2 \(the store's MoE layers\)"
    ):
        ahead(r, 1, L3, [0], [0.5], depth=3)
    with pytest.raises(InvalidArgument, match=r"LayerAhead names depth 1 twice"):
        r.intake.layer_ahead(1, [LayerPrediction(L3, 1, [0], [0.5]), LayerPrediction(L1, 1, [0], [0.5])])


def test_concurrent_demands_and_prefetches_keep_the_invariants(make):
    """Random streams demand while predictions keep the prefetcher busy: every served slot holds
    its blob, nothing pinned is overwritten, and everything settles unpinned."""
    import random

    h = make(slots=4, policy="activation-aware")
    r = h.residency
    errors: list[BaseException] = []
    stop = threading.Event()

    def predictor() -> None:
        rng = random.Random(1)
        token = 0
        # Each layer's next routing is drawn a step early and predicted right, so the measured
        # precision stays high and the prefetcher keeps starting loads (random guesses would be
        # cut by their precision, and prefetch would stop).
        planned = {L1: rng.sample(range(6), 2), L3: rng.sample(range(6), 2)}
        while not stop.is_set():
            token += 1
            for layer in (L1, L3):
                r.intake.observe("req", token, layer, planned[layer])
                planned[layer] = rng.sample(range(6), 2)
                nxt = L3 if layer == L1 else L1
                ahead(r, token if layer == L1 else token + 1, nxt, planned[nxt], [0.9, 0.5])
            time.sleep(0.001)

    def stream(seed: int) -> None:
        rng = random.Random(seed)
        s = r.open_session(f"s{seed}")
        try:
            for _ in range(40):
                layer = rng.choice((L1, L3))
                got = list(r.acquire(s, layer, rng.sample(range(6), 2)))
                for x in got:
                    assert h.slot_bytes(x.slot) == h.blob(x.key), x
                    assert r.slot_owner(x.slot) == x.key
                r.release(s, [x.key for x in got])
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
        finally:
            r.close_session(s)

    feeder = threading.Thread(target=predictor)
    feeder.start()
    run_in_threads(stream, range(2), timeout_s=30)
    stop.set()
    feeder.join(5)
    assert not errors, errors
    wait_for(lambda: r.stats().loading == 0)
    stats = r.stats()
    assert stats.pinned == 0 and stats.inflight_bytes == 0
    assert h.count(h.metrics.prefetch_started) > 0
