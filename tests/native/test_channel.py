"""The client channel of the slot table (csrc/include/expertcache/channel.h): demands, replies,
signal records, futex wake-ups across processes, and the daemon's pins into a client's ledger.
The daemon's view of a channel is ``table.channel(c)``; compute's is ``handle.channel(c)`` of the
handle attached to ledger c's region."""

from __future__ import annotations

import gc
import mmap
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from expertcache.native import MAX_REQUEST_ID_BYTES, LayerSignals, SlotTable, StaleClient, TableState
from tests.slot_tables import claim_and_attach, spawn_holding
from tests.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]

ENTRIES, SLOTS, CLIENTS, MAX_DEMAND, RING = 16, 4, 4, 8, 4096


def _round64(n: int) -> int:
    return (n + 63) // 64 * 64


def _channel_offsets(num_entries: int, max_demand: int, ring_bytes: int) -> dict[str, int]:
    """Where the parts of a client region lie (slot_table.h, channel.h): ClientHeader 128 B, pins,
    stamps, then the channel: ChannelHeader 960 B, experts, sources, ring (each part padded to 64 B)."""
    pins = 128
    stamps = pins + _round64(4 * num_entries)
    channel = stamps + _round64(8 * num_entries)
    experts = channel + 960
    sources = experts + _round64(4 * max_demand)
    ring = sources + _round64(max_demand)
    assert ring + ring_bytes == SlotTable.region_bytes(num_entries, max_demand, ring_bytes)
    return {"pins": pins, "stamps": stamps, "channel": channel, "experts": experts, "ring": ring}


@pytest.fixture
def table():
    return SlotTable.create("ch-table", ENTRIES, SLOTS, CLIENTS, MAX_DEMAND, RING)


@pytest.fixture
def handle(table):
    """Compute's handle of ledger 1."""
    return claim_and_attach(table, 1)


def test_layout_is_in_the_header_and_both_sides_share_the_channel(table, handle):
    assert (table.max_demand, table.ring_bytes, table.signals_wanted) == (MAX_DEMAND, RING, True)
    assert (handle.max_demand, handle.ring_bytes, handle.signals_wanted) == (MAX_DEMAND, RING, True)
    compute, daemon = handle.channel(1), table.channel(1)
    assert (compute.max_demand, compute.ring_bytes) == (daemon.max_demand, daemon.ring_bytes) == (8, 4096)
    seq = compute.post_demand(3, [1, 2])
    assert daemon.take_demand(0) == (seq, 3, [1, 2], b"")
    assert daemon.take_demand(seq) is None  # taken: nothing newer
    table.signals_wanted = False
    assert not handle.signals_wanted
    table_fd, region_fd = table.table_fd(), table.client_fd(1)
    try:
        assert os.fstat(table_fd).st_size == SlotTable.table_bytes(ENTRIES)
        assert os.fstat(region_fd).st_size == SlotTable.region_bytes(ENTRIES, MAX_DEMAND, RING)
    finally:
        os.close(table_fd)
        os.close(region_fd)
    _channel_offsets(ENTRIES, MAX_DEMAND, RING)  # the layout the other tests write into


def test_bad_layouts_are_refused(table, handle):
    with pytest.raises(ValueError, match="ring_bytes must be a multiple of 64 in"):
        SlotTable.create("ch-a", 4, 1, 2, 4, 1000)
    with pytest.raises(ValueError, match="max_demand must be in"):
        SlotTable.create("ch-b", 4, 1, 2, 70000)
    with pytest.raises(IndexError, match="client 4 out of range"):
        table.channel(4)
    with pytest.raises(RuntimeError, match="client ledger 0 has no region"):
        table.channel(0)  # never claimed
    with pytest.raises(ValueError, match="holds client ledger 1, not 0"):
        handle.channel(0)  # compute reaches its own channel only
    with pytest.raises(IndexError, match="client 4 out of range"):
        handle.channel(4)


