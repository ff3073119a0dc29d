"""Hostile compute clients against the slot table, version 6 (csrc/include/expertcache/slot_table.h,
"Trust"): what a client can write is only its own region, and nothing it writes there can move
the daemon's sizes, states or slots, reach another client, or outlive its ledger. Each test names
the review finding of version 4 it answers (C1, C2, C3, C6, and the audit of stray pins); in
version 4 compute mapped the whole table read-write and the daemon read back what it found there."""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import random
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from expertcache.native import SlotTable, StaleClient, TableState
from tests.slot_tables import claim_and_attach

REPO = Path(__file__).resolve().parents[2]

F_SEAL_FUTURE_WRITE = 0x10  # linux/fcntl.h (Python's fcntl module lacks it)
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
LIVE = (TableState.LOADING, TableState.RESIDENT)


def _round64(n: int) -> int:
    return (n + 63) // 64 * 64


def _pins_at(num_entries: int) -> tuple[int, int]:
    """Offsets of pins[] and stamps[] in a client region: ClientHeader is 128 bytes, then uint32
    pins[num_entries] and uint64 stamps[num_entries], each padded to 64 bytes."""
    return 128, 128 + _round64(4 * num_entries)


def _map_region(t: SlotTable, client: int) -> mmap.mmap:
    """Ledger ``client``'s current region mapped read-write, as its compute process can map it."""
    fd = t.client_fd(client)
    try:
        return mmap.mmap(fd, 0)
    finally:
        os.close(fd)


def _set_pin(region: mmap.mmap, entry: int, count: int) -> None:
    pins, _ = _pins_at(0)
    struct.pack_into("<I", region, pins + 4 * entry, count)


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    return libc


