"""The device arena: ``num_slots`` fixed-size slots in one allocation shared with compute.

::

    arena  [num_slots, slot_bytes] uint8        slot i = bytes [i*slot_bytes, (i+1)*slot_bytes)
      cpu : file <shm_dir>/expertcache-<daemon_id> (tmpfs), mmap'ed MAP_SHARED by both processes
      cuda: one torch.empty(..., device="cuda") exported by CUDA IPC (torch storage sharing)

The arena is raw memory: which expert a slot holds, and whether it may be read or overwritten,
is decided by ``cache_daemon.residency.Residency`` (the slot table). ``copy_in`` returns only
when the bytes are in the slot, so a slot reported ready is complete.

The POSIX shm file is created with ``O_CREAT|O_EXCL`` under a per-process name and removed by
``close``. ``multiprocessing.shared_memory`` is not used: its resource tracker unlinks
segments behind our back when a process that merely attached exits.
"""

from __future__ import annotations

import enum
import errno
import logging
import mmap
import os
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import torch

from cache_daemon.errors import ArenaUnavailable, BudgetTooSmall
from cache_daemon.tiers.host import HostBuffer

logger = logging.getLogger(__name__)

SHM_ROOT = Path("/dev/shm")  # where shm_open names live on Linux; ArenaHandle.shm_name is relative to it


class ArenaKind(enum.Enum):
    POSIX_SHM = "posix_shm"
    CUDA_IPC = "cuda_ipc"


@dataclass(frozen=True)
class ArenaHandle:
    """What compute needs to map the arena (domain twin of ``moe.cache.v1.ArenaHandle``).

    POSIX shm: ``shm_name`` is the file name under /dev/shm, or an absolute path when the arena
    lives elsewhere (``shm_dir``); ``os.path.join("/dev/shm", shm_name)`` opens both.
    CUDA IPC: the tuple of ``UntypedStorage._share_cuda_()`` (minus the device index, replaced
    by ``gpu_uuid``). The importer passes them to ``UntypedStorage._new_shared_cuda(device,
    cuda_ipc_handle, cuda_alloc_bytes, cuda_offset, cuda_ref_counter_handle,
    cuda_ref_counter_offset, cuda_event_handle, bool(cuda_event_handle))``; ``cuda_alloc_bytes``
    is the shared storage's size, equal to ``size_bytes``.
    """

    kind: ArenaKind
    size_bytes: int  # num_slots * slot_bytes
    shm_name: str = ""
    cuda_ipc_handle: bytes = b""
    cuda_alloc_bytes: int = 0
    cuda_offset: int = 0
    cuda_ref_counter_handle: bytes = b""
    cuda_ref_counter_offset: int = 0
    cuda_event_handle: bytes = b""
    gpu_uuid: str = ""


def slots_for_budget(budget_bytes: int, blob_bytes: int, field_name: str, *, cap: int | None = None) -> int:
    """``budget_bytes // blob_bytes`` (at most ``cap``); below one blob raises ``BudgetTooSmall``."""
    slots = budget_bytes // blob_bytes
    if slots < 1:
        raise BudgetTooSmall(
            f"{field_name}={budget_bytes} is smaller than one expert blob (blob_bytes={blob_bytes}): "
            f"set {field_name} to at least {blob_bytes}"
        )
    return min(slots, cap) if cap is not None else slots


