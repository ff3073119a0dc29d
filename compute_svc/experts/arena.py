"""Reading the daemon's device arena in place: typed tensor views of one slot.

The daemon owns the arena; compute maps it (a sealed memfd on a CPU, CUDA IPC on a GPU) and never
writes it. Slot layout and sharing: docs/compute.md."""

from __future__ import annotations

import logging
import mmap
import warnings

import torch

from compute_svc.errors import ArenaMismatch
from expertcache import native
from expertcache.arena_handle import ArenaHandle, ArenaKind
from expertcache.manifest import ExpertTensor

logger = logging.getLogger(__name__)


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
    def open(
        cls,
        handle: ArenaHandle,
        num_slots: int,
        slot_bytes: int,
        device: torch.device,
        memory: mmap.mmap | None = None,
    ) -> Arena:
        """``memory``: a memfd arena's read-only mapping (``Attachment.arena_memory``)."""
        if handle.size_bytes < num_slots * slot_bytes:
            raise ArenaMismatch(
                f"arena of {handle.size_bytes} bytes cannot hold {num_slots} slots of {slot_bytes} bytes"
            )
        if handle.kind is ArenaKind.MEMFD:
            return cls._open_memfd(memory, num_slots, slot_bytes)
        if handle.kind is ArenaKind.CUDA_IPC:
            return cls._open_cuda(handle, num_slots, slot_bytes, device)
        raise ArenaMismatch(f"arena kind {handle.kind!r} is not supported")

    @classmethod
    def _open_memfd(cls, memory: mmap.mmap | None, num_slots: int, slot_bytes: int) -> Arena:
        nbytes = num_slots * slot_bytes
        if memory is None:
            raise ArenaMismatch("the cache daemon's arena is a memfd, and its handoff did not give it")
        if len(memory) < nbytes:
            raise ArenaMismatch(
                f"the cache daemon's arena maps {len(memory)} bytes, expected at least {nbytes}"
            )
        with warnings.catch_warnings():
            # torch warns that the buffer is not writable; that is the point: the mapping is
            # read-only, and a stray write from compute faults instead of corrupting an expert.
            warnings.filterwarnings("ignore", message=".*not writable.*")
            flat = torch.frombuffer(memory, dtype=torch.uint8, count=nbytes)  # [nbytes] uint8
        logger.info("mapped the arena (memfd, read-only): %d slots x %d bytes", num_slots, slot_bytes)
        return cls(flat.view(num_slots, slot_bytes), keepalive=memory)

    @classmethod
    def _open_cuda(cls, handle: ArenaHandle, num_slots: int, slot_bytes: int, device: torch.device) -> Arena:
        if handle.cuda_offset:
            raise ArenaMismatch(
                f"the cache daemon's CUDA arena starts {handle.cuda_offset} bytes into its allocation; "
                "this compute maps whole allocations only (daemon and compute versions differ)"
            )
        index = cuda_device_for_uuid(handle.gpu_uuid)
        if device.index is not None and device.index != index:
            raise ArenaMismatch(
                f"arena lives on GPU {handle.gpu_uuid} (cuda:{index}), compute runs on {device}"
            )
        try:
            imported = native.CudaArena.open(handle.cuda_ipc_handle, handle.gpu_uuid, num_slots, slot_bytes)
        except (RuntimeError, ValueError) as exc:
            raise ArenaMismatch(
                f"cannot open the cache daemon's CUDA IPC arena on GPU {handle.gpu_uuid}: {exc} "
                "(compute and daemon must share the GPU and the IPC namespace: same pod, hostIPC or "
                "shareProcessNamespace as the chart sets)"
            ) from exc
        if handle.cuda_alloc_bytes and imported.size_bytes > handle.cuda_alloc_bytes:
            raise ArenaMismatch(
                f"the cache daemon's CUDA arena has {handle.cuda_alloc_bytes} bytes, {num_slots} slots of "
                f"{slot_bytes} bytes need {imported.size_bytes}"
            )
        # The tensor references ``imported`` (torch keeps the __cuda_array_interface__ owner),
        # so the IPC mapping stays open as long as any view of it; ``keepalive`` pins it too.
        full = torch.as_tensor(imported, device=f"cuda:{imported.device}")  # [num_slots, stride] uint8
        logger.info(
            "opened CUDA IPC arena on cuda:%d (%s): %d slots x %d bytes",
            imported.device,
            handle.gpu_uuid,
            num_slots,
            slot_bytes,
        )
        return cls(full[:, :slot_bytes], keepalive=imported)

    def slot_views(self, slot: int, tensors: tuple[ExpertTensor, ...]) -> dict[str, torch.Tensor]:
        """Typed views of one slot: ``{part name: tensor of its shape and dtype}`` for every
        stored part of ``tensors``, aliasing the arena."""
        if not 0 <= slot < self.num_slots:
            raise ArenaMismatch(f"slot {slot} is outside the arena's {self.num_slots} slots")
        row = self.slots[slot]  # [slot_bytes] uint8
        return {
            p.name: row[p.offset : p.offset + p.nbytes].view(_torch_dtype(p.dtype)).view(p.shape)
            for t in tensors
            for p in t.parts
        }


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ArenaMismatch(f"unknown tensor dtype {name!r} in the manifest")
    return dtype


def cuda_device_for_uuid(gpu_uuid: str) -> int:
    """Index of the local CUDA device whose UUID is ``gpu_uuid`` ("GPU-..." or bare, any case)."""
    require_native_cuda()
    try:
        return native.cuda_device_for_uuid(gpu_uuid)
    except ValueError as exc:
        raise ArenaMismatch(
            f"the cache daemon's arena is on GPU {gpu_uuid!r}, which this process cannot see ({exc}); "
            "give both containers the same GPU"
        ) from exc


def require_native_cuda() -> None:
    """Fail with how to fix it when the native module has no CUDA path (built without nvcc)."""
    if not native.CUDA_BUILT:
        raise ArenaMismatch(
            "the cache daemon's arena is in CUDA memory but the native core (expertcache._native) "
            "was built without CUDA: put nvcc on PATH (e.g. export PATH=/usr/local/cuda/bin:$PATH) "
            "and rebuild it (`pip install .`, or `make native` in a checkout)"
        )
