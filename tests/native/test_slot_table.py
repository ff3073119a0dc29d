from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from expertcache.native import SlotTable, TableState

REPO = Path(__file__).resolve().parents[2]


def _child(code: str, *args: str, stdin: bool = False) -> subprocess.Popen:
    prelude = f"import sys\nsys.path.insert(0, {str(REPO)!r})\nfrom expertcache.native import SlotTable\n"
    return subprocess.Popen(
        [sys.executable, "-c", prelude + code, *args],
        stdin=subprocess.PIPE if stdin else None,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _started(code: str, said: str, *args: str, stdin: bool = False) -> subprocess.Popen:
    """A child that has printed ``said``: it has done what comes before that line of ``code``."""
    child = _child(code, *args, stdin=stdin)
    assert child.stdout.readline().strip() == said
    return child


def _output(child: subprocess.Popen) -> str:
    """What the child printed once it has exited cleanly (within 30 s)."""
    out, err = child.communicate(timeout=30)
    assert child.returncode == 0, err
    return out


def _make_resident(t: SlotTable, entry: int, slot: int) -> None:
    t.begin_load(entry, slot)
    t.finish_load(entry)


@pytest.fixture
def table_path(tmp_path):
    return str(tmp_path / "slots.bin")


def test_create_and_open(table_path):
    t = SlotTable.create(table_path, 8, 3)
    assert (t.num_entries, t.num_slots, t.path) == (8, 3, table_path)
    for e in range(8):
        assert t.state(e) == TableState.ABSENT
        assert (t.pins(e), t.slot(e), t.generation(e)) == (0, -1, 0)
    _make_resident(t, 5, 2)
    other = SlotTable.open(table_path)  # a second mapping of the same file sees the same words
    assert (other.num_entries, other.num_slots) == (8, 3)
    assert other.state(5) == TableState.RESIDENT
    assert (other.slot(5), other.generation(5)) == (2, 1)
    assert other.try_pin(5) == 2
    assert t.pins(5) == 1


def test_lifecycle_and_transitions(table_path):
    t = SlotTable.create(table_path, 2, 2)
    assert t.try_pin(0) is None  # ABSENT
    t.begin_load(0, 1)
    assert t.state(0) == TableState.LOADING
    assert t.try_pin(0) is None  # LOADING
    with pytest.raises(RuntimeError, match="begin_load of entry 0 in state LOADING"):
        t.begin_load(0, 0)
    t.finish_load(0)
    with pytest.raises(RuntimeError, match="finish_load of entry 0 in state RESIDENT"):
        t.finish_load(0)
    assert t.try_pin(0) == 1
    t.unpin(0)
    assert t.try_evict(0)
    assert (t.state(0), t.slot(0), t.pins(0)) == (TableState.ABSENT, -1, 0)
    assert not t.try_evict(0)  # already ABSENT
    _make_resident(t, 0, 0)
    assert t.generation(0) == 2
    t.begin_load(1, 0)
    t.abort_load(1)
    assert t.state(1) == TableState.ABSENT


def test_unpin_below_zero_raises(table_path):
    t = SlotTable.create(table_path, 1, 1)
    _make_resident(t, 0, 0)
    with pytest.raises(RuntimeError, match="no pins"):
        t.unpin(0)
    assert t.try_pin(0) == 0
    t.unpin(0)
    with pytest.raises(RuntimeError, match="no pins"):
        t.unpin(0)
    assert t.pins(0) == 0


def test_pinned_entry_cannot_be_evicted(table_path):
    t = SlotTable.create(table_path, 1, 1)
    _make_resident(t, 0, 0)
    assert t.try_pin(0) == 0
    assert t.try_pin(0) == 0
    assert not t.try_evict(0)
    assert t.state(0) == TableState.RESIDENT
    t.unpin(0)
    assert not t.try_evict(0)
    t.unpin(0)
    assert t.try_evict(0)
    assert t.try_pin(0) is None


def test_bounds_checked(table_path):
    t = SlotTable.create(table_path, 4, 2)
    for call in (t.try_pin, t.unpin, t.finish_load, t.try_evict, t.state, t.pins):
        with pytest.raises(IndexError, match="entry 4 out of range"):
            call(4)
        with pytest.raises(IndexError, match="entry -1 out of range"):
            call(-1)
    with pytest.raises(IndexError, match="slot 2 out of range"):
        t.begin_load(0, 2)
    assert t.state(0) == TableState.ABSENT


def test_concurrent_pin_unpin_two_processes(table_path):
    t = SlotTable.create(table_path, 2, 4)
    _make_resident(t, 0, 3)
    t.begin_load(1, 0)  # entry 1 is the start gate: children wait for it to become resident
    code = (
        "t = SlotTable.open(sys.argv[1])\n"
        "print('ready', flush=True)\n"
        "assert t.wait_resident(1, 30.0)\n"
        "for _ in range(100_000):\n"
        "    assert t.try_pin(0) == 3\n"
        "    t.unpin(0)\n"
        "print('ok')\n"
    )
    children = [_child(code, table_path) for _ in range(2)]
    for c in children:
        assert c.stdout.readline().strip() == "ready"
    t.finish_load(1)  # both children start pinning at the same moment
    for c in children:
        out, err = c.communicate(timeout=120)
        assert c.returncode == 0, err
        assert out.strip() == "ok"
    assert t.pins(0) == 0
    assert t.state(0) == TableState.RESIDENT


def test_evict_races_with_pinners_never_evicts_pinned(table_path):
    t = SlotTable.create(table_path, 1, 1)
    _make_resident(t, 0, 0)
    # The child pins, checks the entry is still there while pinned (in its slot, of the same load),
    # and unpins: 50 000 tries and at least 2 000 pins (on a loaded machine the evicting parent may
    # win many in a row). While pinned the state may read EVICTING for an instant: an evictor that
    # saw no pin before ours moves RESIDENT -> EVICTING, then sees our pin and moves it back,
    # evicting nothing (a fresh clone's run saw it once). What must never happen is ABSENT or
    # LOADING, another slot or another generation (an eviction and a reload).
    code = (
        "t = SlotTable.open(sys.argv[1])\n"
        "held = tries = 0\n"
        "while tries < 50_000 or held < 2_000:\n"
        "    tries += 1\n"
        "    slot = t.try_pin(0)\n"
        "    if slot is not None:\n"
        "        gen = t.generation(0)\n"
        "        state = t.state(0)\n"
        "        assert state in (2, 3), state\n"
        "        assert (t.slot(0), t.generation(0)) == (slot, gen), (t.slot(0), slot, t.generation(0), gen)\n"
        "        held += 1\n"
        "        t.unpin(0)\n"
        "print(held)\n"
    )
    child = _child(code, table_path)
    evicted = 0
    while child.poll() is None:
        if t.try_evict(0):
            evicted += 1
            _make_resident(t, 0, 0)
    out, err = child.communicate()
    assert child.returncode == 0, err
    assert t.pins(0) == 0
    assert evicted > 0 and int(out) > 0


def test_wait_resident_woken_by_other_process(table_path):
    t = SlotTable.create(table_path, 1, 1)
    t.begin_load(0, 0)
    code = (
        "import time\n"
        "t = SlotTable.open(sys.argv[1])\n"
        "print('ready', flush=True)\n"
        "t0 = time.monotonic()\n"
        "ok = t.wait_resident(0, 30.0)\n"
        "print(ok, time.monotonic() - t0)\n"
    )
    child = _started(code, "ready", table_path)
    time.sleep(0.2)
    t.finish_load(0)
    ok, elapsed = _output(child).split()
    assert ok == "True"
    assert float(elapsed) < 5.0  # woken by the futex, not by the 30 s timeout


def test_wait_resident_times_out(table_path):
    t = SlotTable.create(table_path, 1, 1)
    t.begin_load(0, 0)
    t0 = time.monotonic()
    assert t.wait_resident(0, 0.2) is False
    assert 0.15 < time.monotonic() - t0 < 5.0
    assert t.wait_resident(0, 0.0) is False


def test_wait_resident_returns_immediately_unless_loading(table_path):
    t = SlotTable.create(table_path, 2, 1)
    assert t.wait_resident(0, 10.0) is False  # ABSENT
    _make_resident(t, 1, 0)
    assert t.wait_resident(1, 10.0) is True
    with pytest.raises(ValueError):
        t.wait_resident(1, -1.0)


def test_wait_resident_releases_gil_and_sees_abort(table_path):
    t = SlotTable.create(table_path, 2, 1)
    t.begin_load(0, 0)
    t.begin_load(1, 0)
    results = {}

    def waiter(e):
        results[e] = t.wait_resident(e, 30.0)

    threads = [threading.Thread(target=waiter, args=(e,)) for e in (0, 1)]
    for th in threads:
        th.start()
    time.sleep(0.1)  # runs only because the waiters released the GIL
    t.finish_load(0)
    t.abort_load(1)
    for th in threads:
        th.join(timeout=10)
        assert not th.is_alive()
    assert results == {0: True, 1: False}


def test_open_missing_file_names_path(tmp_path):
    path = str(tmp_path / "nope.bin")
    with pytest.raises(RuntimeError, match="nope.bin"):
        SlotTable.open(path)


def test_open_short_file_names_path(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(b"\0" * 10)
    with pytest.raises(ValueError, match=f"{path}.*smaller than"):
        SlotTable.open(str(path))


def test_open_bad_magic_names_path(tmp_path):
    path = tmp_path / "junk.bin"
    path.write_bytes(b"x" * 4096)
    with pytest.raises(ValueError, match=f"{path}.*bad magic"):
        SlotTable.open(str(path))


def test_open_truncated_table_names_path(table_path):
    SlotTable.create(table_path, 8, 2)
    with open(table_path, "r+b") as f:
        f.truncate(SlotTable.file_size(8) - 64)
    with pytest.raises(ValueError, match=f"{table_path}.*header says 8 entries"):
        SlotTable.open(table_path)


def test_create_rejects_bad_sizes(table_path):
    with pytest.raises(ValueError, match="num_entries"):
        SlotTable.create(table_path, 0, 1)
    with pytest.raises(ValueError, match="num_slots"):
        SlotTable.create(table_path, 1, 0)


def test_open_wrong_version_names_path(table_path):
    SlotTable.create(table_path, 2, 2)
    with open(table_path, "r+b") as f:
        f.seek(8)  # header: u64 magic, u32 version, u32 num_entries, u32 num_slots
        f.write((99).to_bytes(4, "little"))
    with pytest.raises(ValueError, match=f"{table_path}.*version 99"):
        SlotTable.open(table_path)


# -- version 2: batches, access stamps, hits, client ledgers ----------------------------------------
def test_open_v1_table_is_refused(tmp_path):
    # A version-1 file: 64-byte header (magic, version 1, 2 entries, 2 slots) + 2 64-byte entries.
    path = tmp_path / "v1.bin"
    header = (0x4C42545453435845).to_bytes(8, "little") + (1).to_bytes(4, "little")
    header += (2).to_bytes(4, "little") + (2).to_bytes(4, "little")
    path.write_bytes(header.ljust(64, b"\0") + b"\0" * 128)
    with pytest.raises(ValueError, match=f"{path}: version 1, expected 4.*restart the cache daemon"):
        SlotTable.open(str(path))


def test_try_pin_many_and_unpin_many(table_path):
    t = SlotTable.create(table_path, 6, 4)
    _make_resident(t, 1, 3)
    _make_resident(t, 4, 0)
    t.begin_load(2, 1)  # LOADING: not pinnable
    assert t.try_pin_many([1, 2, 4, 5]) == [3, -1, 0, -1]
    assert [t.pins(e) for e in range(6)] == [0, 1, 0, 0, 1, 0]
    assert t.hits == 2
    assert not t.try_evict(1) and not t.try_evict(4)
    t.unpin_many([1, 4])
    assert [t.pins(e) for e in range(6)] == [0] * 6
    assert t.try_evict(4)
    assert t.try_pin_many([]) == []


def test_batches_check_every_index_first(table_path):
    t = SlotTable.create(table_path, 4, 2)
    _make_resident(t, 0, 0)
    with pytest.raises(IndexError, match="entry 4 out of range"):
        t.try_pin_many([0, 4])
    assert t.pins(0) == 0  # nothing pinned
    assert t.try_pin_many([0]) == [0]
    with pytest.raises(RuntimeError, match="unpin of entry 1 which has no pins"):
        t.unpin_many([0, 1])
    with pytest.raises(RuntimeError, match="unpin of entry 0 which has no pins"):
        t.unpin_many([0, 0])
    assert t.pins(0) == 1  # nothing unpinned
    with pytest.raises(IndexError, match="entry -1 out of range"):
        t.access_stamps([0, -1])


def test_access_stamps_follow_pin_order(table_path):
    t = SlotTable.create(table_path, 4, 4)
    for e in range(4):
        _make_resident(t, e, e)
    assert t.access_stamps([0, 1, 2, 3]) == [0, 0, 0, 0] and t.clock == 0
    t.try_pin_many([2, 0])
    t.try_pin(3)
    t.try_pin(2)
    stamps = t.access_stamps([0, 1, 2, 3])
    assert stamps == [2, 0, 4, 3] and t.clock == 4 and t.hits == 4
    assert t.accessed_since(0) == [0, 3, 2]  # stamp order, each entry once (its last access)
    assert t.accessed_since(2) == [3, 2]
    assert t.accessed_since(4) == []
    assert t.try_pin(1) == 1 and t.stamp(1) == 5


def test_client_ledger_tracks_and_reclaims_pins(table_path):
    t = SlotTable.create(table_path, 4, 4, num_clients=2)
    assert t.num_clients == 2
    for e in range(3):
        _make_resident(t, e, e)
    compute = SlotTable.open(table_path)
    epoch = t.client_epoch(1)
    compute.attach_client(1, epoch)
    assert compute.bound_client == 1
    assert compute.try_pin_many([0, 1, 3]) == [0, 1, -1]
    assert compute.try_pin(1) == 1
    assert t.try_pin(2) == 2  # an unledgered pin of another process
    assert [t.client_pins(1, e) for e in range(4)] == [1, 2, 0, 0]
    assert [t.pins(e) for e in range(4)] == [1, 2, 1, 0]
    compute.unpin_many([1])
    with pytest.raises(RuntimeError, match="unpin of entry 2 which this client has not pinned"):
        compute.unpin(2)
    assert t.reclaim_client(1) == 2  # entry 0 and one pin of entry 1
    assert [t.pins(e) for e in range(4)] == [0, 0, 1, 0]
    assert [t.client_pins(1, e) for e in range(4)] == [0] * 4
    assert t.client_epoch(1) == epoch + 1
    stale = "client ledger 1 was reclaimed by the cache daemon"
    with pytest.raises(native_stale_client(), match=stale):
        compute.try_pin_many([0])
    with pytest.raises(native_stale_client(), match=stale):
        compute.unpin_many([0])  # a reclaimed pin is never dropped twice
    assert t.pins(0) == 0
    with pytest.raises(native_stale_client(), match="is at epoch 1, not 0.*attach again"):
        SlotTable.open(table_path).attach_client(1, epoch)
    with pytest.raises(IndexError, match="client 2 out of range"):
        compute.attach_client(2, 0)
    assert t.try_evict(0) and t.try_evict(1)


def native_stale_client():
    import expertcache.native as native

    return native.StaleClient


def test_sigkilled_client_pins_are_reclaimed(table_path):
    t = SlotTable.create(table_path, 3, 3, num_clients=4)
    for e in range(3):
        _make_resident(t, e, e)
    code = (
        "t = SlotTable.open(sys.argv[1])\n"
        "t.attach_client(3, int(sys.argv[2]))\n"
        "assert t.try_pin_many([0, 2]) == [0, 2]\n"
        "print('pinned', flush=True)\n"
        "import time; time.sleep(60)\n"
    )
    child = _started(code, "pinned", table_path, str(t.client_epoch(3)))
    child.kill()
    child.wait(timeout=10)
    assert [t.pins(e) for e in range(3)] == [1, 0, 1]
    assert not t.try_evict(0)
    assert t.reclaim_client(3) == 2
    assert [t.pins(e) for e in range(3)] == [0, 0, 0]
    assert t.try_evict(0) and t.try_evict(2)


def test_reclaim_races_with_a_live_client_never_loses_count(table_path):
    # A client pins/unpins in a loop while the daemon reclaims its ledger: whichever side wins,
    # the shared count ends at 0 (no pin left behind, none subtracted twice).
    t = SlotTable.create(table_path, 1, 1, num_clients=1)
    _make_resident(t, 0, 0)
    code = (
        "import expertcache.native as n\n"
        "t = SlotTable.open(sys.argv[1])\n"
        "t.attach_client(0, 0)\n"
        "print('go', flush=True)\n"
        "try:\n"
        "    while True:\n"
        "        t.try_pin_many([0]); t.try_pin(0); t.unpin_many([0, 0])\n"
        "except n._native.StaleClient:\n"
        "    print('stale')\n"
    )
    child = _started(code, "go", table_path)
    time.sleep(0.05)
    t.reclaim_client(0)
    assert _output(child).strip() == "stale"
    assert t.pins(0) == 0 and t.client_pins(0, 0) == 0


def test_two_processes_pin_many_with_ledgers(table_path):
    t = SlotTable.create(table_path, 4, 4, num_clients=2)
    for e in range(4):
        _make_resident(t, e, e)
    code = (
        "t = SlotTable.open(sys.argv[1])\n"
        "t.attach_client(int(sys.argv[2]), 0)\n"
        "for _ in range(20_000):\n"
        "    assert t.try_pin_many([0, 1, 2, 3]) == [0, 1, 2, 3]\n"
        "    t.unpin_many([0, 1, 2, 3])\n"
        "print('ok')\n"
    )
    children = [_child(code, table_path, str(c)) for c in range(2)]
    for c in children:
        out, err = c.communicate(timeout=120)
        assert c.returncode == 0, err
        assert out.strip() == "ok"
    assert [t.pins(e) for e in range(4)] == [0] * 4
    assert t.hits == 2 * 20_000 * 4
    assert t.clock == t.hits


# -- version 3: the unpin word (a daemon waiting for slots sleeps until compute unpins) -------------
def test_unpin_to_zero_bumps_the_word_and_nothing_else_does(table_path):
    t = SlotTable.create(table_path, 4, 4)
    _make_resident(t, 0, 0)
    seq = t.unpin_seq
    assert t.try_pin_many([0, 0]) == [0, 0]
    t.unpin(0)  # one pin left: the entry is still pinned
    assert t.unpin_seq == seq
    assert not t.wait_unpin(seq, 0.01)  # times out: nothing changed
    t.unpin(0)  # the last pin: evictable now
    assert t.unpin_seq == seq + 1
    assert t.wait_unpin(seq, 10.0)  # already moved on: returns at once
    t.wake_unpin_waiters()
    assert t.unpin_seq == seq + 2
    assert [s for s in t.states()] == [TableState.RESIDENT, 0, 0, 0] and t.slots() == [0, -1, -1, -1]
    with pytest.raises(ValueError, match="timeout_s is NaN"):
        t.wait_unpin(seq, float("nan"))


def test_a_waiting_daemon_is_woken_by_another_process_unpinning(table_path):
    t = SlotTable.create(table_path, 2, 2, num_clients=1)
    _make_resident(t, 1, 0)
    code = (
        "t = SlotTable.open(sys.argv[1])\n"
        "t.attach_client(0, 0)\n"
        "t.try_pin(1)\n"
        "print('pinned', flush=True)\n"
        "sys.stdin.readline()\n"
        "t.unpin(1)\n"
        "print('unpinned', flush=True)\n"
    )
    child = _started(code, "pinned", table_path, stdin=True)
    seq = t.unpin_seq
    assert not t.try_evict(1)  # compute pins it
    woken = []
    waiter = threading.Thread(target=lambda: woken.append(t.wait_unpin(seq, 30.0)))
    waiter.start()
    time.sleep(0.05)
    assert not woken  # asleep on the futex, not polling
    child.stdin.write("\n")
    child.stdin.flush()
    waiter.join(30)
    assert woken == [True] and t.try_evict(1)
    _output(child)


def test_reclaim_wakes_a_waiter_and_waits_for_a_client_inside_a_call(table_path):
    t = SlotTable.create(table_path, 1, 1, num_clients=1)
    _make_resident(t, 0, 0)
    client = SlotTable.open(table_path)
    client.attach_client(0, 0)
    client.try_pin(0)
    seq = t.unpin_seq
    assert t.reclaim_client(0) == 1
    assert t.unpin_seq == seq + 1  # its pins dropped: a waiting admission re-checks
    # A reclaim with no client inside a call does not wait (the busy word is 0).
    started = time.perf_counter()
    t.reclaim_client(0)
    assert time.perf_counter() - started < 0.5


def test_daemon_holds_count_with_compute_pins(table_path):
    t = SlotTable.create(table_path, 3, 3)
    t.begin_load(0, 0)
    t.hold(0, 2)  # two Demand sessions wait for the load
    t.finish_load(0)
    assert t.pins(0) == 2 and t.hits == 0 and t.stamp(0) == 0  # no access stamp, no table hit
    assert not t.try_evict(0)
    seq = t.unpin_seq
    t.unpin_many([0, 0])
    assert t.pins(0) == 0 and t.unpin_seq == seq + 1 and t.try_evict(0)
    with pytest.raises(RuntimeError, match="hold of entry 0 in state ABSENT, expected LOADING or RESIDENT"):
        t.hold(0)
