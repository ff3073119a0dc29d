"""The compute side of ``moe.cache.v1.ExpertCache``: Attach once, then one long-lived Demand stream.

``DaemonClient`` acquires and releases experts. Its pieces each own their state: ``link`` (Attach,
the slot table, this client's ledger and pins, the current stream), ``transport`` (the messages,
over the ledger's shared-memory channel or the Demand stream), ``wire`` (the daemon's messages ↔
domain types). Resident experts are pinned through the shared table without any message; the
protocol and the fast path are described in docs/compute.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import grpc
from moe.cache.v1 import cache_pb2, cache_pb2_grpc

from compute_svc.daemon.demand_stream import DemandStream
from compute_svc.daemon.link import DaemonLink, HandedBack, StaleClient
from compute_svc.daemon.transport import ChannelTransport, SignalCounts, StreamTransport, Transport
from compute_svc.daemon.wire import Attachment, attachment_from_pb, error_from_rpc
from compute_svc.errors import Cancelled, DaemonUnavailable, DeadlineExceeded
from compute_svc.experts.moe import ExpertProvider, ReadyExpert
from expertcache.grpc_client import wait_ready
from expertcache.protocol import Tier

if TYPE_CHECKING:
    from compute_svc.experts.layer_ahead import Prediction
    from compute_svc.experts.moe import SpanSignals

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 << 20  # the manifest of a large model (checksums per expert) travels in Attach


def _cancelled(layer: int) -> Cancelled:
    return Cancelled(
        f"the requests of this step were all cancelled while it waited for experts of layer {layer}"
    )


class _Wait:
    """The limits of one acquire's wait (``transport.AcquireWait``)."""

    __slots__ = ("_client", "_stream", "_layer", "_limit", "_deadline")

    def __init__(
        self, client: DaemonClient, stream: DemandStream, layer: int, limit: float, deadline: float | None
    ) -> None:
        self._client, self._stream, self._layer = client, stream, layer
        self._limit, self._deadline = limit, deadline

    def left(self) -> float:
        until = self._limit if self._deadline is None else min(self._limit, self._deadline)
        return until - time.monotonic()

    def check_interrupted(self) -> None:
        if self._client._interrupted:
            raise _cancelled(self._layer)

    def remaining(self, stream: DemandStream, experts: Sequence[int]) -> float:
        self.check_interrupted()
        if stream.ended:
            raise DaemonUnavailable(f"cache daemon at {self._client._link.address} closed the Demand stream")
        remaining = self.left()
        if remaining <= 0:
            raise self.timed_out(experts)
        return remaining

    def timed_out(self, experts: Sequence[int]) -> DeadlineExceeded:
        """Why a wait for ``experts`` ended first: the step's deadline, or acquire_timeout_s."""
        if self._deadline is not None and self._deadline <= self._limit:
            return DeadlineExceeded(
                f"the requests of this step passed their deadlines while waiting for experts "
                f"{list(experts)} of layer {self._layer}"
            )
        return DeadlineExceeded(
            f"cache daemon at {self._client._link.address} did not deliver experts {list(experts)} of layer "
            f"{self._layer} within {self._client._acquire_timeout_s:g}s"
        )


