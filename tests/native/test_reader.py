"""The native Reader on real files: bytes, priorities, pre-emption, cancel/promote, errors,
event_fd and shutdown, for both backends (io_uring skipped where it is unavailable)."""

from __future__ import annotations

import ctypes
import gc
import os
import random
import select
import time
import zlib
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from expertcache import native
from expertcache.native import HostPool, Reader, ReadError

KIB = 1024
MIB = 1024 * KIB
URING_OK, URING_WHY = Reader.uring_available()
BACKENDS = [
    "pread",
    pytest.param(
        "io_uring", marks=pytest.mark.skipif(not URING_OK, reason=f"io_uring unavailable: {URING_WHY}")
    ),
]


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


def make_file(path: Path, nbytes: int) -> bytes:
    """A file whose every 4 KiB block differs (a byte pattern offset by the block number)."""
    block = bytes(range(256)) * 16
    data = b"".join(block[i % 256 :] + block[: i % 256] for i in range(nbytes // 4096 + 1))[:nbytes]
    path.write_bytes(data)
    return data


def random_file(path: Path, nbytes: int) -> bytes:
    data = os.urandom(nbytes)
    path.write_bytes(data)
    return data


def o_direct_ok(directory: Path) -> bool:
    probe = directory / ".probe"
    probe.write_bytes(b"\0" * 4096)
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
        return True
    except OSError:
        return False
    finally:
        probe.unlink()


def collect(reader: Reader, n: int, timeout_s: float = 10.0) -> list[tuple]:
    """Exactly ``n`` completions, in the order the reader published them."""
    out: list[tuple] = []
    deadline = time.monotonic() + timeout_s
    while len(out) < n:
        left = deadline - time.monotonic()
        assert left > 0, f"only {len(out)} of {n} completions within {timeout_s} s: {out}"
        out += reader.poll(max_n=n - len(out), timeout_s=left)
    return out


def test_multi_chunk_direct_reads_into_host_pool_slots(tmp_path, backend):
    direct = o_direct_ok(tmp_path)
    path = tmp_path / "data.bin"
    data = random_file(path, 8 * MIB)
    pool = HostPool(4, 2 * MIB + 8 * KIB)
    with Reader(threads=2, queue_depth=8, chunk_bytes=512 * KIB, backend=backend) as reader:
        assert reader.backend == backend and reader.chunk_bytes == 512 * KIB and reader.threads == 2
        fid = reader.open_file(str(path), direct=direct)
        slots = [pool.alloc() for _ in range(4)]
        ranges = [(12 * KIB, 2 * MIB + 8 * KIB), (0, 4 * KIB), (5 * MIB, 2 * MIB), (3 * MIB, 1 * MIB)]
        ids = []
        for slot, (off, n) in zip(slots, ranges, strict=True):
            ids.append(
                reader.submit(
                    fid,
                    off,
                    n,
                    pool.slot_address(slot),
                    Reader.PREFETCH,
                    expected_crc=zlib.crc32(data[off : off + n]),
                    tag=slot,
                )
            )
        for rid in ids:
            assert reader.wait(rid, 10.0) is None
        for slot, (off, n) in zip(slots, ranges, strict=True):
            assert bytes(pool.view(slot)[:n]) == data[off : off + n]
        stats = reader.stats()
        assert stats["submitted"] == stats["completed"] == 4
        assert stats["failed"] == stats["cancelled"] == stats["in_flight"] == stats["queued"] == 0
        assert stats["bytes_read"] == sum(n for _, n in ranges)
        # 512 KiB each, a last piece of at most a quarter chunk riding with the one before it:
        # 2 MiB + 8 KiB is 4 reads (the 8 KiB rides with the fourth), not 5.
        assert stats["chunks"] == 4 + 1 + 4 + 2
        with pytest.raises(IndexError, match=f"unknown request id {ids[0]}"):
            reader.wait(ids[0], 1.0)  # consumed once


def test_many_concurrent_reads_of_mixed_sizes_and_priorities(tmp_path, backend):
    direct = o_direct_ok(tmp_path)
    path = tmp_path / "data.bin"
    data = random_file(path, 16 * MIB)
    rng = random.Random(7)
    pool = HostPool(64, 1 * MIB)
    with Reader(threads=3, queue_depth=8, chunk_bytes=64 * KIB, backend=backend) as reader:
        fid = reader.open_file(str(path), direct=direct)
        want = {}
        for slot in range(64):
            pool.alloc()
            n = rng.randrange(1, 257) * 4 * KIB
            off = rng.randrange(0, (16 * MIB - n) // (4 * KIB) + 1) * 4 * KIB
            crc = zlib.crc32(data[off : off + n])
            rid = reader.submit(
                fid, off, n, pool.slot_address(slot), rng.randrange(3), expected_crc=crc, tag=slot
            )
            want[rid] = (slot, off, n)
        done = collect(reader, len(want), timeout_s=60)
        assert sorted(c[0] for c in done) == sorted(want)
        for rid, tag, error, nbytes, _elapsed in done:
            slot, off, n = want[rid]
            assert (tag, error, nbytes) == (slot, None, n)
            assert bytes(pool.view(slot)[:n]) == data[off : off + n]
        stats = reader.stats()
        assert stats["completed"] == 64 and stats["bytes_read"] == sum(n for _, _, n in want.values())


@contextmanager
def one_thread_reader(tmp_path: Path, backend: str, file_bytes: int):
    """A one-thread Reader with a ``make_file`` file of ``file_bytes`` open (not O_DIRECT): the
    reader, the file's id, the file's bytes and a buffer of their size."""
    path = tmp_path / "data.bin"
    data = make_file(path, file_bytes)
    buf = (ctypes.c_char * file_bytes)()
    with Reader(threads=1, backend=backend) as reader:
        yield reader, reader.open_file(str(path), direct=False), data, buf


def test_poll_reports_tag_nbytes_and_elapsed(tmp_path, backend):
    with one_thread_reader(tmp_path, backend, 64 * KIB) as (reader, fid, data, buf):
        rid = reader.submit(fid, 0, 64 * KIB, ctypes.addressof(buf), Reader.DEMAND, tag=77)
        ((got_id, tag, error, nbytes, elapsed_s),) = collect(reader, 1)
        assert (got_id, tag, error, nbytes) == (rid, 77, None, 64 * KIB) and elapsed_s > 0
        assert bytes(buf) == data
        assert reader.poll() == []


@contextmanager
def paused_serial_reader(tmp_path: Path, backend: str, file_bytes: int, slots: int, chunk_bytes: int):
    """A paused Reader that runs one read at a time (so completion order is dispatch order) on a
    ``make_file`` file of ``file_bytes``: the reader, the file's id and ``slots`` 64 KiB slots."""
    path = tmp_path / "data.bin"
    make_file(path, file_bytes)
    pool = HostPool(slots, 64 * KIB)
    with Reader(threads=1, queue_depth=1, chunk_bytes=chunk_bytes, backend=backend) as reader:
        fid = reader.open_file(str(path), direct=False)
        reader.pause()
        yield reader, fid, [pool.slot_address(pool.alloc()) for _ in range(slots)]


def test_priority_order_after_resume(tmp_path, backend):
    with paused_serial_reader(tmp_path, backend, 1 * MIB, 5, chunk_bytes=64 * KIB) as (reader, fid, addr):
        p1 = reader.submit(fid, 0, 64 * KIB, addr[0], Reader.PREFETCH)
        p2 = reader.submit(fid, 0, 64 * KIB, addr[1], Reader.PREFETCH)
        la = reader.submit(fid, 0, 64 * KIB, addr[2], Reader.LAYER_AHEAD)
        d1 = reader.submit(fid, 0, 64 * KIB, addr[3], Reader.DEMAND)
        d2 = reader.submit(fid, 0, 64 * KIB, addr[4], Reader.DEMAND)
        assert reader.stats()["queued"] == 5 and reader.poll() == []
        reader.resume()
        order = [c[0] for c in collect(reader, 5)]
        assert order == [d1, d2, la, p1, p2]


def test_demand_preempts_a_large_prefetch(tmp_path, backend):
    path = tmp_path / "big.bin"
    make_file(path, 64 * MIB)
    pool = HostPool(2, 64 * MIB)
    big, small = pool.alloc(), pool.alloc()
    # 16384 chunks of 4 KiB: the prefetch is still being read when the demand arrives.
    with Reader(threads=1, queue_depth=1, chunk_bytes=4 * KIB, backend=backend) as reader:
        fid = reader.open_file(str(path), direct=False)
        prefetch = reader.submit(fid, 0, 64 * MIB, pool.slot_address(big), Reader.PREFETCH)
        deadline = time.monotonic() + 10
        while reader.stats()["chunks"] == 0:  # the prefetch has started (no sleep: spin on a counter)
            assert time.monotonic() < deadline, "the prefetch never started"
        demand = reader.submit(fid, 32 * MIB, 16 * KIB, pool.slot_address(small), Reader.DEMAND)
        order = [c[0] for c in collect(reader, 2, timeout_s=60)]
        assert order == [demand, prefetch]
        assert reader.stats()["preemptions"] >= 1
        assert bytes(pool.view(small)[: 16 * KIB]) == path.read_bytes()[32 * MIB : 32 * MIB + 16 * KIB]


def test_no_background_read_runs_beside_a_demand(tmp_path, backend):
    """Demand first: with four workers free, the prefetch and layer-ahead reads submitted after a
    demand still wait for it to finish (they would share the device's bandwidth with it), so
    the 32 MiB demand completes before the 4 KiB reads behind it."""
    path = tmp_path / "big.bin"
    data = make_file(path, 32 * MIB)
    pool = HostPool(4, 32 * MIB)
    slots = [pool.alloc() for _ in range(4)]
    addr = [pool.slot_address(slot) for slot in slots]
    with Reader(threads=4, queue_depth=4, chunk_bytes=32 * MIB, backend=backend) as reader:
        assert reader.background_depth == 2  # half the concurrency by default
        fid = reader.open_file(str(path), direct=False)
        reader.pause()
        demand = reader.submit(fid, 0, 32 * MIB, addr[0], Reader.DEMAND)
        ahead = reader.submit(fid, 0, 4 * KIB, addr[1], Reader.LAYER_AHEAD)
        p1 = reader.submit(fid, 4 * KIB, 4 * KIB, addr[2], Reader.PREFETCH)
        p2 = reader.submit(fid, 8 * KIB, 4 * KIB, addr[3], Reader.PREFETCH)
        reader.resume()
        order = [c[0] for c in collect(reader, 4, timeout_s=60)]
        assert order[0] == demand, order
        assert sorted(order[1:]) == sorted([ahead, p1, p2])
        # The background reads ran once the demand was done.
        assert bytes(pool.view(slots[2])[: 4 * KIB]) == data[4 * KIB : 8 * KIB]
        assert bytes(pool.view(slots[0])[: 32 * MIB]) == data


def test_background_reads_are_capped_at_background_depth(tmp_path, backend):
    """background_depth=1: a second prefetch waits for the first, though three workers are free."""
    path = tmp_path / "big.bin"
    make_file(path, 32 * MIB)
    pool = HostPool(2, 32 * MIB)
    addr = [pool.slot_address(pool.alloc()) for _ in range(2)]
    with Reader(
        threads=4, queue_depth=4, chunk_bytes=32 * MIB, backend=backend, background_depth=1
    ) as reader:
        assert reader.background_depth == 1
        fid = reader.open_file(str(path), direct=False)
        reader.pause()
        first = reader.submit(fid, 0, 32 * MIB, addr[0], Reader.PREFETCH)
        second = reader.submit(fid, 0, 4 * KIB, addr[1], Reader.PREFETCH)
        reader.resume()
        assert [c[0] for c in collect(reader, 2, timeout_s=60)] == [first, second]


def test_cancel_and_promote(tmp_path, backend):
    with paused_serial_reader(tmp_path, backend, 256 * KIB, 4, chunk_bytes=16 * KIB) as (reader, fid, addr):
        keep = reader.submit(fid, 0, 64 * KIB, addr[0], Reader.PREFETCH)
        dropped = reader.submit(fid, 0, 64 * KIB, addr[1], Reader.PREFETCH)
        late = reader.submit(fid, 0, 64 * KIB, addr[2], Reader.PREFETCH)
        promoted = reader.submit(fid, 64 * KIB, 64 * KIB, addr[3], Reader.PREFETCH)
        assert reader.query(promoted) == {"priority": Reader.PREFETCH, "queued": True, "done": False}
        assert reader.cancel(dropped) is True
        assert reader.promote(promoted, Reader.DEMAND) is True
        assert reader.query(promoted) == {"priority": Reader.DEMAND, "queued": True, "done": False}
        assert reader.query(dropped) == {"priority": Reader.PREFETCH, "queued": False, "done": True}
        with pytest.raises(ValueError, match="priority 7 is not one of DEMAND=0"):
            reader.promote(late, 7)
        reader.resume()
        order = collect(reader, 4)
        # The cancelled request completes at once (while paused), then the promoted one first.
        assert [c[0] for c in order] == [dropped, promoted, keep, late]
        error = order[0][2]
        assert isinstance(error, ReadError) and error.kind == "cancelled" and str(error) == "cancelled"
        assert error.request_id == dropped
        assert reader.cancel(keep) is False and reader.promote(keep, Reader.DEMAND) is False  # consumed
        assert reader.query(keep) is None
        stats = reader.stats()
        assert stats["cancelled"] == 1 and stats["completed"] == 3
        # Waiting on a cancelled request raises the "cancelled" ReadError.
        reader.pause()
        victim = reader.submit(fid, 0, 64 * KIB, addr[1], Reader.PREFETCH)
        assert reader.cancel(victim)
        with pytest.raises(ReadError, match="^cancelled$") as info:
            reader.wait(victim, 1.0)
        assert info.value.kind == "cancelled"
        reader.resume()


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_short_read_names_path_and_offset(tmp_path, backend, direct):
    if direct and not o_direct_ok(tmp_path):
        pytest.skip("tmp_path refuses O_DIRECT")
    path = tmp_path / "short.bin"
    make_file(path, 8 * KIB + 100)  # ends 100 bytes into the third 4 KiB block
    pool = HostPool(1, 64 * KIB)
    with Reader(threads=2, chunk_bytes=8 * KIB, backend=backend) as reader:
        fid = reader.open_file(str(path), direct=direct)
        rid = reader.submit(fid, 0, 32 * KIB, pool.slot_address(pool.alloc()), Reader.DEMAND)
        with pytest.raises(ReadError) as info:
            reader.wait(rid, 10.0)
        assert str(info.value) == f"short read: got {8 * KIB + 100} of {32 * KIB} bytes at offset 0 of {path}"
        assert info.value.kind == "short_read" and info.value.nbytes == 8 * KIB + 100
        assert isinstance(info.value, OSError)
        assert reader.stats()["failed"] == 1


def test_io_error_names_the_path(tmp_path, backend):
    pool = HostPool(1, 4 * KIB)
    with Reader(threads=1, backend=backend) as reader:
        fid = reader.open_file(str(tmp_path), direct=False)  # a directory: read() fails EISDIR
        rid = reader.submit(fid, 0, 4 * KIB, pool.slot_address(pool.alloc()), Reader.DEMAND)
        with pytest.raises(ReadError, match=f"^{tmp_path} offset 0: Is a directory$") as info:
            reader.wait(rid, 10.0)
        assert info.value.kind == "io" and info.value.errno == 21


def test_checksum_mismatch(tmp_path, backend):
    path = tmp_path / "data.bin"
    data = make_file(path, 128 * KIB)
    pool = HostPool(1, 128 * KIB)
    right = zlib.crc32(data[4 * KIB : 68 * KIB])
    with Reader(threads=1, chunk_bytes=16 * KIB, backend=backend) as reader:
        fid = reader.open_file(str(path), direct=o_direct_ok(tmp_path))
        addr = pool.slot_address(pool.alloc())
        rid = reader.submit(fid, 4 * KIB, 64 * KIB, addr, Reader.DEMAND, expected_crc=right ^ 1)
        with pytest.raises(ReadError) as info:
            reader.wait(rid, 10.0)
        assert str(info.value) == (
            f"checksum mismatch for {path} offset 4096: expected 0x{right ^ 1:08x} got 0x{right:08x}"
        )
        assert info.value.kind == "checksum" and info.value.actual_crc == right
        assert reader.wait(reader.submit(fid, 4 * KIB, 64 * KIB, addr, 0, expected_crc=right), 10.0) is None


def test_a_changed_byte_in_any_chunk_fails_the_whole_read(tmp_path, backend):
    """Each chunk's CRC is taken as it lands and the request's is combined from them in order: a
    byte changed in the first, a middle or the last chunk (a merged tail included) is caught,
    and the CRC reported is the whole range's."""
    path = tmp_path / "data.bin"
    nbytes = 4 * 16 * KIB + 4 * KIB  # four 16 KiB chunks, the 4 KiB tail riding with the last
    original = random_file(path, nbytes)
    expected = zlib.crc32(original)
    pool = HostPool(1, nbytes)
    addr = pool.slot_address(pool.alloc())
    with Reader(threads=2, queue_depth=4, chunk_bytes=16 * KIB, backend=backend) as reader:
        fid = reader.open_file(str(path), direct=o_direct_ok(tmp_path))
        assert (
            reader.wait(reader.submit(fid, 0, nbytes, addr, Reader.DEMAND, expected_crc=expected), 10.0)
            is None
        )
        assert reader.stats()["chunks"] == 4
        for where in (0, 40 * KIB + 7, nbytes - 1):
            changed = bytearray(original)
            changed[where] ^= 0x5A
            path.write_bytes(changed)
            rid = reader.submit(fid, 0, nbytes, addr, Reader.DEMAND, expected_crc=expected)
            with pytest.raises(ReadError) as info:
                reader.wait(rid, 10.0)
            assert info.value.kind == "checksum", where
            assert info.value.actual_crc == zlib.crc32(changed), where
            assert bytes(pool.view(0)[:nbytes]) == bytes(changed)


@pytest.mark.parametrize(
    ("nbytes", "chunks"),
    [
        (4 * KIB, 1),
        (64 * KIB, 1),
        (80 * KIB, 1),
        (84 * KIB, 2),
        (128 * KIB, 2),
        (144 * KIB, 2),
        (148 * KIB, 3),
    ],
)
def test_a_last_piece_of_at_most_a_quarter_chunk_rides_with_the_chunk_before_it(tmp_path, nbytes, chunks):
    path = tmp_path / "data.bin"
    data = random_file(path, nbytes)
    pool = HostPool(1, nbytes)
    with Reader(threads=1, chunk_bytes=64 * KIB, backend="pread") as reader:
        fid = reader.open_file(str(path), direct=o_direct_ok(tmp_path))
        rid = reader.submit(fid, 0, nbytes, pool.slot_address(pool.alloc()), 0, expected_crc=zlib.crc32(data))
        assert reader.wait(rid, 10.0) is None
        assert reader.stats()["chunks"] == chunks
        assert bytes(pool.view(0)[:nbytes]) == data


def _tasks() -> set[str]:
    return set(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not URING_OK, reason=f"io_uring unavailable: {URING_WHY}")
def test_io_uring_completes_reads_in_its_one_thread():
    """With io_uring no thread but the dispatcher touches a read (no hand-off to a CRC thread):
    the reader starts one thread whatever ``threads`` says; pread starts ``threads`` workers.
    (Threads are counted as those that appeared: one that other tests left may end meanwhile.)"""
    for backend, threads, started in (("io_uring", 4, 1), ("pread", 3, 3)):
        before = _tasks()
        with Reader(threads=threads, backend=backend):
            assert len(_tasks() - before) == started, backend


def test_misaligned_direct_arguments_are_refused(tmp_path, backend):
    if not o_direct_ok(tmp_path):
        pytest.skip("tmp_path refuses O_DIRECT")
    path = tmp_path / "data.bin"
    make_file(path, 64 * KIB)
    pool = HostPool(1, 64 * KIB)
    addr = pool.slot_address(pool.alloc())
    with Reader(threads=1, backend=backend) as reader:
        fid = reader.open_file(str(path))
        with pytest.raises(ValueError, match=r"offset 100 is not a multiple of 4096"):
            reader.submit(fid, 100, 4 * KIB, addr, Reader.DEMAND)
        with pytest.raises(ValueError, match=r"length 5000 is not a multiple of 4096"):
            reader.submit(fid, 0, 5000, addr, Reader.DEMAND)
        with pytest.raises(ValueError, match=rf"dest_address {addr + 8} is not a multiple of 4096"):
            reader.submit(fid, 0, 4 * KIB, addr + 8, Reader.DEMAND)
        with pytest.raises(ValueError, match="priority 3 is not one of"):
            reader.submit(fid, 0, 4 * KIB, addr, 3)
        with pytest.raises(ValueError, match="length must be > 0"):
            reader.submit(fid, 0, 0, addr, Reader.DEMAND)
        with pytest.raises(ValueError, match="unknown file id 99"):
            reader.submit(99, 0, 4 * KIB, addr, Reader.DEMAND)
        # Buffered files take any offset, length and address.
        bid = reader.open_file(str(path), direct=False)
        assert reader.wait(reader.submit(bid, 100, 5000, addr + 8, Reader.DEMAND), 10.0) is None
        assert bytes(pool.view(0)[8:5008]) == path.read_bytes()[100:5100]


def test_open_errors(tmp_path):
    with Reader(threads=1) as reader:
        with pytest.raises(FileNotFoundError, match=f"cannot open {tmp_path}/missing.bin: No such file"):
            reader.open_file(str(tmp_path / "missing.bin"))
        try:
            os.close(os.open("/proc/version", os.O_RDONLY | os.O_DIRECT))
        except OSError:
            with pytest.raises(ValueError, match="cannot open /proc/version: O_DIRECT is unsupported"):
                reader.open_file("/proc/version", direct=True)
        else:
            pytest.skip("/proc accepts O_DIRECT here")
        with pytest.raises(ValueError, match="unknown file id 5"):
            reader.close_file(5)


def test_constructor_errors():
    with pytest.raises(ValueError, match="unknown backend 'spdk'; valid: auto, io_uring, pread"):
        Reader(backend="spdk")
    with pytest.raises(ValueError, match="chunk_bytes=1000 must be a positive multiple of 4096"):
        Reader(chunk_bytes=1000)
    with pytest.raises(ValueError, match=r"threads=0 must be in \[1, 256\]"):
        Reader(threads=0)
    with pytest.raises(ValueError, match=r"queue_depth=0 must be in \[1, 4096\]"):
        Reader(queue_depth=0)
    with pytest.raises(
        ValueError, match=r"background_depth=5 must be in \[1, 4\] \(the pread backend's threads\)"
    ):
        Reader(threads=4, background_depth=5, backend="pread")
    with pytest.raises(ValueError, match=r"background_depth=-1 must be in \[1, 2\]"):
        Reader(threads=2, background_depth=-1, backend="pread")
    assert Reader(threads=1, backend="pread").background_depth == 1  # half of 1, at least 1
    assert Reader(threads=8, backend="pread", background_depth=8).background_depth == 8
    if URING_OK:
        assert Reader(backend="auto").backend == "io_uring"
    else:
        assert Reader(backend="auto").backend == "pread"
        with pytest.raises(ValueError, match="the io_uring backend is unavailable: "):
            Reader(backend="io_uring")


def test_wait_timeout_and_close_file_with_pending_reads(tmp_path, backend):
    with one_thread_reader(tmp_path, backend, 16 * KIB) as (reader, fid, data, buf):
        reader.pause()
        rid = reader.submit(fid, 0, 16 * KIB, ctypes.addressof(buf), Reader.DEMAND)
        with pytest.raises(TimeoutError, match=f"request {rid} did not complete within"):
            reader.wait(rid, 0.05)
        reader.close_file(fid)  # the descriptor stays open for the pending read
        with pytest.raises(ValueError, match=f"unknown file id {fid}"):
            reader.submit(fid, 0, 4 * KIB, ctypes.addressof(buf), Reader.DEMAND)
        reader.resume()
        assert reader.wait(rid, 10.0) is None
        assert bytes(buf) == data


def test_event_fd_is_readable_while_completions_are_unconsumed(tmp_path, backend):
    with one_thread_reader(tmp_path, backend, 16 * KIB) as (reader, fid, _, buf):
        fd = reader.event_fd
        reader.pause()
        a = reader.submit(fid, 0, 8 * KIB, ctypes.addressof(buf), Reader.DEMAND)
        b = reader.submit(fid, 8 * KIB, 8 * KIB, ctypes.addressof(buf) + 8 * KIB, Reader.DEMAND)
        assert select.select([fd], [], [], 0.05)[0] == []
        reader.resume()
        assert select.select([fd], [], [], 10.0)[0] == [fd]
        reader.wait(a, 10.0)
        reader.wait(b, 10.0)
        assert select.select([fd], [], [], 0)[0] == []  # both consumed
        c = reader.submit(fid, 0, 4 * KIB, ctypes.addressof(buf), Reader.DEMAND)
        assert select.select([fd], [], [], 10.0)[0] == [fd]
        assert [x[0] for x in reader.poll()] == [c]
        assert select.select([fd], [], [], 0)[0] == []


def test_poll_leaves_requests_not_pollable_to_their_waiters(tmp_path, backend):
    """One thread reaps the pollable reads while others wait for their own: ``poll`` neither returns
    nor consumes a request submitted with ``pollable=False``, and the event fd ignores it."""
    with one_thread_reader(tmp_path, backend, 16 * KIB) as (reader, fid, _, buf):
        fd = reader.event_fd
        address = ctypes.addressof(buf)
        waited = reader.submit(fid, 0, 8 * KIB, address, Reader.DEMAND, pollable=False)
        deadline = time.monotonic() + 10.0
        while not reader.query(waited)["done"]:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        assert select.select([fd], [], [], 0)[0] == [] and reader.poll(timeout_s=0.05) == []
        reaped = reader.submit(fid, 8 * KIB, 8 * KIB, address + 8 * KIB, Reader.DEMAND)
        assert [x[0] for x in collect(reader, 1)] == [reaped]
        assert select.select([fd], [], [], 0)[0] == []
        assert reader.wait(waited, 10.0) is None  # still there for its waiter
        failed = reader.submit(fid, 12 * KIB, 8 * KIB, address, Reader.DEMAND, expected_crc=0, pollable=False)
        with pytest.raises(ReadError) as info:
            reader.wait(failed, 10.0)
        assert info.value.kind in ("checksum", "short_read") and reader.poll() == []


def test_close_cancels_queued_work_and_is_idempotent(tmp_path, backend):
    path = tmp_path / "data.bin"
    make_file(path, 64 * KIB)
    pool = HostPool(3, 64 * KIB)
    reader = Reader(threads=2, backend=backend)
    fid = reader.open_file(str(path), direct=False)
    reader.pause()
    ids = [
        reader.submit(fid, 0, 64 * KIB, pool.slot_address(pool.alloc()), Reader.PREFETCH) for _ in range(3)
    ]
    reader.close()
    reader.close()
    for rid in ids:
        with pytest.raises(ReadError, match="^cancelled$"):
            reader.wait(rid, 1.0)
    assert reader.stats()["cancelled"] == 3
    with pytest.raises(RuntimeError, match="submit on a closed reader"):
        reader.submit(fid, 0, 4 * KIB, pool.slot_address(0), Reader.DEMAND)


def test_destructor_with_reads_in_flight_does_not_hang(tmp_path, backend):
    path = tmp_path / "big.bin"
    make_file(path, 16 * MIB)
    pool = HostPool(1, 16 * MIB)
    reader = Reader(threads=2, chunk_bytes=64 * KIB, backend=backend)
    fid = reader.open_file(str(path), direct=False)
    reader.submit(fid, 0, 16 * MIB, pool.slot_address(pool.alloc()), Reader.PREFETCH)
    threads_before = len(os.listdir("/proc/self/task"))
    start = time.monotonic()
    del reader
    gc.collect()
    assert time.monotonic() - start < 10
    assert len(os.listdir("/proc/self/task")) < threads_before  # its threads are gone


@pytest.mark.parametrize("size", [0, 1, 7, 4096, 65537, 3 << 20])
def test_crc32_equals_zlib_whatever_the_implementation(size):
    """The store's checksums are zlib's crc32: the CRC in use (ISA-L, the core's carry-less
    multiply or zlib) must agree."""
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    assert native.CRC32_IMPL in ("isa-l", "pclmul", "zlib")
    assert native.crc32(data) == zlib.crc32(data.tobytes())
    assert native.crc32(memoryview(data.tobytes())) == zlib.crc32(data.tobytes())


def cpu_has_pclmul() -> bool:
    flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "").split()
    return "pclmulqdq" in flags and "sse4_1" in flags


@pytest.mark.skipif(not cpu_has_pclmul(), reason="this CPU has no PCLMULQDQ")
def test_carry_less_multiply_crc_equals_zlib_at_every_length_and_seed():
    """The core's own CRC (used where ISA-L is not built in): every length across its paths
    (under 64 bytes: zlib; 64-127: four lanes; 128 and up: eight; a tail of n mod 16 bytes), and
    continued from any earlier CRC, as zlib.crc32(data, crc) is."""
    rng = np.random.default_rng(7)
    for size in [*range(0, 400), 4096, 65537, (1 << 20) + 13]:
        data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        crc = int(rng.integers(0, 1 << 32))
        assert native.crc32_by("pclmul", data) == zlib.crc32(data), size
        assert native.crc32_by("pclmul", data, crc) == zlib.crc32(data, crc), size
    # Split anywhere, continued: the CRC of the whole.
    data = rng.integers(0, 256, 10_000, dtype=np.uint8).tobytes()
    for cut in (0, 1, 63, 64, 127, 128, 5000, 10_000):
        assert native.crc32_by("pclmul", data[cut:], native.crc32_by("pclmul", data[:cut])) == zlib.crc32(
            data
        )


def test_crc32_by_refuses_an_unknown_implementation():
    with pytest.raises(ValueError, match="impl must be 'pclmul' or 'zlib', got 'crc32c'"):
        native.crc32_by("crc32c", b"x")
    assert native.crc32_by("zlib", b"abc", 5) == zlib.crc32(b"abc", 5)
