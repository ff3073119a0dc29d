"""The slot table and demand logic on a real store, a real shm arena and real I/O threads.

Invariants checked throughout: a pinned expert is never evicted or overwritten; a slot is
readable only RESIDENT and pinned; every byte served equals the store's blob.
"""

from __future__ import annotations

import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

from cache_daemon.errors import (
    AcquireTimeout,
    BadAcquire,
    ChecksumMismatch,
    SessionClosed,
    ShuttingDown,
    SlotNotReadable,
)
from cache_daemon.residency import ClientLedger, Ready, Residency
from cache_daemon.tiers import Tier
from expertcache.errors import DataLoss, FailedPrecondition, InvalidArgument, ResourceExhausted
from expertcache.keys import ExpertKey
from expertcache.native import SlotTable, TableState
from expertcache.prom import value
from tests.residencies import ResidencyHarness, harnesses
from tests.slot_tables import compute_handle
from tests.stores import corrupt
from tests.threads import run_in_threads
from tests.waiting import wait_for

L1 = 1  # a MoE layer of the synthetic store (layers 1 and 3, 6 experts each)


class Harness(ResidencyHarness):
    """A Residency whose store reads ``hold_reads`` can hold."""

    def __init__(self, tmp_path: Path, *, slots: int, host_slots: int = 0):
        super().__init__(tmp_path, slots=slots, host_slots=host_slots)

    def hold_reads(self) -> SimpleNamespace:
        """Hold the store's reads (the native reader starts none) until the returned gate's
        ``set()``: loads from the store stay LOADING."""
        self.store.pause()
        return SimpleNamespace(set=self.store.resume)

    def check_served(self, session, readies: list[Ready]) -> None:
        for ready in readies:
            assert bytes(self.residency.read_slot(session, ready.key).numpy()) == self.blob(ready.key)
            assert self.residency.slot_owner(ready.slot) == ready.key


@pytest.fixture
def make(tmp_path):
    yield from harnesses(tmp_path, Harness)


def keys(*experts: int, layer: int = L1) -> list[ExpertKey]:
    return [ExpertKey(layer, e) for e in experts]


def test_misses_then_resident_first(make):
    h = make(slots=4)
    r = h.residency
    s = r.open_session("a")
    first = list(r.acquire(s, L1, [0, 1]))
    assert sorted(x.key for x in first) == keys(0, 1)
    assert {x.source for x in first} == {Tier.STORE}
    h.check_served(s, first)
    r.release(s, keys(0, 1))
    second = list(r.acquire(s, L1, [2, 1]))
    assert second[0] == Ready(ExpertKey(L1, 1), next(x.slot for x in first if x.key.expert == 1), Tier.DEVICE)
    assert second[1].key == ExpertKey(L1, 2) and second[1].source is Tier.STORE
    h.check_served(s, second)
    assert value(h.metrics.hits, "device") == 1
    assert value(h.metrics.misses, "device") == 3
    assert value(h.metrics.bytes_in, "device") == 3 * h.manifest.blob_bytes
    assert value(h.metrics.demands) == 2
    info = r.describe(ExpertKey(L1, 2))
    assert info.state is TableState.RESIDENT and info.pins == 1 and info.generation == 1
    stats = r.stats()
    assert (stats.resident, stats.loading, stats.pinned, stats.sessions) == (3, 0, 2, 1)
    r.close_session(s)
    assert r.stats().pinned == 0 and r.stats().sessions == 0


def test_pinned_expert_is_never_evicted_or_overwritten(make):
    h = make(slots=2)
    r = h.residency
    a, b = r.open_session("a"), r.open_session("b")
    (held,) = r.acquire(a, L1, [0])
    before = bytes(r.read_slot(a, held.key).numpy())
    for expert in range(1, 6):  # b streams every other expert through the one free slot
        (got,) = r.acquire(b, L1, [expert])
        assert got.slot != held.slot
        h.check_served(b, [got])
        r.release(b, [got.key])
    assert r.describe(held.key).state is TableState.RESIDENT and r.slot_owner(held.slot) == held.key
    assert bytes(r.read_slot(a, held.key).numpy()) == before == h.blob(held.key)
    assert value(h.metrics.evictions, "device") == 4
    r.release(a, [held.key])
    (got,) = r.acquire(b, L1, [1])  # now the least recently used, unpinned L1E0 may go
    r.release(b, [got.key])
    (got,) = r.acquire(b, L1, [2])
    assert r.describe(held.key).state is TableState.ABSENT


