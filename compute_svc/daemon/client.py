"""The compute side of ``moe.cache.v1.ExpertCache``: Attach once, then one long-lived Demand stream.

This module acquires and releases experts; its pieces, each the one owner of its state:
``daemon_wire`` (the daemon's messages ↔ domain types, its status codes → ``expertcache.errors``
exceptions), ``demand_stream`` (one Demand call), ``daemon_link`` (Attach, the slot table, this
client's ledger and its pins, the current stream) and ``daemon_signals`` (the one-way messages).

Demand stream, driven from the one scheduler worker thread::

    acquire(layer, experts) ─▶ Acquire(ticket) ─────────────▶ daemon
                     ◀─ ExpertReady(ticket, expert, slot, source) × n   (readiness order)
                     ◀─ AcquireDone(ticket)                             → iterator ends
    release(layer, experts) ─▶ Release(experts)

Predictions travel one way, without a reply (``compute_svc.daemon.signals``). After an error the
stream is dropped (the daemon then releases its pins) and the next call opens a new one.

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
``cache_daemon.residency.channel``) also carries the one-way signals. An Acquire traced by
OpenTelemetry, or any acquire without the fast path, goes through the Demand stream as above (the
daemon's spans join the trace there).

A dropped stream loses the ledger too (the daemon reclaims it); the next stream re-Attaches for a
new one, which is also where a restarted daemon is detected.
"""

from __future__ import annotations

import itertools
import logging
import queue
import time
from collections.abc import Callable, Iterator, Sequence

import grpc
from moe.cache.v1 import cache_pb2, cache_pb2_grpc

from compute_svc.daemon.demand_stream import END, INTERRUPT, DemandStream
from compute_svc.daemon.link import DaemonLink, StaleClient
from compute_svc.daemon.signals import SignalSender
from compute_svc.daemon.wire import (
    CHANNEL_SOURCES,
    SOURCES,
    Attachment,
    attachment_from_pb,
    error_from_rpc,
    error_from_status,
)
from compute_svc.errors import Cancelled, DaemonUnavailable, DeadlineExceeded
from compute_svc.experts.moe import ExpertSource, ReadyExpert
from expertcache import channel as codes
from expertcache import native

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


def _cancelled(layer: int) -> Cancelled:
    return Cancelled(
        f"the requests of this step were all cancelled while it waited for experts of layer {layer}"
    )