def test_a_demand_is_answered_with_its_sequence_number_and_message(table, handle):
    compute, daemon = handle.channel(1), table.channel(1)
    with pytest.raises(ValueError, match=r"a demand names 1..8 experts, got 9"):
        compute.post_demand(0, list(range(9)))
    with pytest.raises(ValueError, match=r"a demand names 1..8 experts, got 0"):
        compute.post_demand(0, [])
    with pytest.raises(ValueError, match="demand expert -1 out of range"):
        compute.post_demand(0, [-1])
    seq = compute.post_demand(2, [5])
    assert compute.reply_seq != seq
    daemon.reply(seq, 15, "checksum mismatch " + "x" * 400)
    assert (compute.reply_seq, compute.reply_status) == (seq, 15)
    assert compute.reply_message.startswith("checksum mismatch") and len(compute.reply_message) == 255
    daemon.set_source(0, 3)
    assert compute.source(0) == 3
    with pytest.raises(IndexError, match="demand position out of range"):
        daemon.set_source(8, 1)
    with pytest.raises(IndexError, match="demand position out of range"):
        compute.source(8)
    seen = compute.fail_seq
    daemon.fail(15, "loading expert L2E5 failed")
    assert compute.fail_seq == seen + 1 and compute.fail_status == 15
    assert compute.fail_message == "loading expert L2E5 failed"
    # A second demand supersedes the first in the mailbox; its sources start unknown.
    seq2 = compute.post_demand(4, [6, 7])
    assert seq2 != seq and compute.source(0) == 0
    assert daemon.take_demand(seq) == (seq2, 4, [6, 7], b"")


def test_a_count_beyond_the_mailbox_is_marked(table, handle):
    # A client that writes its demand count by hand: the daemon takes what fits and a marker.
    at = _channel_offsets(ENTRIES, MAX_DEMAND, RING)["channel"]
    seq = handle.channel(1).post_demand(1, [1, 2, 3])
    region_fd = table.client_fd(1)
    try:
        with mmap.mmap(region_fd, 0) as region:
            region[at + 8 : at + 12] = (1000).to_bytes(4, "little")  # demand_count
            got = table.channel(1).take_demand(0)
            expected = np.frombuffer(region[at + 960 : at + 960 + 4 * MAX_DEMAND], np.uint32).tolist()
    finally:
        os.close(region_fd)
    assert got is not None and got[:2] == (seq, 1)
    assert got[2] == [*expected, 4294967295] and got[2][:3] == [1, 2, 3]


def test_signal_records_round_trip_in_order(table, handle):
    compute, daemon = handle.channel(1), table.channel(1)
    assert compute.signal_begin(7, "req-é")
    assert compute.signal_route(7, 3, 2, [1, 5, 9])
    assert compute.signal_ahead(7, 3, [4, 5], [1, 2], [[1, 2], [3]], [[0.5, 0.25], [1.0]])
    assert compute.signal_end(7)
    records, corrupt = daemon.drain()
    assert not corrupt
    assert records[0] == ("begin", 7, "req-é".encode())
    kind, handle_, token, layer, experts = records[1]
    assert (kind, handle_, token, layer, experts.tolist()) == ("route", 7, 3, 2, [1, 5, 9])
    kind, handle_, token, preds = records[2]
    assert (kind, handle_, token) == ("ahead", 7, 3)
    assert [(la, d, e.tolist(), s.tolist()) for la, d, e, s in preds] == [
        (4, 1, [1, 2], [0.5, 0.25]),
        (5, 2, [3], [1.0]),
    ]
    assert records[3] == ("end", 7)
    assert daemon.drain() == ([], False)


def test_the_ring_wraps_and_drops_what_does_not_fit(table, handle):
    compute, daemon = handle.channel(1), table.channel(1)
    written = 0
    while compute.signal_route(1, written, 0, list(range(20))):  # 8 + 16 + 40 = 64-byte records
        written += 1
    assert compute.ring_dropped == 1 and written == RING // 64
    records, _ = daemon.drain()
    assert [r[2] for r in records] == list(range(written))
    for round_ in range(200):  # around the ring many times, records of varying sizes
        n = round_ % 37
        assert compute.signal_route(2, round_, 1, list(range(n)))
        (record,), corrupt = daemon.drain()
        assert not corrupt and record[2] == round_ and record[4].tolist() == list(range(n))
    with pytest.raises(ValueError, match="request id of 1025 bytes"):
        compute.signal_begin(3, "r" * (MAX_REQUEST_ID_BYTES + 1))
    with pytest.raises(ValueError, match="expert 65536 is outside 0..65535"):
        compute.signal_route(1, 0, 0, [65536])
    with pytest.raises(ValueError, match="has 2 experts but 1 scores"):
        compute.signal_ahead(1, 0, [1], [1], [[1, 2]], [[0.5]])


