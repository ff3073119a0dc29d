"""The shared slot table, version 6 (csrc/include/expertcache/slot_table.h): the daemon's table in
memfds, compute handles attached from its descriptors, pins in per-client regions, evictions,
loads and the waits across processes. Hostile clients: test_slot_table_isolation.py."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from expertcache import _native
from expertcache.native import SlotTable, StaleClient, TableState
from tests.slot_tables import claim_and_attach, spawn_holding
from tests.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]


def _child(t: SlotTable, client: int, code: str, *, stdin: bool = False) -> subprocess.Popen:
    """A process holding ledger ``client`` of ``t`` (a new region, claimed here): ``code`` runs
    with its compute handle as ``h``, attached from the descriptors it inherited."""
    epoch = t.claim_channel(client)
    fds = (t.table_fd(), t.client_fd(client))
    prelude = (
        "import os, sys\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "from expertcache.native import SlotTable, StaleClient\n"
        "tf, rf, client, epoch = map(int, sys.argv[1:5])\n"
        "h = SlotTable.attach(tf, rf, client, epoch)\n"
        "os.close(tf)\n"
        "os.close(rf)\n"
    )
    return spawn_holding(prelude + code, fds, (*fds, client, epoch), stdin=stdin)


def _started(t: SlotTable, client: int, code: str, said: str, *, stdin: bool = False) -> subprocess.Popen:
    """A child that has printed ``said``: it has done what comes before that line of ``code``."""
    child = _child(t, client, code, stdin=stdin)
    line = child.stdout.readline().strip()
    if line != said:
        child.kill()
        _, err = child.communicate(timeout=30)
        pytest.fail(f"child said {line!r}, not {said!r}: {err}")
    return child


def _output(child: subprocess.Popen, timeout_s: float = 60) -> str:
    """What the child printed once it has exited cleanly (within ``timeout_s``)."""
    out, err = child.communicate(timeout=timeout_s)
    assert child.returncode == 0, err
    return out


def _make_resident(t: SlotTable, entry: int, slot: int) -> None:
    t.begin_load(entry, slot)
    t.finish_load(entry)


def _one_resident_entry(name: str) -> SlotTable:
    """A table of one entry, resident in its one slot, with one client ledger."""
    t = SlotTable.create(name, 1, 1, num_clients=1)
    _make_resident(t, 0, 0)
    return t


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _sealed_memfd(data: bytes) -> int:
    """A memfd holding ``data``, sealed against shrinking and growing (as the daemon's are): what
    a forged table or region looks like to attach."""
    import fcntl

    fd = os.memfd_create("forged", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(fd, data)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


def test_version_and_layout_sizes():
    assert _native.SLOT_TABLE_VERSION == 6
    # Header 128 B + 16 B per entry (padded to 64 B).
    assert SlotTable.table_bytes(8) == 128 + 128 and SlotTable.table_bytes(5) == 128 + 128
    # ClientHeader 128 B | pins (4 B each) | stamps (8 B each) | channel: each part padded to 64 B.
    channel = SlotTable.region_bytes(16, 8, 4096) - (128 + 64 + 128)
    assert SlotTable.region_bytes(100, 8, 4096) == 128 + 448 + 832 + channel


def test_create_and_attach():
    t = SlotTable.create("st-create", 8, 3)
    assert (t.num_entries, t.num_slots, t.num_clients, t.name, t.is_owner) == (8, 3, 32, "st-create", True)
    for e in range(8):
        assert t.state(e) == TableState.ABSENT
        assert (t.pins(e), t.slot(e), t.generation(e)) == (0, -1, 0)
    _make_resident(t, 5, 2)
    epoch = t.claim_channel(0)  # the daemon keeps the new region's memfd open
    before = _open_fds()
    table_fd, region_fd = t.table_fd(), t.client_fd(0)
    h = SlotTable.attach(table_fd, region_fd, 0, epoch)
    os.close(table_fd)
    os.close(region_fd)
    assert _open_fds() == before  # attach keeps no descriptor: the mappings are enough
    assert (h.is_owner, h.bound_client, h.num_entries, h.num_slots, h.num_clients) == (False, 0, 8, 3, 32)
    assert h.state(5) == TableState.RESIDENT  # compute reads what the daemon published
    assert (h.slot(5), h.generation(5)) == (2, 1)
    assert h.try_pin(5) == 2
    assert (t.pins(5), h.pins(5), t.client_pins(0, 5)) == (1, 1, 1)
    assert (h.hits, t.hits) == (1, 1)
    # table_fd and client_fd hand out a new descriptor at every call; the caller closes them.
    fds = [t.table_fd(), t.table_fd(), t.client_fd(0)]
    assert len(set(fds)) == 3
    for fd in fds:
        os.fstat(fd)
        os.close(fd)
    assert _open_fds() == before


def test_lifecycle_and_transitions():
    t = SlotTable.create("st-life", 2, 2)
    h = claim_and_attach(t, 0)
    assert h.try_pin(0) is None  # ABSENT
    t.begin_load(0, 1)
    assert t.state(0) == h.state(0) == TableState.LOADING
    assert h.try_pin(0) is None  # LOADING
    with pytest.raises(RuntimeError, match="begin_load of entry 0 in state LOADING"):
        t.begin_load(0, 0)
    t.finish_load(0)
    with pytest.raises(RuntimeError, match="finish_load of entry 0 in state RESIDENT"):
        t.finish_load(0)
    with pytest.raises(RuntimeError, match="abort_load of entry 0 in state RESIDENT"):
        t.abort_load(0)
    assert h.try_pin(0) == 1
    h.unpin(0)
    assert t.try_evict(0)
    assert (t.state(0), t.slot(0), t.pins(0)) == (TableState.ABSENT, -1, 0)
    assert (h.state(0), h.slot(0)) == (TableState.ABSENT, -1)
    assert not t.try_evict(0)  # already ABSENT
    _make_resident(t, 0, 0)
    assert t.generation(0) == h.generation(0) == 2
    t.begin_load(1, 0)
    t.abort_load(1)
    assert t.state(1) == h.state(1) == TableState.ABSENT
    assert t.generation(1) == 0  # an aborted load is no generation


def test_unpin_below_zero_raises():
    t = SlotTable.create("st-unpin0", 1, 1)
    h = claim_and_attach(t, 0)
    _make_resident(t, 0, 0)
    with pytest.raises(RuntimeError, match="unpin of entry 0 which this client has not pinned"):
        h.unpin(0)
    assert h.try_pin(0) == 0
    h.unpin(0)
    with pytest.raises(RuntimeError, match="which this client has not pinned"):
        h.unpin(0)
    assert t.pins(0) == h.pins(0) == 0
    # The owner's unpin drops the daemon's own holds.
    with pytest.raises(RuntimeError, match="unpin of entry 0 which has no pins"):
        t.unpin(0)
    t.hold(0)
    t.unpin(0)
    assert t.pins(0) == 0


def test_pinned_entry_cannot_be_evicted():
    t = SlotTable.create("st-pinned", 1, 1)
    h = claim_and_attach(t, 0)
    _make_resident(t, 0, 0)
    assert h.try_pin(0) == 0
    assert h.try_pin(0) == 0
    assert not t.try_evict(0)
    assert t.state(0) == h.state(0) == TableState.RESIDENT  # a refused eviction goes back
    h.unpin(0)
    assert not t.try_evict(0)
    h.unpin(0)
    assert t.try_evict(0)
    assert h.try_pin(0) is None


def test_pins_of_every_attached_region_and_the_holds_count():
    t = SlotTable.create("st-sum", 2, 2, num_clients=3)
    handles = [claim_and_attach(t, c) for c in range(3)]
    _make_resident(t, 0, 0)
    for n, h in enumerate(handles):
        for _ in range(n + 1):
            assert h.try_pin(0) == 0
    t.hold(0, 4)
    assert t.pins(0) == 1 + 2 + 3 + 4
    assert [h.pins(0) for h in handles] == [1, 2, 3]  # each handle sees its own
    assert [t.client_pins(c, 0) for c in range(3)] == [1, 2, 3]
    for n, h in enumerate(handles):
        h.unpin_many([0] * (n + 1))
        assert not t.try_evict(0)  # the holds remain
    t.unpin_many([0] * 4)
    assert t.pins(0) == 0 and t.try_evict(0)


def test_bounds_checked():
    t = SlotTable.create("st-bounds", 4, 2, num_clients=2)
    h = claim_and_attach(t, 0)
    for call in (h.try_pin, h.unpin, h.state, h.pins, h.slot, h.generation):
        with pytest.raises(IndexError, match="entry 4 out of range"):
            call(4)
        with pytest.raises(IndexError, match="entry -1 out of range"):
            call(-1)
    for call in (t.finish_load, t.abort_load, t.try_evict, t.state, t.pins, t.slot, t.generation, t.hold):
        with pytest.raises(IndexError, match="entry 4 out of range"):
            call(4)
        with pytest.raises(IndexError, match="entry -1 out of range"):
            call(-1)
    with pytest.raises(IndexError, match="entry 4 out of range"):
        h.wait_resident(4, 0.0)
    with pytest.raises(IndexError, match="slot 2 out of range"):
        t.begin_load(0, 2)
    for call in (t.claim_channel, t.client_fd, t.reclaim_client, t.audit_client, t.client_epoch):
        with pytest.raises(IndexError, match="client 2 out of range"):
            call(2)
    with pytest.raises(IndexError, match="client 2 out of range"):
        t.hold_for_client(2, 0, 0)
    assert t.state(0) == TableState.ABSENT


def test_create_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_entries must be > 0"):
        SlotTable.create("bad", 0, 1)
    with pytest.raises(ValueError, match="num_entries must be <= 2"):
        SlotTable.create("bad", (1 << 24) + 1, 1)
    with pytest.raises(ValueError, match="num_slots must be > 0"):
        SlotTable.create("bad", 1, 0)
    with pytest.raises(ValueError, match="num_clients must be in"):
        SlotTable.create("bad", 1, 1, num_clients=0)
    with pytest.raises(ValueError, match="num_clients must be in"):
        SlotTable.create("bad", 1, 1, num_clients=4097)


def test_attach_refuses_what_is_not_a_table_or_region_of_it():
    t = SlotTable.create("st-refuse", 4, 2, num_clients=2)
    epoch = t.claim_channel(0)
    table_fd, region_fd = t.table_fd(), t.client_fd(0)
    header = bytearray(128)
    header[0:8] = (0x4C42545453435845).to_bytes(8, "little")  # "EXCSTTBL"
    forged = []
    try:
        with pytest.raises(ValueError, match="bad magic"):
            SlotTable.attach(region_fd, region_fd, 0, epoch)  # the region given as the table
        with pytest.raises(ValueError, match="client region: .*smaller than"):
            SlotTable.attach(table_fd, table_fd, 0, epoch)  # the table given as the region
        plain = os.memfd_create("plain", os.MFD_CLOEXEC)
        forged.append(plain)
        os.ftruncate(plain, os.fstat(region_fd).st_size)
        with pytest.raises(ValueError, match="not a sealed memfd of the cache daemon"):
            SlotTable.attach(table_fd, plain, 0, epoch)
        with pytest.raises(ValueError, match="not a sealed memfd of the cache daemon"):
            SlotTable.attach(plain, region_fd, 0, epoch)
        # A table of another release: magic right, version 5.
        old = bytearray(header)
        old[8:12] = (5).to_bytes(4, "little")
        forged.append(_sealed_memfd(bytes(old) + bytes(128)))
        with pytest.raises(ValueError, match="version 5, expected 6"):
            SlotTable.attach(forged[-1], region_fd, 0, epoch)
        # Version 6, but the header's sizes disagree with the memfd's (8 entries in 256 bytes).
        bad = bytearray(header)
        for at, value in ((8, 6), (12, 8), (16, 2), (20, 2), (24, 4), (28, 4096)):
            bad[at : at + 4] = value.to_bytes(4, "little")
        forged.append(_sealed_memfd(bytes(bad) + bytes(64)))
        with pytest.raises(ValueError, match="inconsistent header"):
            SlotTable.attach(forged[-1], region_fd, 0, epoch)
        # A region of the right size that the daemon did not make (no magic).
        forged.append(_sealed_memfd(bytes(os.fstat(region_fd).st_size)))
        with pytest.raises(ValueError, match="not a region of this slot table"):
            SlotTable.attach(table_fd, forged[-1], 0, epoch)
        # A region of another table (another size).
        other = SlotTable.create("st-refuse-other", 5, 2, num_clients=2)
        other.claim_channel(0)
        forged.append(other.client_fd(0))
        with pytest.raises(ValueError, match="client region"):
            SlotTable.attach(table_fd, forged[-1], 0, epoch)
        with pytest.raises(IndexError, match="client 2 out of range"):
            SlotTable.attach(table_fd, region_fd, 2, epoch)
        with pytest.raises(StaleClient, match=f"is at epoch {epoch}, not {epoch + 1}.*attach again"):
            SlotTable.attach(table_fd, region_fd, 0, epoch + 1)
        assert SlotTable.attach(table_fd, region_fd, 0, epoch).try_pin(0) is None
    finally:
        for fd in (table_fd, region_fd, *forged):
            os.close(fd)


def test_roles_are_enforced():
    t = SlotTable.create("st-roles", 4, 2, num_clients=2)
    h = claim_and_attach(t, 0)
    _make_resident(t, 0, 0)
    with pytest.raises(RuntimeError, match="try_pin is compute's"):
        t.try_pin(0)
    with pytest.raises(RuntimeError, match="try_pin is compute's"):
        t.try_pin_many([0])
    daemons = {
        "begin_load": lambda: h.begin_load(1, 0),
        "finish_load": lambda: h.finish_load(0),
        "abort_load": lambda: h.abort_load(0),
        "try_evict": lambda: h.try_evict(0),
        "hold": lambda: h.hold(0),
        "claim_channel": lambda: h.claim_channel(1),
        "table_fd": h.table_fd,
        "client_fd": lambda: h.client_fd(0),
        "hold_for_client": lambda: h.hold_for_client(0, 0, 0),
        "unhold_for_client": lambda: h.unhold_for_client(0, 0, 0),
        "reclaim_client": lambda: h.reclaim_client(0),
        "audit_client": lambda: h.audit_client(0),
        "accessed_since": lambda: h.accessed_since(0),
        "wait_unpin": lambda: h.wait_unpin(0, 0.0),
        "set_signals_wanted": lambda: setattr(h, "signals_wanted", False),
    }
    for name, call in daemons.items():
        with pytest.raises(RuntimeError, match=f"{name} is the cache daemon's"):
            call()
    # Nothing moved: the entry is still the daemon's RESIDENT one, unpinned.
    assert (t.state(0), t.pins(0), t.state(1), t.signals_wanted) == (TableState.RESIDENT, 0, 0, True)
    assert h.try_pin(0) == 0


def test_wake_unpin_waiters_on_a_compute_handle_raises():
    code = (
        f"import os, sys\nsys.path.insert(0, {str(REPO)!r})\n"
        "from expertcache.native import SlotTable\n"
        "t = SlotTable.create('st-wake', 2, 1)\n"
        "epoch = t.claim_channel(0)\n"
        "h = SlotTable.attach(t.table_fd(), t.client_fd(0), 0, epoch)\n"
        "try:\n"
        "    h.wake_unpin_waiters()\n"
        "except RuntimeError as e:\n"
        "    print(e)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"rc {done.returncode}: {done.stderr}"
    assert "the cache daemon's" in done.stdout


def test_concurrent_pin_unpin_two_processes():
    t = SlotTable.create("st-2proc", 2, 4, num_clients=2)
    _make_resident(t, 0, 3)
    t.begin_load(1, 0)  # entry 1 is the start gate: children wait for it to become resident
    code = (
        "print('ready', flush=True)\n"
        "assert h.wait_resident(1, 30.0)\n"
        "for _ in range(100_000):\n"
        "    assert h.try_pin(0) == 3\n"
        "    h.unpin(0)\n"
        "print(h.hits)\n"
    )
    children = [_started(t, c, code, "ready") for c in range(2)]
    t.finish_load(1)  # both children start pinning at the same moment
    for c in children:
        assert _output(c, 120).strip() == "100000"
    assert t.pins(0) == 0
    assert t.hits == 200_000
    assert t.state(0) == TableState.RESIDENT and t.try_evict(0)


def test_evict_races_with_pinners_never_evicts_pinned():
    # The child pins, checks the entry is still there while pinned (in its slot, of the same load),
    # and unpins: 50 000 tries and at least 2 000 pins (on a loaded machine the evicting parent may
    # win many in a row). While pinned the state may read EVICTING for an instant: an evictor that
    # saw no pin before ours moves RESIDENT -> EVICTING, then sees our pin and moves it back,
    # evicting nothing. What must never happen is ABSENT or LOADING, another slot or another
    # generation (an eviction and a reload).
    code = (
        "held = tries = 0\n"
        "while tries < 50_000 or held < 2_000:\n"
        "    tries += 1\n"
        "    slot = h.try_pin(0)\n"
        "    if slot is not None:\n"
        "        gen = h.generation(0)\n"
        "        state = h.state(0)\n"
        "        assert state in (2, 3), state\n"
        "        assert (h.slot(0), h.generation(0)) == (slot, gen), (h.slot(0), slot, h.generation(0), gen)\n"
        "        held += 1\n"
        "        h.unpin(0)\n"
        "print(held)\n"
    )
    t = _one_resident_entry("st-evict-race")
    child = _child(t, 0, code)
    evicted = 0
    deadline = time.monotonic() + 240
    while child.poll() is None:
        assert time.monotonic() < deadline, "the child did not finish"
        if t.try_evict(0):
            evicted += 1
            _make_resident(t, 0, 0)
    held = int(_output(child))
    assert t.pins(0) == 0
    assert evicted > 0 and held > 0
    assert t.generation(0) == evicted + 1


def test_wait_resident_woken_by_other_process():
    t = SlotTable.create("st-wake-proc", 1, 1, num_clients=1)
    t.begin_load(0, 0)
    code = (
        "import time\n"
        "print('ready', flush=True)\n"
        "t0 = time.monotonic()\n"
        "ok = h.wait_resident(0, 30.0)\n"
        "print(ok, time.monotonic() - t0)\n"
    )
    child = _started(t, 0, code, "ready")
    t.finish_load(0)
    ok, elapsed = _output(child).split()
    assert ok == "True"
    assert float(elapsed) < 20.0  # woken by the futex, not by the 30 s timeout


def test_wait_resident_times_out():
    t = SlotTable.create("st-timeout", 1, 1)
    h = claim_and_attach(t, 0)
    t.begin_load(0, 0)
    t0 = time.monotonic()
    assert h.wait_resident(0, 0.2) is False
    assert 0.15 < time.monotonic() - t0 < 10.0
    assert h.wait_resident(0, 0.0) is False
    assert t.wait_resident(0, 0.0) is False  # the owner reads the published word too


def test_wait_resident_returns_immediately_unless_loading():
    t = SlotTable.create("st-immediate", 2, 1)
    h = claim_and_attach(t, 0)
    started = time.monotonic()
    assert h.wait_resident(0, 30.0) is False  # ABSENT
    _make_resident(t, 1, 0)
    assert h.wait_resident(1, 30.0) is True
    assert time.monotonic() - started < 10.0
    with pytest.raises(ValueError, match="timeout_s must be finite"):
        h.wait_resident(1, -1.0)
    with pytest.raises(ValueError, match="timeout_s must be finite"):
        h.wait_resident(1, float("inf"))


def test_wait_resident_releases_gil_and_sees_abort():
    t = SlotTable.create("st-gil", 2, 1)
    h = claim_and_attach(t, 0)
    t.begin_load(0, 0)
    t.begin_load(1, 0)
    results = {}

    def waiter(e):
        results[e] = h.wait_resident(e, 30.0)

    threads = [threading.Thread(target=waiter, args=(e,)) for e in (0, 1)]
    for th in threads:
        th.start()
    # Whether or not the waiters are asleep yet, they see the outcome; this thread runs at all
    # only because a waiter that sleeps released the GIL.
    t.finish_load(0)
    t.abort_load(1)
    for th in threads:
        th.join(timeout=30)
        assert not th.is_alive()
    assert results == {0: True, 1: False}


def test_try_pin_many_and_unpin_many():
    t = SlotTable.create("st-many", 6, 4)
    h = claim_and_attach(t, 0)
    _make_resident(t, 1, 3)
    _make_resident(t, 4, 0)
    t.begin_load(2, 1)  # LOADING: not pinnable
    assert h.try_pin_many([1, 2, 4, 5]) == [3, -1, 0, -1]
    assert [t.pins(e) for e in range(6)] == [0, 1, 0, 0, 1, 0]
    assert [h.pins(e) for e in range(6)] == [0, 1, 0, 0, 1, 0]
    assert h.hits == t.hits == 2
    assert h.resident_slots([1, 2, 4, 5]) == [3, -1, 0, -2]
    assert not t.try_evict(1) and not t.try_evict(4)
    h.unpin_many([1, 4])
    assert [t.pins(e) for e in range(6)] == [0] * 6
    assert t.try_evict(4)
    assert h.try_pin_many([]) == []
    h.unpin_many([])


def test_batches_check_every_index_first():
    t = SlotTable.create("st-check", 4, 2)
    h = claim_and_attach(t, 0)
    _make_resident(t, 0, 0)
    with pytest.raises(IndexError, match="entry 4 out of range"):
        h.try_pin_many([0, 4])
    assert h.pins(0) == 0 and h.hits == 0  # nothing pinned
    assert h.try_pin_many([0]) == [0]
    with pytest.raises(RuntimeError, match="unpin of entry 1 which this client has not pinned"):
        h.unpin_many([0, 1])
    with pytest.raises(RuntimeError, match="unpin of entry 0 which this client has not pinned"):
        h.unpin_many([0, 0])
    with pytest.raises(IndexError, match="entry -1 out of range"):
        h.unpin_many([0, -1])
    assert h.pins(0) == 1  # nothing unpinned
    with pytest.raises(IndexError, match="entry -1 out of range"):
        h.resident_slots([0, -1])
    t.hold(0, 1)
    with pytest.raises(RuntimeError, match="unpin of entry 0 which has no pins"):
        t.unpin_many([0, 0])
    assert t.pins(0) == 2


def _accessed(t: SlotTable, since: int, want: int) -> tuple[list[int], int]:
    """accessed_since(since) once it shows ``want`` entries (a scan may trail a pin a little)."""

    def shown():
        got = t.accessed_since(since)
        return got if len(got[0]) >= want else None

    return wait_for(shown, f"{want} accessed entries", poll_s=0.001)


def _tick() -> None:
    """Until CLOCK_MONOTONIC moves on: the next pin gets a later stamp than the last one."""
    now = time.monotonic_ns()
    while time.monotonic_ns() == now:
        pass


def test_accessed_since_follows_pin_order():
    t = SlotTable.create("st-stamps", 4, 4)
    h = claim_and_attach(t, 0)
    for e in range(4):
        _make_resident(t, e, e)
    entries, until = t.accessed_since(0)
    assert entries == [] and until <= time.monotonic_ns()
    h.try_pin_many([2, 0])  # one stamp for the batch
    _tick()
    h.try_pin(3)
    _tick()
    h.try_pin(2)  # entry 2 again: its last access counts
    entries, until = _accessed(t, 0, 3)
    assert entries == [0, 3, 2] and h.hits == t.hits == 4
    assert until <= time.monotonic_ns()
    assert t.accessed_since(until)[0] == []
    _tick()
    h.try_pin(1)
    entries, later = _accessed(t, until, 1)
    assert entries == [1] and later >= until
    # A hold is no access (no stamp, no hit); an unpin leaves the stamp.
    t.hold(3)
    h.unpin_many([0, 1, 2, 2, 3])
    assert t.accessed_since(later)[0] == [] and t.hits == 5
    assert _accessed(t, 0, 4)[0] == [0, 3, 2, 1]


def test_accessed_since_covers_every_region_until_it_is_detached():
    t = SlotTable.create("st-stamps-2", 4, 4, num_clients=2)
    h0, h1 = claim_and_attach(t, 0), claim_and_attach(t, 1)
    for e in range(4):
        _make_resident(t, e, e)
    h1.try_pin(3)
    _tick()
    h0.try_pin(1)
    assert _accessed(t, 0, 2)[0] == [3, 1]
    t.reclaim_client(1)  # ledger 1's region is detached: its stamps are read no more
    assert t.accessed_since(0)[0] == [1]


def test_client_ledger_tracks_and_reclaims_pins():
    t = SlotTable.create("st-ledger", 4, 4, num_clients=2)
    assert t.num_clients == 2
    for e in range(3):
        _make_resident(t, e, e)
    compute = claim_and_attach(t, 1)
    epoch = t.client_epoch(1)
    assert compute.bound_client == 1 and compute.client_epoch(1) == epoch
    assert compute.try_pin_many([0, 1, 3]) == [0, 1, -1]
    assert compute.try_pin(1) == 1
    other = claim_and_attach(t, 0)
    assert other.try_pin(2) == 2  # another client's pin
    assert [t.client_pins(1, e) for e in range(4)] == [1, 2, 0, 0]
    assert [compute.client_pins(1, e) for e in range(4)] == [1, 2, 0, 0]
    assert [t.pins(e) for e in range(4)] == [1, 2, 1, 0]
    compute.unpin_many([1])
    with pytest.raises(RuntimeError, match="unpin of entry 2 which this client has not pinned"):
        compute.unpin(2)
    hits = t.hits
    compute.count_waited(2)  # experts in flight it waited for and pinned itself
    other.count_waited(1)
    assert (compute.waited, other.waited, t.waited) == (2, 1, 3)
    with pytest.raises(RuntimeError, match="count_waited is compute's"):
        t.count_waited(1)
    assert t.reclaim_client(1) == 2  # entry 0 and one pin of entry 1
    assert t.hits == hits  # a detached region's hits still count
    assert t.waited == 3  # and its waited
    assert [t.pins(e) for e in range(4)] == [0, 0, 1, 0]
    assert [t.client_pins(1, e) for e in range(4)] == [0] * 4
    assert t.client_epoch(1) == epoch + 1
    stale = "client ledger 1 was reclaimed by the cache daemon"
    with pytest.raises(StaleClient, match=stale):
        compute.try_pin_many([0])
    with pytest.raises(StaleClient, match=stale):
        compute.unpin_many([0])  # a reclaimed pin is never dropped twice
    assert issubclass(StaleClient, RuntimeError)
    assert t.pins(0) == 0
    with pytest.raises(RuntimeError, match="client ledger 1 has no region"):
        t.client_fd(1)
    assert t.reclaim_client(1) == 0  # nothing to detach
    assert t.try_evict(0) and t.try_evict(1) and not t.try_evict(2)
    again = claim_and_attach(t, 1)  # a new region at the new epoch
    assert again.client_epoch(1) == t.client_epoch(1) == epoch + 3  # two reclaims, then the claim
    assert [again.pins(e) for e in range(4)] == [0] * 4


def test_sigkilled_client_pins_are_reclaimed():
    t = SlotTable.create("st-kill", 3, 3, num_clients=4)
    for e in range(3):
        _make_resident(t, e, e)
    code = "assert h.try_pin_many([0, 2]) == [0, 2]\nprint('pinned', flush=True)\nsys.stdin.read()\n"
    child = _started(t, 3, code, "pinned", stdin=True)
    child.kill()
    child.communicate(timeout=30)
    assert [t.pins(e) for e in range(3)] == [1, 0, 1]  # the region outlives the process
    assert not t.try_evict(0)
    assert t.reclaim_client(3) == 2
    assert [t.pins(e) for e in range(3)] == [0, 0, 0]
    assert t.try_evict(0) and t.try_evict(2)


def test_reclaim_races_with_a_live_client_and_never_waits_for_it():
    # A client pins/unpins in a loop while the daemon reclaims its ledger: the reclaim returns at
    # once, the client's next call is refused, and the detached region's pins count nowhere.
    code = (
        "print('go', flush=True)\n"
        "try:\n"
        "    while True:\n"
        "        h.try_pin_many([0]); h.try_pin(0); h.unpin_many([0, 0])\n"
        "except StaleClient:\n"
        "    print('stale')\n"
    )
    t = _one_resident_entry("st-reclaim-race")
    child = _started(t, 0, code, "go")
    started = time.monotonic()
    removed = t.reclaim_client(0)
    # Version 4 waited kReclaimWaitS (1 s) for a client inside a call; nothing waits now.
    assert time.monotonic() - started < 1.0 and 0 <= removed <= 2
    assert _output(child).strip() == "stale"
    assert t.pins(0) == 0 and t.client_pins(0, 0) == 0
    assert t.try_evict(0)


def test_two_processes_pin_many_with_ledgers():
    t = SlotTable.create("st-2many", 4, 4, num_clients=2)
    for e in range(4):
        _make_resident(t, e, e)
    code = (
        "for _ in range(20_000):\n"
        "    assert h.try_pin_many([0, 1, 2, 3]) == [0, 1, 2, 3]\n"
        "    h.unpin_many([0, 1, 2, 3])\n"
        "print(h.hits)\n"
    )
    children = [_child(t, c, code) for c in range(2)]
    for c in children:
        assert _output(c, 120).strip() == str(20_000 * 4)
    assert [t.pins(e) for e in range(4)] == [0] * 4
    assert t.hits == 2 * 20_000 * 4


# -- the unpin word (a daemon waiting for slots sleeps until something is unpinned) ----------------
def test_the_daemons_own_unpins_bump_the_word():
    t = SlotTable.create("st-word", 4, 4, num_clients=1)
    h = claim_and_attach(t, 0)
    _make_resident(t, 0, 0)
    seq = t.unpin_seq
    assert h.unpin_seq == seq  # compute reads the same word
    t.hold(0, 2)
    t.unpin(0)  # one hold left: the entry is still held
    assert t.unpin_seq == seq
    assert t.wait_unpin(seq, 0.0) is False  # nothing changed
    t.unpin(0)  # the last hold
    assert t.unpin_seq == seq + 1
    assert t.wait_unpin(seq, 10.0)  # already moved on: returns at once
    t.wake_unpin_waiters()
    assert t.unpin_seq == seq + 2
    # A client's unpin wakes a waiting daemon but leaves the word alone (compute cannot write it).
    assert h.try_pin_many([0, 0]) == [0, 0]
    h.unpin_many([0, 0])
    assert t.unpin_seq == seq + 2
    assert t.states() == [TableState.RESIDENT, 0, 0, 0] and t.slots() == [0, -1, -1, -1]
    assert h.states() == t.states() and h.slots() == t.slots()
    with pytest.raises(ValueError, match="timeout_s is NaN"):
        t.wait_unpin(seq, float("nan"))


def test_wait_unpin_is_a_short_poll():
    t = SlotTable.create("st-poll", 1, 1)
    seq = t.unpin_seq
    for timeout_s in (30.0, -1.0):  # longer than the poll, or none: one poll (5 ms) at most
        started = time.monotonic()
        assert t.wait_unpin(seq, timeout_s) is False
        assert time.monotonic() - started < 1.0


def test_a_polling_daemon_sees_another_process_unpin():
    t = SlotTable.create("st-wake-unpin", 2, 2, num_clients=1)
    _make_resident(t, 1, 0)
    code = "h.try_pin(1)\nprint('pinned', flush=True)\nsys.stdin.readline()\nh.unpin(1)\nprint('unpinned')\n"
    child = _started(t, 0, code, "pinned", stdin=True)
    assert not t.try_evict(1)  # compute pins it
    woken = []

    def daemon_waits():
        # What admission does: read the word, check, wait (a poll of <= 5 ms), check again.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            seen = t.unpin_seq
            if t.try_evict(1):
                woken.append(True)
                return
            t.wait_unpin(seen, 1.0)

    waiter = threading.Thread(target=daemon_waits)
    waiter.start()
    child.stdin.write("\n")
    child.stdin.flush()
    waiter.join(60)
    assert woken == [True] and t.state(1) == TableState.ABSENT
    assert _output(child).strip() == "unpinned"


def test_reclaim_bumps_the_unpin_word():
    t = _one_resident_entry("st-reclaim-word")
    client = claim_and_attach(t, 0)
    client.try_pin(0)
    seq = t.unpin_seq
    assert t.reclaim_client(0) == 1
    assert t.unpin_seq == seq + 1  # its pins dropped: a waiting admission re-checks
    assert t.try_evict(0)


def test_daemon_holds_count_with_compute_pins():
    t = SlotTable.create("st-holds", 3, 3)
    t.begin_load(0, 0)
    t.hold(0, 2)  # two Demand sessions wait for the load
    t.finish_load(0)
    time.sleep(0.003)  # past the stamps' slack: a stamp would show now
    assert t.pins(0) == 2 and t.hits == 0 and t.accessed_since(0)[0] == []  # no stamp, no hit
    assert not t.try_evict(0)
    seq = t.unpin_seq
    t.unpin_many([0, 0])
    assert t.pins(0) == 0 and t.unpin_seq == seq + 1 and t.try_evict(0)
    with pytest.raises(RuntimeError, match="hold of entry 0 in state ABSENT, expected LOADING or RESIDENT"):
        t.hold(0)


def test_the_owner_reports_its_own_record():
    t = SlotTable.create("st-record", 3, 2)
    h = claim_and_attach(t, 0)
    t.begin_load(0, 1)
    _make_resident(t, 2, 0)
    assert t.states() == [TableState.LOADING, TableState.ABSENT, TableState.RESIDENT]
    assert t.slots() == [1, -1, 0]
    assert h.states() == t.states() and h.slots() == t.slots()  # what compute reads is published
    assert h.resident_slots([0, 1, 2]) == [-1, -2, 0]
    assert [t.generation(e) for e in range(3)] == [h.generation(e) for e in range(3)] == [0, 0, 1]
