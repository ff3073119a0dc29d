"""``ArenaHandle``: what the cache daemon tells compute about its device arena, so compute can map
it (the domain twin of ``moe.cache.v1.ArenaHandle``; the daemon makes it, compute opens it).

POSIX shm: ``shm_name`` is the file name under /dev/shm, or an absolute path when the arena lives
elsewhere (``shm_dir``); ``os.path.join("/dev/shm", shm_name)`` opens both.
CUDA IPC: ``cuda_ipc_handle`` is the native arena's ``export_handle()`` (64 bytes,
cudaIpcGetMemHandle) and ``gpu_uuid`` its GPU; the importer calls
``native.CudaArena.open(cuda_ipc_handle, gpu_uuid, num_slots, slot_bytes)``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ArenaKind(enum.Enum):
    POSIX_SHM = "posix_shm"
    CUDA_IPC = "cuda_ipc"


@dataclass(frozen=True)
class ArenaHandle:
    kind: ArenaKind
    size_bytes: int  # num_slots * slot_bytes
    shm_name: str = ""  # POSIX shm: name under /dev/shm, or an absolute path of the shm file
    cuda_ipc_handle: bytes = b""  # 64 bytes: the daemon's native CudaArena.export_handle()
    gpu_uuid: str = ""  # "GPU-xxxxxxxx-..." of the GPU that owns the allocation
    cuda_offset: int = 0  # bytes of the arena's start inside the exported allocation (0)
    cuda_alloc_bytes: int = 0  # bytes of the whole exported allocation (num_slots * stride)
