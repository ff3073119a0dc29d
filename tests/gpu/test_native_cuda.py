"""The native CUDA path on a real GPU: arena allocation and layout, IPC export opened by another
process through the handle and the GPU UUID, copies from a pinned host pool on the copy engine's
streams, ticket completion and the timeout path, UUIDs equal to torch's.
"""

from __future__ import annotations

import multiprocessing as mp
import traceback
import zlib

import pytest
import torch

try:
    from expertcache import native
except ImportError as exc:  # tests/native/conftest.py builds it; this directory does not
    pytest.skip(f"native extension not built ({exc}); run `make native`", allow_module_level=True)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not native.CUDA_BUILT, reason="extension built without nvcc"),
]

SLOT_BYTES = 5000  # not a multiple of 256: the stride is padded to 5120


def _pattern(slot: int, nbytes: int) -> bytes:
    return bytes((slot * 31 + i * 7) % 251 for i in range(nbytes))


def _child_read_and_mark(handle: bytes, gpu_uuid: str, num_slots: int, slot_bytes: int, results) -> None:
    """In a spawned process: open the arena by handle + UUID, send back each slot's CRC-32, then
    write a marker into the last slot for the parent to see."""
    try:
        from expertcache import native as nat

        arena = nat.CudaArena.open(handle, gpu_uuid, num_slots, slot_bytes)
        assert not arena.owned and arena.gpu_uuid == nat.cuda_normalize_uuid(gpu_uuid)
        try:
            arena.export_handle()
            raise AssertionError("an imported arena was exported again")
        except RuntimeError as e:
            assert "cannot be exported again" in str(e), e
        view = torch.as_tensor(arena, device=f"cuda:{arena.device}")  # [num_slots, stride] uint8
        assert view.data_ptr() == arena.base_address and tuple(view.shape) == (num_slots, arena.stride)
        crcs = [zlib.crc32(view[i, :slot_bytes].cpu().numpy().tobytes()) for i in range(num_slots)]
        view[num_slots - 1, :4] = torch.tensor(
            [0xDE, 0xAD, 0xBE, 0xEF], dtype=torch.uint8, device=view.device
        )
        torch.cuda.synchronize(view.device)
        del view
        arena.close()
        results.put(("ok", crcs))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent as text
        results.put(("error", traceback.format_exc()))


def test_device_uuids_equal_torchs():
    assert native.cuda_device_count() == torch.cuda.device_count()
    for i in range(torch.cuda.device_count()):
        bare = str(torch.cuda.get_device_properties(i).uuid)  # torch prints no "GPU-" prefix
        assert native.cuda_device_uuid(i) == native.cuda_normalize_uuid(bare)
        assert native.cuda_device_uuid(i) == "GPU-" + bare.lower().removeprefix("gpu-")
        assert native.cuda_device_for_uuid(bare) == i
        assert native.cuda_device_for_uuid(bare.upper()) == i
        assert native.cuda_device_for_uuid(native.cuda_device_uuid(i)) == i


def test_unknown_uuid_lists_the_visible_devices():
    with pytest.raises(
        ValueError, match=r"no visible CUDA device has UUID GPU-0{8}-.*; visible: GPU-"
    ) as err:
        native.cuda_device_for_uuid("GPU-00000000-0000-0000-0000-000000000000")
    assert native.cuda_device_uuid(0) in str(err.value)


def test_arena_layout_zero_fill_and_close():
    arena = native.CudaArena.allocate(0, 3, SLOT_BYTES)
    assert arena.owned and arena.device == 0 and arena.gpu_uuid == native.cuda_device_uuid(0)
    assert arena.stride == 5120 and arena.size_bytes == 3 * 5120 and arena.slot_bytes == SLOT_BYTES
    assert arena.base_address % 256 == 0
    assert [arena.slot_address(i) for i in range(3)] == [arena.base_address + i * 5120 for i in range(3)]
    with pytest.raises(IndexError, match=r"slot 3 out of range \[0, 3\)"):
        arena.slot_address(3)
    with pytest.raises(IndexError, match=r"slot -1 out of range"):
        arena.slot_address(-1)
    assert len(arena.export_handle()) == native._native.CUDA_IPC_HANDLE_BYTES == 64
    view = torch.as_tensor(arena, device="cuda:0")
    assert view.dtype == torch.uint8 and tuple(view.shape) == (3, 5120)
    assert view.data_ptr() == arena.base_address  # a view, not a copy
    assert int(view.count_nonzero()) == 0
    del view
    arena.close()
    assert arena.closed
    arena.close()  # idempotent
    with pytest.raises(RuntimeError, match="device arena is closed"):
        _ = arena.base_address


