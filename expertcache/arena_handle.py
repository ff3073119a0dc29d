"""``ArenaHandle``: what the cache daemon tells compute about its device arena, so compute can map
it (the domain twin of ``moe.cache.v1.ArenaHandle``; the daemon makes it, compute opens it).

memfd (CPU): nothing here opens it. The arena has no name; its sealed descriptor travels over the
daemon's handoff socket (``expertcache.handoff``) to the client that attached, and maps read-only.
CUDA IPC: ``cuda_ipc_handle`` is the native arena's ``export_handle()`` (64 bytes,
cudaIpcGetMemHandle) and ``gpu_uuid`` its GPU; the importer calls
``native.CudaArena.open(cuda_ipc_handle, gpu_uuid, num_slots, slot_bytes)``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ArenaKind(enum.Enum):
    MEMFD = "memfd"
    CUDA_IPC = "cuda_ipc"


@dataclass(frozen=True)
class ArenaHandle:
    kind: ArenaKind
    size_bytes: int  # num_slots * slot_bytes
    cuda_ipc_handle: bytes = b""  # 64 bytes: the daemon's native CudaArena.export_handle()
    gpu_uuid: str = ""  # "GPU-xxxxxxxx-..." of the GPU that owns the allocation
    cuda_offset: int = 0  # bytes of the arena's start inside the exported allocation (0)
    cuda_alloc_bytes: int = 0  # bytes of the whole exported allocation (num_slots * stride)
