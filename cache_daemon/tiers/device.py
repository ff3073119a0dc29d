"""The device arena: ``num_slots`` fixed-size slots in one allocation shared with compute, a
sealed memfd (CPU) or one CUDA allocation exported by IPC. Raw memory: which expert a slot holds is
the residency's (docs/residency.md, "The device arena").
"""

from __future__ import annotations

import ctypes
import glob
import itertools
import logging
import mmap
import os
import threading
import time
from abc import ABC, abstractmethod

import torch

from cache_daemon.errors import ArenaUnavailable, CopyInFlight
from cache_daemon.tiers.host import StagingBuffer
from expertcache import memfd, native
from expertcache.arena_handle import ArenaHandle, ArenaKind

logger = logging.getLogger(__name__)


class _ThreadStaging(threading.local):
    """Each I/O thread's staging buffer, made on its first read that needs one."""

    staging: StagingBuffer | None = None


def resolve_device(device: str) -> str:
    """The arena kind for a configured device: ``"cpu"`` or ``"cuda"``.

    ``device`` is ``auto``, ``cpu``, ``cuda`` or ``cuda:<ordinal or GPU UUID>``. ``auto`` →
    ``"cuda"`` when torch sees a GPU, else ``"cpu"``; ``cuda`` without one fails. A CUDA arena
    also needs the native module built with nvcc (``native.CUDA_BUILT``); on a GPU machine
    without it this fails rather than silently serving from CPU memory.
    """
    kind, _, gpu = device.partition(":")
    if device == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    elif kind not in ARENAS or (gpu and kind != "cuda"):
        raise ValueError(
            f"unknown arena device {device!r}; known: auto, {', '.join(sorted(ARENAS))}, "
            "cuda:<ordinal>, cuda:<GPU UUID>"
        )
    elif kind == "cuda" and not torch.cuda.is_available():
        raise ArenaUnavailable(
            f"device={device!r} was configured but torch sees no CUDA device (use auto or cpu)"
        )
    if kind == "cuda":
        require_native_cuda()
    return kind


def require_native_cuda() -> None:
    """Fail with how to fix it when the native core cannot use the GPU torch sees: built without
    CUDA, or linking a CUDA runtime newer than the driver (the reason names both versions)."""
    if not native.CUDA_BUILT:
        raise ArenaUnavailable(
            "this machine has a CUDA device but the native core (expertcache._native) was built without "
            "CUDA: put nvcc on PATH (e.g. export PATH=/usr/local/cuda/bin:$PATH) and rebuild it "
            "(`pip install .`, or `make native` in a checkout)"
        )
    if native.cuda_device_count() == 0:
        raise ArenaUnavailable(f"the native core sees no CUDA device: {native.cuda_no_device_reason()}")