class DaemonClient:
    """Attach + Demand against one cache daemon. Implements ``moe.ExpertProvider``.

    Not for concurrent use: the scheduler's single worker thread drives it. The connection's
    state is its ``DaemonLink``'s; the one-way messages are its ``SignalSender``'s, whose
    methods it exposes as its own (bound once: no extra call on the decode step).
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
        self._link = DaemonLink(address, channel, attachment, fast_path=fast_path)
        self._signals = SignalSender(self._link)
        self._link.on_open = self._signals.reannounce_locked
        self.begin_request = self._signals.begin_request
        self.end_request = self._signals.end_request
        self.routed = self._signals.routed
        self.layer_ahead = self._signals.layer_ahead
        self._acquire_timeout_s = acquire_timeout_s
        self._tickets = itertools.count(1)
        self._interrupted = False  # interrupt() since the step began
        if self._link.table is not None:
            with self._link.lock:
                self._link.open_locked()  # ties the ledger to a stream now, so closing always frees it

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
    def attachment(self) -> Attachment:
        return self._link.attachment

    @property
    def num_slots(self) -> int:
        return self._link.attachment.num_slots

    @property
    def on_stream_end(self) -> Callable[[str], None] | None:
        """Told when the Demand stream ends on its own (the daemon died or ended it), so the
        service can stop serving and re-attach without waiting for a request to fail."""
        return self._link.on_stream_end

    @on_stream_end.setter
    def on_stream_end(self, callback: Callable[[str], None] | None) -> None:
        self._link.on_stream_end = callback

    @property
    def signals_sent(self) -> int:
        return self._signals.sent

    @property
    def signals_dropped(self) -> int:
        return self._signals.dropped

    def acquire(self, layer: int, experts: Sequence[int], **options) -> Iterator[ReadyExpert]:
        """``acquire_batches`` (same options), one expert at a time."""
        for batch in self.acquire_batches(layer, experts, **options):
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
        link, signals = self._link, self._signals
        with link.lock:
            stream = link.open_locked()
            if link.table is not None:
                stream, hits = self._pin_resident(stream, layer, experts)
            pinned = {h.expert for h in hits}
            misses = [e for e in experts if e not in pinned]
            ticket = next(self._tickets)
            channel = link.shm_channel if (link.shm_channel is not None and not trace_context) else None
            if misses and channel is not None:
                fail_seen = channel.fail_seq
                demand_seq = channel.post_demand(layer, misses)
                signals.ring_locked(due=True)
            elif misses:
                signals.ring_locked()  # signals already in the channel go first
                stream.send(signals.acquire_locked(ticket, layer, misses, trace_context))
            else:
                signals.flush_carried_locked()  # every expert was pinned here: no Acquire carries them
                signals.ring_locked()
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
                            ready.expert.expert, ready.slot, SOURCES.get(ready.source, ExpertSource.UNKNOWN)
                        )
                    ]
                elif kind == "done" and response.done.ticket == ticket:
                    break
                else:
                    logger.debug("ignoring a demand response for another ticket: %s", response)
            finished = True
        finally:
            if not finished:
                link.drop(stream)

    def _channel_wait(
        self,
        stream: DemandStream,
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
            # Read before the checks: a stream end or an interrupt after them bumps it and ends
            # the wait at once (read after them, it would be slept through).
            seen = channel.notify_seq
            remaining = self._remaining(stream, limit, deadline, layer, misses)
            channel.wait_reply(seq, seen, remaining, CHANNEL_SPIN_S, CHANNEL_GRACE_S)
        if channel.reply_status != codes.STATUS_OK:
            raise error_from_status(channel.reply_status, channel.reply_message, self._link.address)
        # Admitted: the daemon pinned every miss into our ledger; we release them like our hits.
        with self._link.lock:
            for e in misses:
                key = (layer, e)
                self._link.held[key] = self._link.held.get(key, 0) + 1
        num_experts = self._link.attachment.manifest.num_experts
        pending = list(range(len(misses)))
        entries = [layer * num_experts + e for e in misses]
        table = self._link.table
        gather = self._link.attachment.slot_bytes < GATHER_MISSES_BELOW_BYTES
        while pending:
            seen = channel.notify_seq  # before the checks: a landing after them wakes the wait
            if channel.fail_seq != fail_seen:
                raise error_from_status(channel.fail_status, channel.fail_message, self._link.address)
            slots = table.resident_slots([entries[i] for i in pending])
            landed = sum(1 for slot in slots if slot >= 0)
            if landed and (landed == len(pending) or not gather):
                batch = [
                    ReadyExpert(misses[i], slot, CHANNEL_SOURCES.get(channel.source(i), ExpertSource.UNKNOWN))
                    for i, slot in zip(pending, slots, strict=True)
                    if slot >= 0
                ]
                pending = [i for i, slot in zip(pending, slots, strict=True) if slot < 0]
                yield batch
                continue
            if any(slot == -2 for slot in slots):
                raise DaemonUnavailable(
                    f"cache daemon at {self._link.address} dropped experts of layer {layer} it had admitted "
                    "(its stream ended)"
                )
            self._wait_notify(stream, channel, seen, limit, deadline, layer, [misses[i] for i in pending])

    def _wait_notify(
        self,
        stream: DemandStream,
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
        self, stream: DemandStream, limit: float, deadline: float | None, layer: int, experts: Sequence[int]
    ) -> float:
        """Seconds a wait for experts may still take; raises what ends it (an interrupt, the
        stream's end, the timeout or the step's deadline)."""
        if self._interrupted:
            raise _cancelled(layer)
        if stream.ended:
            raise DaemonUnavailable(f"cache daemon at {self._link.address} closed the Demand stream")
        until = limit if deadline is None else min(limit, deadline)
        remaining = until - time.monotonic()
        if remaining <= 0:
            raise self._timed_out(limit, deadline, layer, experts)
        return remaining

    def _timed_out(
        self, limit: float, deadline: float | None, layer: int, experts: Sequence[int]
    ) -> DeadlineExceeded:
        """Why a wait for ``experts`` ended first: the step's deadline, or acquire_timeout_s."""
        if deadline is not None and deadline <= limit:
            return DeadlineExceeded(
                f"the requests of this step passed their deadlines while waiting for experts "
                f"{list(experts)} of layer {layer}"
            )
        return DeadlineExceeded(
            f"cache daemon at {self._link.address} did not deliver experts {list(experts)} of layer {layer} "
            f"within {self._acquire_timeout_s:g}s"
        )

    def release(self, layer: int, experts: Sequence[int]) -> None:
        """Unpin ``experts`` of ``layer`` (acquired earlier on the current stream).

        ``DaemonUnavailable`` if the daemon took back this client's shm pins while they were held
        (its stream ended): the slots may have been overwritten under the computation."""
        with self._link.lock:
            shm, demand = [], []
            for e in experts:
                key = (layer, e)
                held = self._link.held.get(key, 0)
                if held:
                    shm.append(e)
                    if held == 1:
                        del self._link.held[key]
                    else:
                        self._link.held[key] = held - 1
                else:
                    demand.append(e)
            if shm:
                num_experts = self._link.attachment.manifest.num_experts
                try:
                    self._link.table.unpin_many([layer * num_experts + e for e in shm])
                except StaleClient as exc:
                    self._link.held.clear()
                    raise DaemonUnavailable(
                        f"cache daemon at {self._link.address} took back the pins of experts {shm} of layer {layer} "
                        f"while they were in use (its Demand stream ended): {exc}"
                    ) from None
            if not demand or self._link.stream is None:
                return  # nothing went through Demand, or the stream broke: the daemon released those
            self._signals.flush_carried_locked()
            self._link.stream.send(
                cache_pb2.DemandRequest(
                    release=cache_pb2.Release(
                        experts=[cache_pb2.ExpertRef(decoder_layer=layer, expert=e) for e in demand]
                    )
                )
            )

    def _pin_resident(
        self, stream: DemandStream, layer: int, experts: list[int]
    ) -> tuple[DemandStream, list[ReadyExpert]]:
        """Pin the resident ``experts`` through the slot table (no RPC); their ReadyExperts."""
        manifest = self._link.attachment.manifest
        num_experts = manifest.num_experts
        if not 0 <= layer < manifest.num_layers or any(not 0 <= e < num_experts for e in experts):
            return stream, []  # outside the table: the daemon answers the Demand with the precise error
        if len(set(experts)) != len(experts):
            return stream, []  # a duplicate: likewise
        entries = [layer * num_experts + e for e in experts]
        try:
            slots = self._link.table.try_pin_many(entries)
        except StaleClient:
            # The daemon ended our stream (and took back the ledger) before we read that it did.
            self._link.drop_locked(stream)
            stream = self._link.open_locked()
            slots = self._link.table.try_pin_many(entries)
        hits = []
        for expert, slot in zip(experts, slots, strict=True):
            if slot >= 0:
                key = (layer, expert)
                self._link.held[key] = self._link.held.get(key, 0) + 1
                hits.append(ReadyExpert(expert, slot, ExpertSource.DEVICE))
        return stream, hits

    def _next(
        self, stream: DemandStream, limit: float, deadline: float | None, layer: int, experts: Sequence[int]
    ):
        """The stream's next response; waits until ``limit`` (acquire_timeout_s) or ``deadline``."""
        while True:
            until = limit if deadline is None else min(limit, deadline)
            try:
                item = stream.responses.get(timeout=max(until - time.monotonic(), 0.0))
            except queue.Empty:
                raise self._timed_out(limit, deadline, layer, experts) from None
            if item is INTERRUPT:
                if self._interrupted:
                    raise _cancelled(layer)
                continue  # left over from an earlier step
            if isinstance(item, grpc.RpcError):
                raise error_from_rpc(item, self._link.address)
            if item is END:
                raise DaemonUnavailable(f"cache daemon at {self._link.address} closed the Demand stream")
            return item

    # -- steps: interruption ------------------------------------------------------------------------
    def begin_step(self) -> None:
        """A new step starts: an interrupt of an earlier one no longer applies."""
        self._interrupted = False

    def interrupt(self) -> None:
        """Wake a wait for experts of the current step (its requests are all gone): it raises
        ``Cancelled``. Thread-safe; called from a gRPC thread."""
        self._interrupted = True
        self._link.wake_channel()
        stream = self._link.stream
        if stream is not None:
            stream.interrupt()

    # -- re-attaching to a restarted daemon ---------------------------------------------------------
    def reattach(self) -> Attachment:
        """Attach again (the daemon restarted, or its stream ended): a new arena, slot table and
        ledger. ``DaemonUnavailable`` while it is not back; ``FailedPrecondition`` if it now serves
        another model. The caller maps the new arena (``attachment``) before the next acquire."""
        return self._link.reattach()

    def close(self) -> None:
        self._link.close()