def _run(code: str, *args: str, pass_fds: tuple[int, ...] = (), timeout_s: float = 240) -> str:
    """Runs ``code`` in a fresh interpreter (a crash there is a failure here, not pytest's death)."""
    prelude = f"import sys\nsys.path.insert(0, {str(REPO)!r})\n"
    done = subprocess.run(
        [sys.executable, "-c", prelude + code, *args],
        pass_fds=pass_fds,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert done.returncode == 0, f"exit status {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


# -- C1 ----------------------------------------------------------------------------------------------
def test_c1_compute_cannot_write_the_table_or_resize_anything():
    """C1: the daemon re-read sizes from shared memory that compute could write. Now the table is
    sealed: no writable mapping, no write, no mprotect to writable, no hole punched, no resize;
    the region cannot be resized either (so the daemon's mapping never faults)."""
    t = SlotTable.create("c1-seal", 8, 4, num_clients=2, max_demand=4, ring_bytes=4096)
    t.begin_load(1, 3)
    t.finish_load(1)
    h = claim_and_attach(t, 0)
    table_fd, region_fd = t.table_fd(), t.client_fd(0)
    libc = _libc()
    size = os.fstat(table_fd).st_size
    try:
        seals = fcntl.fcntl(table_fd, fcntl.F_GET_SEALS)
        want = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | F_SEAL_FUTURE_WRITE
        assert seals & want == want
        with pytest.raises(PermissionError):
            fcntl.fcntl(table_fd, fcntl.F_ADD_SEALS, 0)  # sealed against new seals (and none come off)
        region_seals = fcntl.fcntl(region_fd, fcntl.F_GET_SEALS)
        assert (
            region_seals & (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
            == fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
        )

        for access in (mmap.ACCESS_WRITE, mmap.ACCESS_DEFAULT):
            with pytest.raises(PermissionError):
                mmap.mmap(table_fd, size, access=access)
        reopened = os.open(f"/proc/self/fd/{table_fd}", os.O_RDWR)  # a new open file: same seals
        try:
            with pytest.raises(PermissionError):
                mmap.mmap(reopened, size)
            with pytest.raises(PermissionError):
                os.pwrite(reopened, b"\xff" * 4, 12)
        finally:
            os.close(reopened)
        with pytest.raises(PermissionError):
            os.pwrite(table_fd, b"\xff" * 4, 12)  # num_entries
        for fd in (table_fd, region_fd):
            for new_size in (0, 64, os.fstat(fd).st_size * 2):
                with pytest.raises(PermissionError):
                    os.ftruncate(fd, new_size)
        # A read-only shared mapping cannot be made writable afterwards.
        at = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, table_fd, 0)
        assert at not in (None, ctypes.c_void_p(-1).value)
        try:
            assert libc.mprotect(at, size, mmap.PROT_READ | mmap.PROT_WRITE) == -1
            assert ctypes.get_errno() in (13, 1)  # EACCES (or EPERM)
        finally:
            libc.munmap(at, size)
        # Nor can its pages be dropped (a punched hole would read as zeros).
        assert libc.fallocate(table_fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, size) == -1
        # A private copy-on-write mapping, where the kernel allows one, reaches nobody.
        try:
            private = mmap.mmap(table_fd, size, access=mmap.ACCESS_COPY)
        except PermissionError:
            private = None
        if private is not None:
            private[:] = b"\xff" * size
            private.close()
        ro = mmap.mmap(table_fd, size, access=mmap.ACCESS_READ)
        num_entries, num_slots = struct.unpack_from("<II", ro, 12)
        ro.close()
        assert (num_entries, num_slots) == (8, 4)
    finally:
        os.close(table_fd)
        os.close(region_fd)
    assert (t.num_entries, t.num_slots, t.max_demand, t.ring_bytes) == (8, 4, 4, 4096)
    assert (h.state(1), h.slot(1), h.generation(1)) == (TableState.RESIDENT, 3, 1)
    assert claim_and_attach(t, 1).num_entries == 8  # the header a new client reads is intact


def test_c1_a_compute_process_maps_the_table_read_only():
    """C1: in a compute process (which gets the fds over the handoff socket), every mapping of the
    table memfd is read-only, and it cannot write through any of them."""
    t = SlotTable.create("c1-maps", 4, 2, num_clients=1)
    epoch = t.claim_channel(0)
    fds = (t.table_fd(), t.client_fd(0))
    code = (
        "import ctypes, os\n"
        "from expertcache.native import SlotTable\n"
        "tf, rf, epoch = map(int, sys.argv[1:4])\n"
        "h = SlotTable.attach(tf, rf, 0, epoch)\n"
        "os.close(tf); os.close(rf)\n"
        "for line in open('/proc/self/maps'):\n"
        "    if line.rstrip().endswith('/memfd:c1-maps (deleted)'):\n"
        "        print(line.split()[1])\n"
    )
    try:
        out = _run(code, *map(str, (*fds, epoch)), pass_fds=fds)
    finally:
        for fd in fds:
            os.close(fd)
    perms = out.split()
    assert perms and all(p.startswith("r-") and p.endswith("s") for p in perms), perms


_C1_GARBAGE = r"""
import ctypes, mmap, os, random, struct, subprocess, time
from expertcache.native import SlotTable, StaleClient, TableState

N, SLOTS, MAXD, RING = 64, 16, 8, 4096
PINS, STAMPS = 128, 128 + 4 * N
CHANNEL = STAMPS + 8 * N
EXPERTS = CHANNEL + 960
RING_AT = EXPERTS + 64 + 64
assert RING_AT + RING == SlotTable.region_bytes(N, MAXD, RING)
LIVE = (TableState.LOADING, TableState.RESIDENT)
KINDS = ("begin", "end", "route", "ahead")
rng = random.Random(int(sys.argv[1]))
libc = ctypes.CDLL(None, use_errno=True)
libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]

t = SlotTable.create("c1-garbage", N, SLOTS, 2, MAXD, RING)
slot_of = {}  # the test's model of the daemon's record: entry -> slot (LOADING or RESIDENT)
for e in range(SLOTS - 1):
    t.begin_load(e, e)
    t.finish_load(e)
    slot_of[e] = e
t.begin_load(SLOTS - 1, SLOTS - 1)  # one stays LOADING
slot_of[SLOTS - 1] = SLOTS - 1
epoch = t.claim_channel(0)
tf, rf = t.table_fd(), t.client_fd(0)
h = SlotTable.attach(tf, rf, 0, epoch)
os.close(tf)
size = os.fstat(rf).st_size
region = mmap.mmap(rf, size)


def records():
    # Plausible-looking records of random types, lengths and counts: the parser's worst case.
    out, at = bytearray(), 0
    while True:
        n = 8 * rng.randint(1, 24)
        if at + n > RING:
            return bytes(out), at
        body = bytearray(os.urandom(n - 8))
        for i in range(0, len(body) - 3, 4):
            if rng.random() < 0.5:
                struct.pack_into("<I", body, i, rng.choice((0, 1, 2, 3, 7, 255, 1024, 65535, 2**31)))
        out += struct.pack("<IHH", n if rng.random() < 0.9 else rng.getrandbits(32), rng.randint(0, 5), 0)
        out += body
        at += n


def scribble(mode):
    if mode == "punch":  # the client gives its pages back: the daemon reads zeros, no fault
        assert libc.fallocate(rf, 3, 0, size) == 0
        return
    data = bytearray(b"\xff" * size) if mode == "ones" else bytearray(os.urandom(size))
    if mode in ("zero-pins", "records"):
        data[PINS:PINS + 4 * N] = bytes(4 * N)
    if mode == "stamps":  # stamps in the past, so that a scan takes them
        now = time.monotonic_ns()
        struct.pack_into(f"<{N}Q", data, STAMPS, *(rng.randrange(0, now) for _ in range(N)))
    if mode == "records":  # a valid header (the compute handle works) and ring bounds around random records
        struct.pack_into("<QIII", data, 0, 0x4E47524343435845, 5, N, epoch)
        ring, head = records()
        tail = rng.getrandbits(40) * RING
        struct.pack_into("<Q", data, CHANNEL + 24, tail + head)
        struct.pack_into("<Q", data, CHANNEL + 80, tail)
        data[RING_AT:RING_AT + len(ring)] = ring
    region[:] = bytes(data)


def reload_into(slot):
    new = rng.choice([x for x in range(N) if x not in slot_of])
    t.begin_load(new, slot)
    t.finish_load(new)
    slot_of[new] = slot


def check_record():
    assert t.slots() == [slot_of.get(e, -1) for e in range(N)]
    used = [s for s in t.slots() if s >= 0]
    assert len(used) == len(set(used)) == SLOTS
    assert h.slots() == t.slots()  # what compute reads is the daemon's record, published


def compute_calls():
    # The hostile client's own calls on its garbage: refused or done, never a crash.
    for call in (lambda: h.try_pin_many(list(range(N))), lambda: h.unpin_many([0, 1, 1]),
                 lambda: h.channel(0).post_demand(1, [1, 2]), lambda: h.channel(0).signal_end(3),
                 lambda: h.channel(0).signal_route(1, 2, 3, [4, 5]), lambda: h.channel(0).ring_doorbell(),
                 lambda: h.channel(0).wait_reply(1, h.channel(0).notify_seq, 0.0)):
        try:
            call()
        except (StaleClient, RuntimeError, ValueError):
            pass


MODES = ("random", "zero-pins", "ones", "stamps", "records", "punch")
taken = 0
for round_ in range(360):
    scribble(MODES[round_ % len(MODES)])
    compute_calls()
    pins = struct.unpack_from(f"<{N}I", region, PINS)
    stamps = struct.unpack_from(f"<{N}Q", region, STAMPS)
    hits = struct.unpack_from("<Q", region, 64)[0]
    for e in range(N):
        assert t.pins(e) == t.client_pins(0, e) == pins[e], (e, t.pins(e), pins[e])
    assert t.hits == hits
    pinned, stray = t.audit_client(0)
    assert pinned == sum(1 for p in pins if p)
    assert stray == [e for e in range(N) if pins[e] and t.state(e) not in LIVE][:64]
    since = rng.choice((0, rng.randrange(0, time.monotonic_ns())))
    entries, until = t.accessed_since(since)
    assert until >= since
    assert entries == [e for s, e in sorted((s, e) for e, s in enumerate(stamps) if since < s <= until)]
    # Evictions follow the region's pins; the freed slot is the daemon's own record of it.
    for e in sorted(slot_of):
        if t.state(e) != TableState.RESIDENT:
            assert not t.try_evict(e)
            continue
        slot = t.slot(e)
        assert slot == slot_of[e]
        assert t.try_evict(e) == (pins[e] == 0)
        if pins[e] == 0:
            del slot_of[e]
            reload_into(slot)
    check_record()
    # The daemon's pins for the client go into the garbage and come back out.
    e = rng.choice(sorted(slot_of))
    before = struct.unpack_from("<I", region, PINS + 4 * e)[0]
    assert t.hold_for_client(0, epoch, e)
    assert t.unhold_for_client(0, epoch, e) == (before != 0xFFFFFFFF)
    # The channel: take the demand, drain the ring, answer.
    daemon = t.channel(0)
    seq, layer, count = struct.unpack_from("<3I", region, CHANNEL)
    experts = list(struct.unpack_from(f"<{MAXD}I", region, EXPERTS))
    got = daemon.take_demand(taken)
    if seq == taken:
        assert got is None
    else:
        assert got[:3] == (seq, layer, experts[:min(count, MAXD)] + ([0xFFFFFFFF] if count > MAXD else []))
        assert isinstance(got[3], bytes) and len(got[3]) <= 256  # the trace context: bounded
        taken = seq
    recs, corrupt = daemon.drain()
    assert isinstance(corrupt, bool) and all(r[0] in KINDS for r in recs)
    assert daemon.drain() == ([], False)  # whatever it was, the ring is consumed
    daemon.reply(seq, 1, "garbage in")
    daemon.fail(2, "garbage out")
    daemon.set_source(MAXD - 1, 3)
    daemon.notify()
    daemon.wait_doorbell(daemon.doorbell_seq, 0.001)
    assert (daemon.reply_seq, daemon.reply_message, daemon.fail_message) == (seq, "garbage in", "garbage out")
    t.wait_unpin(t.unpin_seq, 0.0)

# A second process scribbles without pause while the daemon works (bounds only: the bytes move).
writer = subprocess.Popen(
    [sys.executable, "-c",
     "import mmap, os, sys\n"
     "m = mmap.mmap(int(sys.argv[1]), 0)\n"
     "ones = b'\\xff' * len(m)\n"
     "while True:\n"
     "    m[:] = os.urandom(len(m))\n"
     "    m[:] = ones\n", str(rf)],
    pass_fds=(rf,),
)
try:
    for round_ in range(300):
        for e in range(N):
            assert 0 <= t.pins(e) <= 0xFFFFFFFF
        pinned, stray = t.audit_client(0)
        assert pinned <= N and len(stray) <= 64
        assert all(0 <= e < N and t.state(e) not in LIVE for e in stray)
        entries, until = t.accessed_since(0)
        assert len(entries) <= N and all(0 <= e < N for e in entries)
        for e in sorted(slot_of):
            if t.state(e) == TableState.RESIDENT:
                slot = t.slot(e)
                if t.try_evict(e):
                    del slot_of[e]
                    reload_into(slot)
        check_record()
        got = t.channel(0).take_demand(round_)
        assert got is None or len(got[2]) <= MAXD + 1
        recs, corrupt = t.channel(0).drain()
        assert all(r[0] in KINDS for r in recs)
        assert 0 <= t.hits < 2**64
    assert writer.poll() is None  # it wrote all along
finally:
    writer.kill()
    writer.wait()

# Reclaim: returns the region's pins as they are, never waits, and the region then counts nowhere.
pins = struct.unpack_from(f"<{N}I", region, PINS)
started = time.monotonic()
assert t.reclaim_client(0) == sum(pins)
assert time.monotonic() - started < 1.0  # version 4 waited 1 s for a client's busy word
scribble("ones")
assert all(t.pins(e) == 0 for e in range(N))
assert t.audit_client(0) == (0, []) and t.accessed_since(0)[0] == []
for e in sorted(slot_of):
    resident = t.state(e) == TableState.RESIDENT
    assert t.try_evict(e) == resident
print("ok")
"""


@pytest.mark.parametrize("seed", [1, 2])
def test_c1_garbage_in_a_region_leaves_the_daemon_working(seed):
    """C1: a client writes random bytes over every byte of its region, again and again (and, in a
    second process, without pause while the daemon works): every daemon call still works and is
    bounded by the daemon's own sizes: pins, hits, try_evict, audit_client, accessed_since,
    hold/unhold_for_client, the channel's take_demand / drain / reply, reclaim_client. Run in a
    subprocess: a crash is a failed test, not a dead pytest."""
    assert _run(_C1_GARBAGE, str(seed)).strip() == "ok"


# -- C2 ----------------------------------------------------------------------------------------------
_C2_RECORD = r"""
import ctypes, os, random
from expertcache.native import SlotTable, TableState

N, SLOTS = 8, 4
rng = random.Random(7)
t = SlotTable.create("c2-record", N, SLOTS, 2, 4, 4096)
for e, s in ((0, 2), (1, 0), (2, 1)):
    t.begin_load(e, s)
    t.finish_load(e)
t.begin_load(3, 3)  # LOADING
epoch = t.claim_channel(0)
h = SlotTable.attach(t.table_fd(), t.client_fd(0), 0, epoch)
size = SlotTable.table_bytes(N)
# The daemon's own read-write mapping of the table (made before the seal): the only writable one.
# Writing garbage into it stands for a compute process that could write the table (v4).
rw = [l.split() for l in open("/proc/self/maps")
      if l.rstrip().endswith("/memfd:c2-record (deleted)") and l.split()[1] == "rw-s"]
assert len(rw) == 1, rw
start = int(rw[0][0].split("-")[0], 16)


def record():
    return (t.states(), t.slots(), [t.state(e) for e in range(N)], [t.slot(e) for e in range(N)],
            [t.generation(e) for e in range(N)], t.num_entries, t.num_slots, t.num_clients,
            t.max_demand, t.ring_bytes)


resident, spare = 0, 5  # entry 0 and entry 5 take turns in slot 2
for round_ in range(100):
    expected = record()
    ctypes.memmove(start, os.urandom(size), size)  # every header field and every entry
    assert record() == expected
    try:
        t.state(N)
        raise AssertionError("entry N is out of the daemon's range")
    except IndexError:
        pass
    assert t.audit_client(0) == (0, [])  # scans the daemon's N entries, whatever the header says
    assert set(t.accessed_since(0)[0]) <= {0, 5}  # compute's pins of the two entries below
    # Decisions follow the daemon's record, not the table's words.
    assert not t.try_evict(spare)  # ABSENT (the table may say RESIDENT)
    assert not t.try_evict(3)  # LOADING
    try:
        t.hold(spare)
        raise AssertionError("hold of an ABSENT entry")
    except RuntimeError:
        pass
    gen = t.generation(spare)
    assert t.try_evict(resident)  # RESIDENT, unpinned: evicted, its slot (2) back to the daemon
    assert t.slot(resident) == -1 and t.state(resident) == TableState.ABSENT
    t.begin_load(spare, 2)
    t.finish_load(spare)
    assert (t.state(spare), t.slot(spare), t.generation(spare)) == (TableState.RESIDENT, 2, gen + 1)
    # What compute reads of that entry is republished from the daemon's record.
    assert (h.state(spare), h.slot(spare), h.generation(spare)) == (TableState.RESIDENT, 2, gen + 1)
    assert h.try_pin(spare) == 2
    h.unpin(spare)
    resident, spare = spare, resident
    used = [s for s in t.slots() if s >= 0]
    assert sorted(used) == [0, 1, 2, 3]
print("ok")
"""


def test_c2_the_daemons_record_of_states_and_slots_is_its_own():
    """C2: the daemon freed whatever slot number it read from shared memory. The owner's
    state/slot/generation/states()/slots() and its sizes are private: garbage written over the
    whole table (through the daemon's own writable mapping, since compute has none: see the C1
    tests) changes none of them, nor any decision (evict, hold, load), and each load republishes
    the entry compute reads. Run in a subprocess: it writes raw memory."""
    assert _run(_C2_RECORD).strip() == "ok"


def test_c2_region_pins_never_choose_a_slot():
    """C2: a region whose pins are garbage can only keep entries resident: the slot an eviction
    frees is the daemon's own record of it, so no two entries ever share a slot, and slots()
    changes only with the daemon's own loads and evictions."""
    n, slots = 24, 6
    rng = random.Random(3)
    t = SlotTable.create("c2-slots", n, slots, num_clients=2)
    claim_and_attach(t, 0)  # ledger 0's region: written below as its client could
    other = claim_and_attach(t, 1)
    slot_of: dict[int, int] = {}
    for e in range(slots):
        t.begin_load(e, e)
        t.finish_load(e)
        slot_of[e] = e
    region = _map_region(t, 0)
    pins_at, _ = _pins_at(n)
    try:
        for round_ in range(300):
            if round_ % 5 == 0:
                region[:] = os.urandom(len(region))  # the whole region, header and channel too
            for e in range(n):
                count = rng.choice((0, 0, 0, 1, 2, 0xFFFFFFFF, rng.getrandbits(32)))
                struct.pack_into("<I", region, pins_at + 4 * e, count)
            pins = struct.unpack_from(f"<{n}I", region, pins_at)
            for e in sorted(slot_of):
                slot = t.slot(e)
                assert slot == slot_of[e]
                assert t.try_evict(e) == (pins[e] == 0)
                if pins[e] == 0:
                    del slot_of[e]
                    new = rng.choice([x for x in range(n) if x not in slot_of and x != e])
                    t.begin_load(new, slot)
                    t.finish_load(new)
                    slot_of[new] = slot
            expected = [slot_of.get(e, -1) for e in range(n)]
            assert t.slots() == expected
            assert sorted(s for s in expected if s >= 0) == list(range(slots))  # each slot once
            assert other.resident_slots(list(range(n))) == [s if s >= 0 else -2 for s in expected]
            assert t.states() == [
                TableState.RESIDENT if e in slot_of else TableState.ABSENT for e in range(n)
            ]
    finally:
        region.close()


# -- C3 ----------------------------------------------------------------------------------------------
def test_c3_a_client_cannot_reach_another_ledger():
    """C3: clients were not isolated (one shared table held every ledger). Now ledger 0's handle
    reaches only its own region: h0.channel(1) raises, and after h0 has made every call it can
    and written random bytes over its whole region, ledger 1's region (pins, epoch, channel) is
    byte for byte what it was, and ledger 1's client and the daemon's view of it work on."""
    t = SlotTable.create("c3-isolation", 8, 4, num_clients=3, max_demand=4, ring_bytes=4096)
    for e in range(4):
        t.begin_load(e, e)
        t.finish_load(e)
    h0, h1 = claim_and_attach(t, 0), claim_and_attach(t, 1)
    epoch1 = t.client_epoch(1)
    assert h1.try_pin_many([1, 2]) == [1, 2]
    assert t.hold_for_client(1, epoch1, 3)
    seq1 = h1.channel(1).post_demand(2, [5, 6])
    assert h1.channel(1).signal_route(4, 1, 2, [5, 6])
    region1 = _map_region(t, 1)
    snapshot = bytes(region1)

    for other in (1, 2):
        with pytest.raises(ValueError, match="holds client ledger 0, not"):
            h0.channel(other)
    assert [h0.client_pins(1, e) for e in range(8)] == [0] * 8  # it sees only its own
    # Every call a compute handle has, on its own ledger.
    h0.try_pin_many(list(range(8)))
    h0.try_pin(1)
    h0.unpin_many([0, 1, 1, 2, 3])
    h0.resident_slots(list(range(8)))
    h0.wait_resident(5, 0.0)
    _ = (h0.states(), h0.slots(), h0.hits, h0.unpin_seq, h0.signals_wanted)
    own = h0.channel(0)
    own.post_demand(1, [1, 2, 3, 4])
    own.signal_begin(1, "x")
    own.signal_ahead(1, 1, [1], [1], [[1]], [[1.0]])
    own.ring_doorbell()
    own.notify()
    own.wait_notify(own.notify_seq, 0.0)
    own.wait_reply(99, own.notify_seq, 0.0)
    # The daemon-side calls of a channel view touch only the view's own region too.
    own.take_demand(0)
    own.drain()
    own.reply(1, 1, "self")
    own.fail(1, "self")
    own.set_source(0, 1)
    own.reset()
    for call in (lambda: h0.reclaim_client(1), lambda: h0.claim_channel(1), lambda: h0.client_fd(1)):
        with pytest.raises(RuntimeError, match="the cache daemon's"):
            call()
    region0 = _map_region(t, 0)
    for _ in range(20):
        region0[:] = os.urandom(len(region0))
        for call in (lambda: h0.try_pin_many(list(range(8))), lambda: h0.unpin_many([1])):
            try:
                call()
            except RuntimeError:  # StaleClient, or nothing to unpin: its own garbage
                pass

    assert bytes(region1) == snapshot
    assert t.client_epoch(1) == epoch1
    assert [t.client_pins(1, e) for e in range(8)] == [0, 1, 1, 1, 0, 0, 0, 0]
    assert t.channel(1).take_demand(0) == (seq1, 2, [5, 6], b"")
    records, corrupt = t.channel(1).drain()
    assert not corrupt and [(r[0], r[1], r[4].tolist()) for r in records] == [("route", 4, [5, 6])]
    h1.unpin_many([1, 2, 3])  # not stale, its pins intact
    assert [t.client_pins(1, e) for e in range(8)] == [0] * 8

    # Reclaim of ledger 0 with every byte of its region set ("busy", counts at their maximum)
    # returns at once, like the reclaim of a clean ledger; version 4 waited up to 1 s.
    h2 = claim_and_attach(t, 2)
    started = time.monotonic()
    assert t.reclaim_client(2) == 0
    clean_s = time.monotonic() - started
    region0[:] = b"\xff" * len(region0)
    started = time.monotonic()
    assert t.reclaim_client(0) == 0xFFFFFFFF * 8
    busy_s = time.monotonic() - started
    # Version 4 waited 1 s (kReclaimWaitS) for a region whose busy word was set: nothing waits now.
    assert busy_s < 1.0 and clean_s < 1.0, (busy_s, clean_s)
    assert t.client_epoch(1) == epoch1 and h1.try_pin(1) == 1  # ledger 1 untouched by either
    with pytest.raises(StaleClient):
        h2.try_pin(1)
    region0.close()
    region1.close()


# -- C6 ----------------------------------------------------------------------------------------------
def test_c6_a_ledger_handed_out_again_is_a_new_region():
    """C6: a ledger was handed out again while its old daemon thread (or old compute) could still
    write into it. Now reclaim_client + claim_channel give ledger 0 a new region: what the old
    daemon channel view writes (reply, fail, set_source, notify) and what the old compute
    region pins reaches neither the new compute handle nor pins() / try_evict / audit_client."""
    t = SlotTable.create("c6-reuse", 4, 4, num_clients=2, max_demand=4, ring_bytes=4096)
    for e in range(3):
        t.begin_load(e, e)
        t.finish_load(e)
    old = claim_and_attach(t, 0)
    old_epoch = t.client_epoch(0)
    assert old.try_pin(0) == 0
    old_daemon = t.channel(0)  # the old session's thread keeps its view
    old_compute = old.channel(0)
    old_seq = old_compute.post_demand(1, [1, 2])
    old_region = _map_region(t, 0)
    old_fd = t.client_fd(0)
    try:
        assert t.reclaim_client(0) == 1
        new = claim_and_attach(t, 0)
        new_epoch = t.client_epoch(0)
        assert new_epoch != old_epoch
        new_fd = t.client_fd(0)
        try:
            assert os.fstat(new_fd).st_ino != os.fstat(old_fd).st_ino  # another memfd
        finally:
            os.close(new_fd)
        fresh = new.channel(0)
        notify, doorbell = fresh.notify_seq, t.channel(0).doorbell_seq

        # The old daemon thread answers late; the old compute goes on posting and pinning.
        old_daemon.reply(old_seq, 7, "late answer")
        old_daemon.fail(9, "late failure")
        old_daemon.set_source(0, 5)
        old_daemon.notify()
        old_compute.post_demand(2, [3])
        old_compute.signal_end(1)
        old_compute.ring_doorbell()
        with pytest.raises(StaleClient):
            old.try_pin(1)
        for e, count in ((0, 5), (1, 7), (3, 1)):
            _set_pin(old_region, e, count)

        assert (old_compute.reply_seq, old_compute.reply_message) == (
            old_seq,
            "late answer",
        )  # the old region
        assert (fresh.reply_seq, fresh.reply_status, fresh.reply_message) == (0, 0, "")
        assert (fresh.fail_seq, fresh.fail_status, fresh.fail_message) == (0, 0, "")
        assert fresh.source(0) == 0 and fresh.notify_seq == notify
        daemon = t.channel(0)
        assert daemon.doorbell_seq == doorbell
        assert daemon.take_demand(0) is None and daemon.drain() == ([], False)
        assert [new.pins(e) for e in range(4)] == [0] * 4
        assert [t.pins(e) for e in range(4)] == [0] * 4
        assert t.audit_client(0) == (0, [])  # the old region's pin on ABSENT entry 3 is not seen
        assert t.accessed_since(0)[0] == []  # nor its stamps
        # The daemon's pins for the new client go into the new region only.
        assert not t.hold_for_client(0, old_epoch, 2)
        assert t.hold_for_client(0, new_epoch, 2)
        assert new.pins(2) == 1 and struct.unpack_from("<I", old_region, _pins_at(4)[0] + 8)[0] == 0
        new.unpin(2)
        assert t.try_evict(0) and t.try_evict(1) and t.try_evict(2)
        # The new client works; its channel is its own.
        seq = fresh.post_demand(3, [1])
        assert daemon.take_demand(0) == (seq, 3, [1], b"")
    finally:
        old_region.close()
        os.close(old_fd)


def test_c6_a_detached_region_never_yields_a_working_handle():
    """C6 (a gap found while writing these tests): a region the daemon detached must refuse
    pins, whatever epoch its holder presents."""
    t = SlotTable.create("c6-detached", 2, 2, num_clients=1)
    t.begin_load(0, 0)
    t.finish_load(0)
    # (a) the old handle after a claim over its live region (no reclaim in between)
    old = claim_and_attach(t, 0)
    t.claim_channel(0)
    with pytest.raises(StaleClient):
        old.try_pin(0)
    # (b) the old region's fd attached again at the ledger's new epoch
    table_fd, region_fd = t.table_fd(), t.client_fd(0)
    try:
        t.reclaim_client(0)
        epoch = t.claim_channel(0)
        with pytest.raises(StaleClient):
            SlotTable.attach(table_fd, region_fd, 0, epoch)
    finally:
        os.close(table_fd)
        os.close(region_fd)


# -- audit -------------------------------------------------------------------------------------------
def test_audit_finds_stray_pins():
    """Audit: a client that writes pin counts into its region at will shows up. A pin on an entry
    that is neither LOADING nor RESIDENT is stray (no real pin survives there); the client's real
    pins, and the daemon's pins for it, are not."""
    t = SlotTable.create("audit", 6, 4, num_clients=2)
    t.begin_load(0, 0)
    t.finish_load(0)  # RESIDENT
    t.begin_load(1, 1)  # LOADING
    h = claim_and_attach(t, 0)
    epoch = t.client_epoch(0)
    assert h.try_pin(0) == 0
    assert t.hold_for_client(0, epoch, 1)
    assert t.audit_client(0) == (2, [])
    region = _map_region(t, 0)
    pins_at, stamps_at = _pins_at(6)
    try:
        # The layout the test writes into: the real pins are where it says.
        assert struct.unpack_from("<6I", region, pins_at) == (1, 1, 0, 0, 0, 0)
        assert struct.unpack_from("<Q", region, stamps_at)[0] > 0
        assert struct.unpack_from("<Q", region, 64)[0] == h.hits == 1
        _set_pin(region, 3, 1)  # ABSENT
        assert t.audit_client(0) == (3, [3])
        _set_pin(region, 2, 40)  # ABSENT
        _set_pin(region, 0, 9)  # RESIDENT: more pins than it made, but not stray
        assert t.audit_client(0) == (4, [2, 3])
        assert t.audit_client(1) == (0, [])  # another ledger: nothing
        t.finish_load(1)  # LOADING -> RESIDENT: still not stray
        assert t.audit_client(0) == (4, [2, 3])
        _set_pin(region, 0, 0)
        assert t.try_evict(0)  # now ABSENT: a pin written there afterwards is stray
        _set_pin(region, 0, 1)
        assert t.audit_client(0) == (4, [0, 2, 3])
    finally:
        region.close()


def test_audit_reports_at_most_64_stray_entries():
    """Audit: the stray list is bounded (64 entries), the count is not."""
    n = 100
    t = SlotTable.create("audit-many", n, 4, num_clients=1)
    claim_and_attach(t, 0)
    region = _map_region(t, 0)
    pins_at, _ = _pins_at(n)
    try:
        region[pins_at : pins_at + 4 * n] = struct.pack(f"<{n}I", *([1] * n))
        pinned, stray = t.audit_client(0)
    finally:
        region.close()
    assert pinned == n and stray == list(range(64))