def _overwrite_in_ring(table: SlotTable, client: int, find: bytes, write: bytes) -> None:
    """Writes ``write`` over the first ``find`` in ledger ``client``'s ring, as a buggy or hostile
    client could (its region is mapped read-write in its process)."""
    ring = _channel_offsets(ENTRIES, MAX_DEMAND, RING)["ring"]
    region_fd = table.client_fd(client)
    try:
        with mmap.mmap(region_fd, 0) as region:
            at = region.find(find, ring)
            assert at >= ring
            region[at : at + len(write)] = write
    finally:
        os.close(region_fd)


def test_a_corrupt_ring_is_reported_and_skipped(table, handle):
    compute, daemon = handle.channel(1), table.channel(1)
    compute.signal_route(1, 0, 0, [1, 2])
    compute.signal_route(1, 1, 0, [3])
    # length 32, type ROUTE, handle 1, token 0, layer 0, 2 experts: 1, 2
    record = np.array([32, 3, 1, 0, 0, 2, 1 | 2 << 16], dtype=np.uint32).tobytes()
    _overwrite_in_ring(table, 1, record, np.uint32(12345).tobytes())  # the first record's length
    records, corrupt = daemon.drain()
    assert corrupt and records == []
    assert compute.signal_route(1, 2, 0, [4])  # the ring goes on after the skip
    records, corrupt = daemon.drain()
    assert not corrupt and records[0][2] == 2


def test_malformed_records_end_the_drain(table, handle):
    compute, daemon = handle.channel(1), table.channel(1)
    cases = [
        # An unknown record type (ROUTE's 3 made 9).
        (
            lambda: compute.signal_route(1, 5, 0, [1]),
            np.array([32, 3, 1, 5], np.uint32),
            np.array([32, 9, 1, 5], np.uint32),
        ),
        # A route whose expert count runs past its record (1 made 1000).
        (
            lambda: compute.signal_route(1, 6, 0, [1]),
            np.array([32, 3, 1, 6, 0, 1], np.uint32),
            np.array([32, 3, 1, 6, 0, 1000], np.uint32),
        ),
        # A begin whose id length runs past its record.
        (
            lambda: compute.signal_begin(1, "abcd"),
            np.array([24, 1, 1, 4], np.uint32),
            np.array([24, 1, 1, 400], np.uint32),
        ),
        # A length that is not a multiple of 8.
        (lambda: compute.signal_end(1), np.array([16, 2, 1], np.uint32), np.array([12, 2, 1], np.uint32)),
    ]
    for post, find, write in cases:
        assert post()
        assert compute.signal_end(99)  # a good record after the bad one is skipped with it
        _overwrite_in_ring(table, 1, find.tobytes(), write.tobytes())
        assert daemon.drain() == ([], True)
        assert daemon.drain() == ([], False)
    assert compute.signal_end(3)
    assert daemon.drain() == ([("end", 3)], False)


def test_waits_end_at_a_notify_a_doorbell_or_the_timeout(table, handle):
    compute, daemon = handle.channel(1), table.channel(1)
    seen = compute.notify_seq
    started = time.monotonic()
    assert not compute.wait_notify(seen, 0.05)
    assert time.monotonic() - started >= 0.04
    threading.Timer(0.05, daemon.notify).start()
    assert compute.wait_notify(seen, 30.0)
    seen = daemon.doorbell_seq
    threading.Timer(0.05, compute.ring_doorbell).start()
    assert daemon.wait_doorbell(seen, 30.0)
    with pytest.raises(ValueError, match="NaN"):
        compute.wait_notify(compute.notify_seq, float("nan"))


