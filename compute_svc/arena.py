"""Reading the daemon's device arena in place: typed tensor views of one slot.

The daemon owns the arena (``num_slots × slot_bytes`` bytes, one allocation); compute maps it
and never writes it. A slot holds one expert blob laid out as the manifest's ``tensors``::

    arena  [num_slots, slot_bytes] uint8
    slot s ├─ gate_up_proj   offset 0      → view(float32).view([2*I, H])
           ├─ down_proj      offset 256·k  → view(float32).view([H, I])
           └─ (biases)       ...
    i.e. ``arena[s, off:off + nbytes].view(dtype).view(shape)`` == ``experts.<name>[expert]``

CPU serving shares the arena through a POSIX shm file (mmap, read-only here); CUDA serving
through CUDA IPC, rebuilt with the same storage-sharing call torch's multiprocessing uses.
"""

from __future__ import annotations

import enum
import logging
import mmap
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from compute_svc.errors import ArenaMismatch
from expertcache.manifest import TensorLayout

logger = logging.getLogger(__name__)

SHM_ROOT = Path("/dev/shm")  # where POSIX shm_open names live on Linux


class ArenaKind(enum.Enum):
    POSIX_SHM = "posix_shm"
    CUDA_IPC = "cuda_ipc"


@dataclass(frozen=True)
class ArenaHandle:
    """What the daemon tells compute about its arena (the domain twin of ``cache.v1.ArenaHandle``)."""

    kind: ArenaKind
    size_bytes: int  # num_slots * slot_bytes
    shm_name: str = ""  # POSIX shm: name under /dev/shm, or an absolute path of the shm file
    cuda_ipc_handle: bytes = b""
    gpu_uuid: str = ""  # "GPU-xxxxxxxx-..." of the GPU that owns the allocation
    cuda_offset: int = 0  # bytes of the arena's start inside the exported allocation
    cuda_ref_counter_handle: bytes = b""
    cuda_ref_counter_offset: int = 0
    cuda_event_handle: bytes = b""
    cuda_alloc_bytes: int = 0


def shm_path(shm_name: str) -> Path:
    """The file behind a shm name: an absolute path as is, else (``/name`` or ``name``) under /dev/shm."""
    path = Path(shm_name)
    if path.is_absolute() and path.exists():
        return path
    return SHM_ROOT / shm_name.lstrip("/")


def resolve_device(requested: str, kind: ArenaKind, cuda_available: bool | None = None) -> torch.device:
    """The compute device: it must be where the arena lives, since experts are read in place."""
    cuda_available = torch.cuda.is_available() if cuda_available is None else cuda_available
    arena_device = "cuda" if kind is ArenaKind.CUDA_IPC else "cpu"
    if requested not in ("auto", arena_device):
        raise ArenaMismatch(
            f"device {requested!r} was configured but the cache daemon's arena is {kind.value} "
            f"(readable on {arena_device} only): set --device auto or {arena_device}"
        )
    if arena_device == "cuda" and not cuda_available:
        raise ArenaMismatch("the cache daemon's arena is in CUDA memory but this process sees no CUDA device")
    return torch.device(arena_device)


