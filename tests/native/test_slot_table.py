from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from expertcache.native import SlotState, SlotTable

REPO = Path(__file__).resolve().parents[2]


def _child(code: str, *args: str) -> subprocess.Popen:
    prelude = f"import sys\nsys.path.insert(0, {str(REPO)!r})\nfrom expertcache.native import SlotTable\n"
    return subprocess.Popen(
        [sys.executable, "-c", prelude + code, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


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
        assert t.state(e) == SlotState.ABSENT
        assert (t.pins(e), t.slot(e), t.generation(e)) == (0, -1, 0)
    _make_resident(t, 5, 2)
    other = SlotTable.open(table_path)  # a second mapping of the same file sees the same words
    assert (other.num_entries, other.num_slots) == (8, 3)
    assert other.state(5) == SlotState.RESIDENT
    assert (other.slot(5), other.generation(5)) == (2, 1)
    assert other.try_pin(5) == 2
    assert t.pins(5) == 1


def test_lifecycle_and_transitions(table_path):
    t = SlotTable.create(table_path, 2, 2)
    assert t.try_pin(0) is None  # ABSENT
    t.begin_load(0, 1)
    assert t.state(0) == SlotState.LOADING
    assert t.try_pin(0) is None  # LOADING
    with pytest.raises(RuntimeError, match="begin_load of entry 0 in state LOADING"):
        t.begin_load(0, 0)
    t.finish_load(0)
    with pytest.raises(RuntimeError, match="finish_load of entry 0 in state RESIDENT"):
        t.finish_load(0)
    assert t.try_pin(0) == 1
    t.unpin(0)
    assert t.try_evict(0)
    assert (t.state(0), t.slot(0), t.pins(0)) == (SlotState.ABSENT, -1, 0)
    assert not t.try_evict(0)  # already ABSENT
    _make_resident(t, 0, 0)
    assert t.generation(0) == 2
    t.begin_load(1, 0)
    t.abort_load(1)
    assert t.state(1) == SlotState.ABSENT


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
    assert t.state(0) == SlotState.RESIDENT
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
    assert t.state(0) == SlotState.ABSENT


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
    assert t.state(0) == SlotState.RESIDENT


def test_evict_races_with_pinners_never_evicts_pinned(table_path):
    t = SlotTable.create(table_path, 1, 1)
    _make_resident(t, 0, 0)
    # The child pins, checks the entry is still resident while pinned, and unpins.
    code = (
        "t = SlotTable.open(sys.argv[1])\n"
        "held = 0\n"
        "for _ in range(50_000):\n"
        "    if t.try_pin(0) is not None:\n"
        "        assert t.state(0) == 2, t.state(0)\n"
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
    child = _child(code, table_path)
    assert child.stdout.readline().strip() == "ready"
    time.sleep(0.2)
    t.finish_load(0)
    out, err = child.communicate(timeout=30)
    assert child.returncode == 0, err
    ok, elapsed = out.split()
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
