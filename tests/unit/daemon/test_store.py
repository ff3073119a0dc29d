"""The daemon's tiers on real files: the store reader (native Reader: O_DIRECT via io_uring or
pread, or buffered), shm arena. The host tier's tests are in test_host.py. The synthetic stores
they read are written by ``tests.stores.write_store``."""

from __future__ import annotations

import mmap
import os
import zlib
from pathlib import Path

import pytest
import torch

from cache_daemon.errors import (
    ChecksumMismatch,
    ShortRead,
    ShuttingDown,
    StoreIncomplete,
)
from cache_daemon.metrics import DaemonMetrics
from cache_daemon.tiers import ArenaKind, StoreReader, Tier
from cache_daemon.tiers.device import MemfdArena
from cache_daemon.tiers.store import (
    IO_MODE_BUFFERED,
    IO_MODE_PREAD,
    IO_MODE_URING,
    Priority,
    aligned_buffer,
)
from expertcache import memfd
from expertcache.arena_handle import ArenaHandle
from expertcache.errors import DataLoss, FailedPrecondition
from expertcache.keys import ExpertKey
from expertcache.manifest import StoreManifest
from expertcache.native import Reader
from expertcache.prom import value
from tests.stores import blob_of, corrupt, supports_o_direct, write_store

URING_OK, URING_WHY = Reader.uring_available()
BACKENDS = [
    "pread",
    pytest.param(
        "io_uring", marks=pytest.mark.skipif(not URING_OK, reason=f"io_uring unavailable: {URING_WHY}")
    ),
]
DIRECT_MODE = {"pread": IO_MODE_PREAD, "io_uring": IO_MODE_URING}

# -- store reader ----------------------------------------------------------------------------


@pytest.fixture
def store(tmp_path: Path) -> tuple[Path, StoreManifest]:
    root = tmp_path / "store"
    return root, write_store(root)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_store_read_equals_file_bytes(store, backend, direct):
    root, manifest = store
    metrics = DaemonMetrics()
    reader = StoreReader(root, manifest, metrics, io_threads=2, backend=backend, direct=direct)
    try:
        want = DIRECT_MODE[backend] if direct and supports_o_direct(root) else IO_MODE_BUFFERED
        assert reader.io_mode == want
        for key in manifest.all_keys():
            buf = aligned_buffer(manifest.blob_bytes)
            reader.read_into(key, buf)
            assert bytes(buf) == blob_of(root, manifest, key)
            assert bytes(reader.get(key).numpy()) == blob_of(root, manifest, key)
        assert value(metrics.hits, "store") == 2 * manifest.num_blobs
        assert value(metrics.store_read_bytes) == 2 * manifest.num_blobs * manifest.blob_bytes
        assert value(metrics.store_read_seconds) > 0
        assert value(metrics.checksum_failures) == 0
        stats = reader.reader_stats()
        assert stats["completed"] == 2 * manifest.num_blobs and stats["failed"] == 0
    finally:
        reader.close()


def test_store_on_tmpfs_falls_back_to_buffered_reads(tmp_path):
    shm = Path("/dev/shm")
    if not shm.is_dir() or supports_o_direct(shm):
        pytest.skip("needs a /dev/shm that refuses O_DIRECT (tmpfs before Linux 6.6)")
    root = shm / f"expertcache-test-store-{os.getpid()}"
    try:
        manifest = write_store(root)
        reader = StoreReader(root, manifest, DaemonMetrics())
        assert reader.io_mode == IO_MODE_BUFFERED
        key = ExpertKey(3, 4)
        assert bytes(reader.get(key).numpy()) == blob_of(root, manifest, key)
        reader.close()
    finally:
        for path in sorted(root.rglob("*"), reverse=True):
            path.rmdir() if path.is_dir() else path.unlink()
        root.rmdir()