def test_pinned_host_pool_reports_pinned():
    pool = native.HostPool(2, 4096, pin=True)
    assert pool.pinned is True
    del pool  # cudaHostUnregister before munmap; a failure would be printed, not raised


def test_copy_from_pinned_pool_is_read_by_another_process_through_ipc():
    num_slots = 4
    arena = native.CudaArena.allocate(0, num_slots, SLOT_BYTES)
    pool = native.HostPool(num_slots, SLOT_BYTES, pin=True)
    engine = native.CopyEngine(0, num_streams=2)
    tickets = []
    for slot in range(num_slots):
        i = pool.alloc()
        pool.view(i)[:] = _pattern(slot, SLOT_BYTES)
        tickets.append(
            engine.copy_h2d(arena.slot_address(slot), pool.slot_address(i), SLOT_BYTES, stream=slot % 2)
        )
    assert tickets == sorted(tickets) and len(set(tickets)) == num_slots
    for t in tickets:
        engine.wait(t, timeout_s=30.0)
        assert engine.query(t)  # released tickets stay complete
    assert engine.pending == 0

    ctx = mp.get_context("spawn")  # a forked child cannot use CUDA; a process cannot open its own handle
    results = ctx.Queue()
    child = ctx.Process(
        target=_child_read_and_mark,
        args=(
            arena.export_handle(),
            arena.gpu_uuid.lower().removeprefix("gpu-"),
            num_slots,
            SLOT_BYTES,
            results,
        ),
    )
    child.start()
    status, payload = results.get(timeout=120)
    child.join(timeout=60)
    assert status == "ok", payload
    assert child.exitcode == 0
    assert payload == [zlib.crc32(_pattern(slot, SLOT_BYTES)) for slot in range(num_slots)]

    view = torch.as_tensor(arena, device="cuda:0")
    assert view[num_slots - 1, :4].tolist() == [0xDE, 0xAD, 0xBE, 0xEF]  # the child's write
    del view
    arena.close()


def test_wait_times_out_while_the_copy_is_in_flight_then_completes():
    nbytes = 256 << 20
    arena = native.CudaArena.allocate(0, 1, nbytes)
    pool = native.HostPool(1, nbytes, pin=True)
    src = pool.slot_address(pool.alloc())
    engine = native.CopyEngine(0, num_streams=1)
    # ~2 GiB queued on one stream: tens of milliseconds at PCIe/NVLink-C2C speeds, so the last
    # ticket cannot be complete when it is first queried.
    tickets = [engine.copy_h2d(arena.slot_address(0), src, nbytes) for _ in range(8)]
    with pytest.raises(TimeoutError, match=rf"copy ticket {tickets[-1]} not complete after 0\.0+ s"):
        engine.wait(tickets[-1], timeout_s=0.0)
    engine.wait(tickets[-1], timeout_s=60.0)
    assert engine.query(tickets[-1])
    engine.synchronize()
    assert engine.pending == 0
    assert all(engine.query(t) for t in tickets)
    arena.close()


def test_copy_engine_rejects_unknown_tickets_and_streams():
    arena = native.CudaArena.allocate(0, 1, 4096)
    pool = native.HostPool(1, 4096, pin=True)
    engine = native.CopyEngine(0, num_streams=2)
    with pytest.raises(ValueError, match=r"unknown copy ticket 1 \(issued so far: 1\.\.0\)"):
        engine.query(1)
    with pytest.raises(ValueError, match="unknown copy ticket 0"):
        engine.wait(0, timeout_s=1.0)
    with pytest.raises(IndexError, match=r"stream 2 out of range \[0, 2\)"):
        engine.copy_h2d(arena.slot_address(0), pool.slot_address(pool.alloc()), 4096, stream=2)
    with pytest.raises(ValueError, match="null address"):
        engine.copy_h2d(0, pool.base_address, 4096)
    t = engine.copy_h2d(arena.slot_address(0), pool.base_address, 4096, stream=1)
    engine.wait(t)
    assert engine.query(t) and engine.pending == 0
    arena.close()


def test_open_rejects_a_uuid_this_process_cannot_see():
    arena = native.CudaArena.allocate(0, 1, 4096)
    with pytest.raises(ValueError, match=r"no visible CUDA device has UUID GPU-f{8}-"):
        native.CudaArena.open(arena.export_handle(), "GPU-ffffffff-ffff-ffff-ffff-ffffffffffff", 1, 4096)
    arena.close()


def test_export_after_close_is_refused():
    arena = native.CudaArena.allocate(0, 1, 4096)
    handle = arena.export_handle()
    assert isinstance(handle, bytes) and len(handle) == 64
    arena.close()
    with pytest.raises(RuntimeError, match="device arena is closed"):
        arena.export_handle()
