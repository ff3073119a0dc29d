"""The compute side of ``moe.cache.v1.ExpertCache``: Attach once, then one long-lived Demand stream.

This module and ``server.py`` are the only compute modules that touch the wire: it converts the
daemon's messages into domain types (``Attachment``, ``ArenaHandle``, ``ReadyExpert``) and its
status codes into ``expertcache.errors`` exceptions, keeping the daemon's message.

Demand stream, driven from the one scheduler worker thread::

    acquire(layer, experts) ─▶ Acquire(ticket) ─────────────▶ daemon
                     ◀─ ExpertReady(ticket, expert, slot, source) × n   (readiness order)
                     ◀─ AcquireDone(ticket)                             → iterator ends
    release(layer, experts) ─▶ Release(experts)

Requests go through a queue that the stream's request iterator drains; a reader thread moves
responses into a queue so that each wait can have a deadline (``acquire_timeout_s``). After an
error the stream is dropped (the daemon then releases its pins) and the next call opens a new one.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import grpc
from moe.cache.v1 import cache_pb2, cache_pb2_grpc

from compute_svc.arena import ArenaHandle, ArenaKind
from compute_svc.errors import (
    DaemonUnavailable,
    DataLoss,
    DeadlineExceeded,
    ExpertCacheError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from compute_svc.moe import ReadyExpert, Tier
from expertcache.manifest import StoreManifest

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 << 20  # the manifest of a large model (checksums per expert) travels in Attach

# The daemon's status → the exception compute raises (and serves to its own clients).
_STATUS_ERRORS: dict[grpc.StatusCode, type[ExpertCacheError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.DATA_LOSS: DataLoss,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.UNAVAILABLE: DaemonUnavailable,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
}

_TIERS = {
    cache_pb2.TIER_DEVICE: Tier.DEVICE,
    cache_pb2.TIER_HOST: Tier.HOST,
    cache_pb2.TIER_STORE: Tier.STORE,
}

_ARENA_KINDS = {
    cache_pb2.ARENA_KIND_POSIX_SHM: ArenaKind.POSIX_SHM,
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


# -- wire → domain -------------------------------------------------------------------------------
def arena_from_pb(pb: cache_pb2.ArenaHandle) -> ArenaHandle:
    kind = _ARENA_KINDS.get(pb.kind)
    if kind is None:
        raise FailedPrecondition(f"the cache daemon reports an unknown arena kind {pb.kind}")
    return ArenaHandle(
        kind=kind,
        size_bytes=pb.size_bytes,
        shm_name=pb.shm_name,
        cuda_ipc_handle=pb.cuda_ipc_handle,
        gpu_uuid=pb.gpu_uuid,
        cuda_offset=pb.cuda_offset,
        cuda_ref_counter_handle=pb.cuda_ref_counter_handle,
        cuda_ref_counter_offset=pb.cuda_ref_counter_offset,
        cuda_event_handle=pb.cuda_event_handle,
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
    )


def error_from_rpc(exc: grpc.RpcError, address: str) -> ExpertCacheError:
    """The domain exception for a failed daemon call; keeps the daemon's message."""
    code = exc.code() if hasattr(exc, "code") else None
    details = (exc.details() if hasattr(exc, "details") else None) or str(exc)
    cls = _STATUS_ERRORS.get(code, ExpertCacheError)
    if cls is DaemonUnavailable:
        return DaemonUnavailable(f"cache daemon at {address} is unavailable: {details}")
    if cls is ExpertCacheError:
        name = code.name if code is not None else "UNKNOWN"
        return ExpertCacheError(f"cache daemon at {address} failed with {name}: {details}")
    return cls(details)


# -- the Demand stream ----------------------------------------------------------------------------
_END = object()  # the response stream ended without an error


class _DemandStream:
    """One open Demand call: a request queue feeding gRPC, a reader thread draining responses."""

    def __init__(self, stub: cache_pb2_grpc.ExpertCacheStub) -> None:
        self._requests: queue.Queue = queue.Queue()
        self.responses: queue.Queue = queue.Queue()
        self._call = stub.Demand(self._request_iter())
        self._reader = threading.Thread(target=self._read, name="demand-reader", daemon=True)
        self._reader.start()

    def _request_iter(self) -> Iterator[cache_pb2.DemandRequest]:
        while True:
            item = self._requests.get()
            if item is None:
                return
            yield item

    def _read(self) -> None:
        try:
            for response in self._call:
                self.responses.put(response)
            self.responses.put(_END)
        except grpc.RpcError as exc:
            self.responses.put(exc)

    def send(self, request: cache_pb2.DemandRequest) -> None:
        self._requests.put(request)

    def close(self) -> None:
        """Half-close and cancel: the daemon releases every pin this stream holds."""
        self._requests.put(None)
        self._call.cancel()


