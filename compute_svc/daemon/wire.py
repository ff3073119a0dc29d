"""The daemon's wire → compute's domain: what Attach returned, the sources of ready experts, and
the daemon's status codes as ``expertcache.errors`` exceptions (keeping the daemon's message).

With ``server.py`` the only compute code that knows the daemon's messages; the Demand stream
(``compute_svc.daemon.demand_stream``) and the client (``compute_svc.daemon.client``) use it.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field

import grpc
from moe.cache.v1 import cache_pb2

from compute_svc import errors
from compute_svc.errors import DaemonUnavailable, ExpertCacheError, FailedPrecondition
from compute_svc.experts.arena import ArenaHandle, ArenaKind
from expertcache import protocol as codes
from expertcache.manifest import StoreManifest

# The daemon's status → the exception compute raises (and serves to its own clients).
_STATUS_ERRORS: dict[grpc.StatusCode, type[ExpertCacheError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgument,
    grpc.StatusCode.DATA_LOSS: errors.DataLoss,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.DeadlineExceeded,
    grpc.StatusCode.UNAVAILABLE: DaemonUnavailable,
    grpc.StatusCode.NOT_FOUND: errors.NotFound,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.ResourceExhausted,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
}

_ARENA_KINDS = {
    cache_pb2.ARENA_KIND_MEMFD: ArenaKind.MEMFD,
    cache_pb2.ARENA_KIND_CUDA_IPC: ArenaKind.CUDA_IPC,
}


@dataclass(frozen=True)
class Attachment:
    """What Attach returned: how to read the arena and what the store holds."""

    arena: ArenaHandle
    num_slots: int
    slot_bytes: int
    manifest: StoreManifest
    daemon_id: str
    client_index: int = -1  # our ledger in the table; -1 when none was asked for or given
    client_epoch: int = 0
    # Where handoff_token buys the arena (a memfd) and, with a ledger, the table and our region;
    # empty when there is nothing to hand over.
    handoff_socket: str = ""
    handoff_token: bytes = b""
    # The arena's read-only mapping, once the handoff gave it (a memfd arena; compute_svc.daemon.link).
    arena_memory: mmap.mmap | None = field(default=None, compare=False, repr=False)


def arena_from_pb(pb: cache_pb2.ArenaHandle) -> ArenaHandle:
    kind = _ARENA_KINDS.get(pb.kind)
    if kind is None:
        raise FailedPrecondition(f"the cache daemon reports an unknown arena kind {pb.kind}")
    return ArenaHandle(
        kind=kind,
        size_bytes=pb.size_bytes,
        cuda_ipc_handle=pb.cuda_ipc_handle,
        gpu_uuid=pb.gpu_uuid,
        cuda_offset=pb.cuda_offset,
        cuda_alloc_bytes=pb.cuda_alloc_bytes,
    )


def attachment_from_pb(pb: cache_pb2.AttachResponse, address: str) -> Attachment:
    return Attachment(
        arena=arena_from_pb(pb.arena),
        num_slots=pb.num_slots,
        slot_bytes=pb.slot_bytes,
        manifest=StoreManifest.from_json(
            pb.manifest_json, origin=f"manifest from the cache daemon at {address}"
        ),
        daemon_id=pb.daemon_id,
        client_index=pb.client_index,
        client_epoch=pb.client_epoch,
        handoff_socket=pb.handoff_socket,
        handoff_token=pb.handoff_token,
    )


def _daemon_error(code: grpc.StatusCode | None, name: str, message: str, address: str) -> ExpertCacheError:
    """The domain exception for status ``code`` (spelled ``name``) with the daemon's ``message``."""
    cls = _STATUS_ERRORS.get(code, ExpertCacheError)
    if cls is DaemonUnavailable:
        return DaemonUnavailable(f"cache daemon at {address} is unavailable: {message}")
    if cls is ExpertCacheError:
        return ExpertCacheError(f"cache daemon at {address} failed with {name}: {message}")
    return cls(message)


def error_from_status(status: int, message: str, address: str) -> ExpertCacheError:
    """The domain exception for a channel status (a refused demand or a failed load)."""
    name = codes.STATUS_NAMES.get(status, "INTERNAL")
    return _daemon_error(getattr(grpc.StatusCode, name), name, message, address)


def error_from_rpc(exc: grpc.RpcError, address: str) -> ExpertCacheError:
    """The domain exception for a failed daemon call; keeps the daemon's message."""
    code = exc.code() if hasattr(exc, "code") else None
    details = (exc.details() if hasattr(exc, "details") else None) or str(exc)
    return _daemon_error(code, code.name if code is not None else "UNKNOWN", details, address)
