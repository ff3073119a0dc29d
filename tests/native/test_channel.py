"""The client channel of the slot table (csrc/include/expertcache/channel.h): demands, replies,
signal records, futex wake-ups across processes, and the daemon's pins into a client's ledger."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from expertcache.native import MAX_REQUEST_ID_BYTES, SlotTable, StaleClient, TableState

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def table(tmp_path):
    t = SlotTable.create(str(tmp_path / "slots"), 16, 4, 4, 8, 4096)
    t.claim_channel(1)
    return t


def test_layout_is_in_the_header_and_a_second_mapping_shares_the_channel(table, tmp_path):
    assert (table.max_demand, table.ring_bytes, table.signals_wanted) == (8, 4096, True)
    other = SlotTable.open(table.path)
    assert (other.max_demand, other.ring_bytes) == (8, 4096)
    seq = other.channel(1).post_demand(3, [1, 2])
    assert table.channel(1).take_demand(0) == (seq, 3, [1, 2])
    assert table.channel(1).take_demand(seq) is None  # taken: nothing newer
    table.signals_wanted = False
    assert not other.signals_wanted
    assert SlotTable.file_size(16, 4, 8, 4096) == Path(table.path).stat().st_size


def test_bad_layouts_are_refused(tmp_path):
    with pytest.raises(ValueError, match="ring_bytes must be a multiple of 64 in"):
        SlotTable.create(str(tmp_path / "a"), 4, 1, 2, 4, 1000)
    with pytest.raises(ValueError, match="max_demand must be in"):
        SlotTable.create(str(tmp_path / "b"), 4, 1, 2, 70000)
    with pytest.raises(IndexError):
        SlotTable.create(str(tmp_path / "c"), 4, 1, 2).channel(2)


def test_a_demand_is_answered_with_its_sequence_number_and_message(table):
    compute, daemon = table.channel(1), table.channel(1)
    with pytest.raises(ValueError, match=r"a demand names 1..8 experts, got 9"):
        compute.post_demand(0, list(range(9)))
    with pytest.raises(ValueError, match=r"a demand names 1..8 experts, got 0"):
        compute.post_demand(0, [])
    seq = compute.post_demand(2, [5])
    assert compute.reply_seq != seq
    daemon.reply(seq, 15, "checksum mismatch " + "x" * 400)
    assert (compute.reply_seq, compute.reply_status) == (seq, 15)
    assert compute.reply_message.startswith("checksum mismatch") and len(compute.reply_message) == 255
    daemon.set_source(0, 3)
    assert compute.source(0) == 3
    seen = compute.fail_seq
    daemon.fail(15, "loading expert L2E5 failed")
    assert compute.fail_seq == seen + 1 and compute.fail_message == "loading expert L2E5 failed"


def test_signal_records_round_trip_in_order(table):
    compute, daemon = table.channel(1), table.channel(1)
    assert compute.signal_begin(7, "req-é")
    assert compute.signal_route(7, 3, 2, [1, 5, 9])
    assert compute.signal_ahead(7, 3, [4, 5], [1, 2], [[1, 2], [3]], [[0.5, 0.25], [1.0]])
    assert compute.signal_end(7)
    records, corrupt = daemon.drain()
    assert not corrupt
    assert records[0] == ("begin", 7, "req-é".encode())
    kind, handle, token, layer, experts = records[1]
    assert (kind, handle, token, layer, experts.tolist()) == ("route", 7, 3, 2, [1, 5, 9])
    kind, handle, token, preds = records[2]
    assert (kind, handle, token) == ("ahead", 7, 3)
    assert [(la, d, e.tolist(), s.tolist()) for la, d, e, s in preds] == [
        (4, 1, [1, 2], [0.5, 0.25]),
        (5, 2, [3], [1.0]),
    ]
    assert records[3] == ("end", 7)
    assert daemon.drain() == ([], False)


def test_the_ring_wraps_and_drops_what_does_not_fit(table):
    compute, daemon = table.channel(1), table.channel(1)
    written = 0
    while compute.signal_route(1, written, 0, list(range(20))):  # 8 + 16 + 40 = 64-byte records
        written += 1
    assert compute.ring_dropped == 1 and written == 4096 // 64
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


def test_a_corrupt_ring_is_reported_and_skipped(table, tmp_path):
    compute, daemon = table.channel(1), table.channel(1)
    compute.signal_route(1, 0, 0, [1, 2])
    compute.signal_route(1, 1, 0, [3])
    # Overwrite the first record's length with garbage, as a buggy or hostile client could.
    with open(table.path, "r+b") as f:
        data = f.read()
        # length 32, type ROUTE, handle 1, token 0, layer 0, 2 experts: 1, 2
        record = np.array([32, 3, 1, 0, 0, 2, 1 | 2 << 16], dtype=np.uint32).tobytes()
        at = data.find(record)
        assert at > 0
        f.seek(at)
        f.write(np.uint32(12345).tobytes())
    records, corrupt = daemon.drain()
    assert corrupt and records == []
    assert compute.signal_route(1, 2, 0, [4])  # the ring goes on after the skip
    records, corrupt = daemon.drain()
    assert not corrupt and records[0][2] == 2


def test_waits_end_at_a_notify_a_doorbell_or_the_timeout(table):
    compute, daemon = table.channel(1), table.channel(1)
    seen = compute.notify_seq
    started = time.monotonic()
    assert not compute.wait_notify(seen, 0.05)
    assert time.monotonic() - started >= 0.04
    threading.Timer(0.05, daemon.notify).start()
    assert compute.wait_notify(seen, 5.0)
    seen = daemon.doorbell_seq
    threading.Timer(0.05, compute.ring_doorbell).start()
    assert daemon.wait_doorbell(seen, 5.0)
    with pytest.raises(ValueError, match="NaN"):
        compute.wait_notify(compute.notify_seq, float("nan"))


def test_another_process_posts_and_is_woken(table):
    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "from expertcache.native import SlotTable\n"
        "t = SlotTable.open(sys.argv[1]); c = t.channel(1)\n"
        "seen = c.notify_seq\n"
        "seq = c.post_demand(1, [2, 3]); c.ring_doorbell()\n"
        "assert c.wait_notify(seen, 10.0)\n"
        "print(c.reply_seq == seq, c.reply_status, c.reply_message)\n"
    )
    daemon = table.channel(1)
    seen = daemon.doorbell_seq
    child = subprocess.Popen([sys.executable, "-c", code, table.path], stdout=subprocess.PIPE, text=True)
    assert daemon.wait_doorbell(seen, 10.0)
    demand = daemon.take_demand(0)
    assert demand is not None and demand[1:] == (1, [2, 3])
    daemon.reply(demand[0], 0, "admitted")
    out, _ = child.communicate(timeout=20)
    assert out.split() == ["True", "0", "admitted"]


def test_the_daemon_pins_into_a_ledger_until_it_is_reclaimed(table):
    compute = SlotTable.open(table.path)
    epoch = table.client_epoch(1)
    compute.attach_client(1, epoch)
    with pytest.raises(RuntimeError, match="hold_for_client of entry 3 in state ABSENT"):
        table.hold_for_client(1, epoch, 3)
    table.begin_load(3, 0)
    assert table.hold_for_client(1, epoch, 3)  # LOADING: pinned for the client
    assert (table.pins(3), table.client_pins(1, 3)) == (1, 1)
    assert not table.try_evict(3)
    table.finish_load(3)
    assert compute.resident_slots([3, 4]) == [0, -2]
    compute.unpin_many([3])  # the client releases it like one of its own pins
    assert (table.pins(3), table.client_pins(1, 3)) == (0, 0)
    assert table.hold_for_client(1, epoch, 3)
    assert table.unhold_for_client(1, epoch, 3)  # a failed load: the daemon takes it back
    assert not table.unhold_for_client(1, epoch, 3)  # none left
    assert table.hold_for_client(1, epoch, 3)
    seen = table.channel(1).doorbell_seq
    assert table.reclaim_client(1) == 1  # the stream ended: the daemon's pin goes with the ledger
    assert table.pins(3) == 0
    assert table.channel(1).doorbell_seq != seen  # the channel's thread is woken to see it
    assert not table.hold_for_client(1, epoch, 3)  # the old epoch: refused, nothing pinned
    assert table.pins(3) == 0 and table.state(3) == TableState.RESIDENT
    with pytest.raises(StaleClient):
        compute.unpin_many([3])


def test_hold_for_client_and_reclaim_never_leave_a_stray_pin(table):
    # A reclaim racing the daemon's own pins for the client: every pin is either reclaimed or
    # refused, whatever the interleaving.
    table.begin_load(5, 1)
    table.finish_load(5)
    for _ in range(50):
        epoch = table.client_epoch(1)
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
        time.sleep(0.001)
        table.reclaim_client(1)
        stop.set()
        worker.join()
        assert table.pins(5) == 0 and table.client_pins(1, 5) == 0