def _least_cpu_of(waits: int, wait, tries: int = 3) -> float:
    """The least of ``tries`` measures of ``_cpu_of(waits, wait)``. On a busy virtual machine a
    sleeping wait is at times charged the time its CPU was taken away (22 ms of 200 in one CI run);
    a wait that polls is charged its polling every time, so the least measure still shows it."""
    return min(_cpu_of(waits, wait) for _ in range(tries))


def _cpu_of(waits: int, wait) -> float:
    """CPU seconds one thread spent in `waits` calls of ``wait()`` (asleep in a futex costs none),
    measured on a thread of its own."""
    spent: list[float] = []

    def run() -> None:
        started = time.thread_time()
        for _ in range(waits):
            wait()
        spent.append(time.thread_time() - started)

    waiter = threading.Thread(target=run)
    waiter.start()
    waiter.join()
    return spent[0]


def test_a_wait_for_landings_polls_only_while_the_daemon_copies_for_it(table, handle):
    compute, daemon = handle.channel(1), table.channel(1)
    assert not compute.copying
    # Nothing being copied: a few microseconds of grace, then asleep. Polling for the whole spin
    # would cost 40 x 1 ms of CPU; a bound of a quarter of that leaves room for a loaded machine's
    # accounting noise (a single wait's 0.5 ms bound failed there).
    seen = compute.notify_seq
    assert _least_cpu_of(40, lambda: compute.wait_notify(seen, 5e-3, 1e-3, 5e-6)) < 10e-3
    # Copying for it: polls, and sees the landing without sleeping.
    daemon.copying = True
    assert compute.copying
    seen = compute.notify_seq
    threading.Timer(0.0, daemon.notify).start()
    assert compute.wait_notify(seen, 30.0, 1e-3, 5e-6)
    daemon.copying = False
    assert not compute.copying
    daemon.copying = True
    daemon.reset()
    assert not compute.copying


def test_a_wait_for_the_reply_polls_past_its_grace_only_while_the_daemon_copies_for_it(table, handle):
    compute, daemon = handle.channel(1), table.channel(1)
    seq = compute.post_demand(0, [1])
    taken = daemon.take_demand(0)
    assert taken is not None and taken[0] == seq

    # Taken up, nothing being copied (an admission reading the store, or applying signals): a
    # grace of microseconds, then asleep. Polling for the whole spin would cost 40 x 1 ms.
    def unanswered() -> None:
        assert not compute.wait_reply(seq, compute.notify_seq, 5e-3, 1e-3, 5e-6)

    assert _least_cpu_of(40, unanswered) < 10e-3
    # Copying for it: polls through the spin, and sees the reply without sleeping.
    daemon.copying = True
    assert _cpu_of(4, unanswered) >= 1e-3  # of 4 ms: room for a busy CPU
    seen = compute.notify_seq
    threading.Timer(0.0, lambda: daemon.reply(seq, 0, "admitted")).start()
    assert compute.wait_reply(seq, seen, 30.0, 1e-3, 5e-6)
    daemon.copying = False


def test_taking_a_demand_sets_copying_in_the_same_call(table, handle):
    compute, daemon = handle.channel(1), table.channel(1)
    assert daemon.take_demand(0, copying=True) is None and not compute.copying  # nothing taken: unchanged
    seq = compute.post_demand(0, [1])
    assert daemon.take_demand(0, copying=True)[0] == seq and compute.copying
    seq = compute.post_demand(0, [2])
    assert daemon.take_demand(seq - 1)[0] == seq and not compute.copying  # the default lowers it


def test_wait_reply_ends_at_the_reply_a_notify_after_seen_or_the_timeout(table, handle):
    compute, daemon = handle.channel(1), table.channel(1)
    seen = compute.notify_seq
    seq = compute.post_demand(0, [1])
    started = time.monotonic()
    assert not compute.wait_reply(seq, seen, 0.05)
    assert time.monotonic() - started >= 0.04
    # A notify that came after `seen` was read (an interrupt, the stream's end) ends the wait at
    # once, even with no limit: the caller checks what it was.
    daemon.notify()
    started = time.monotonic()
    assert not compute.wait_reply(seq, seen, -1.0)
    assert not compute.wait_reply(seq, seen, 30.0, spin_s=1e-3, grace_s=1e-3)
    assert time.monotonic() - started < 10.0
    # The reply, from the daemon's thread once it took the demand up.
    seen = compute.notify_seq

    def serve():
        taken = daemon.take_demand(0)
        assert taken is not None
        daemon.reply(taken[0], 0, "admitted")

    threading.Timer(0.05, serve).start()
    assert compute.wait_reply(seq, seen, 30.0, spin_s=1e-3, grace_s=1e-4)
    assert (compute.reply_status, compute.reply_message) == (0, "admitted")
    assert compute.wait_reply(seq, seen, 0.0)  # answered: at once


