"""One protocol to the daemon, two transports, each message written once per transport.

``ChannelTransport`` writes into the ledger's shared-memory channel (the fast path);
``StreamTransport`` sends ``moe.cache.v1`` messages on the Demand stream. ``DaemonClient`` picks
one per call, by whether the link holds a channel now; tracing does not change the choice (a
traced demand carries its W3C context on either).

The one-way signals (begin, end, route, layer ahead) never wait: with nothing open to carry them
they are dropped and counted, since a lost prediction costs a prefetch, never correctness.
"""

from __future__ import annotations

import itertools
import queue
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

import grpc
from moe.cache.v1 import cache_pb2

from compute_svc.daemon.demand_stream import END, INTERRUPT, DemandStream
from compute_svc.daemon.link import DaemonLink
from compute_svc.daemon.wire import error_from_rpc, error_from_status
from compute_svc.errors import DaemonUnavailable, InvalidArgument
from compute_svc.experts.moe import ReadyExpert
from expertcache import native
from expertcache import protocol as codes
from expertcache.protocol import Tier, encode_trace_context

if TYPE_CHECKING:
    from compute_svc.experts.layer_ahead import Prediction

# A wait for the daemon's answer polls the client channel this long (grace) before it sleeps on its
# futex, and up to CHANNEL_SPIN_S only while the daemon's thread copies host-tier experts for it
# (``copying``): an admission that reads the store, or applies the layer's signals first, takes
# hundreds of microseconds, and polling through it takes a CPU from the daemon's threads.
CHANNEL_SPIN_S = 300e-6
CHANNEL_GRACE_S = 20e-6
# A wait for admitted experts to land polls this long, and longer only while the daemon's thread
# copies them from its host tier (the channel's ``copying``): a store read takes milliseconds, and
# polling through it would take a core from the daemon's own threads.
CHANNEL_LANDING_GRACE_S = 5e-6
# Experts smaller than this that an acquire misses are handed over together once all have landed
# (the daemon answers once the host-tier copies are done).
GATHER_MISSES_BELOW_BYTES = codes.GATHER_BELOW_BYTES


class SignalCounts:
    """What both transports share: the live requests (re-announced on a new stream) and the
    signals sent and dropped."""

    def __init__(self) -> None:
        self.sent = 0
        self.dropped = 0
        self.live_requests: set[str] = set()

    def count(self, written: bool) -> None:
        if written:
            self.sent += 1
        else:
            self.dropped += 1  # the ring was full: the daemon was behind


class AcquireWait(Protocol):
    """The limits of one acquire's wait: acquire_timeout_s, the step's deadline, an interrupt."""

    def remaining(self, stream: DemandStream, experts: Sequence[int]) -> float:
        """Seconds the wait may still take; raises what ends it (an interrupt, the stream's end,
        the timeout)."""
        ...

    def left(self) -> float:
        """Seconds until the timeout or deadline (<= 0 once past)."""
        ...

    def check_interrupted(self) -> None:
        """Raises ``Cancelled`` once the step was interrupted."""
        ...

    def timed_out(self, experts: Sequence[int]) -> Exception: ...


class Transport(Protocol):
    """The client's messages to the daemon. ``*_locked``: the link's lock is held."""

    def begin_request(self, request_id: str) -> None: ...

    def end_request(self, request_id: str) -> None: ...

    def routed(
        self, request_id: str, token: int, layer: int, experts: Sequence[int], *, with_acquire: bool = False
    ) -> None: ...

    def layer_ahead(
        self, request_id: str, token: int, predictions: Sequence[Prediction], *, with_acquire: bool = False
    ) -> None: ...

    def reannounce_locked(self, stream: DemandStream) -> None: ...

    def no_demand_locked(self) -> None: ...

    def post_locked(
        self, stream: DemandStream, layer: int, misses: list[int], trace_context: dict[str, str] | None
    ) -> Callable[[AcquireWait], Iterator[list[ReadyExpert]]]: ...

    def release_locked(self, layer: int, experts: list[int]) -> None: ...