def test_slot_readable_only_resident_and_pinned(make):
    h = make(slots=2)
    r = h.residency
    a, b = r.open_session("a"), r.open_session("b")
    (ready,) = r.acquire(a, L1, [0])
    with pytest.raises(SlotNotReadable, match="L1E0 is resident and not pinned by this stream"):
        r.read_slot(b, ready.key)
    r.release(a, [ready.key])
    with pytest.raises(SlotNotReadable, match="not pinned"):
        r.read_slot(a, ready.key)
    with pytest.raises(SlotNotReadable, match="L1E5 is absent"):
        r.read_slot(a, ExpertKey(L1, 5))


def test_a_layer_larger_than_the_arena_is_processed_in_waves(make):
    # acquiring the whole layer at once is refused: see test_bad_acquire_arguments
    h = make(slots=2)
    r = h.residency
    s = r.open_session("waves")
    seen = []
    for wave in ([0, 1], [2, 3], [4, 5]):
        readies = list(r.acquire(s, L1, wave))
        h.check_served(s, readies)
        seen += [x.key for x in readies]
        r.release(s, [x.key for x in readies])
    assert sorted(seen) == keys(0, 1, 2, 3, 4, 5)
    list(r.acquire(s, L1, [0]))
    with pytest.raises(BadAcquire, match="this stream still pins 1 other experts and the arena has 2 slots"):
        list(r.acquire(s, L1, [1, 2]))  # would wait for itself: refused, not a deadlock


@pytest.mark.parametrize(
    "slots, layer, experts, error, match",
    [
        (
            4,
            2,
            [0],
            InvalidArgument,
            r"layer 2 is not a MoE layer of this synthetic model \(MoE layers: \[1, 3\]\)",
        ),
        (4, L1, [0, 6], InvalidArgument, "expert 6 is out of range for layer 1"),
        (4, L1, [3, 1, 3], BadAcquire, "names expert 3 more than once"),
        (
            2,
            L1,
            [0, 1, 2],
            BadAcquire,
            r"names 3 experts but the arena has 2 slots: acquire them in waves of at most 2",
        ),
    ],
)
def test_bad_acquire_arguments(make, slots, layer, experts, error, match):
    r = make(slots=slots).residency
    s = r.open_session("bad")
    with pytest.raises(error, match=match):
        r.acquire(s, layer, experts)
    assert r.stats().pinned == 0  # refused whole: not one of the experts named is pinned


def test_bad_releases_and_an_empty_acquire(make):
    h = make(slots=4)
    r = h.residency
    s = r.open_session("bad")
    with pytest.raises(BadAcquire, match="Release of expert L1E0, which this stream does not pin"):
        r.release(s, keys(0))
    (ready,) = r.acquire(s, L1, [0])
    with pytest.raises(BadAcquire, match="L1E0"):
        r.release(s, [ready.key, ready.key])  # one pin, two releases: nothing released
    assert r.describe(ready.key).pins == 1
    assert list(r.acquire(s, L1, [])) == []


def test_waits_for_a_slot_released_by_another_thread(make):
    h = make(slots=1)
    r = h.residency
    a, b = r.open_session("a"), r.open_session("b")
    (held,) = r.acquire(a, L1, [0])
    got: list = []

    def demand():
        start = time.monotonic()
        got.extend(r.acquire(b, L1, [1], timeout_s=5))
        got.append(time.monotonic() - start)

    thread = threading.Thread(target=demand)
    thread.start()
    time.sleep(0.3)
    assert thread.is_alive() and not got  # every slot is pinned: b waits, holding nothing
    assert r.describe(ExpertKey(L1, 1)).state is TableState.ABSENT
    r.release(a, [held.key])
    thread.join(5)
    assert got[0].key == ExpertKey(L1, 1) and got[0].slot == held.slot and got[1] >= 0.25
    h.check_served(b, got[:1])