class DaemonClient(ExpertProvider):
    """Attach + Demand against one cache daemon. Implements ``moe.ExpertProvider``.

    Not for concurrent use: the scheduler's single worker thread drives it. The connection's
    state is its ``DaemonLink``'s; every message goes through one ``Transport``.
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
        self._counts = SignalCounts()
        self._channel_transport = ChannelTransport(self._link, self._counts)
        self._stream_transport = StreamTransport(self._link, self._counts)
        self._link.on_open = lambda stream: self._transport().reannounce_locked(stream)
        self._acquire_timeout_s = acquire_timeout_s
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
        if not wait_ready(channel, connect_timeout_s):
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
        return self._counts.sent

    @property
    def signals_dropped(self) -> int:
        return self._counts.dropped

    def _transport(self) -> Transport:
        """The channel while the link holds one (the fast path), else the Demand stream."""
        return self._channel_transport if self._link.shm_channel is not None else self._stream_transport

    # -- the one-way signals (``Transport``) ------------------------------------------------------
    def begin_request(self, request_id: str) -> None:
        """A request starts: the daemon starts its routing history afresh."""
        self._transport().begin_request(request_id)

    def end_request(self, request_id: str) -> None:
        """A request ended: the daemon drops its routing history."""
        self._transport().end_request(request_id)

    def routed(
        self, request_id: str, token: int, layer: int, experts: Sequence[int], *, with_acquire: bool = False
    ) -> None:
        """Layer ``layer`` of token ``token`` of ``request_id`` was routed to ``experts``, hits
        included. ``with_acquire``: the caller acquires next, and the signal travels with it."""
        self._transport().routed(request_id, token, layer, experts, with_acquire=with_acquire)

    def layer_ahead(
        self, request_id: str, token: int, predictions: Sequence[Prediction], *, with_acquire: bool = False
    ) -> None:
        """Lookahead for token ``token`` of ``request_id``: per depth, the predicted experts of a
        later layer with their router probabilities. ``with_acquire`` as for ``routed``."""
        self._transport().layer_ahead(request_id, token, predictions, with_acquire=with_acquire)

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
        ``trace_context`` (W3C, from ``expertcache.telemetry``) travels with the demand: the
        daemon's spans join the trace.
        """
        experts = list(experts)
        hits: list[ReadyExpert] = []
        link = self._link
        limit = time.monotonic() + self._acquire_timeout_s
        with link.lock:
            back = self._take_handed_back_locked(layer, experts)
            if back is not None:  # a native span pinned the hits and posted the demand already
                stream, misses = back.stream, back.misses
                for e, slot in zip(back.hits, back.slots, strict=True):
                    link.held[(layer, e)] = link.held.get((layer, e), 0) + 1
                    hits.append(ReadyExpert(e, slot, Tier.DEVICE))
                waiting = self._channel_transport.posted_locked(
                    stream, layer, misses, back.seq, back.fail_seen
                )
                limit -= back.elapsed_s
            else:
                stream = link.open_locked()
                if link.table is not None:
                    stream, hits = self._pin_resident(stream, layer, experts)
                pinned = {h.expert for h in hits}
                misses = [e for e in experts if e not in pinned]
                transport = self._transport()
                if misses:
                    waiting = transport.post_locked(stream, layer, misses, trace_context)
                else:
                    transport.no_demand_locked()
        finished = False
        try:
            if hits:
                yield hits  # resident experts first: compute starts on them at once
            if misses:  # the limits of a wait, made only when there is one to wait for
                yield from waiting(_Wait(self, stream, layer, limit, deadline))
            finished = True
        finally:
            if not finished:
                link.drop(stream)

    def run_resident(
        self, layer: int, experts: Sequence[int], run: Callable[[object, list[int]], int]
    ) -> bool:
        """Where every one of ``experts`` of ``layer`` is resident in the shared slot table, the
        whole layer in one call: ``run(table, entries)`` pins them, computes and unpins (the fused
        kernel's ``run_resident``, which returns 1 when it ran, 0 when one was not resident and
        it pinned and ran nothing, -1 when it ran but the daemon took the pins back meanwhile).
        The signals held for the layer's acquire are sent first. False where this does not apply
        (no slot table, an expert not resident, a ledger the daemon took back): ``acquire_batches``
        then serves the layer as before. ``DaemonUnavailable`` as ``release`` raises it."""
        link = self._link
        with link.lock:
            table = link.table
            if table is None:
                return False
            entries = self._table_entries(layer, experts)
            if entries is None or min(table.resident_slots(entries)) < 0:
                return False  # a miss (its signals travel with its demand), or not the table's to take
            stream = link.open_locked()
            self._transport().no_demand_locked()
            try:
                ran = run(table, entries)
            except StaleClient:
                # The daemon ended our stream (and took back the ledger) before we read that it did.
                link.drop_locked(stream)
                return False
            if ran < 0:
                link.held.clear()
                raise DaemonUnavailable(
                    f"cache daemon at {link.address} took back the pins of experts {list(experts)} of layer "
                    f"{layer} while they were in use (its Demand stream ended)"
                )
            return ran > 0

    def run_layer(
        self,
        layer: int,
        run: Callable[..., int],
        signals: SpanSignals | None = None,
        *,
        demand: bool = False,
        deadline: float | None = None,
    ) -> int:
        """A decode layer (or a span of them) in one call that finds its experts itself:
        ``run(table, num_experts, layer_signals)`` pins the experts of its routing through the
        shared slot table at ``layer * num_experts + e``, all or none, computes and unpins (the
        fused kernel's ``run_layer`` / ``run_layers``): the number of experts it ran, 0 where one
        was not resident (nothing pinned or run), -1 where the daemon took the pins back
        meanwhile. Returns that number, or 0 where this does not apply: no slot table or channel,
        or the daemon uses routes and lookaheads now (``signals_wanted``) and they cannot go with
        the call. They can where ``signals`` (the step's rows and lookahead) is given and a daemon
        thread serves the channel: ``layer_signals`` is then the ``native.LayerSignals`` the call
        writes each layer's records with (else None).

        With ``demand`` (a span), ``run`` takes a fourth argument: the ``native.SpanDemand`` with which
        a layer with a miss posts its demand and waits for it within the call (each wait at most
        acquire_timeout_s, none past ``deadline``; an interrupt or the stream's end stops it), or None
        where no daemon thread serves the channel. A layer it hands back is the next acquire's
        (``acquire_batches`` of that layer adopts its pins and its demand).
        ``DaemonUnavailable`` as ``release`` raises it."""
        link = self._link
        with link.lock:
            table = link.table
            if table is None or link.shm_channel is None or (table.signals_wanted and signals is None):
                return 0
            if link.spans.handed_back is not None:  # never adopted (its layer's forward failed)
                link.drop_locked(link.spans.handed_back.stream)
            stream = link.open_locked()
            layer_signals = None
            if table.signals_wanted:
                layer_signals = self._channel_transport.layer_signals_locked(*signals)
                if layer_signals is None:
                    return 0
            args: tuple = (table, link.attachment.manifest.num_experts, layer_signals)
            span_demand = None
            if demand:
                span_demand = self._channel_transport.span_demand_locked(self._acquire_timeout_s, deadline)
                link.spans.running = span_demand
                if self._interrupted and span_demand is not None:
                    span_demand.stop()  # interrupted before the span could be told
                args += (span_demand,)
            try:
                ran = run(*args)
            except StaleClient:
                # The daemon ended our stream (and took back the ledger) before we read that it did.
                link.drop_locked(stream)
                return 0
            except BaseException:
                if span_demand is not None and span_demand.handed_back is not None:
                    link.drop_locked(stream)  # pins and a demand of a layer nobody will adopt
                raise
            finally:
                link.spans.running = None
                if layer_signals is not None:
                    self._channel_transport.count_layer_signals(layer_signals)
            back = None if span_demand is None else span_demand.handed_back
            if back is not None:
                link.spans.handed_back = HandedBack(stream, *back)
            if ran < 0:
                link.held.clear()
                raise DaemonUnavailable(
                    f"cache daemon at {link.address} took back the pins of layer {layer}'s experts while "
                    "they were in use (its Demand stream ended)"
                )
            return ran

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
            if demand:
                self._transport().release_locked(layer, demand)

    def _take_handed_back_locked(self, layer: int, experts: list[int]) -> HandedBack | None:
        """The layer a native span handed back, where this acquire is its (the same layer and
        experts, on the open stream); one that is not is dropped with its stream, which releases
        its pins and its demand."""
        link = self._link
        back, link.spans.handed_back = link.spans.handed_back, None
        if back is None:
            return None
        if (
            back.stream is link.stream
            and back.layer == layer
            and sorted(back.hits + back.misses) == sorted(experts)
        ):
            return back
        link.drop_locked(back.stream)
        return None

    def _table_entries(self, layer: int, experts: Sequence[int]) -> list[int] | None:
        """The slot-table entries of ``experts`` of ``layer``, or None where the table cannot take
        them: outside it, or an expert twice (the daemon answers the Demand with the precise error)."""
        manifest = self._link.attachment.manifest
        num_experts = manifest.num_experts
        if not 0 <= layer < manifest.num_layers or any(not 0 <= e < num_experts for e in experts):
            return None
        if len(set(experts)) != len(experts):
            return None
        return [layer * num_experts + e for e in experts]

    def _pin_resident(
        self, stream: DemandStream, layer: int, experts: list[int]
    ) -> tuple[DemandStream, list[ReadyExpert]]:
        """Pin the resident ``experts`` through the slot table (no RPC); their ReadyExperts."""
        entries = self._table_entries(layer, experts)
        if entries is None:
            return stream, []
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
                hits.append(ReadyExpert(expert, slot, Tier.DEVICE))
        return stream, hits

    # -- steps: interruption ------------------------------------------------------------------------
    def begin_step(self) -> None:
        """A new step starts: an interrupt of an earlier one no longer applies, nor a layer an
        earlier step's span handed back and never adopted (dropped with its stream)."""
        self._interrupted = False
        link = self._link
        if link.spans.handed_back is not None:
            with link.lock:
                if link.spans.handed_back is not None:
                    link.drop_locked(link.spans.handed_back.stream)

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
