"""The compute side of ``moe.cache.v1.ExpertCache``: Attach once, then one long-lived Demand stream.

This module and ``server.py`` are the only compute modules that touch the wire: it converts the
daemon's messages into domain types (``Attachment``, ``ArenaHandle``, ``ReadyExpert``) and its
status codes into ``expertcache.errors`` exceptions, keeping the daemon's message.

Demand stream, driven from the one scheduler worker thread::

    acquire(layer, experts) ─▶ Acquire(ticket) ─────────────▶ daemon
                     ◀─ ExpertReady(ticket, expert, slot, source) × n   (readiness order)
                     ◀─ AcquireDone(ticket)                             → iterator ends
    release(layer, experts) ─▶ Release(experts)

Predictions travel the same stream one way (no reply, so no round trip on the decode step)::

    begin_request(id) ─▶ RequestBegin       routed(token, layer, experts) ─▶ Route
    end_request(id)   ─▶ RequestEnd         layer_ahead(token, [Prediction per depth]) ─▶ LayerAhead

They are only queued; with no stream open they are dropped and counted (``signals_dropped``):
a lost prediction costs a prefetch, never correctness.

Requests go through a queue that the stream's request iterator drains; a reader thread moves
responses into a queue so that each wait can have a deadline (``acquire_timeout_s``). After an
error the stream is dropped (the daemon then releases its pins) and the next call opens a new one.

Fast path (``fast_path=True``, the default, when the daemon offers a slot table): Attach also
claims a *client ledger* in the daemon's shared slot table (``expertcache.native.SlotTable``),
which this client maps; the Demand stream names the ledger in its metadata, so when the stream
ends — even by this process being killed — the daemon drops every pin the ledger holds::

    acquire(layer, experts)
      try_pin_many(layer * num_experts + e for e in experts)   atomic pins in shared memory, no RPC
        hits   → [ReadyExpert(e, slot, DEVICE), ...] at once, as one batch
        misses → a demand on the client channel (shared memory, futex-woken; no gRPC message):
                 the daemon pins them into our ledger, answers, and we wait until each is
                 RESIDENT in the table, yielding them in batches as they land
    release(layer, experts) → unpin_many(all of them) locally

The channel (``expertcache.native.ClientChannel``, one per client ledger; the daemon side is
``cache_daemon.residency.channel``) also carries the one-way signals: ``routed`` and
``layer_ahead`` write records into its ring (only while the daemon uses them: the table's
``signals_wanted``), begin/end always; the doorbell that wakes the daemon rings once per layer.
An Acquire traced by OpenTelemetry, or any acquire without the fast path, goes through the
Demand stream as above (the daemon's spans join the trace there).

A dropped stream loses the ledger too (the daemon reclaims it); the next stream re-Attaches for a
new one, which is also where a restarted daemon is detected.
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
    Cancelled,
    DaemonUnavailable,
    DataLoss,
    DeadlineExceeded,
    ExpertCacheError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from compute_svc.layer_ahead import Prediction
from compute_svc.moe import ExpertSource, ReadyExpert
from expertcache import channel as codes
from expertcache import native
from expertcache.manifest import StoreManifest

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 << 20  # the manifest of a large model (checksums per expert) travels in Attach
# How long a wait for the daemon's answer polls the client channel before it sleeps on its futex,
# while the daemon's thread has the demand in hand (it runs, on another CPU); and how long it polls
# for that thread to take the demand up at all: one that does not may be waiting for this CPU.
CHANNEL_SPIN_S = 300e-6
CHANNEL_GRACE_S = 20e-6
# Experts smaller than this that an acquire misses are handed over together once all have landed
# (expertcache.channel.GATHER_BELOW_BYTES: the daemon answers once the host-tier copies are done).
GATHER_MISSES_BELOW_BYTES = codes.GATHER_BELOW_BYTES

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

_SOURCES = {
    cache_pb2.TIER_DEVICE: ExpertSource.DEVICE,
    cache_pb2.TIER_HOST: ExpertSource.HOST,
    cache_pb2.TIER_STORE: ExpertSource.STORE,
}
# The channel's source codes (expertcache.channel) → sources.
_CHANNEL_SOURCES = {
    codes.SOURCE_DEVICE: ExpertSource.DEVICE,
    codes.SOURCE_HOST: ExpertSource.HOST,
    codes.SOURCE_STORE: ExpertSource.STORE,
}

# Demand call metadata naming this client's ledger (cache.proto, Demand).
CLIENT_INDEX_KEY = "expertcache-client-index"
CLIENT_EPOCH_KEY = "expertcache-client-epoch"
_StaleClient = native.StaleClient  # RuntimeError: the daemon reclaimed our ledger

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
    slot_table_path: str = ""  # empty: the daemon offers no shared slot table
    client_index: int = -1  # our ledger in the table; -1 when none was asked for or given
    client_epoch: int = 0


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
        slot_table_path=pb.slot_table_path,
        client_index=pb.client_index,
        client_epoch=pb.client_epoch,
    )


def error_from_status(status: int, message: str, address: str) -> ExpertCacheError:
    """The domain exception for a channel status (a refused demand or a failed load)."""
    name = codes.STATUS_NAMES.get(status, "INTERNAL")
    cls = _STATUS_ERRORS.get(getattr(grpc.StatusCode, name), ExpertCacheError)
    if cls is DaemonUnavailable:
        return DaemonUnavailable(f"cache daemon at {address} is unavailable: {message}")
    if cls is ExpertCacheError:
        return ExpertCacheError(f"cache daemon at {address} failed with {name}: {message}")
    return cls(message)


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
_INTERRUPT = object()  # interrupt(): the step waiting for experts lost all its requests


class _DemandStream:
    """One open Demand call: a request queue feeding gRPC, a reader thread draining responses."""

    def __init__(
        self,
        stub: cache_pb2_grpc.ExpertCacheStub,
        metadata: tuple[tuple[str, str], ...] = (),
        on_end: Callable[[str], None] | None = None,
        wake: Callable[[], None] | None = None,
    ) -> None:
        self._requests: queue.Queue = queue.Queue()
        self._wake = wake  # wakes a wait on the client channel when the stream ends
        self.responses: queue.Queue = queue.Queue()
        self.ended = False  # the response stream is over (the daemon ended it, or it broke)
        self._closing = False  # we closed it (then its end is no news)
        self._on_end = on_end
        self._call = stub.Demand(self._request_iter(), metadata=metadata or None)
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
            self.ended = True
            self.responses.put(_END)
            reason = "the cache daemon closed the Demand stream"
        except grpc.RpcError as exc:
            self.ended = True
            self.responses.put(exc)
            reason = f"the Demand stream to the cache daemon broke: {exc.code().name if exc.code() else exc}"
        if self._wake is not None:
            self._wake()
        if not self._closing and self._on_end is not None:
            self._on_end(reason)

    def send(self, request: cache_pb2.DemandRequest) -> None:
        self._requests.put(request)

    def close(self) -> None:
        """Half-close and cancel: the daemon releases every pin this stream holds."""
        self._closing = True
        self._requests.put(None)
        self._call.cancel()


class DaemonClient:
    """Attach + Demand against one cache daemon. Implements ``moe.ExpertProvider``.

    Not for concurrent use: the scheduler's single worker thread drives it.
    """

    def __init__(
        self,
        address: str,
        channel: grpc.Channel,
        attachment: Attachment,
        acquire_timeout_s: float,
        *,
        fast_path: bool = True,
    ):
        self.address = address
        self.attachment = attachment
        self.fast_path = fast_path
        # The shared slot table (fast path only); bound to the ledger of the current stream.
        self._table: native.SlotTable | None = None
        self._shm_channel: native.ClientChannel | None = None  # the ledger's channel (demands, signals)
        self._ledger: tuple[int, int] | None = None  # (index, epoch) for the next stream
        self._shm_held: dict[tuple[int, int], int] = {}  # (layer, expert) -> pins taken in shm
        self._channel = channel
        self._stub = cache_pb2_grpc.ExpertCacheStub(channel)
        self._acquire_timeout_s = acquire_timeout_s
        self._tickets = itertools.count(1)
        self._stream: _DemandStream | None = None
        self._streams_opened = 0
        # Told when the Demand stream ends on its own (the daemon died or ended it), so the
        # service can stop serving and re-attach without waiting for a request to fail.
        self.on_stream_end: Callable[[str], None] | None = None
        self._interrupted = False  # interrupt() since the step began
        self._lock = threading.Lock()
        # One-way prediction messages (routed / layer_ahead / begin / end): sent, and dropped
        # because no Demand stream was open (never waited for, never retried).
        self.signals_sent = 0
        self.signals_dropped = 0
        self._live_requests: set[str] = set()  # begun and not ended; re-announced on a new stream
        # Request ids → the small handles their channel records carry (begin names the id once).
        self._handles: dict[str, int] = {}
        self._next_handle = itertools.count(1)
        self._doorbell_due = False  # signals written to the channel that the daemon was not told of
        # Route / LayerAhead messages held for the next Acquire (``with_acquire``), in order.
        self._carried: list[cache_pb2.DemandRequest] = []
        if fast_path:
            self._map_table(attachment)
            if self._table is not None:
                with self._lock:
                    self._open()  # ties the ledger to a stream now, so closing always frees it

    def _map_table(self, attachment: Attachment) -> None:
        """Map the daemon's slot table for the fast path, or stay on Demand-only if it has none."""
        if not attachment.slot_table_path or attachment.client_index < 0:
            logger.warning(
                "cache daemon at %s offers no shared slot table: every acquire goes through Demand",
                self.address,
            )
            return
        try:
            table = native.SlotTable.open(attachment.slot_table_path)
        except (OSError, RuntimeError, ValueError) as exc:
            raise FailedPrecondition(
                f"cannot map the cache daemon's slot table {attachment.slot_table_path}: {exc} "
                "(is its shared-memory directory mounted in this container? or pass --no-shm-fast-path)"
            ) from None
        manifest = attachment.manifest
        if table.num_entries != manifest.num_layers * manifest.num_experts:
            raise FailedPrecondition(
                f"slot table {attachment.slot_table_path} has {table.num_entries} entries, expected "
                f"{manifest.num_layers} layers x {manifest.num_experts} experts"
            )
        self._table = table
        self._shm_channel = table.channel(attachment.client_index)
        self._ledger = (attachment.client_index, attachment.client_epoch)

    @classmethod
    def connect(
        cls,
        address: str,
        *,
        connect_timeout_s: float,
        acquire_timeout_s: float,
        client_name: str = "compute_svc",
        fast_path: bool = True,
    ) -> DaemonClient:
        """Wait for the daemon (up to ``connect_timeout_s``) and Attach; ``DaemonUnavailable`` otherwise.

        ``fast_path``: pin resident experts through the daemon's shared slot table without any RPC
        (``FailedPrecondition`` if the table the daemon names cannot be mapped); False sends every
        acquire through Demand."""
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
                cache_pb2.AttachRequest(client_name=client_name, shm_fast_path=fast_path), timeout=remaining
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
        try:
            return cls(address, channel, attachment, acquire_timeout_s, fast_path=fast_path)
        except BaseException:
            channel.close()
            raise

    @property
    def num_slots(self) -> int:
        return self.attachment.num_slots

    def acquire(
        self,
        layer: int,
        experts: Sequence[int],
        *,
        deadline: float | None = None,
        trace_context: dict[str, str] | None = None,
    ) -> Iterator[ReadyExpert]:
        """``acquire_batches``, one expert at a time."""
        for batch in self.acquire_batches(layer, experts, deadline=deadline, trace_context=trace_context):
            yield from batch

    def acquire_batches(
        self,
        layer: int,
        experts: Sequence[int],
        *,
        deadline: float | None = None,
        trace_context: dict[str, str] | None = None,
    ) -> Iterator[list[ReadyExpert]]:
        """Pin ``experts`` of ``layer``; yields them in batches as they become resident (the
        resident ones first, at once), ends when every one was yielded.

        Raises the daemon's error (``DataLoss``, ``InvalidArgument``, ...), ``DeadlineExceeded``
        after ``acquire_timeout_s`` or at ``deadline`` (``time.monotonic()``: the step's requests
        are all past theirs), or ``Cancelled`` once ``interrupt`` was called in this step. Closing
        the iterator before its end drops the stream, which releases every pin of this process.
        ``trace_context`` (W3C, from ``expertcache.telemetry``) sends the misses through the
        Demand stream, in an Acquire the daemon's spans join.
        """
        experts = list(experts)
        hits: list[ReadyExpert] = []
        demand_seq = None
        with self._lock:
            stream = self._open()
            if self._table is not None:
                stream, hits = self._pin_resident(stream, layer, experts)
            pinned = {h.expert for h in hits}
            misses = [e for e in experts if e not in pinned]
            ticket = next(self._tickets)
            channel = self._shm_channel if (self._shm_channel is not None and not trace_context) else None
            if misses and channel is not None:
                fail_seen = channel.fail_seq
                demand_seq = channel.post_demand(layer, misses)
                self._doorbell_due = True
                self._ring_locked()
            elif misses:
                self._ring_locked()  # signals already in the channel go first
                self._send_acquire_locked(stream, ticket, layer, misses, trace_context)
            else:
                self._flush_carried_locked()  # every expert was pinned here: no Acquire carries them
                self._ring_locked()
        limit = time.monotonic() + self._acquire_timeout_s
        finished = False
        try:
            if hits:
                yield hits  # resident experts first: compute starts on them at once
            if misses and demand_seq is not None:
                yield from self._channel_wait(
                    stream, channel, demand_seq, fail_seen, layer, misses, limit, deadline
                )
            while misses and demand_seq is None:
                response = self._next(stream, limit, deadline, layer, misses)
                kind = response.WhichOneof("kind")
                if kind == "ready" and response.ready.ticket == ticket:
                    ready = response.ready
                    yield [
                        ReadyExpert(
                            ready.expert.expert, ready.slot, _SOURCES.get(ready.source, ExpertSource.UNKNOWN)
                        )
                    ]
                elif kind == "done" and response.done.ticket == ticket:
                    break
                else:
                    logger.debug("ignoring a demand response for another ticket: %s", response)
            finished = True
        finally:
            if not finished:
                self._drop(stream)

    def _send_acquire_locked(
        self,
        stream: _DemandStream,
        ticket: int,
        layer: int,
        misses: list[int],
        trace_context: dict[str, str] | None,
    ) -> None:
        carried, self._carried = self._carried, []
        request = cache_pb2.DemandRequest(
            acquire=cache_pb2.Acquire(ticket=ticket, decoder_layer=layer, experts=misses)
        )
        if trace_context:
            request.acquire.trace_context.update(trace_context)
        for signal in carried:
            if signal.HasField("route"):
                request.acquire.routes.append(signal.route)
            else:
                request.acquire.layer_aheads.append(signal.layer_ahead)
        stream.send(request)
        self.signals_sent += len(carried)

    def _channel_wait(
        self,
        stream: _DemandStream,
        channel: native.ClientChannel,
        seq: int,
        fail_seen: int,
        layer: int,
        misses: list[int],
        limit: float,
        deadline: float | None,
    ) -> Iterator[list[ReadyExpert]]:
        """The daemon's answer to demand ``seq``, then the misses in batches as they land."""
        while channel.reply_seq != seq:
            remaining = self._remaining(stream, limit, deadline, layer, misses)
            channel.wait_reply(seq, remaining, CHANNEL_SPIN_S, CHANNEL_GRACE_S)
        if channel.reply_status != codes.STATUS_OK:
            raise error_from_status(channel.reply_status, channel.reply_message, self.address)
        # Admitted: the daemon pinned every miss into our ledger; we release them like our hits.
        with self._lock:
            for e in misses:
                key = (layer, e)
                self._shm_held[key] = self._shm_held.get(key, 0) + 1
        num_experts = self.attachment.manifest.num_experts
        pending = list(range(len(misses)))
        entries = [layer * num_experts + e for e in misses]
        table = self._table
        gather = self.attachment.slot_bytes < GATHER_MISSES_BELOW_BYTES
        while pending:
            seen = channel.notify_seq  # before the checks: a landing after them wakes the wait
            if channel.fail_seq != fail_seen:
                raise error_from_status(channel.fail_status, channel.fail_message, self.address)
            slots = table.resident_slots([entries[i] for i in pending])
            landed = sum(1 for slot in slots if slot >= 0)
            if landed and (landed == len(pending) or not gather):
                batch = [
                    ReadyExpert(
                        misses[i], slot, _CHANNEL_SOURCES.get(channel.source(i), ExpertSource.UNKNOWN)
                    )
                    for i, slot in zip(pending, slots, strict=True)
                    if slot >= 0
                ]
                pending = [i for i, slot in zip(pending, slots, strict=True) if slot < 0]
                yield batch
                continue
            if any(slot == -2 for slot in slots):
                raise DaemonUnavailable(
                    f"cache daemon at {self.address} dropped experts of layer {layer} it had admitted "
                    "(its stream ended)"
                )
            self._wait_notify(stream, channel, seen, limit, deadline, layer, [misses[i] for i in pending])

    def _wait_notify(
        self,
        stream: _DemandStream,
        channel: native.ClientChannel,
        seen: int,
        limit: float,
        deadline: float | None,
        layer: int,
        experts: Sequence[int],
    ) -> None:
        """Sleep until the daemon (or an interrupt, or the stream's end) bumps the notify word
        past ``seen``; raise what ends the wait otherwise."""
        channel.wait_notify(seen, self._remaining(stream, limit, deadline, layer, experts), CHANNEL_SPIN_S)

    def _remaining(
        self, stream: _DemandStream, limit: float, deadline: float | None, layer: int, experts: Sequence[int]
    ) -> float:
        """Seconds a wait for experts may still take; raises what ends it (an interrupt, the
        stream's end, the timeout or the step's deadline)."""
        if self._interrupted:
            raise Cancelled(
                f"the requests of this step were all cancelled while it waited for experts of layer {layer}"
            )
        if stream.ended:
            raise DaemonUnavailable(f"cache daemon at {self.address} closed the Demand stream")
        until = limit if deadline is None else min(limit, deadline)
        remaining = until - time.monotonic()
        if remaining <= 0:
            if deadline is not None and deadline <= limit:
                raise DeadlineExceeded(
                    f"the requests of this step passed their deadlines while waiting for experts "
                    f"{list(experts)} of layer {layer}"
                )
            raise DeadlineExceeded(
                f"cache daemon at {self.address} did not deliver experts {list(experts)} of layer {layer} "
                f"within {self._acquire_timeout_s:g}s"
            )
        return remaining

    def release(self, layer: int, experts: Sequence[int]) -> None:
        """Unpin ``experts`` of ``layer`` (acquired earlier on the current stream).

        ``DaemonUnavailable`` if the daemon took back this client's shm pins while they were held
        (its stream ended): the slots may have been overwritten under the computation."""
        with self._lock:
            shm, demand = [], []
            for e in experts:
                key = (layer, e)
                held = self._shm_held.get(key, 0)
                if held:
                    shm.append(e)
                    if held == 1:
                        del self._shm_held[key]
                    else:
                        self._shm_held[key] = held - 1
                else:
                    demand.append(e)
            if shm:
                num_experts = self.attachment.manifest.num_experts
                try:
                    self._table.unpin_many([layer * num_experts + e for e in shm])
                except _StaleClient as exc:
                    self._shm_held.clear()
                    raise DaemonUnavailable(
                        f"cache daemon at {self.address} took back the pins of experts {shm} of layer {layer} "
                        f"while they were in use (its Demand stream ended): {exc}"
                    ) from None
            if not demand or self._stream is None:
                return  # nothing went through Demand, or the stream broke: the daemon released those
            self._flush_carried_locked()
            self._stream.send(
                cache_pb2.DemandRequest(
                    release=cache_pb2.Release(
                        experts=[cache_pb2.ExpertRef(decoder_layer=layer, expert=e) for e in demand]
                    )
                )
            )

    # -- one-way prediction messages (no reply, never block) ---------------------------------------
    def begin_request(self, request_id: str) -> None:
        """A request starts: the daemon starts its routing history afresh."""
        with self._lock:
            self._live_requests.add(request_id)
            if self._shm_channel is not None:
                if self._channel_live_locked():
                    self._channel_begin_locked(request_id)
                    self._ring_locked()
                return
            self._signal_locked(
                cache_pb2.DemandRequest(request_begin=cache_pb2.RequestBegin(request_id=request_id))
            )

    def end_request(self, request_id: str) -> None:
        """A request ended: the daemon drops its routing history."""
        with self._lock:
            self._live_requests.discard(request_id)
            if self._shm_channel is not None:
                handle = self._handles.pop(request_id, None)
                if handle is not None and self._channel_live_locked():
                    self._count(self._shm_channel.signal_end(handle))
                    self._ring_locked()
                return
            self._signal_locked(
                cache_pb2.DemandRequest(request_end=cache_pb2.RequestEnd(request_id=request_id))
            )

    def routed(
        self, request_id: str, token: int, layer: int, experts: Sequence[int], *, with_acquire: bool = False
    ) -> None:
        """Layer ``layer`` of token ``token`` (position in request ``request_id``) was routed to
        ``experts``, hits included: the daemon cannot see shared-memory hits in order.
        ``with_acquire``: the caller acquires next; the record's doorbell rings with that acquire
        (on the Demand stream: the Route travels in its Acquire, or on its own if every expert is
        pinned through the table, or before any other message)."""
        with self._lock:
            channel = self._shm_channel
            if channel is not None:
                if self._table.signals_wanted and self._channel_live_locked():
                    handle = self._handle_locked(request_id)
                    self._count(channel.signal_route(handle, token, layer, [int(e) for e in experts]))
                    self._doorbell_due = True
                    if not with_acquire:
                        self._ring_locked()
                return
        message = cache_pb2.DemandRequest(
            route=cache_pb2.Route(
                request_id=request_id, token=token, decoder_layer=layer, experts=[int(e) for e in experts]
            )
        )
        with self._lock:
            if with_acquire:
                self._carried.append(message)
            else:
                self._signal_locked(message)

    def layer_ahead(
        self, request_id: str, token: int, predictions: Sequence[Prediction], *, with_acquire: bool = False
    ) -> None:
        """Lookahead for token ``token`` of ``request_id``: per depth, the predicted experts of a
        later layer (its router applied to the current hidden state) with their router
        probabilities. ``with_acquire`` as for ``routed``."""
        for p in predictions:
            if len(p.experts) != len(p.scores):
                raise InvalidArgument(
                    f"layer_ahead for layer {p.layer} at depth {p.depth}: {len(p.experts)} experts but "
                    f"{len(p.scores)} scores"
                )
        with self._lock:
            channel = self._shm_channel
            if channel is not None:
                if self._table.signals_wanted and self._channel_live_locked():
                    handle = self._handle_locked(request_id)
                    self._count(
                        channel.signal_ahead(
                            handle,
                            token,
                            [int(p.layer) for p in predictions],
                            [int(p.depth) for p in predictions],
                            [[int(e) for e in p.experts] for p in predictions],
                            [[float(x) for x in p.scores] for p in predictions],
                        )
                    )
                    self._doorbell_due = True
                    if not with_acquire:
                        self._ring_locked()
                return
        message = cache_pb2.LayerAhead(
            request_id=request_id,
            token=token,
            predictions=[
                cache_pb2.LayerPrediction(
                    decoder_layer=p.layer,
                    depth=p.depth,
                    experts=[int(e) for e in p.experts],
                    scores=[float(x) for x in p.scores],
                )
                for p in predictions
            ],
        )
        with self._lock:
            if with_acquire:
                self._carried.append(cache_pb2.DemandRequest(layer_ahead=message))
            else:
                self._signal_locked(cache_pb2.DemandRequest(layer_ahead=message))

    def _handle_locked(self, request_id: str) -> int:
        """The channel handle of ``request_id`` (begun on the channel now if it was not)."""
        handle = self._handles.get(request_id)
        if handle is None:
            handle = self._channel_begin_locked(request_id)
        return handle

    def _channel_begin_locked(self, request_id: str) -> int:
        handle = next(self._next_handle) & 0xFFFFFFFF
        self._handles[request_id] = handle
        self._count(self._shm_channel.signal_begin(handle, request_id))
        self._doorbell_due = True
        return handle

    def _count(self, written: bool) -> None:
        if written:
            self.signals_sent += 1
        else:
            self.signals_dropped += 1  # the ring was full: the daemon was behind

    def _channel_live_locked(self) -> bool:
        """Whether a daemon thread serves the channel now (a stream is open); a signal written
        while none does would be lost with the ledger, so it is dropped and counted instead."""
        if self._stream is None or self._stream.ended:
            self.signals_dropped += 1
            return False
        return True

    def _ring_locked(self) -> None:
        """Wake the daemon's channel thread for what was written to the channel (one syscall, and
        only while it sleeps)."""
        if self._doorbell_due and self._shm_channel is not None:
            self._doorbell_due = False
            self._shm_channel.ring_doorbell()

    def _signal_locked(self, request: cache_pb2.DemandRequest) -> None:
        """Queue a one-way message on the open Demand stream; with none open, drop it. Opening a
        stream may take an Attach round trip, which has no place on the decode step: the next
        acquire opens one (and re-announces the current request). Signals held for an Acquire go
        first, so that the daemon sees every message in the order it was made."""
        self._flush_carried_locked()
        self._send_signal_locked(request)

    def _flush_carried_locked(self) -> None:
        """Send the signals held for an Acquire on their own."""
        carried, self._carried = self._carried, []
        for signal in carried:
            self._send_signal_locked(signal)

    def _send_signal_locked(self, request: cache_pb2.DemandRequest) -> None:
        stream = self._stream
        if stream is None or stream.ended:
            self.signals_dropped += 1
            return
        stream.send(request)
        self.signals_sent += 1

    def close(self) -> None:
        with self._lock:
            if self._stream is not None:
                self._stream.close()
                self._stream = None
            self._shm_channel = None  # nothing serves it any more: later signals are dropped
        self._channel.close()

    # -- internals --------------------------------------------------------------------------------
    def _open(self) -> _DemandStream:
        if self._stream is not None and self._stream.ended and self._table is not None:
            # Hits never read the stream: notice here that it ended (daemon gone or restarted).
            self._drop_locked(self._stream)
        if self._stream is None:
            if self._streams_opened:
                self._check_same_daemon()
            metadata: tuple[tuple[str, str], ...] = ()
            if self._table is not None:
                index, epoch = self._ledger
                try:
                    self._table.attach_client(index, epoch)
                except _StaleClient as exc:
                    raise DaemonUnavailable(f"cache daemon at {self.address}: {exc}") from None
                metadata = ((CLIENT_INDEX_KEY, str(index)), (CLIENT_EPOCH_KEY, str(epoch)))
            self._stream = _DemandStream(
                self._stub, metadata, on_end=self._stream_ended, wake=self._wake_channel
            )
            self._streams_opened += 1
            # The old stream's messages may be lost (or the daemon new): say what runs now.
            self._handles.clear()
            for request_id in sorted(self._live_requests):
                if self._shm_channel is not None:
                    self._channel_begin_locked(request_id)
                else:
                    self._stream.send(
                        cache_pb2.DemandRequest(request_begin=cache_pb2.RequestBegin(request_id=request_id))
                    )
            self._ring_locked()
            logger.debug("opened a Demand stream to %s", self.address)
        return self._stream

    def _pin_resident(
        self, stream: _DemandStream, layer: int, experts: list[int]
    ) -> tuple[_DemandStream, list[ReadyExpert]]:
        """Pin the resident ``experts`` through the slot table (no RPC); their ReadyExperts."""
        manifest = self.attachment.manifest
        num_experts = manifest.num_experts
        if not 0 <= layer < manifest.num_layers or any(not 0 <= e < num_experts for e in experts):
            return stream, []  # outside the table: the daemon answers the Demand with the precise error
        if len(set(experts)) != len(experts):
            return stream, []  # a duplicate: likewise
        entries = [layer * num_experts + e for e in experts]
        try:
            slots = self._table.try_pin_many(entries)
        except _StaleClient:
            # The daemon ended our stream (and took back the ledger) before we read that it did.
            self._drop_locked(stream)
            stream = self._open()
            slots = self._table.try_pin_many(entries)
        hits = []
        for expert, slot in zip(experts, slots, strict=True):
            if slot >= 0:
                key = (layer, expert)
                self._shm_held[key] = self._shm_held.get(key, 0) + 1
                hits.append(ReadyExpert(expert, slot, ExpertSource.DEVICE))
        return stream, hits

    def _check_same_daemon(self) -> None:
        """After a broken stream: a restarted daemon has a new arena, so our mapping is stale."""
        try:
            reply = self._stub.Attach(
                cache_pb2.AttachRequest(client_name="compute_svc", shm_fast_path=self._table is not None),
                timeout=10,
            )
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, self.address) from None
        if reply.daemon_id != self.attachment.daemon_id:
            # Slots of the new daemon index an arena this process has not mapped: reading them
            # would compute with the wrong bytes. The service re-attaches (reattach) and maps it.
            raise DaemonUnavailable(
                f"cache daemon at {self.address} restarted (id {self.attachment.daemon_id} -> {reply.daemon_id}): "
                "re-attaching to its new arena"
            )
        if self._table is not None:
            self._ledger = (reply.client_index, reply.client_epoch)  # the old one went with its stream
            self._shm_channel = self._table.channel(reply.client_index) if reply.client_index >= 0 else None

    def _wake_channel(self) -> None:
        channel = self._shm_channel
        if channel is not None:
            channel.notify()  # a wait for the daemon's answer sees the stream ended

    def _stream_ended(self, reason: str) -> None:
        if self.on_stream_end is not None:
            self.on_stream_end(f"cache daemon at {self.address}: {reason}")

    def _drop(self, stream: _DemandStream) -> None:
        with self._lock:
            self._drop_locked(stream)

    def _drop_locked(self, stream: _DemandStream) -> None:
        stream.close()
        if self._stream is stream:
            self._stream = None
            self._shm_held.clear()  # the daemon reclaims the stream's ledger with its shm pins

    def _next(
        self, stream: _DemandStream, limit: float, deadline: float | None, layer: int, experts: Sequence[int]
    ):
        """The stream's next response; waits until ``limit`` (acquire_timeout_s) or ``deadline``."""
        while True:
            until = limit if deadline is None else min(limit, deadline)
            try:
                item = stream.responses.get(timeout=max(until - time.monotonic(), 0.0))
            except queue.Empty:
                if deadline is not None and deadline <= limit:
                    raise DeadlineExceeded(
                        f"the requests of this step passed their deadlines while waiting for experts "
                        f"{list(experts)} of layer {layer}"
                    ) from None
                raise DeadlineExceeded(
                    f"cache daemon at {self.address} did not deliver experts {list(experts)} of layer {layer} "
                    f"within {self._acquire_timeout_s:g}s"
                ) from None
            if item is _INTERRUPT:
                if self._interrupted:
                    raise Cancelled(
                        f"the requests of this step were all cancelled while it waited for experts of layer {layer}"
                    )
                continue  # left over from an earlier step
            if isinstance(item, grpc.RpcError):
                raise error_from_rpc(item, self.address)
            if item is _END:
                raise DaemonUnavailable(f"cache daemon at {self.address} closed the Demand stream")
            return item

    # -- steps: interruption ------------------------------------------------------------------------
    def begin_step(self) -> None:
        """A new step starts: an interrupt of an earlier one no longer applies."""
        self._interrupted = False

    def interrupt(self) -> None:
        """Wake a wait for experts of the current step (its requests are all gone): it raises
        ``Cancelled``. Thread-safe; called from a gRPC thread."""
        self._interrupted = True
        channel = self._shm_channel
        if channel is not None:
            channel.notify()
        stream = self._stream
        if stream is not None:
            stream.responses.put(_INTERRUPT)

    # -- re-attaching to a restarted daemon ---------------------------------------------------------
    def reattach(self) -> Attachment:
        """Attach again (the daemon restarted, or its stream ended): a new arena, slot table and
        ledger. ``DaemonUnavailable`` while it is not back; ``FailedPrecondition`` if it now serves
        another model. The caller maps the new arena (``attachment``) before the next acquire."""
        with self._lock:
            if self._stream is not None:
                self._drop_locked(self._stream)
            try:
                reply = self._stub.Attach(
                    cache_pb2.AttachRequest(client_name="compute_svc", shm_fast_path=self.fast_path),
                    timeout=10,
                )
            except grpc.RpcError as exc:
                raise error_from_rpc(exc, self.address) from None
            attachment = attachment_from_pb(reply, self.address)
            if attachment.manifest.model_id != self.attachment.manifest.model_id:
                raise FailedPrecondition(
                    f"the cache daemon at {self.address} now serves model {attachment.manifest.model_id}, "
                    f"not {self.attachment.manifest.model_id}: restart compute with its store"
                )
            self.attachment = attachment
            self._table, self._ledger, self._shm_channel = None, None, None
            self._shm_held.clear()
            self._streams_opened = 0
            if self.fast_path:
                self._map_table(attachment)
                if self._table is not None:
                    self._open()
        logger.info(
            "re-attached to cache daemon %s at %s: %d slots",
            attachment.daemon_id,
            self.address,
            attachment.num_slots,
        )
        return attachment
