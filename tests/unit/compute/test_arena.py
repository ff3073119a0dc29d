"""Arena mapping: a real shm file, typed per-slot views, device agreement, and the CUDA IPC
path's errors that a machine without a GPU can reach (the mapping itself is in tests/gpu/)."""

from __future__ import annotations

import os
import uuid

import pytest
import torch

from compute_svc.arena import Arena, ArenaHandle, ArenaKind, cuda_device_for_uuid, resolve_device, shm_path
from compute_svc.errors import ArenaMismatch
from expertcache import native
from expertcache.manifest import plan_blob

LAYOUT, BLOB = plan_blob(
    [("gate_up_proj", "float32", (6, 4)), ("down_proj", "bfloat16", (4, 3)), ("b", "float32", (4,))]
)


@pytest.fixture
def shm_file():
    name = f"expertcache-test-{uuid.uuid4().hex}"
    path = shm_path(name)
    yield name, path
    path.unlink(missing_ok=True)


def write_arena(path, num_slots: int) -> list[dict[str, torch.Tensor]]:
    """Fill each slot with known tensors laid out as LAYOUT (what the daemon would copy in)."""
    expected = []
    raw = bytearray(num_slots * BLOB)
    for slot in range(num_slots):
        tensors = {
            "gate_up_proj": torch.arange(24, dtype=torch.float32).view(6, 4) + 100 * slot,
            "down_proj": (torch.arange(12, dtype=torch.float32).view(4, 3) - slot).to(torch.bfloat16),
            "b": torch.full((4,), float(slot)),
        }
        for t in LAYOUT:
            (part,) = t.parts  # plain tensors: one stored part each
            data = tensors[t.name].contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
            start = slot * BLOB + part.offset
            raw[start : start + len(data)] = data
        expected.append(tensors)
    path.write_bytes(bytes(raw))
    return expected


def test_shm_arena_views_alias_the_daemon_bytes(shm_file):
    name, path = shm_file
    expected = write_arena(path, 3)
    handle = ArenaHandle(kind=ArenaKind.POSIX_SHM, size_bytes=3 * BLOB, shm_name=name)
    arena = Arena.open(handle, 3, BLOB, torch.device("cpu"))
    assert (arena.num_slots, arena.slot_bytes) == (3, BLOB)
    for slot in range(3):
        views = arena.slot_views(slot, LAYOUT)
        for key, want in expected[slot].items():
            assert views[key].dtype == want.dtype and views[key].shape == want.shape
            assert torch.equal(views[key], want)
    # The mapping is shared: a later write by the daemon is seen through the same views.
    views = arena.slot_views(1, LAYOUT)
    with open(path, "r+b") as f:
        f.seek(1 * BLOB + LAYOUT[2].parts[0].offset)
        f.write(torch.full((4,), 7.0).numpy().tobytes())
    assert views["b"].tolist() == [7.0] * 4


def test_shm_name_may_be_an_absolute_path(tmp_path):
    path = tmp_path / "arena.bin"
    write_arena(path, 1)
    handle = ArenaHandle(kind=ArenaKind.POSIX_SHM, size_bytes=BLOB, shm_name=str(path))
    arena = Arena.open(handle, 1, BLOB, torch.device("cpu"))
    assert arena.slot_views(0, LAYOUT)["b"].tolist() == [0.0] * 4
    assert shm_path("/expertcache-x") == shm_path("expertcache-x")  # POSIX "/name" spelling


def test_missing_or_short_arena_is_a_clear_error(shm_file):
    name, path = shm_file
    handle = ArenaHandle(kind=ArenaKind.POSIX_SHM, size_bytes=2 * BLOB, shm_name=name)
    with pytest.raises(
        ArenaMismatch, match="cannot open the cache daemon's arena .*same pod, same IPC namespace"
    ):
        Arena.open(handle, 2, BLOB, torch.device("cpu"))
    path.write_bytes(b"\0" * BLOB)
    with pytest.raises(ArenaMismatch, match=f"has {BLOB} bytes, expected at least {2 * BLOB}"):
        Arena.open(handle, 2, BLOB, torch.device("cpu"))
    assert os.path.exists(path)


def test_device_must_agree_with_the_arena():
    assert resolve_device("auto", ArenaKind.POSIX_SHM) == torch.device("cpu")
    assert resolve_device("auto", ArenaKind.CUDA_IPC, cuda_available=True) == torch.device("cuda")
    with pytest.raises(
        ArenaMismatch, match="device 'cuda' was configured but the cache daemon's arena is posix_shm"
    ):
        resolve_device("cuda", ArenaKind.POSIX_SHM)
    with pytest.raises(ArenaMismatch, match="sees no CUDA device"):
        resolve_device("auto", ArenaKind.CUDA_IPC, cuda_available=False)


GPU = "GPU-12345678-1234-1234-1234-123456789abc"


def cuda_handle(**overrides) -> ArenaHandle:
    fields = dict(
        kind=ArenaKind.CUDA_IPC,
        size_bytes=2 * BLOB,
        cuda_ipc_handle=b"\1" * 64,
        gpu_uuid=GPU,
        cuda_alloc_bytes=2 * BLOB,
    )
    return ArenaHandle(**{**fields, **overrides})


@pytest.mark.skipif(not native.CUDA_BUILT, reason="the native module was built without nvcc")
def test_cuda_arena_on_a_gpu_this_process_cannot_see():
    if native.cuda_available() and GPU in {
        native.cuda_device_uuid(i) for i in range(native.cuda_device_count())
    }:
        pytest.skip("a GPU with the made-up UUID exists")
    with pytest.raises(
        ArenaMismatch,
        match=rf"arena is on GPU '{GPU}', which this process cannot see \(no visible CUDA device has UUID "
        rf"{GPU}; visible: .*\); give both containers the same GPU",
    ):
        Arena.open(cuda_handle(), 2, BLOB, torch.device("cuda"))
    with pytest.raises(ArenaMismatch, match="arena is on GPU 'nonsense'.*malformed GPU UUID 'nonsense'"):
        cuda_device_for_uuid("nonsense")


def test_cuda_arena_needs_a_native_module_built_with_nvcc(monkeypatch):
    monkeypatch.setattr(native, "CUDA_BUILT", False)
    with pytest.raises(
        ArenaMismatch, match=r"built without CUDA: put nvcc on PATH .* rebuild it .*`make native`"
    ):
        Arena.open(cuda_handle(), 2, BLOB, torch.device("cuda"))


def test_cuda_arena_must_start_at_its_allocation():
    with pytest.raises(ArenaMismatch, match="starts 256 bytes into its allocation"):
        Arena.open(cuda_handle(cuda_offset=256), 2, BLOB, torch.device("cuda"))
    with pytest.raises(ArenaMismatch, match=f"arena of {2 * BLOB} bytes cannot hold 3 slots of {BLOB} bytes"):
        Arena.open(cuda_handle(), 3, BLOB, torch.device("cuda"))