def test_timeout_when_every_slot_stays_pinned(make):
    h = make(slots=2)
    r = h.residency
    a, b = r.open_session("a"), r.open_session("b")
    list(r.acquire(a, L1, [0, 1]))
    start = time.monotonic()
    with pytest.raises(
        AcquireTimeout, match=r"waiting for 1 free slot\(s\) for layer 1: 2 of 2 slots are pinned"
    ):
        list(r.acquire(b, L1, [0, 2], timeout_s=0.2))
    assert 0.2 <= time.monotonic() - start < 2
    assert r.describe(ExpertKey(L1, 0)).pins == 1  # b took nothing while it waited


def test_no_deadlock_between_partial_acquires(make):
    """Two streams each needing 2 of 3 slots, one resident each: admission is all or nothing."""
    h = make(slots=3)
    r = h.residency
    a, b = r.open_session("a"), r.open_session("b")
    errors: list[BaseException] = []

    def run(session, layer_experts):
        try:
            for _ in range(30):
                readies = list(r.acquire(session, L1, layer_experts, timeout_s=5))
                h.check_served(session, readies)
                r.release(session, [x.key for x in readies])
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(a, [0, 1])), threading.Thread(target=run, args=(b, [2, 3]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not errors and not any(t.is_alive() for t in threads)


def test_concurrent_demand_of_the_same_key_loads_once(make):
    h = make(slots=2)
    r = h.residency
    sessions = [r.open_session(f"s{i}") for i in range(4)]
    gate = h.hold_reads()
    results: dict[int, list] = {}
    threads = [
        threading.Thread(target=lambda i=i, s=s: results.setdefault(i, list(r.acquire(s, L1, [4]))))
        for i, s in enumerate(sessions)
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 5
    while r.describe(ExpertKey(L1, 4)).pins < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    info = r.describe(ExpertKey(L1, 4))
    assert info.state is TableState.LOADING and info.pins == 4  # all four wait on one load
    gate.set()
    for t in threads:
        t.join(5)
    assert len({results[i][0].slot for i in range(4)}) == 1
    assert all(results[i][0].source is Tier.STORE for i in range(4))
    assert value(h.metrics.hits, "store") == 1
    assert r.describe(ExpertKey(L1, 4)).generation == 1
    for s in sessions:
        h.check_served(s, results[sessions.index(s)])


def test_checksum_mismatch_frees_the_slot_and_fails_every_waiter(make):
    h = make(slots=2)
    corrupt(h.root, h.manifest, ExpertKey(L1, 3))
    r = h.residency
    a, b = r.open_session("a"), r.open_session("b")
    gate = h.hold_reads()
    failures: list[BaseException] = []

    def demand_b():
        try:
            list(r.acquire(b, L1, [3]))
        except DataLoss as exc:
            failures.append(exc)

    it = r.acquire(a, L1, [0, 3])
    thread = threading.Thread(target=demand_b)
    first = []
    reader = threading.Thread(target=lambda: first.extend(_drain(it, failures)))
    reader.start()
    deadline = time.monotonic() + 5
    while r.describe(ExpertKey(L1, 3)).pins < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    thread.start()
    while r.describe(ExpertKey(L1, 3)).pins < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    gate.set()
    reader.join(5)
    thread.join(5)
    assert len(failures) == 2
    for exc in failures:
        assert isinstance(exc, ChecksumMismatch)
        assert "checksum mismatch for expert L1E3 in experts/layer_0001.bin at offset 12288" in str(exc)
    info = r.describe(ExpertKey(L1, 3))
    assert (info.state, info.slot, info.pins) == (TableState.ABSENT, -1, 0)
    # L1E0's read may complete after L1E3's failure (the worker publishes reads as they complete,
    # in any order): nothing stays LOADING once it has.
    wait_for(lambda: r.stats().loading == 0, "L1E0's load published")
    assert value(h.metrics.checksum_failures) == 1
    # a's pins: L1E0 only if it was handed out before the failure; never the failed key.
    assert r.describe(ExpertKey(L1, 0)).pins == len(first)
    r.close_session(a)
    r.close_session(b)
    assert r.stats().pinned == 0
    # The freed slot is usable: both slots can be filled with good experts.
    c = r.open_session("c")
    h.check_served(c, list(r.acquire(c, L1, [1, 2])))


def _drain(iterator, failures):
    out = []
    try:
        for item in iterator:
            out.append(item)
    except DataLoss as exc:
        failures.append(exc)
    return out


def test_host_tier_hits(make):
    h = make(slots=1, host_slots=4)
    r = h.residency
    s = r.open_session("h")
    for expert, source in ((0, Tier.STORE), (1, Tier.STORE), (0, Tier.HOST), (0, Tier.DEVICE)):
        (ready,) = r.acquire(s, L1, [expert])
        assert ready.source is source, expert
        h.check_served(s, [ready])
        r.release(s, [ready.key])
    m = h.metrics
    assert (value(m.hits, "host"), value(m.misses, "host")) == (1, 2)
    assert value(m.hits, "store") == 2
    assert (value(m.hits, "device"), value(m.misses, "device")) == (1, 3)
    assert value(m.evictions, "device") == 2
    assert value(m.bytes_in, "host") == 2 * h.manifest.blob_bytes
    assert h.host.resident_count() == 2 and h.host.pin_count(ExpertKey(L1, 0)) == 0


def _interrupt_a_waiting_demand(make, interrupt) -> tuple[Residency, object, BaseException]:
    """With its one slot pinned by session a, session b's demand for another expert waits; the
    waiting demand's outcome once ``interrupt(residency, b)`` has run (the residency, b and it)."""
    r = make(slots=1).residency
    a, b = r.open_session("a"), r.open_session("b")
    list(r.acquire(a, L1, [0]))
    outcome: list = []

    def demand():
        try:
            outcome.extend(r.acquire(b, L1, [1], timeout_s=10))
        except BaseException as exc:  # noqa: BLE001
            outcome.append(exc)

    thread = threading.Thread(target=demand)
    thread.start()
    time.sleep(0.1)
    interrupt(r, b)
    thread.join(2)
    return r, b, outcome[0]


def test_closing_a_session_wakes_its_waiting_acquire(make):
    # e.g. the client cancelled the stream
    r, b, outcome = _interrupt_a_waiting_demand(make, lambda r, b: r.close_session(b))
    assert isinstance(outcome, SessionClosed)
    with pytest.raises(SessionClosed, match="Demand session b is closed"):
        next(r.acquire(b, L1, [1]))
    with pytest.raises(SessionClosed):
        r.release(b, [])


def test_shutdown_wakes_waiting_acquires(make):
    r, _, outcome = _interrupt_a_waiting_demand(make, lambda r, b: r.shutdown())
    assert isinstance(outcome, ShuttingDown)
    with pytest.raises(ShuttingDown):
        r.open_session("late")


def test_abandoned_acquire_drops_the_pins_it_never_handed_out(make):
    h = make(slots=3)
    r = h.residency
    s = r.open_session("s")
    list(r.acquire(s, L1, [0]))
    r.release(s, keys(0))
    it = r.acquire(s, L1, [0, 1, 2])
    first = next(it)  # the resident one
    assert first.key == ExpertKey(L1, 0) and first.source is Tier.DEVICE
    it.close()
    assert r.describe(ExpertKey(L1, 0)).pins == 1
    assert r.describe(ExpertKey(L1, 1)).pins == 0 and r.describe(ExpertKey(L1, 2)).pins == 0
    deadline = time.monotonic() + 5
    while r.stats().loading and time.monotonic() < deadline:
        time.sleep(0.01)
    assert r.stats().resident == 3  # the loads completed, unpinned and evictable


def test_random_concurrent_streams_keep_the_invariants(make):
    h = make(slots=4, host_slots=3)
    r = h.residency
    errors: list[BaseException] = []

    def stream(seed: int):
        rng = random.Random(seed)
        s = r.open_session(f"r{seed}")
        try:
            for _ in range(40):
                layer = rng.choice((1, 3))
                experts = rng.sample(range(6), rng.randint(1, 3))
                readies = list(r.acquire(s, layer, experts, timeout_s=5))
                assert sorted(x.key.expert for x in readies) == sorted(experts)
                h.check_served(s, readies)
                time.sleep(rng.random() * 0.002)
                h.check_served(s, readies)  # still intact while pinned
                r.release(s, [x.key for x in readies])
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
        finally:
            r.close_session(s)

    run_in_threads(stream, range(4), timeout_s=30)
    assert not errors, errors
    stats = r.stats()
    assert stats.pinned == 0 and stats.loading == 0 and stats.resident == 4


# -- the shared slot table: mirrored transitions, shm pins, recency, client ledgers ---------------
def entry(h: Harness, key: ExpertKey) -> int:
    return key.layer * h.manifest.num_experts + key.expert


def compute_view(h: Harness, client: int | None = None) -> SlotTable:
    """Compute's handle on the table (read-only) and a claimed ledger's region (a new claim
    unless ``client`` names one)."""
    if client is None:
        client = h.residency.claim_client().index
    return compute_handle(h.table, client)


def load(h: Harness, *experts: int) -> list[Ready]:
    s = h.residency.open_session("loader")
    got = list(h.residency.acquire(s, L1, list(experts)))
    h.residency.close_session(s)
    return got


def test_transitions_are_mirrored_in_the_shared_table(make):
    h = make(slots=2)
    r, t = h.residency, h.table
    gate = h.hold_reads()
    s = r.open_session("a")
    it = r.acquire(s, L1, [0])
    waiter = ThreadPoolExecutor(1).submit(list, it)
    deadline = time.monotonic() + 5
    while t.state(entry(h, ExpertKey(L1, 0))) != TableState.LOADING and time.monotonic() < deadline:
        time.sleep(0.001)
    assert t.state(entry(h, ExpertKey(L1, 0))) == TableState.LOADING
    gate.set()
    (ready,) = waiter.result(5)
    e0 = entry(h, ready.key)
    assert (t.state(e0), t.slot(e0), t.generation(e0)) == (TableState.RESIDENT, ready.slot, 1)
    r.close_session(s)
    load(h, 1)
    load(h, 2)  # evicts L1E0 (least recently used) through try_evict
    assert (t.state(e0), t.slot(e0)) == (TableState.ABSENT, -1)
    assert r.describe(ready.key).state is TableState.ABSENT


def test_failed_load_is_aborted_in_the_shared_table(make):
    h = make(slots=2)
    corrupt(h.root, h.manifest, ExpertKey(L1, 3))
    s = h.residency.open_session("a")
    with pytest.raises(ChecksumMismatch):
        list(h.residency.acquire(s, L1, [3]))
    e3 = entry(h, ExpertKey(L1, 3))
    assert (h.table.state(e3), h.table.slot(e3)) == (TableState.ABSENT, -1)


def test_shm_pinned_expert_is_skipped_as_victim(make):
    h = make(slots=2)
    r = h.residency
    (e0,) = load(h, 0)
    (e1,) = load(h, 1)  # L1E0 is now the least recently used
    compute = compute_view(h)
    assert compute.try_pin_many([entry(h, e0.key)]) == [e0.slot]
    assert r.describe(e0.key).pins == 1 and r.stats().pinned == 1
    (e2,) = load(h, 2)  # must evict L1E1, not the shm-pinned L1E0
    assert e2.slot == e1.slot
    assert r.describe(e0.key).state is TableState.RESIDENT and r.slot_owner(e0.slot) == e0.key
    assert r.describe(e1.key).state is TableState.ABSENT
    compute.unpin_many([entry(h, e0.key)])


def test_demand_waits_for_shm_pins_and_times_out_with_the_clear_message(make):
    h = make(slots=2)
    r = h.residency
    readies = load(h, 0, 1)
    compute = compute_view(h)
    compute.try_pin_many([entry(h, x.key) for x in readies])
    s = r.open_session("b")
    with pytest.raises(
        AcquireTimeout, match=r"waiting for 1 free slot\(s\) for layer 1: 2 of 2 slots are pinned"
    ):
        list(r.acquire(s, L1, [2], timeout_s=0.2))
    assert all(r.describe(x.key).state is TableState.RESIDENT for x in readies)
    # A waiting demand proceeds once compute drops a shm pin (no RPC tells the daemon).
    it = r.acquire(s, L1, [2], timeout_s=5)
    waiter = ThreadPoolExecutor(1).submit(list, it)
    time.sleep(0.05)
    assert not waiter.done()
    compute.unpin_many([entry(h, readies[1].key)])
    (got,) = waiter.result(5)
    assert got.slot == readies[1].slot
    assert r.describe(readies[0].key).state is TableState.RESIDENT
    h.check_served(s, [got])


def test_shm_hits_keep_lru_order_and_count_as_device_hits(make):
    h = make(slots=3)
    r = h.residency
    e0, e1, e2 = (load(h, x)[0] for x in (0, 1, 2))
    compute = compute_view(h)
    for x in (e0, e1):  # hits without any RPC: L1E2 becomes the least recently used
        compute.try_pin_many([entry(h, x.key)])
        compute.unpin_many([entry(h, x.key)])
    assert r.stats().shm_hits == 2
    demands = value(h.metrics.demands)
    (e3,) = load(h, 3)
    assert e3.slot == e2.slot and r.describe(e2.key).state is TableState.ABSENT
    (e4,) = load(h, 4)
    assert e4.slot == e0.slot  # then L1E0, whose shm hit was older than L1E1's
    assert value(h.metrics.demands) == demands + 2


def test_closing_a_session_reclaims_its_client_ledger(make):
    h = make(slots=2)
    r = h.residency
    readies = load(h, 0, 1)
    ledger = r.claim_client()
    compute = compute_view(h, ledger.index)
    s = r.open_session("compute")
    r.bind_client(s, ledger)
    assert compute.try_pin_many([entry(h, x.key) for x in readies]) == [x.slot for x in readies]
    assert r.stats().pinned == 2
    r.close_session(s)
    assert r.stats().pinned == 0 and h.table.client_epoch(ledger.index) == ledger.epoch + 1
    load(h, 2, 3)  # both slots are evictable again
    with pytest.raises(RuntimeError, match="reclaimed by the cache daemon"):
        compute.unpin_many([entry(h, readies[0].key)])
    again = r.claim_client()
    assert again.index == ledger.index and again.epoch == ledger.epoch + 2  # the reclaim's, then its own


def test_bind_client_errors(make):
    h = make(slots=2)
    r = h.residency
    s = r.open_session("a")
    with pytest.raises(
        FailedPrecondition, match=r"client ledger 0 \(epoch 0\) is not an unused ledger claimed"
    ):
        r.bind_client(s, ClientLedger(0, 0))
    ledger = r.claim_client()
    with pytest.raises(
        FailedPrecondition, match=rf"epoch 7\) is not an unused ledger.*current epoch {ledger.epoch}"
    ):
        r.bind_client(s, ClientLedger(ledger.index, 7))
    with pytest.raises(FailedPrecondition, match="client ledger 99"):
        r.bind_client(s, ClientLedger(99, 0))
    r.bind_client(s, ledger)
    with pytest.raises(FailedPrecondition, match="not an unused ledger"):
        r.bind_client(r.open_session("b"), ledger)  # bound already


def test_every_client_ledger_in_use(make):
    h = make(slots=2)  # the harness table has 4 ledgers
    r = h.residency
    ledgers = []
    for _ in range(4):  # each tied to its stream right after its Attach, as compute does
        ledgers.append(r.claim_client())
        r.bind_client(r.open_session("compute"), ledgers[-1])
    assert [x.index for x in ledgers] == [0, 1, 2, 3]
    with pytest.raises(ResourceExhausted, match="all 4 client ledgers of the slot table are in use"):
        r.claim_client()


def test_attach_calls_without_a_stream_never_exhaust_the_ledgers_of_working_clients(make):
    """Finding C7: 40 Attach calls took all 32 ledgers (each claim held 30 s). Unbound claims
    are bounded to half the ledgers: more Attach calls take back the oldest unbound claim, and
    ledgers tied to a stream are never taken."""
    h = make(slots=2)  # 4 ledgers: at most 2 unbound claims
    r = h.residency
    working = r.claim_client()
    r.bind_client(r.open_session("working"), working)
    flood = [r.claim_client() for _ in range(40)]
    assert all(x.index != working.index for x in flood)
    assert h.table.client_epoch(working.index) == working.epoch  # never taken back
    # Only the two newest flood claims still stand; the older ones were taken back.
    assert r.handoff_fds(flood[0]) is None and r.handoff_fds(flood[-3]) is None
    fds = r.handoff_fds(flood[-1])
    assert fds is not None and len(fds) == 2
    for fd in fds:
        os.close(fd)
    # A newcomer still gets a ledger and can tie it to its stream.
    newcomer = r.claim_client()
    r.bind_client(r.open_session("newcomer"), newcomer)


def test_a_copy_that_outlives_its_timeout_keeps_its_slot_and_source_until_it_lands(make, monkeypatch):
    # A GPU copy stalled past its timeout is still queued: its waiters fail, but neither the arena
    # slot it writes nor the host slot it reads may be reused before it lands.
    from cache_daemon.errors import CopyInFlight

    h = make(slots=1, host_slots=2)
    r = h.residency
    landed = threading.Event()
    real_copy = h.arena.copy_in
    stalled = {"first": True}

    def copy_in(slot, src):
        if stalled.pop("first", False):

            def wait_done():
                landed.wait(10)
                real_copy(slot, src)  # the late copy finally writes the slot

            raise CopyInFlight("copy into slot 0 took over 60s", wait_done=wait_done)
        real_copy(slot, src)

    monkeypatch.setattr(h.arena, "copy_in", copy_in)
    a = r.open_session("a")
    with pytest.raises(CopyInFlight, match="took over 60s"):
        list(r.acquire(a, L1, [0]))
    assert r.slots.free == 0  # the only slot is held back for the copy
    assert h.host.pin_count(ExpertKey(L1, 0)) == 1  # its source stays pinned
    got: list = []
    waiter = threading.Thread(target=lambda: got.extend(r.acquire(a, L1, [1])))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive(), "the held-back slot was handed to another load"
    landed.set()
    waiter.join(10)
    assert [x.key for x in got] == keys(1)
    h.check_served(a, got)  # the new load's bytes, not the late copy's
    assert h.host.pin_count(ExpertKey(L1, 0)) == 0


def test_drain_evicts_everything_and_waits_for_compute_to_release_before_the_arena_goes(make):
    # At shutdown the arena may be freed only once no compute process reads a slot: compute
    # releases a pin after its kernels are done, so drain waits for the pins and evicts the rest.
    h = make(slots=4)
    r = h.residency
    readies = load(h, 0, 1, 2)
    compute = compute_view(h)
    assert compute.try_pin_many([entry(h, readies[0].key)]) == [readies[0].slot]
    r.shutdown()
    result: list[int] = []
    drainer = threading.Thread(target=lambda: result.append(r.drain(10.0)))
    drainer.start()
    drainer.join(0.3)
    assert drainer.is_alive(), "drain returned while compute still pinned a slot"
    assert [r.slots.state(x.key) for x in readies[1:]] == [TableState.ABSENT] * 2  # nobody's: evicted
    assert compute.try_pin_many([entry(h, readies[1].key)]) == [-1]  # no new hit can pin one
    compute.unpin_many([entry(h, readies[0].key)])
    drainer.join(5)
    assert result == [0] and r.slots.state(readies[0].key) is TableState.ABSENT
    # A compute that never lets go: drain gives up after its grace and says how many are pinned.
    h2 = make(slots=2)
    (ready,) = load(h2, 3)
    stuck = compute_view(h2)
    stuck.try_pin_many([entry(h2, ready.key)])
    h2.residency.shutdown()
    assert h2.residency.drain(0.2) == 1


def test_a_demand_starts_its_reads_before_its_bookkeeping(make, monkeypatch):
    """The loads of a demand's missing experts start (a store read is submitted) before the
    demand's per-key bookkeeping (the prefetch outcome, the scheduler, the pins), which costs tens
    of microseconds of Python a key on a busy node that the disk would otherwise wait out."""
    h = make(slots=4)
    r = h.residency
    s = r.open_session("a")
    r.release(s, [x.key for x in r.acquire(s, L1, [0])])  # expert 0 resident
    order: list[tuple[str, ExpertKey]] = []
    loads, scheduler = r._loads, r._prefetcher.scheduler
    start, on_demand = loads.start, scheduler.on_demand

    def recorded_start(key, *args, **kwargs):
        order.append(("start", key))
        return start(key, *args, **kwargs)

    def recorded_on_demand(key):
        order.append(("bookkeeping", key))
        return on_demand(key)

    monkeypatch.setattr(loads, "start", recorded_start)
    monkeypatch.setattr(scheduler, "on_demand", recorded_on_demand)
    got = list(r.acquire(s, L1, [0, 1, 2]))
    assert order == [("start", k) for k in keys(1, 2)] + [("bookkeeping", k) for k in keys(0, 1, 2)]
    assert {x.key: x.source for x in got} == {
        ExpertKey(L1, 0): Tier.DEVICE,
        ExpertKey(L1, 1): Tier.STORE,
        ExpertKey(L1, 2): Tier.STORE,
    }
    h.check_served(s, got)
