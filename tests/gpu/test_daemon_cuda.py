"""The daemon's CUDA arena: IPC export readable from another process, copies via pinned memory."""

from __future__ import annotations

import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from cache_daemon.config import DaemonConfig  # noqa: E402
from cache_daemon.daemon import CacheDaemon  # noqa: E402
from cache_daemon.tiers import ArenaKind, Tier  # noqa: E402
from cache_daemon.tiers.device import CudaArena  # noqa: E402
from tests.unit.test_daemon_store import blob_of, write_store  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BLOB = 4096

# Run in a child: a process cannot open its own CUDA IPC handle.
IMPORTER = """
import ast, sys, zlib, torch
h = ast.literal_eval(sys.stdin.read())
index = [i for i in range(torch.cuda.device_count())
         if "GPU-" + str(torch.cuda.get_device_properties(i).uuid).removeprefix("GPU-") == h["gpu_uuid"]][0]
torch.cuda._lazy_init()
storage = torch.UntypedStorage._new_shared_cuda(
    index, h["cuda_ipc_handle"], h["cuda_alloc_bytes"], h["cuda_offset"],
    h["cuda_ref_counter_handle"], h["cuda_ref_counter_offset"], h["cuda_event_handle"], bool(h["cuda_event_handle"]))
flat = torch.empty(0, dtype=torch.uint8, device=f"cuda:{index}")
flat.set_(storage, 0, (h["size_bytes"],), (1,))
print(zlib.crc32(flat.cpu().numpy().tobytes()))
"""


def test_cuda_arena_export_is_readable_from_another_process():
    arena = CudaArena(3, BLOB)
    try:
        src = torch.arange(3 * BLOB, dtype=torch.int64).remainder(251).to(torch.uint8).pin_memory()
        for slot in range(3):
            arena.copy_in(slot, src[slot * BLOB : (slot + 1) * BLOB])
        assert torch.equal(arena.slots.cpu().reshape(-1), src)
        handle = arena.handle()
        assert handle.kind is ArenaKind.CUDA_IPC and handle.size_bytes == 3 * BLOB
        assert handle.gpu_uuid.startswith("GPU-") and handle.cuda_ipc_handle
        assert handle.cuda_alloc_bytes == 3 * BLOB
        fields = {
            name: getattr(handle, name)
            for name in (
                "cuda_ipc_handle",
                "cuda_alloc_bytes",
                "cuda_offset",
                "cuda_ref_counter_handle",
                "cuda_ref_counter_offset",
                "cuda_event_handle",
                "gpu_uuid",
                "size_bytes",
            )
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
        store_dir=str(store), socket_path=str(tmp_path / "d.sock"), device_budget_bytes=manifest.blob_bytes
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