def resolve_device(device: str) -> str:
    """``"auto"`` → ``"cuda"`` when torch sees a GPU, else ``"cpu"``; ``"cuda"`` without one fails."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ArenaUnavailable("device='cuda' was configured but torch sees no CUDA device (use auto or cpu)")
    if device not in ARENAS:
        raise ValueError(f"unknown arena device {device!r}; known: {', '.join(sorted(ARENAS))}")
    return device


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

    @abstractmethod
    def handle(self) -> ArenaHandle:
        """How another process maps this arena."""

    def host_buffer(self, slot: int) -> memoryview | None:
        """A writable host view of ``slot`` to read the store into directly, or None (CUDA)."""
        return None

    @abstractmethod
    def staging_buffer(self) -> torch.Tensor:
        """A page-aligned ``[slot_bytes]`` uint8 host buffer private to the calling thread."""

    @abstractmethod
    def copy_in(self, slot: int, src: torch.Tensor) -> None:
        """Copy ``src`` (``[slot_bytes]`` uint8, host) into ``slot``; returns once it is there."""

    @abstractmethod
    def close(self) -> None:
        """Free the arena (and remove the shm file). Idempotent."""


class ShmArena(DeviceArena):
    """CPU arena: a file on tmpfs mapped ``MAP_SHARED`` (compute maps the same file read-only)."""

    kind = ArenaKind.POSIX_SHM

    def __init__(self, num_slots: int, slot_bytes: int, *, shm_dir: str | Path, daemon_id: str) -> None:
        super().__init__(num_slots, slot_bytes)
        self.path = Path(shm_dir) / f"expertcache-{daemon_id}"
        nbytes = self.size_bytes
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise ArenaUnavailable(f"cannot create the arena file {self.path}: {exc.strerror}") from exc
        try:
            try:
                # Reserve the pages now: on a full tmpfs this fails here with ENOSPC instead of
                # killing the daemon with SIGBUS on the first write into a sparse file.
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    raise ArenaUnavailable(
                        f"cannot reserve {nbytes} bytes for the arena in {shm_dir}: {exc.strerror} "
                        "(enlarge the shared-memory volume or lower device_budget_bytes)"
                    ) from exc
                os.ftruncate(fd, nbytes)
            self._mmap = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            raise
        os.close(fd)
        self.slots = torch.frombuffer(self._mmap, dtype=torch.uint8, count=nbytes).view(num_slots, slot_bytes)
        self._local = threading.local()
        self._closed = False
        logger.info("arena: %s, %d slots x %d bytes", self.path, num_slots, slot_bytes)

    def handle(self) -> ArenaHandle:
        shm_name = self.path.name if self.path.parent.resolve() == SHM_ROOT else str(self.path.resolve())
        return ArenaHandle(kind=self.kind, size_bytes=self.size_bytes, shm_name=shm_name)

    def host_buffer(self, slot: int) -> memoryview:
        start = slot * self.slot_bytes
        return memoryview(self._mmap)[start : start + self.slot_bytes]

    def staging_buffer(self) -> torch.Tensor:
        buf = getattr(self._local, "staging", None)
        if buf is None:
            buf = self._local.staging = HostBuffer(self.slot_bytes)
        return buf.tensor

    def copy_in(self, slot: int, src: torch.Tensor) -> None:
        self.slots[slot].copy_(src.reshape(-1))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.path.unlink(missing_ok=True)
        self.slots = torch.empty(0, 0, dtype=torch.uint8)
        try:
            self._mmap.close()
        except BufferError:
            pass  # views handed out earlier are still alive; the mapping goes with them


class CudaArena(DeviceArena):
    """GPU arena: one device allocation exported by CUDA IPC, filled on a dedicated copy stream.

    Host→device copies are issued ``non_blocking`` on ``_stream`` and waited for with an event
    before ``copy_in`` returns, so the I/O thread, not the GPU's default stream, absorbs the
    wait and an expert reported ready is complete. The source must stay untouched until then,
    which holds because callers keep it pinned across ``copy_in``.
    """

    kind = ArenaKind.CUDA_IPC

    def __init__(
        self,
        num_slots: int,
        slot_bytes: int,
        *,
        shm_dir: str | Path = "",
        daemon_id: str = "",
        index: int | None = None,
    ) -> None:
        del shm_dir, daemon_id  # CPU-arena arguments; accepted so every arena is built the same way
        super().__init__(num_slots, slot_bytes)
        self.index = torch.cuda.current_device() if index is None else index
        flat = torch.empty(self.size_bytes, dtype=torch.uint8, device=f"cuda:{self.index}")  # [bytes] uint8
        self.slots = flat.view(num_slots, slot_bytes)
        # The same call torch.multiprocessing uses to send a CUDA tensor (reductions.py).
        (
            _device,
            self._ipc_handle,
            self._storage_bytes,
            self._storage_offset,
            self._ref_counter_handle,
            self._ref_counter_offset,
            self._event_handle,
            _event_sync_required,
        ) = flat.untyped_storage()._share_cuda_()
        props = torch.cuda.get_device_properties(self.index)
        uuid = str(props.uuid)
        self.gpu_uuid = uuid if uuid.upper().startswith("GPU-") else f"GPU-{uuid}"
        self._stream = torch.cuda.Stream(device=self.index)
        self._local = threading.local()
        logger.info(
            "arena: cuda:%d (%s), %d slots x %d bytes", self.index, self.gpu_uuid, num_slots, slot_bytes
        )

    @property
    def pin_host_memory(self) -> bool:
        return True

    def handle(self) -> ArenaHandle:
        return ArenaHandle(
            kind=self.kind,
            size_bytes=self.size_bytes,
            cuda_ipc_handle=bytes(self._ipc_handle),
            cuda_alloc_bytes=int(self._storage_bytes),
            cuda_offset=int(self._storage_offset),
            cuda_ref_counter_handle=bytes(self._ref_counter_handle or b""),
            cuda_ref_counter_offset=int(self._ref_counter_offset),
            cuda_event_handle=bytes(self._event_handle or b""),
            gpu_uuid=self.gpu_uuid,
        )

    def staging_buffer(self) -> torch.Tensor:
        # One per I/O thread, kept for the thread's life (the pool lives as long as the daemon).
        buf = getattr(self._local, "staging", None)
        if buf is None:
            buf = self._local.staging = HostBuffer(self.slot_bytes, pin_memory=True)
        return buf.tensor

    def copy_in(self, slot: int, src: torch.Tensor) -> None:
        done = torch.cuda.Event()
        with torch.cuda.stream(self._stream):
            self.slots[slot].copy_(src.reshape(-1), non_blocking=True)
            done.record(self._stream)
        done.synchronize()

    def close(self) -> None:
        if getattr(self, "_closed", False):
            return
        self._closed = True
        self._stream.synchronize()
        self.slots = torch.empty(0, 0, dtype=torch.uint8)


ARENAS: dict[str, type[DeviceArena]] = {"cpu": ShmArena, "cuda": CudaArena}


def create_arena(
    device: str, num_slots: int, slot_bytes: int, *, shm_dir: str | Path, daemon_id: str
) -> DeviceArena:
    """The arena for ``device`` (``auto``/``cpu``/``cuda``) with ``num_slots`` slots of ``slot_bytes``."""
    return ARENAS[resolve_device(device)](num_slots, slot_bytes, shm_dir=shm_dir, daemon_id=daemon_id)