def _check_predictions(predictions: Sequence[Prediction]) -> None:
    for p in predictions:
        if len(p.experts) != len(p.scores):
            raise InvalidArgument(
                f"layer_ahead for layer {p.layer} at depth {p.depth}: {len(p.experts)} experts but "
                f"{len(p.scores)} scores"
            )


class ChannelTransport:
    """Signals as records in the ledger's channel ring, demands in its mailbox; the doorbell that
    wakes the daemon's thread rings once per layer. ``routed`` and ``layer_ahead`` are written
    only while the daemon uses them (the table's ``signals_wanted``)."""

    def __init__(self, link: DaemonLink, counts: SignalCounts) -> None:
        self._link = link
        self._counts = counts
        # Request ids → the small handles their records carry (begin names the id once).
        self._handles: dict[str, int] = {}
        self._next_handle = itertools.count(1)
        self._doorbell_due = False  # records written that the daemon was not told of

    def begin_request(self, request_id: str) -> None:
        with self._link.lock:
            self._counts.live_requests.add(request_id)
            if self._live_locked():
                self._begin_locked(request_id)
                self._ring_locked()

    def end_request(self, request_id: str) -> None:
        with self._link.lock:
            self._counts.live_requests.discard(request_id)
            handle = self._handles.pop(request_id, None)
            if handle is not None and self._live_locked():
                self._counts.count(self._link.shm_channel.signal_end(handle))
                self._ring_locked()

    def routed(
        self, request_id: str, token: int, layer: int, experts: Sequence[int], *, with_acquire: bool = False
    ) -> None:
        with self._link.lock:
            if self._wanted_locked() and self._live_locked():
                handle = self._handle_locked(request_id)
                channel = self._link.shm_channel
                self._counts.count(channel.signal_route(handle, token, layer, [int(e) for e in experts]))
                self._written_locked(with_acquire)

    def layer_ahead(
        self, request_id: str, token: int, predictions: Sequence[Prediction], *, with_acquire: bool = False
    ) -> None:
        _check_predictions(predictions)
        with self._link.lock:
            if self._wanted_locked() and self._live_locked():
                handle = self._handle_locked(request_id)
                self._counts.count(
                    self._link.shm_channel.signal_ahead(
                        handle,
                        token,
                        [int(p.layer) for p in predictions],
                        [int(p.depth) for p in predictions],
                        [[int(e) for e in p.experts] for p in predictions],
                        [[float(x) for x in p.scores] for p in predictions],
                    )
                )
                self._written_locked(with_acquire)

    def layer_signals_locked(
        self,
        request_ids: Sequence[str],
        tokens: Sequence[int],
        top_k: int,
        layers: int,
        depth: int,
        ahead: Sequence[int],
    ) -> native.LayerSignals | None:
        """The step's signals for layers run natively (``native.LayerSignals``: each such layer's
        ``routed`` and ``layer_ahead`` records, written by ``ExpertFfn.run_layers``): row r is
        ``request_ids[r]``'s token ``tokens[r]``; ``ahead`` [layers * depth] the layer predicted at
        each depth from each layer (-1: none). None while the daemon wants no signals or no daemon
        thread serves the channel (``routed`` would drop them): such layers run in Python.
        ``count_layer_signals`` once they ran."""
        stream = self._link.stream
        if not self._wanted_locked() or self._link.shm_channel is None or stream is None or stream.ended:
            return None  # not counted as dropped: the layers' own signals will be, in Python
        handles = [self._handle_locked(request_id) for request_id in request_ids]
        return native.LayerSignals(
            self._link.shm_channel, handles, list(tokens), top_k, layers, depth, list(ahead)
        )

    def count_layer_signals(self, signals: native.LayerSignals) -> None:
        """What ``signals`` wrote and dropped, counted as ``routed`` counts its records; records
        it left unrung (a layer with a miss) ring with what follows, as ``with_acquire`` ones."""
        self._counts.sent += signals.written
        self._counts.dropped += signals.dropped
        if signals.unrung:
            self._doorbell_due = True

    def reannounce_locked(self, stream: DemandStream) -> None:
        """A new stream: its daemon thread knows none of our handles, so begin them afresh."""
        self._handles.clear()
        for request_id in sorted(self._counts.live_requests):
            self._begin_locked(request_id)
        self._ring_locked()

    def no_demand_locked(self) -> None:
        self._ring_locked()

    def post_locked(
        self, stream: DemandStream, layer: int, misses: list[int], trace_context: dict[str, str] | None
    ) -> Callable[[AcquireWait], Iterator[list[ReadyExpert]]]:
        channel = self._link.shm_channel
        fail_seen = channel.fail_seq
        seq = channel.post_demand(layer, misses, encode_trace_context(trace_context))
        self._ring_locked(due=True)
        return self.posted_locked(stream, layer, misses, seq, fail_seen)

    def posted_locked(
        self, stream: DemandStream, layer: int, misses: list[int], seq: int, fail_seen: int
    ) -> Callable[[AcquireWait], Iterator[list[ReadyExpert]]]:
        """The wait for demand ``seq``, posted already for ``misses`` of ``layer`` (by
        ``post_locked``, or by a native span that handed the layer back) while the channel's
        ``fail_seq`` was ``fail_seen``."""
        channel = self._link.shm_channel
        return lambda wait: self._wait(wait, stream, channel, seq, fail_seen, layer, misses)

    def span_demand_locked(self, timeout_s: float, deadline: float | None) -> native.SpanDemand | None:
        """The demands a native span may post and wait for itself (``native.SpanDemand``), each
        wait at most ``timeout_s`` and none past ``deadline`` (``time.monotonic()``), polling as
        ``_wait`` does; None while no daemon thread serves the channel."""
        channel = self._link.shm_channel
        stream = self._link.stream
        if channel is None or stream is None or stream.ended:
            return None
        deadline_s = 1e9 if deadline is None else max(deadline - time.monotonic(), 0.0)
        return native.SpanDemand(
            channel,
            timeout_s,
            deadline_s,
            CHANNEL_SPIN_S,
            CHANNEL_GRACE_S,
            CHANNEL_LANDING_GRACE_S,
            self._link.attachment.slot_bytes < GATHER_MISSES_BELOW_BYTES,
        )

    def release_locked(self, layer: int, experts: list[int]) -> None:
        """Experts not pinned in our ledger: their pins went with a ledger the daemon took back
        (its stream ended), so there is nothing to release."""

    def _wait(
        self,
        wait: AcquireWait,
        stream: DemandStream,
        channel: native.ClientChannel,
        seq: int,
        fail_seen: int,
        layer: int,
        misses: list[int],
    ) -> Iterator[list[ReadyExpert]]:
        """The daemon's answer to demand ``seq``, then the misses in batches as they land."""
        link = self._link
        while channel.reply_seq != seq:
            # Read before the checks: a stream end or an interrupt after them bumps it and ends
            # the wait at once (read after them, it would be slept through).
            seen = channel.notify_seq
            channel.wait_reply(seq, seen, wait.remaining(stream, misses), CHANNEL_SPIN_S, CHANNEL_GRACE_S)
        if channel.reply_status != codes.STATUS_OK:
            raise error_from_status(channel.reply_status, channel.reply_message, link.address)
        # Admitted: the daemon pinned every miss into our ledger; we release them like our hits.
        with link.lock:
            for e in misses:
                key = (layer, e)
                link.held[key] = link.held.get(key, 0) + 1
        num_experts = link.attachment.manifest.num_experts
        pending = list(range(len(misses)))
        entries = [layer * num_experts + e for e in misses]
        table = link.table
        gather = link.attachment.slot_bytes < GATHER_MISSES_BELOW_BYTES
        while pending:
            seen = channel.notify_seq  # before the checks: a landing after them wakes the wait
            if channel.fail_seq != fail_seen:
                raise error_from_status(channel.fail_status, channel.fail_message, link.address)
            slots = table.resident_slots([entries[i] for i in pending])
            landed = sum(1 for slot in slots if slot >= 0)
            if landed and (landed == len(pending) or not gather):
                batch = [
                    ReadyExpert(
                        misses[i], slot, codes.TIER_OF_CHANNEL_CODE.get(channel.source(i), Tier.UNKNOWN)
                    )
                    for i, slot in zip(pending, slots, strict=True)
                    if slot >= 0
                ]
                pending = [i for i, slot in zip(pending, slots, strict=True) if slot < 0]
                yield batch
                continue
            if any(slot == -2 for slot in slots):
                # A failed load is posted (fail_seq) before its slot goes absent: a failure posted
                # since the check above is why, not an ended stream.
                if channel.fail_seq != fail_seen:
                    raise error_from_status(channel.fail_status, channel.fail_message, link.address)
                raise DaemonUnavailable(
                    f"cache daemon at {link.address} dropped experts of layer {layer} it had admitted "
                    "(its stream ended)"
                )
            channel.wait_notify(
                seen,
                wait.remaining(stream, [misses[i] for i in pending]),
                CHANNEL_SPIN_S,
                CHANNEL_LANDING_GRACE_S,
            )

    def _wanted_locked(self) -> bool:
        """Whether the daemon uses routes and lookaheads now (the table's ``signals_wanted``);
        not while the link holds no table (a re-attach is under way)."""
        table = self._link.table
        return table is not None and table.signals_wanted

    def _live_locked(self) -> bool:
        """Whether a daemon thread serves the channel now (a stream is open); a signal written
        while none does would be lost with the ledger, so it is dropped and counted instead."""
        stream = self._link.stream
        if self._link.shm_channel is None or stream is None or stream.ended:
            self._counts.dropped += 1
            return False
        return True

    def _handle_locked(self, request_id: str) -> int:
        """The channel handle of ``request_id`` (begun on the channel now if it was not)."""
        handle = self._handles.get(request_id)
        if handle is None:
            handle = self._begin_locked(request_id)
        return handle

    def _begin_locked(self, request_id: str) -> int:
        handle = next(self._next_handle) & 0xFFFFFFFF
        self._handles[request_id] = handle
        self._counts.count(self._link.shm_channel.signal_begin(handle, request_id))
        self._doorbell_due = True
        return handle

    def _written_locked(self, with_acquire: bool) -> None:
        """A record went into the channel: its doorbell rings now, or with the acquire that follows."""
        self._doorbell_due = True
        if not with_acquire:
            self._ring_locked()

    def _ring_locked(self, due: bool = False) -> None:
        """Wake the daemon's channel thread for what was written (one syscall, and only while it
        sleeps); ``due``: something else was written there (a demand)."""
        channel = self._link.shm_channel
        if (due or self._doorbell_due) and channel is not None:
            self._doorbell_due = False
            channel.ring_doorbell()