class DaemonClient:
    """Attach + Demand against one cache daemon. Implements ``moe.ExpertProvider``.

    Not for concurrent use: the scheduler's single worker thread drives it.
    """

    def __init__(self, address: str, channel: grpc.Channel, attachment: Attachment, acquire_timeout_s: float):
        self.address = address
        self.attachment = attachment
        self._channel = channel
        self._stub = cache_pb2_grpc.ExpertCacheStub(channel)
        self._acquire_timeout_s = acquire_timeout_s
        self._tickets = itertools.count(1)
        self._stream: _DemandStream | None = None
        self._streams_opened = 0
        self._stopped: str | None = None  # why this client refuses every call, once the daemon restarted
        self.on_stale: Callable[[str], None] | None = None  # told once when the daemon restarted
        self._lock = threading.Lock()

    @classmethod
    def connect(
        cls,
        address: str,
        *,
        connect_timeout_s: float,
        acquire_timeout_s: float,
        client_name: str = "compute_svc",
    ) -> DaemonClient:
        """Wait for the daemon (up to ``connect_timeout_s``) and Attach; ``DaemonUnavailable`` otherwise."""
        channel = grpc.insecure_channel(
            address,
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ],
        )
        started = time.monotonic()
        try:
            grpc.channel_ready_future(channel).result(timeout=connect_timeout_s)
        except grpc.FutureTimeoutError:
            channel.close()
            raise DaemonUnavailable(
                f"cache daemon at {address} is not reachable after {connect_timeout_s:g}s: "
                "is it running and is the socket shared with this container?"
            ) from None
        remaining = max(connect_timeout_s - (time.monotonic() - started), 1.0)
        try:
            reply = cache_pb2_grpc.ExpertCacheStub(channel).Attach(
                cache_pb2.AttachRequest(client_name=client_name), timeout=remaining
            )
        except grpc.RpcError as exc:
            channel.close()
            raise error_from_rpc(exc, address) from None
        attachment = attachment_from_pb(reply, address)
        logger.info(
            "attached to cache daemon %s at %s: %s arena, %d slots x %d bytes, %s with %d experts x %d MoE layers",
            attachment.daemon_id,
            address,
            attachment.arena.kind.value,
            attachment.num_slots,
            attachment.slot_bytes,
            attachment.manifest.model_type,
            attachment.manifest.num_experts,
            len(attachment.manifest.moe_layers),
        )
        return cls(address, channel, attachment, acquire_timeout_s)

    @property
    def num_slots(self) -> int:
        return self.attachment.num_slots

    def acquire(self, layer: int, experts: Sequence[int]) -> Iterator[ReadyExpert]:
        """Pin ``experts`` of ``layer``; yields each as it becomes resident, ends at AcquireDone.

        Raises the daemon's error (``DataLoss``, ``InvalidArgument``, ...) or ``DeadlineExceeded``
        after ``acquire_timeout_s``. Closing the iterator before its end drops the stream, which
        releases every pin of this process.
        """
        with self._lock:
            stream = self._open()
            ticket = next(self._tickets)
            stream.send(
                cache_pb2.DemandRequest(
                    acquire=cache_pb2.Acquire(ticket=ticket, layer=layer, experts=list(experts))
                )
            )
        deadline = time.monotonic() + self._acquire_timeout_s
        finished = False
        try:
            while True:
                response = self._next(stream, deadline, layer, experts)
                kind = response.WhichOneof("kind")
                if kind == "ready" and response.ready.ticket == ticket:
                    ready = response.ready
                    yield ReadyExpert(ready.expert.expert, ready.slot, _TIERS.get(ready.source, Tier.UNKNOWN))
                elif kind == "done" and response.done.ticket == ticket:
                    finished = True
                    return
                else:
                    logger.debug("ignoring a demand response for another ticket: %s", response)
        finally:
            if not finished:
                self._drop(stream)

    def release(self, layer: int, experts: Sequence[int]) -> None:
        """Unpin ``experts`` of ``layer`` (acquired earlier on the current stream)."""
        with self._lock:
            if self._stream is None:
                return  # the stream broke: the daemon already released its pins
            self._stream.send(
                cache_pb2.DemandRequest(
                    release=cache_pb2.Release(
                        experts=[cache_pb2.ExpertRef(layer=layer, expert=e) for e in experts]
                    )
                )
            )

    def close(self) -> None:
        with self._lock:
            if self._stream is not None:
                self._stream.close()
                self._stream = None
        self._channel.close()

    # -- internals --------------------------------------------------------------------------------
    def _open(self) -> _DemandStream:
        if self._stopped is not None:
            raise DaemonUnavailable(self._stopped)
        if self._stream is None:
            if self._streams_opened:
                self._check_same_daemon()
            self._stream = _DemandStream(self._stub)
            self._streams_opened += 1
            logger.debug("opened a Demand stream to %s", self.address)
        return self._stream

    def _check_same_daemon(self) -> None:
        """After a broken stream: a restarted daemon has a new arena, so our mapping is stale."""
        try:
            reply = self._stub.Attach(cache_pb2.AttachRequest(client_name="compute_svc"), timeout=10)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, self.address) from None
        if reply.daemon_id != self.attachment.daemon_id:
            # Slots of the new daemon index an arena this process has not mapped: reading them
            # would compute with the wrong bytes. Refuse for good; the process must restart.
            self._stopped = (
                f"cache daemon at {self.address} restarted (id {self.attachment.daemon_id} -> "
                f"{reply.daemon_id}); restart compute to map its new arena"
            )
            logger.error("%s", self._stopped)
            if self.on_stale is not None:
                self.on_stale(self._stopped)
            raise DaemonUnavailable(self._stopped)

    def _drop(self, stream: _DemandStream) -> None:
        with self._lock:
            stream.close()
            if self._stream is stream:
                self._stream = None

    def _next(self, stream: _DemandStream, deadline: float, layer: int, experts: Sequence[int]):
        try:
            item = stream.responses.get(timeout=max(deadline - time.monotonic(), 0.0))
        except queue.Empty:
            raise DeadlineExceeded(
                f"cache daemon at {self.address} did not deliver experts {list(experts)} of layer {layer} "
                f"within {self._acquire_timeout_s:g}s"
            ) from None
        if isinstance(item, grpc.RpcError):
            raise error_from_rpc(item, self.address)
        if item is _END:
            raise DaemonUnavailable(f"cache daemon at {self.address} closed the Demand stream")
        return item