def test_another_process_posts_and_is_woken(table):
    epoch = table.claim_channel(1)
    fds = (table.table_fd(), table.client_fd(1))
    code = (
        "import os, sys\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "from expertcache.native import SlotTable\n"
        "tf, rf, epoch = map(int, sys.argv[1:4])\n"
        "h = SlotTable.attach(tf, rf, 1, epoch); os.close(tf); os.close(rf)\n"
        "c = h.channel(1)\n"
        "seen = c.notify_seq\n"
        "seq = c.post_demand(1, [2, 3]); c.ring_doorbell()\n"
        "assert c.wait_reply(seq, seen, 30.0)\n"
        "print(c.reply_seq == seq, c.reply_status, c.reply_message)\n"
    )
    daemon = table.channel(1)
    seen = daemon.doorbell_seq
    child = spawn_holding(code, fds, (*fds, epoch))
    assert daemon.wait_doorbell(seen, 30.0)
    demand = daemon.take_demand(0)
    assert demand is not None and demand[1:] == (1, [2, 3], b"")
    daemon.reply(demand[0], 0, "admitted")
    out, err = child.communicate(timeout=60)
    assert child.returncode == 0, err
    assert out.split() == ["True", "0", "admitted"]


def test_the_daemon_pins_into_a_ledger_until_it_is_reclaimed(table, handle):
    compute = handle
    epoch = table.client_epoch(1)
    with pytest.raises(RuntimeError, match="hold_for_client of entry 3 in state ABSENT"):
        table.hold_for_client(1, epoch, 3)
    table.begin_load(3, 0)
    assert table.hold_for_client(1, epoch, 3)  # LOADING: pinned for the client
    assert (table.pins(3), table.client_pins(1, 3), compute.pins(3)) == (1, 1, 1)
    assert not table.hold_for_client(1, epoch + 1, 3)  # another epoch: refused
    assert not table.hold_for_client(2, table.client_epoch(2), 3)  # ledger 2 has no region
    table.finish_load(3)
    assert not table.try_evict(3)
    assert compute.resident_slots([3, 4]) == [0, -2]
    compute.unpin_many([3])  # the client releases it like one of its own pins
    assert (table.pins(3), table.client_pins(1, 3)) == (0, 0)
    assert table.hold_for_client(1, epoch, 3)
    seq = table.unpin_seq
    assert table.unhold_for_client(1, epoch, 3)  # a failed load: the daemon takes it back
    assert table.unpin_seq == seq + 1  # the last pin went: a waiting admission re-checks
    assert not table.unhold_for_client(1, epoch, 3)  # none left
    assert table.hold_for_client(1, epoch, 3)
    assert not table.unhold_for_client(1, epoch + 1, 3)
    daemon = table.channel(1)
    doorbell, notify = daemon.doorbell_seq, compute.channel(1).notify_seq
    assert table.reclaim_client(1) == 1  # the stream ended: the daemon's pin goes with the ledger
    assert table.pins(3) == 0
    assert daemon.doorbell_seq != doorbell  # the channel's thread is woken to see it
    assert compute.channel(1).notify_seq != notify  # and a waiting compute too
    assert not table.hold_for_client(1, epoch, 3)  # the old epoch: refused, nothing pinned
    assert not table.hold_for_client(1, table.client_epoch(1), 3)  # no region until a claim
    assert not table.unhold_for_client(1, epoch, 3)
    assert table.pins(3) == 0 and table.state(3) == TableState.RESIDENT
    with pytest.raises(StaleClient):
        compute.unpin_many([3])
    with pytest.raises(RuntimeError, match="client ledger 1 has no region"):
        table.channel(1)