class DeviceArena(ABC):
    """``slots``: the ``[num_slots, slot_bytes]`` uint8 tensor on ``device``."""

    kind: ArenaKind
    slots: torch.Tensor

    def __init__(self, num_slots: int, slot_bytes: int) -> None:
        if num_slots < 1:
            raise ValueError(f"an arena needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes

    @property
    def size_bytes(self) -> int:
        return self.num_slots * self.slot_bytes

    @property
    def device(self) -> torch.device:
        return self.slots.device

    @property
    def pin_host_memory(self) -> bool:
        """Whether host buffers feeding this arena should be page-locked (true for CUDA)."""
        return False

    @property
    def numa_node(self) -> int:
        """The NUMA node host buffers feeding this arena should live on; -1: anywhere."""
        return -1

    @abstractmethod
    def handle(self) -> ArenaHandle:
        """How another process maps this arena."""

    def arena_fd(self) -> int | None:
        """A new descriptor of the arena for a client (the handoff sends it and closes it), or
        None when the arena is not shared by descriptor (CUDA IPC) or is closed."""
        return None

    def host_buffer(self, slot: int) -> memoryview | None:
        """A writable host view of ``slot`` to read the store into directly, or None (CUDA)."""
        return None

    @abstractmethod
    def staging_buffer(self) -> torch.Tensor:
        """A page-aligned ``[slot_bytes]`` uint8 host buffer private to the calling thread."""

    @abstractmethod
    def copy_in(self, slot: int, src: torch.Tensor) -> None:
        """Copy ``src`` (``[slot_bytes]`` uint8, host) into ``slot``; returns once it is there.
        ``CopyInFlight`` if it is not there in time and still may be written (slot and source
        stay reserved until ``wait_done()``)."""

    @abstractmethod
    def close(self) -> None:
        """Free the arena. Idempotent."""


class MemfdArena(DeviceArena):
    """CPU arena: a sealed memfd mapped ``MAP_SHARED``, writable here and read-only everywhere else
    (``expertcache.memfd``). No name: compute gets the descriptor over the handoff socket
    (``arena_fd``), and the memory goes when the last mapping and descriptor go, however the
    daemon dies."""

    kind = ArenaKind.MEMFD

    def __init__(
        self, num_slots: int, slot_bytes: int, *, daemon_id: str, gpu: int | str | None = None
    ) -> None:
        del gpu  # a CUDA-arena argument; accepted so every arena is built the same way
        super().__init__(num_slots, slot_bytes)
        nbytes = self.size_bytes
        try:
            self._fd = memfd.create(f"expertcache-arena-{daemon_id}", nbytes)
        except memfd.MemfdError as exc:
            raise ArenaUnavailable(
                f"cannot make the CPU arena: {exc} (raise the daemon container's memory limit or lower "
                "device_budget_bytes)"
            ) from None
        try:
            self._mmap = mmap.mmap(
                self._fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE
            )
            memfd.seal(self._fd)  # after our writable mapping: no other may be made
        except (OSError, memfd.MemfdError) as exc:
            os.close(self._fd)
            raise ArenaUnavailable(f"cannot map the CPU arena: {exc}") from None
        started = time.perf_counter()
        try:
            memfd.populate(self._mmap, "the CPU arena")  # zeroed now, not at each slot's first fill
        except memfd.MemfdError as exc:
            self._mmap.close()
            os.close(self._fd)
            raise ArenaUnavailable(
                f"{exc} (raise the daemon container's memory limit or lower device_budget_bytes)"
            ) from None
        populate_s = time.perf_counter() - started
        self.slots = torch.frombuffer(self._mmap, dtype=torch.uint8, count=nbytes).view(num_slots, slot_bytes)
        self._base = self.slots.data_ptr()  # the mapping's address: copies go there by memmove
        self._views: dict[int, torch.Tensor] = {}  # slot -> its row of slots, made on first use
        self._local = _ThreadStaging()
        self._lock = threading.Lock()  # arena_fd against close
        self._closed = False
        logger.info(
            "arena: memfd, %d slots x %d bytes, faulted in in %.2f s", num_slots, slot_bytes, populate_s
        )

    def arena_fd(self) -> int | None:
        with self._lock:
            return None if self._closed else os.dup(self._fd)

    def handle(self) -> ArenaHandle:
        return ArenaHandle(kind=self.kind, size_bytes=self.size_bytes)

    def host_buffer(self, slot: int) -> memoryview:
        start = slot * self.slot_bytes
        return memoryview(self._mmap)[start : start + self.slot_bytes]

    def staging_buffer(self) -> torch.Tensor:
        buf = self._local.staging
        if buf is None:
            buf = self._local.staging = StagingBuffer(self.slot_bytes, pin=False)
        return buf.tensor

    def copy_in(self, slot: int, src: torch.Tensor) -> None:
        if (
            src.device.type == "cpu"
            and src.dtype == torch.uint8
            and src.numel() == self.slot_bytes
            and src.is_contiguous()
            and 0 <= slot < self.num_slots
            and not self._closed
        ):
            # A host slot or staging buffer: one memmove (a tensor copy costs more in calls than
            # the copy of a small expert takes).
            ctypes.memmove(self._base + slot * self.slot_bytes, src.data_ptr(), self.slot_bytes)
            return
        view = self._views.get(slot)
        if view is None:  # made once per slot: a tensor view costs microseconds at every load
            view = self._views[slot] = self.slots[slot]
        view.copy_(src if src.dim() == 1 else src.reshape(-1))

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            os.close(self._fd)
        self._views.clear()
        self.slots = torch.empty(0, 0, dtype=torch.uint8)
        try:
            self._mmap.close()
        except BufferError:
            pass  # views handed out earlier are still alive; the mapping goes with them


class CudaArena(DeviceArena):
    """GPU arena: one native device allocation exported by CUDA IPC, filled by the native copy engine.

    ``slots`` is ``torch.as_tensor`` over the native arena's ``__cuda_array_interface__``
    (``[num_slots, stride]`` uint8) cut to ``[num_slots, slot_bytes]``; the tensor references
    the native object, so the memory lives as long as any view of it.

    ``copy_in`` queues the host→device copy on one of the engine's own streams (never torch's
    current stream, so compute kernels do not queue behind it) and waits for its event before
    returning: the I/O thread, not the GPU, absorbs the wait, and an expert reported ready is
    complete. The source must stay untouched until then, which holds because callers pin it
    across ``copy_in``; from a page-locked source (host tier, staging buffer) the copy is DMA.
    """

    kind = ArenaKind.CUDA_IPC
    COPY_STREAMS = 2  # concurrent copies from the I/O threads overlap on two streams
    COPY_TIMEOUT_S = 60.0  # a copy of one expert taking this long means the GPU is wedged

    def __init__(
        self,
        num_slots: int,
        slot_bytes: int,
        *,
        daemon_id: str = "",
        gpu: int | str | None = None,
    ) -> None:
        """``gpu``: a CUDA ordinal, a GPU UUID ("GPU-…", case and prefix free), or None for
        torch's current device."""
        del daemon_id  # a CPU-arena argument; accepted so every arena is built the same way
        super().__init__(num_slots, slot_bytes)
        require_native_cuda()
        self.index = _gpu_ordinal(gpu)
        try:
            self._native = native.CudaArena.allocate(self.index, num_slots, slot_bytes)
            self._engine = native.CopyEngine(self.index, self.COPY_STREAMS)
        except RuntimeError as exc:
            raise ArenaUnavailable(
                f"cannot allocate the CUDA arena ({num_slots} slots x {slot_bytes} bytes) "
                f"on cuda:{self.index}: {exc} (lower device_budget_bytes)"
            ) from exc
        self.gpu_uuid: str = self._native.gpu_uuid
        full = torch.as_tensor(self._native, device=f"cuda:{self.index}")  # [num_slots, stride] uint8
        self.slots = full[:, :slot_bytes]  # [num_slots, slot_bytes] uint8, rows stride apart
        self._next_stream = itertools.count()
        self._local = _ThreadStaging()
        self._closed = False
        logger.info(
            "arena: cuda:%d (%s), %d slots x %d bytes (stride %d)",
            self.index,
            self.gpu_uuid,
            num_slots,
            slot_bytes,
            self._native.stride,
        )

    @property
    def pin_host_memory(self) -> bool:
        return True

    @property
    def numa_node(self) -> int:
        """The GPU's node where the machine has several (its host pool then avoids the socket
        interconnect on every copy), else -1."""
        if len(glob.glob("/sys/devices/system/node/node[0-9]*")) < 2:
            return -1
        return int(native.cuda_device_numa_node(self.index))

    def handle(self) -> ArenaHandle:
        return ArenaHandle(
            kind=self.kind,
            size_bytes=self.size_bytes,
            cuda_ipc_handle=bytes(self._native.export_handle()),
            cuda_alloc_bytes=int(self._native.size_bytes),
            cuda_offset=0,
            gpu_uuid=self.gpu_uuid,
        )

    def staging_buffer(self) -> torch.Tensor:
        # One per I/O thread, kept for the thread's life (the pool lives as long as the daemon).
        buf = self._local.staging
        if buf is None:
            buf = self._local.staging = StagingBuffer(self.slot_bytes, pin=True, numa_node=self.numa_node)
        return buf.tensor

    def copy_in(self, slot: int, src: torch.Tensor) -> None:
        if self._closed:
            raise ArenaUnavailable("copy into a closed CUDA arena")
        if src.device.type != "cpu" or src.dtype != torch.uint8 or src.numel() != self.slot_bytes:
            raise ValueError(
                f"copy_in takes a [{self.slot_bytes}] uint8 host tensor, got {list(src.shape)} "
                f"{src.dtype} on {src.device}"
            )
        if not src.is_contiguous():
            src = src.contiguous()  # a pageable copy; host slots and staging buffers never need it
        stream = next(self._next_stream) % self.COPY_STREAMS
        ticket = self._engine.copy_h2d(
            self._native.slot_address(slot), src.data_ptr(), self.slot_bytes, stream
        )
        try:
            self._engine.wait(ticket, self.COPY_TIMEOUT_S)
        except TimeoutError as exc:
            # The copy is still queued: its slot and its source must not be reused until it lands.
            raise CopyInFlight(
                f"copying {self.slot_bytes} bytes into CUDA arena slot {slot} took over {self.COPY_TIMEOUT_S}s "
                "(the GPU is stalled); the slot stays reserved until the copy lands",
                wait_done=lambda: self._engine.wait(ticket, -1),
            ) from exc

    def close(self) -> None:
        """Wait for queued copies and drop the arena. The device memory is freed when the last
        tensor view of it goes (views hold the native object), never under a live view."""
        if self._closed:
            return
        self._closed = True
        self._engine.synchronize()
        self.slots = torch.empty(0, 0, dtype=torch.uint8)
        self._native = None


def _gpu_ordinal(gpu: int | str | None) -> int:
    """CUDA ordinal for ``gpu`` (ordinal, "GPU-…" UUID, or None for torch's current device)."""
    if gpu is None:
        return torch.cuda.current_device()
    if isinstance(gpu, str) and gpu.isdigit():
        gpu = int(gpu)
    if isinstance(gpu, int):
        count = native.cuda_device_count()
        if not 0 <= gpu < count:
            raise ArenaUnavailable(f"CUDA device {gpu} does not exist: {count} visible")
        return gpu
    try:
        return native.cuda_device_for_uuid(gpu)
    except ValueError as exc:
        raise ArenaUnavailable(f"the configured GPU {gpu!r} is not visible: {exc}") from exc


# Every arena class takes (num_slots, slot_bytes, *, daemon_id, gpu).
ARENAS: dict[str, type[DeviceArena]] = {"cpu": MemfdArena, "cuda": CudaArena}


def create_arena(device: str, num_slots: int, slot_bytes: int, *, daemon_id: str) -> DeviceArena:
    """The arena for ``device`` (``auto``/``cpu``/``cuda``/``cuda:<ordinal or UUID>``) with
    ``num_slots`` slots of ``slot_bytes``."""
    kind = resolve_device(device)
    gpu = device.partition(":")[2] or None
    return ARENAS[kind](num_slots, slot_bytes, daemon_id=daemon_id, gpu=gpu)
