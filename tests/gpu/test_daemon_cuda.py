"""The daemon's CUDA arena on the native core: allocation on a GPU chosen by ordinal or UUID,
copies from pinned host memory through the copy engine, the IPC export opened by compute's
``Arena.open`` in another process, and the daemon serving checksummed experts from the GPU."""

from __future__ import annotations

import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

from cache_daemon.config import DaemonConfig
from cache_daemon.daemon import CacheDaemon
from cache_daemon.decisions.policy import make_policy
from cache_daemon.metrics import DaemonMetrics
from cache_daemon.tiers import ArenaKind, HostTier, Tier
from cache_daemon.tiers.device import CudaArena, create_arena
from expertcache import native
from expertcache.keys import ExpertKey
from tests.stores import blob_of, write_store

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not native.CUDA_BUILT, reason="native module built without nvcc"),
]

REPO = Path(__file__).resolve().parents[2]

BLOB = 4096
ODD = 5000  # not a multiple of 256: rows are padded to a 5120-byte stride

# Run in a child: a process cannot open its own CUDA IPC handle. Compute's own opening code.
IMPORTER = """
import ast, sys, zlib, torch
from compute_svc.experts.arena import Arena, ArenaHandle, ArenaKind
h = ast.literal_eval(sys.stdin.read())
num_slots, slot_bytes = h.pop("num_slots"), h.pop("slot_bytes")
arena = Arena.open(ArenaHandle(kind=ArenaKind.CUDA_IPC, **h), num_slots, slot_bytes, torch.device("cuda"))
assert arena.slots.shape == (num_slots, slot_bytes) and arena.device.type == "cuda"
print(zlib.crc32(arena.slots.cpu().contiguous().numpy().tobytes()))
"""


def pattern(num_slots: int, slot_bytes: int) -> torch.Tensor:
    """``[num_slots, slot_bytes]`` uint8 of distinct bytes per slot, in page-locked memory."""
    return (
        torch.arange(num_slots * slot_bytes, dtype=torch.int64)
        .remainder(251)
        .to(torch.uint8)
        .view(num_slots, slot_bytes)
        .pin_memory()
    )


@pytest.mark.parametrize("slot_bytes", [BLOB, ODD])
def test_cuda_arena_export_is_readable_from_another_process(slot_bytes):
    arena = CudaArena(3, slot_bytes)
    try:
        assert arena.slots.shape == (3, slot_bytes) and arena.slots.device.type == "cuda"
        stride = -(-slot_bytes // 256) * 256
        assert arena.slots.stride() == (stride, 1)
        src = pattern(3, slot_bytes)
        for slot in range(3):
            arena.copy_in(slot, src[slot])
        assert torch.equal(arena.slots.cpu(), src)
        handle = arena.handle()
        assert handle.kind is ArenaKind.CUDA_IPC and handle.size_bytes == 3 * slot_bytes
        assert handle.gpu_uuid == native.cuda_device_uuid(arena.index)
        assert len(handle.cuda_ipc_handle) == 64 and handle.cuda_offset == 0
        assert handle.cuda_alloc_bytes == 3 * stride
        fields = {
            "size_bytes": handle.size_bytes,
            "cuda_ipc_handle": handle.cuda_ipc_handle,
            "cuda_alloc_bytes": handle.cuda_alloc_bytes,
            "gpu_uuid": handle.gpu_uuid,
            "num_slots": 3,
            "slot_bytes": slot_bytes,
        }
        child = subprocess.run(
            [sys.executable, "-c", IMPORTER],
            input=repr(fields),
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=120,
        )
        assert child.returncode == 0, child.stderr
        assert int(child.stdout.strip()) == zlib.crc32(src.numpy().tobytes())
    finally:
        arena.close()
    arena.close()  # idempotent


def test_gpu_by_ordinal_or_uuid_and_copy_in_checks(tmp_path):
    last = torch.cuda.device_count() - 1
    for device in (f"cuda:{last}", f"cuda:{native.cuda_device_uuid(last)}"):
        arena = create_arena(device, 2, BLOB, daemon_id="gpu1")
        try:
            assert arena.index == last and arena.slots.device == torch.device("cuda", last)
            assert {p.name for p in tmp_path.iterdir()} == {"expertcache-gpu1.lock"}  # no arena file
            with pytest.raises(ValueError, match=r"copy_in takes a \[4096\] uint8 host tensor, got \[100\]"):
                arena.copy_in(0, torch.zeros(100, dtype=torch.uint8))
            with pytest.raises(ValueError, match="on cuda"):
                arena.copy_in(0, torch.zeros(BLOB, dtype=torch.uint8, device=arena.slots.device))
            pageable = torch.full((BLOB,), 7, dtype=torch.uint8)  # works, only synchronously
            arena.copy_in(1, pageable)
            assert torch.equal(arena.slots[1].cpu(), pageable)
            staging = arena.staging_buffer()
            assert staging.data_ptr() % 4096 == 0 and staging.is_pinned()
            assert arena.staging_buffer().data_ptr() == staging.data_ptr()  # one per thread
        finally:
            arena.close()
        assert list(tmp_path.iterdir()) == []


def test_host_tier_is_pinned_and_feeds_the_arena():
    host = HostTier(2, BLOB, make_policy("lru"), DaemonMetrics(), pin_memory=True)
    arena = CudaArena(1, BLOB)
    try:
        assert host.pinned_memory
        key = ExpertKey(1, 1)
        view = host.put_from(key, lambda v: v.copy_(torch.arange(BLOB).remainder(253).to(torch.uint8)))
        assert view is not None and view.is_pinned()
        arena.copy_in(0, view)
        host.unpin(key)
        assert torch.equal(arena.slots[0].cpu(), torch.arange(BLOB).remainder(253).to(torch.uint8))
    finally:
        arena.close()
        host.close()


def test_daemon_on_cuda_serves_checksummed_experts(tmp_path):
    store = tmp_path / "store"
    manifest = write_store(store)
    config = DaemonConfig(
        store_dir=str(store),
        socket_path=str(tmp_path / "d.sock"),
        device_budget_bytes=2 * manifest.blob_bytes,
        host_budget_bytes=3 * manifest.blob_bytes,
        device="cuda",
    )
    daemon = CacheDaemon.start(config)
    try:
        assert daemon.attach("test").arena.kind is ArenaKind.CUDA_IPC
        assert daemon.host.pinned_memory
        r = daemon.residency
        s = r.open_session("gpu")
        for wave, sources in (([0, 1], {Tier.STORE}), ([2], {Tier.STORE}), ([0], {Tier.HOST})):
            readies = list(r.acquire(s, 1, wave))
            assert {x.source for x in readies} == sources
            for x in readies:
                got = bytes(r.read_slot(s, x.key).cpu().numpy())
                assert got == blob_of(store, manifest, x.key)
            r.release(s, [x.key for x in readies])
        r.close_session(s)
    finally:
        daemon.close()
    config = DaemonConfig(
        store_dir=str(store),
        socket_path=str(tmp_path / "d.sock"),
        device_budget_bytes=manifest.blob_bytes,
    )
    # device "auto" picks CUDA; without a host tier the store is read into a pinned staging buffer.
    daemon = CacheDaemon.start(config)
    try:
        r = daemon.residency
        s = r.open_session("gpu")
        (ready,) = r.acquire(s, 3, [4])
        assert bytes(r.read_slot(s, ready.key).cpu().numpy()) == blob_of(store, manifest, ready.key)
    finally:
        daemon.close()