def test_hold_for_client_and_reclaim_never_leave_a_stray_pin(table):
    # A reclaim racing the daemon's own pins for the client: every pin is either reclaimed or
    # refused, whatever the interleaving.
    table.begin_load(5, 1)
    table.finish_load(5)
    for _ in range(50):
        epoch = table.claim_channel(1)
        stop = threading.Event()
        held = []

        def pin(epoch=epoch, stop=stop, held=held):
            while not stop.is_set():
                if table.hold_for_client(1, epoch, 5):
                    held.append(1)
                else:
                    return

        worker = threading.Thread(target=pin)
        worker.start()
        wait_for(lambda held=held: held, "a pin for the client", poll_s=0.0005)
        removed = table.reclaim_client(1)
        stop.set()
        worker.join(30)
        assert not worker.is_alive()
        assert removed == len(held)  # each pin made was in the region when it was detached
        assert table.pins(5) == 0 and table.client_pins(1, 5) == 0
    assert table.try_evict(5)


def test_a_channel_view_keeps_its_region_mapped(table):
    compute = claim_and_attach(table, 2).channel(2)  # no name keeps the handle
    daemon = table.channel(2)
    gc.collect()
    seq = compute.post_demand(1, [4])
    assert daemon.take_demand(0) == (seq, 1, [4], b"")
    table.reclaim_client(2)  # detached: both views still point into the (old) region
    gc.collect()
    daemon.reply(seq, 0, "late")
    assert (compute.reply_seq, compute.reply_message) == (seq, "late")
    assert compute.signal_end(1)
    assert daemon.drain() == ([("end", 1)], False)


def test_reset_empties_the_channel(table, handle):
    compute, daemon = handle.channel(1), table.channel(1)
    seq = compute.post_demand(1, [1])
    daemon.reply(seq, 3, "x")
    daemon.fail(4, "y")
    compute.signal_end(1)
    notify = compute.notify_seq
    daemon.reset()
    assert (compute.reply_seq, compute.reply_status, compute.reply_message) == (0, 0, "")
    assert (compute.fail_seq, compute.fail_status, compute.fail_message) == (0, 0, "")
    assert daemon.take_demand(0) is None and daemon.drain() == ([], False)
    assert compute.notify_seq == notify  # sleepers compare against what they read: it keeps counting


def _records(daemon):
    records, corrupt = daemon.drain()
    assert not corrupt
    out = []
    for r in records:
        if r[0] == "route":
            out.append(("route", r[1], r[2], r[3], r[4].tolist()))
        else:
            out.append(("ahead", r[1], r[2], [(la, d, e.tolist(), s.tolist()) for la, d, e, s in r[3]]))
    return out


