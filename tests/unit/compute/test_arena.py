"""Arena mapping: a real memfd arena as the daemon makes it, typed per-slot views, device agreement, and the CUDA IPC
path's errors that a machine without a GPU can reach (the mapping itself is in tests/gpu/)."""

from __future__ import annotations

import os

import pytest
import torch

from cache_daemon.tiers.device import MemfdArena
from compute_svc.errors import ArenaMismatch
from compute_svc.experts.arena import Arena, ArenaHandle, ArenaKind, cuda_device_for_uuid, resolve_device
from expertcache import memfd, native
from expertcache.manifest import plan_blob

LAYOUT, BLOB = plan_blob(
    [("gate_up_proj", "float32", (6, 4)), ("down_proj", "bfloat16", (4, 3)), ("b", "float32", (4,))]
)


def write_arena(arena: MemfdArena) -> list[dict[str, torch.Tensor]]:
    """Fill each slot with known tensors laid out as LAYOUT, as the daemon copies them in."""
    expected = []
    for slot in range(arena.num_slots):
        tensors = {
            "gate_up_proj": torch.arange(24, dtype=torch.float32).view(6, 4) + 100 * slot,
            "down_proj": (torch.arange(12, dtype=torch.float32).view(4, 3) - slot).to(torch.bfloat16),
            "b": torch.full((4,), float(slot)),
        }
        for t in LAYOUT:
            (part,) = t.parts  # plain tensors: one stored part each
            data = tensors[t.name].contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
            arena.host_buffer(slot)[part.offset : part.offset + len(data)] = data
        expected.append(tensors)
    return expected


def compute_side(arena: MemfdArena, nbytes: int | None = None):
    """The read-only mapping compute makes of the arena's handed-over descriptor."""
    fd = arena.arena_fd()
    try:
        return memfd.map_readonly(fd, arena.size_bytes if nbytes is None else nbytes, "the arena")
    finally:
        os.close(fd)


def test_memfd_arena_views_alias_the_daemon_bytes():
    daemon_side = MemfdArena(3, BLOB, daemon_id="views")
    try:
        expected = write_arena(daemon_side)
        arena = Arena.open(daemon_side.handle(), 3, BLOB, torch.device("cpu"), compute_side(daemon_side))
        assert (arena.num_slots, arena.slot_bytes) == (3, BLOB)
        for slot in range(3):
            views = arena.slot_views(slot, LAYOUT)
            for key, want in expected[slot].items():
                assert views[key].dtype == want.dtype and views[key].shape == want.shape
                assert torch.equal(views[key], want)
        # The mapping is shared: a later write by the daemon is seen through the same views.
        views = arena.slot_views(1, LAYOUT)
        offset = LAYOUT[2].parts[0].offset
        daemon_side.host_buffer(1)[offset : offset + 16] = torch.full((4,), 7.0).numpy().tobytes()
        assert views["b"].tolist() == [7.0] * 4
    finally:
        daemon_side.close()


def test_a_missing_or_short_arena_is_a_clear_error():
    handle = ArenaHandle(kind=ArenaKind.MEMFD, size_bytes=2 * BLOB)
    with pytest.raises(ArenaMismatch, match="arena is a memfd, and its handoff did not give it"):
        Arena.open(handle, 2, BLOB, torch.device("cpu"))
    daemon_side = MemfdArena(1, BLOB, daemon_id="short")
    try:
        with pytest.raises(
            memfd.MemfdError, match=f"the arena has {BLOB} bytes, expected at least {2 * BLOB}"
        ):
            compute_side(daemon_side, 2 * BLOB)
        with pytest.raises(ArenaMismatch, match=f"maps {BLOB} bytes, expected at least {2 * BLOB}"):
            Arena.open(handle, 2, BLOB, torch.device("cpu"), compute_side(daemon_side))
    finally:
        daemon_side.close()


def test_an_unsealed_descriptor_is_refused():
    fd = os.memfd_create("unsealed", os.MFD_CLOEXEC)  # writable by whoever holds it
    try:
        os.ftruncate(fd, BLOB)
        with pytest.raises(memfd.MemfdError, match="the arena is not sealed"):
            memfd.map_readonly(fd, BLOB, "the arena")
    finally:
        os.close(fd)
    with open(__file__, "rb") as f:  # not a memfd at all
        with pytest.raises(memfd.MemfdError, match="the arena is not a sealed memfd"):
            memfd.map_readonly(f.fileno(), BLOB, "the arena")


def test_device_must_agree_with_the_arena():
    assert resolve_device("auto", ArenaKind.MEMFD) == torch.device("cpu")
    assert resolve_device("auto", ArenaKind.CUDA_IPC, cuda_available=True) == torch.device("cuda")
    with pytest.raises(
        ArenaMismatch, match="device 'cuda' was configured but the cache daemon's arena is memfd"
    ):
        resolve_device("cuda", ArenaKind.MEMFD)
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