def test_unaligned_destinations_go_through_a_bounce_buffer(store):
    root, manifest = store
    if not supports_o_direct(root):
        pytest.skip("the filesystem of tmp_path refuses O_DIRECT")
    reader = StoreReader(root, manifest, DaemonMetrics())
    direct_mode = reader.io_mode
    assert direct_mode in (IO_MODE_PREAD, IO_MODE_URING)
    backing = aligned_buffer(manifest.blob_bytes + 4096)
    unaligned = memoryview(backing)[1 : 1 + manifest.blob_bytes]
    key = ExpertKey(1, 2)
    reader.read_into(key, unaligned)
    assert bytes(unaligned) == blob_of(root, manifest, key)
    assert bytes(backing[0:1]) == b"\0" and bytes(backing[1 + manifest.blob_bytes :]) == bytes(4095)
    tensor = torch.zeros(manifest.blob_bytes + 8, dtype=torch.uint8)[8:]  # data_ptr 8 past a boundary
    reader.read_into(ExpertKey(3, 1), tensor)
    assert bytes(tensor.numpy()) == blob_of(root, manifest, ExpertKey(3, 1))
    as_bf16 = torch.empty(manifest.blob_bytes // 2, dtype=torch.bfloat16)  # any dtype: raw bytes
    reader.read_into(ExpertKey(3, 2), as_bf16)
    assert bytes(as_bf16.view(torch.uint8).numpy()) == blob_of(root, manifest, ExpertKey(3, 2))
    with pytest.raises(ValueError, match="contiguous CPU buffer"):
        reader.read_into(key, torch.zeros(2, manifest.blob_bytes, dtype=torch.uint8)[:, :8])
    assert reader.io_mode == direct_mode  # still O_DIRECT: nothing fell back
    with pytest.raises(ValueError, match="cannot hold a blob of 4096 bytes"):
        reader.read_into(key, bytearray(100))
    reader.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_priority_reaches_the_native_reader(store, backend):
    root, manifest = store
    reader = StoreReader(root, manifest, DaemonMetrics(), io_threads=1, queue_depth=1, backend=backend)
    reader.pause()
    keys = [ExpertKey(1, 0), ExpertKey(1, 1), ExpertKey(3, 2)]
    bufs = [aligned_buffer(manifest.blob_bytes) for _ in keys]
    priorities = [Priority.PREFETCH, Priority.LAYER_AHEAD, Priority.DEMAND]
    handles = [reader.submit(k, b, p) for k, b, p in zip(keys, bufs, priorities, strict=True)]
    for handle, priority in zip(handles, priorities, strict=True):
        assert handle.state == {"priority": int(priority), "queued": True, "done": False}
        assert not handle.done
    with pytest.raises(TimeoutError, match="did not complete within"):
        handles[0].wait(0.01)  # paused: nothing is read; the read stays pending
    assert [int(p) for p in Priority] == [Reader.DEMAND, Reader.LAYER_AHEAD, Reader.PREFETCH]
    reader.resume()
    for handle, key, buf in zip(reversed(handles), reversed(keys), reversed(bufs), strict=True):
        handle.wait(10.0)
        assert handle.done and handle.state is None
        assert bytes(buf) == blob_of(root, manifest, key)
    with pytest.raises(FailedPrecondition, match="the read of expert L1E0 was already waited for"):
        handles[0].wait()
    assert reader.reader_stats()["completed"] == 3
    reader.close()


def test_close_cancels_pending_reads(store):
    root, manifest = store
    reader = StoreReader(root, manifest, DaemonMetrics())
    reader.pause()
    handle = reader.submit(ExpertKey(3, 5), aligned_buffer(manifest.blob_bytes), Priority.PREFETCH)
    reader.close()
    with pytest.raises(ShuttingDown, match="the store reader closed before expert L3E5 was read") as info:
        handle.wait(1.0)
    assert info.value.grpc_code == "UNAVAILABLE"
    with pytest.raises(ShuttingDown, match="the store reader is closed: cannot read expert L1E0"):
        reader.read_into(ExpertKey(1, 0), aligned_buffer(manifest.blob_bytes))
    reader.close()  # idempotent


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_checksum_mismatch_names_expert_file_and_offset(store, backend, direct):
    root, manifest = store
    key = ExpertKey(1, 3)
    corrupt(root, manifest, key)
    metrics = DaemonMetrics()
    reader = StoreReader(root, manifest, metrics, backend=backend, direct=direct)
    for priority in Priority:
        with pytest.raises(ChecksumMismatch) as info:
            reader.read_into(key, aligned_buffer(manifest.blob_bytes), priority)
        expected = manifest.checksums[1][3]
        got = zlib.crc32(blob_of(root, manifest, key))
        assert str(info.value) == (
            f"checksum mismatch for expert L1E3 in experts/layer_0001.bin at offset {3 * manifest.blob_bytes}: "
            f"expected 0x{expected:08x}, got 0x{got:08x}"
        )
        assert info.value.grpc_code == "DATA_LOSS"
    assert value(metrics.checksum_failures) == 3
    reader.get(ExpertKey(1, 2))  # its neighbours are intact
    reader.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_truncated_store_file(store, backend):
    root, manifest = store
    path = root / manifest.layer_files[3]
    reader = StoreReader(root, manifest, DaemonMetrics(), backend=backend)
    os.truncate(path, 4 * manifest.blob_bytes + 100)  # after the daemon opened it
    with pytest.raises(
        ShortRead,
        match=r"^experts/layer_0003.bin ends at offset 16484: expert L3E4's blob at offset 16384 needs 4096 bytes",
    ):
        reader.get(ExpertKey(3, 4))
    with pytest.raises(
        ShortRead, match="^experts/layer_0003.bin ends at offset 20480: expert L3E5's"
    ) as info:
        reader.get(ExpertKey(3, 5))
    assert info.value.grpc_code == "DATA_LOSS"
    reader.close()
    with pytest.raises(
        StoreIncomplete, match=r"layer_0003.bin has 16484 bytes but layer 3's 6 blobs need 24576"
    ):
        StoreReader(root, manifest, DaemonMetrics())
    path.unlink()
    with pytest.raises(StoreIncomplete, match="layer_0003.bin for layer 3 is missing"):
        StoreReader(root, manifest, DaemonMetrics())


def test_store_is_read_only(store):
    root, manifest = store
    reader = StoreReader(root, manifest, DaemonMetrics())
    key = ExpertKey(1, 0)
    assert reader.contains(key) and reader.pin(key) and not reader.contains(ExpertKey(2, 0))
    with pytest.raises(FailedPrecondition, match="read-only"):
        reader.put(key, torch.zeros(manifest.blob_bytes, dtype=torch.uint8))
    with pytest.raises(FailedPrecondition, match="read-only"):
        reader.remove(key)
    reader.close()


# -- arena buffers ---------------------------------------------------------------------------

BLOB = 4096


def blob(value: int) -> torch.Tensor:
    return torch.full((BLOB,), value, dtype=torch.uint8)


# -- CPU arena -------------------------------------------------------------------------------


def test_memfd_arena_is_shared_read_only_and_nameless():
    arena = MemfdArena(3, BLOB, daemon_id="t1")
    handle = arena.handle()
    assert handle == ArenaHandle(kind=ArenaKind.MEMFD, size_bytes=3 * BLOB)  # no name to open
    arena.copy_in(1, blob(9))
    arena.host_buffer(2)[:4] = b"abcd"
    assert bytes(arena.slots[2, :4].numpy()) == b"abcd"
    fd = arena.arena_fd()
    try:
        assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:expertcache-arena-t1")
        seen = memfd.map_readonly(fd, 3 * BLOB, "the arena")  # what compute sees
        assert seen[BLOB : 2 * BLOB] == bytes([9]) * BLOB and seen[:BLOB] == bytes(BLOB)
        assert seen[2 * BLOB : 2 * BLOB + 4] == b"abcd"
        seen.close()
        with pytest.raises(PermissionError):  # sealed: no writable mapping but the daemon's own
            mmap.mmap(fd, BLOB, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"x", 0)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, BLOB)
    finally:
        os.close(fd)
    arena.close()
    assert arena.arena_fd() is None
    arena.close()  # idempotent


def test_tier_names_are_metric_labels():
    assert [t.value for t in Tier] == ["device", "host", "store", "unknown"]  # unknown: compute only


def test_a_layer_file_symlinked_out_of_the_store_is_refused(tmp_path):
    root = tmp_path / "store"
    manifest = write_store(root)
    outside = tmp_path / "elsewhere.bin"
    (root / "experts" / "layer_0003.bin").rename(outside)
    (root / "experts" / "layer_0003.bin").symlink_to(outside)
    with pytest.raises(DataLoss) as info:
        StoreReader(root, manifest, DaemonMetrics())
    assert (
        f"layer file (layer_files.3) 'experts/layer_0003.bin' of store {root} resolves to {outside}, "
        "outside the store" in str(info.value)
    )
    # A symlink that stays inside the store is followed.
    inside = root / "experts" / "moved.bin"
    outside.rename(inside)
    (root / "experts" / "layer_0003.bin").unlink()
    (root / "experts" / "layer_0003.bin").symlink_to("moved.bin")
    reader = StoreReader(root, manifest, DaemonMetrics())
    key = ExpertKey(3, 1)
    assert bytes(reader.get(key).numpy()) == blob_of(root, manifest, key)
    reader.close()