def test_layer_signals_write_a_layers_routes_then_its_lookahead_per_row(table, handle):
    # LayerSignals (what a natively run decode layer tells the daemon): per row, the row's experts
    # ascending and once; then per row its predictions, each depth's router weights renormalised
    # to sum to 1 (float32), best first, ties by the lower expert, a weight of 0 left out, a depth
    # with no layer ahead (-1) left out; as predict_host gives them. Then the doorbell rings, unless
    # the layer's demand is to ring it.
    compute, daemon = handle.channel(1), table.channel(1)
    layers, depth = 3, 2
    ahead = [1, 2, 2, -1, -1, -1]  # layer 0 predicts 1 and 2, layer 1 only 2, layer 2 nothing
    signals = LayerSignals(compute, [11, 12], [40, 7], 3, layers, depth, ahead)
    bell = daemon.doorbell_seq
    ids = np.array([5, 1, 5, 3, 2, 0], np.int64)  # row 0 names expert 5 twice
    d1_ids = np.array([4, 0, 6, 1, 2, 3], np.int64)
    d1_w = np.array([0.5, 0.5, 1.0, 0.0, 0.25, 0.25], np.float32)  # row 0: a tie; row 1: a 0
    d2_ids = np.array([7, 3, 2, 6, 5, 4], np.int64)
    d2_w = np.array([2.0, 1.0, 1.0, 1.0, 1.0, 2.0], np.float32)
    signals.write(0, ids, [d1_ids, d2_ids], [d1_w, d2_w])
    assert daemon.doorbell_seq != bell
    assert _records(daemon) == [
        ("route", 11, 40, 0, [1, 5]),
        ("route", 12, 7, 0, [0, 2, 3]),
        ("ahead", 11, 40, [(1, 1, [6, 0, 4], [0.5, 0.25, 0.25]), (2, 2, [7, 2, 3], [0.5, 0.25, 0.25])]),
        ("ahead", 12, 7, [(1, 1, [2, 3], [0.5, 0.5]), (2, 2, [4, 5, 6], [0.5, 0.25, 0.25])]),
    ]
    signals.write(1, ids, [d1_ids, d2_ids], [d1_w, d2_w])  # depth 2 of layer 1 names no layer
    assert [r[3] for r in _records(daemon) if r[0] == "ahead"] == [
        [(2, 1, [6, 0, 4], [0.5, 0.25, 0.25])],
        [(2, 1, [2, 3], [0.5, 0.5])],
    ]
    signals.write(2, ids, [d1_ids, d2_ids], [d1_w, d2_w])  # the last layer: routes only
    assert [r[0] for r in _records(daemon)] == ["route", "route"]
    assert not signals.unrung
    # A layer with a miss: its records, and the doorbell left to its demand.
    bell = daemon.doorbell_seq
    signals.write(2, ids, [d1_ids, d2_ids], [d1_w, d2_w], ring=False)
    assert daemon.doorbell_seq == bell and signals.unrung
    assert [r[0] for r in _records(daemon)] == ["route", "route"]
    # As given (a benchmark's modelled predictions): the order kept, only capped at 1.
    signals.write(0, ids, [d1_ids, d2_ids], [d1_w, d2_w], as_given=True)
    assert daemon.doorbell_seq != bell and not signals.unrung
    got = [r for r in _records(daemon) if r[0] == "ahead"]
    assert got[0][3][1] == (2, 2, [7, 3, 2], [1.0, 1.0, 1.0])
    assert got[1][3][0] == (1, 1, [1, 2, 3], [0.0, 0.25, 0.25])
    assert (signals.written, signals.dropped) == (4 + 4 + 2 + 2 + 4, 0)


def test_layer_signals_count_what_the_ring_drops_and_refuse_bad_shapes(table, handle):
    compute, daemon = handle.channel(1), table.channel(1)
    signals = LayerSignals(compute, [1], [0], 2, 1, 0, [])
    while compute.signal_route(1, 0, 0, list(range(20))):  # fill the ring
        pass
    signals.write(0, np.array([0, 1], np.int64), [], [])
    assert (signals.written, signals.dropped) == (0, 1)
    daemon.drain()
    signals.write(0, np.array([0, 1], np.int64), [], [])
    assert (signals.written, signals.dropped) == (1, 1)
    for args, message in (
        (([1, 2], [0], 2, 1, 0, []), "2 handles but 1 tokens"),
        (([1], [0], 2, 2, 1, [1]), "the lookahead table holds 1 layers, not layers x depth = 2"),
        (([1], [0], 2, 2, 1, [5, -1]), "lookahead layer 5 is outside -1 .. 1"),
        (([-1], [0], 2, 1, 0, []), "handle -1 is outside"),
        (([1], [0], 0, 1, 0, []), "need rows, a top k and layers"),
    ):
        with pytest.raises(ValueError, match=message):
            LayerSignals(compute, *args)
    with pytest.raises(ValueError, match="must be a ClientChannel"):
        LayerSignals(table, [1], [0], 2, 1, 0, [])
    with pytest.raises(ValueError, match="ids must hold rows \\* top_k = 2 values"):
        signals.write(0, np.array([0, 1, 2], np.int64), [], [])
    with pytest.raises(ValueError, match="one array each per depth"):
        signals.write(0, np.array([0, 1], np.int64), [np.array([0, 1], np.int64)], [])
    with pytest.raises(ValueError, match="outside the signals' layers"):
        signals.write(1, np.array([0, 1], np.int64), [], [])