class StreamTransport:
    """Every message on the Demand stream. A Route / LayerAhead made just before an acquire
    travels inside its Acquire; with no stream open a signal is dropped (opening one may take an
    Attach round trip, which has no place on the decode step: the next acquire opens one)."""

    def __init__(self, link: DaemonLink, counts: SignalCounts) -> None:
        self._link = link
        self._counts = counts
        self._tickets = itertools.count(1)
        # Route / LayerAhead messages held for the next Acquire (``with_acquire``), in order.
        self._carried: list[cache_pb2.DemandRequest] = []

    def begin_request(self, request_id: str) -> None:
        with self._link.lock:
            self._counts.live_requests.add(request_id)
            self._signal_locked(
                cache_pb2.DemandRequest(request_begin=cache_pb2.RequestBegin(request_id=request_id))
            )

    def end_request(self, request_id: str) -> None:
        with self._link.lock:
            self._counts.live_requests.discard(request_id)
            self._signal_locked(
                cache_pb2.DemandRequest(request_end=cache_pb2.RequestEnd(request_id=request_id))
            )

    def routed(
        self, request_id: str, token: int, layer: int, experts: Sequence[int], *, with_acquire: bool = False
    ) -> None:
        message = cache_pb2.DemandRequest(
            route=cache_pb2.Route(
                request_id=request_id, token=token, decoder_layer=layer, experts=[int(e) for e in experts]
            )
        )
        self._queue(message, with_acquire)

    def layer_ahead(
        self, request_id: str, token: int, predictions: Sequence[Prediction], *, with_acquire: bool = False
    ) -> None:
        _check_predictions(predictions)
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
        self._queue(cache_pb2.DemandRequest(layer_ahead=message), with_acquire)

    def reannounce_locked(self, stream: DemandStream) -> None:
        """A new stream: the old one's messages may be lost (or the daemon is new), so say which
        requests run now."""
        for request_id in sorted(self._counts.live_requests):
            stream.send(cache_pb2.DemandRequest(request_begin=cache_pb2.RequestBegin(request_id=request_id)))

    def no_demand_locked(self) -> None:
        """Every expert was pinned without a demand: no Acquire carries the held signals."""
        self._flush_carried_locked()

    def post_locked(
        self, stream: DemandStream, layer: int, misses: list[int], trace_context: dict[str, str] | None
    ) -> Callable[[AcquireWait], Iterator[list[ReadyExpert]]]:
        """The Acquire of ``misses``, carrying the signals held for it."""
        ticket = next(self._tickets)
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
        self._counts.sent += len(carried)
        stream.send(request)
        return lambda wait: self._wait(wait, stream, ticket, misses)

    def release_locked(self, layer: int, experts: list[int]) -> None:
        stream = self._link.stream
        if stream is None:
            return  # the stream broke: the daemon released its pins
        self._flush_carried_locked()
        stream.send(
            cache_pb2.DemandRequest(
                release=cache_pb2.Release(
                    experts=[cache_pb2.ExpertRef(decoder_layer=layer, expert=e) for e in experts]
                )
            )
        )

    def _wait(
        self, wait: AcquireWait, stream: DemandStream, ticket: int, misses: list[int]
    ) -> Iterator[list[ReadyExpert]]:
        while True:
            response = self._next(wait, stream, misses)
            kind = response.WhichOneof("kind")
            if kind == "ready" and response.ready.ticket == ticket:
                ready = response.ready
                yield [
                    ReadyExpert(
                        ready.expert.expert, ready.slot, codes.TIER_OF_PB.get(ready.source, Tier.UNKNOWN)
                    )
                ]
            elif kind == "done" and response.done.ticket == ticket:
                return
            # else: an answer to an earlier ticket (abandoned): skipped

    def _next(
        self, wait: AcquireWait, stream: DemandStream, experts: Sequence[int]
    ) -> cache_pb2.DemandResponse:
        """The stream's next response; waits as long as ``wait`` allows."""
        while True:
            try:
                item = stream.responses.get(timeout=max(wait.left(), 0.0))
            except queue.Empty:
                raise wait.timed_out(experts) from None
            if item is INTERRUPT:
                wait.check_interrupted()
                continue  # left over from an earlier step
            if isinstance(item, grpc.RpcError):
                raise error_from_rpc(item, self._link.address)
            if item is END:
                raise DaemonUnavailable(f"cache daemon at {self._link.address} closed the Demand stream")
            return item

    def _queue(self, message: cache_pb2.DemandRequest, with_acquire: bool) -> None:
        with self._link.lock:
            if with_acquire:
                self._carried.append(message)
            else:
                self._signal_locked(message)

    def _signal_locked(self, request: cache_pb2.DemandRequest) -> None:
        """Queue a one-way message on the open stream; with none open, drop it. Signals held for
        an Acquire go first, so that the daemon sees every message in the order it was made."""
        self._flush_carried_locked()
        self._send_locked(request)

    def _flush_carried_locked(self) -> None:
        carried, self._carried = self._carried, []
        for signal in carried:
            self._send_locked(signal)

    def _send_locked(self, request: cache_pb2.DemandRequest) -> None:
        stream = self._link.stream
        if stream is None or stream.ended:
            self._counts.dropped += 1
            return
        stream.send(request)
        self._counts.sent += 1


__all__ = [
    "CHANNEL_GRACE_S",
    "CHANNEL_LANDING_GRACE_S",
    "CHANNEL_SPIN_S",
    "GATHER_MISSES_BELOW_BYTES",
    "AcquireWait",
    "ChannelTransport",
    "SignalCounts",
    "StreamTransport",
    "Transport",
]