class Arena:
    """The mapped arena: ``slots`` is a [num_slots, slot_bytes] uint8 tensor on the arena's device.

    Build per-slot tensors with ``slot_views``; they alias the arena and are valid only while
    the daemon keeps that slot pinned for this process (between ExpertReady and Release).
    """

    def __init__(self, slots: torch.Tensor, keepalive: object = None) -> None:
        self.slots = slots  # [num_slots, slot_bytes] uint8
        self._keepalive = keepalive  # the mmap / storage that backs ``slots``

    @property
    def num_slots(self) -> int:
        return int(self.slots.shape[0])

    @property
    def slot_bytes(self) -> int:
        return int(self.slots.shape[1])

    @property
    def device(self) -> torch.device:
        return self.slots.device

    @classmethod
    def open(cls, handle: ArenaHandle, num_slots: int, slot_bytes: int, device: torch.device) -> Arena:
        if handle.size_bytes < num_slots * slot_bytes:
            raise ArenaMismatch(
                f"arena of {handle.size_bytes} bytes cannot hold {num_slots} slots of {slot_bytes} bytes"
            )
        if handle.kind is ArenaKind.POSIX_SHM:
            return cls._open_shm(handle, num_slots, slot_bytes)
        if handle.kind is ArenaKind.CUDA_IPC:
            return cls._open_cuda(handle, num_slots, slot_bytes, device)
        raise ArenaMismatch(f"arena kind {handle.kind!r} is not supported")

    @classmethod
    def _open_shm(cls, handle: ArenaHandle, num_slots: int, slot_bytes: int) -> Arena:
        path = shm_path(handle.shm_name)
        nbytes = num_slots * slot_bytes
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise ArenaMismatch(
                f"cannot open the cache daemon's arena {path}: {exc.strerror} "
                "(compute and daemon must share /dev/shm: same pod, same IPC namespace)"
            ) from exc
        try:
            size = os.fstat(fd).st_size
            if size < nbytes:
                raise ArenaMismatch(f"arena file {path} has {size} bytes, expected at least {nbytes}")
            # Read-only on purpose: a stray write from compute would fault instead of silently
            # corrupting an expert the daemon believes intact.
            buf = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        with warnings.catch_warnings():
            # torch warns that the buffer is not writable; that is the point.
            warnings.filterwarnings("ignore", message=".*not writable.*")
            flat = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)  # [nbytes] uint8
        logger.info("mapped arena %s: %d slots x %d bytes", path, num_slots, slot_bytes)
        return cls(flat.view(num_slots, slot_bytes), keepalive=buf)

    @classmethod
    def _open_cuda(cls, handle: ArenaHandle, num_slots: int, slot_bytes: int, device: torch.device) -> Arena:
        index = cuda_device_for_uuid(handle.gpu_uuid)
        if device.index is not None and device.index != index:
            raise ArenaMismatch(
                f"arena lives on GPU {handle.gpu_uuid} (cuda:{index}), compute runs on {device}"
            )
        torch.cuda._lazy_init()
        storage = torch.UntypedStorage._new_shared_cuda(
            index,
            handle.cuda_ipc_handle,
            handle.cuda_alloc_bytes or handle.size_bytes,  # bytes of the shared storage (the arena)
            handle.cuda_offset,  # where it starts inside the exported allocation
            handle.cuda_ref_counter_handle,
            handle.cuda_ref_counter_offset,
            handle.cuda_event_handle,
            bool(handle.cuda_event_handle),
        )
        nbytes = num_slots * slot_bytes
        flat = torch.empty(0, dtype=torch.uint8, device=f"cuda:{index}")
        flat.set_(storage, 0, (nbytes,), (1,))  # [nbytes] uint8 aliasing the daemon's allocation
        logger.info("opened CUDA IPC arena on cuda:%d: %d slots x %d bytes", index, num_slots, slot_bytes)
        return cls(flat.view(num_slots, slot_bytes), keepalive=storage)

    def slot_views(self, slot: int, layouts: tuple[TensorLayout, ...]) -> dict[str, torch.Tensor]:
        """Typed views of one slot: ``{name: tensor of layout.shape and dtype}`` aliasing the arena."""
        if not 0 <= slot < self.num_slots:
            raise ArenaMismatch(f"slot {slot} is outside the arena's {self.num_slots} slots")
        row = self.slots[slot]  # [slot_bytes] uint8
        return {
            t.name: row[t.offset : t.offset + t.nbytes].view(_torch_dtype(t.dtype)).view(t.shape)
            for t in layouts
        }


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ArenaMismatch(f"unknown tensor dtype {name!r} in the manifest")
    return dtype


def cuda_device_for_uuid(gpu_uuid: str) -> int:
    """Index of the local CUDA device whose UUID is ``gpu_uuid`` ("GPU-..." or bare)."""
    want = _norm_uuid(gpu_uuid)
    seen = []
    for index in range(torch.cuda.device_count()):
        have = _norm_uuid(str(torch.cuda.get_device_properties(index).uuid))
        seen.append(have)
        if have == want:
            return index
    raise ArenaMismatch(
        f"the cache daemon's arena is on GPU {gpu_uuid!r}, which this process cannot see "
        f"(visible GPUs: {', '.join(seen) or 'none'}); give both containers the same GPU"
    )


def _norm_uuid(uuid: str) -> str:
    uuid = uuid.strip().lower()
    return uuid[4:] if uuid.startswith("gpu-") else uuid
