"""One-way prediction messages to the daemon: no reply, never a wait on the decode step.

::

    begin_request(id) ─▶ RequestBegin       routed(token, layer, experts) ─▶ Route
    end_request(id)   ─▶ RequestEnd         layer_ahead(token, [Prediction per depth]) ─▶ LayerAhead

On the fast path they are records in the ledger's client channel (``expertcache.native``):
``routed`` and ``layer_ahead`` only while the daemon uses them (the table's ``signals_wanted``),
begin/end always; the doorbell that wakes the daemon rings once per layer. Otherwise they travel
the Demand stream, a Route / LayerAhead made just before an acquire inside its Acquire. With no
stream open they are dropped and counted (``dropped``): a lost prediction costs a prefetch,
never correctness. A new stream re-announces the running requests.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from moe.cache.v1 import cache_pb2

from compute_svc.errors import InvalidArgument

if TYPE_CHECKING:
    from compute_svc.daemon.demand_stream import DemandStream
    from compute_svc.daemon.link import DaemonLink
    from compute_svc.experts.layer_ahead import Prediction


class SignalSender:
    """The one-way messages of one client, over its ``DaemonLink`` (its lock, stream, channel)."""

    def __init__(self, link: DaemonLink) -> None:
        self._link = link
        self._lock = link.lock
        # Sent, and dropped because no Demand stream was open or the channel's ring was full
        # (never waited for, never retried).
        self.sent = 0
        self.dropped = 0
        self._live_requests: set[str] = set()  # begun and not ended; re-announced on a new stream
        # Request ids → the small handles their channel records carry (begin names the id once).
        self._handles: dict[str, int] = {}
        self._next_handle = itertools.count(1)
        self._doorbell_due = False  # signals written to the channel that the daemon was not told of
        # Route / LayerAhead messages held for the next Acquire (``with_acquire``), in order.
        self._carried: list[cache_pb2.DemandRequest] = []

    def begin_request(self, request_id: str) -> None:
        """A request starts: the daemon starts its routing history afresh."""
        with self._lock:
            self._live_requests.add(request_id)
            if self._link.shm_channel is not None:
                if self._channel_live_locked():
                    self._channel_begin_locked(request_id)
                    self.ring_locked()
                return
            self._signal_locked(
                cache_pb2.DemandRequest(request_begin=cache_pb2.RequestBegin(request_id=request_id))
            )

    def end_request(self, request_id: str) -> None:
        """A request ended: the daemon drops its routing history."""
        with self._lock:
            self._live_requests.discard(request_id)
            if self._link.shm_channel is not None:
                handle = self._handles.pop(request_id, None)
                if handle is not None and self._channel_live_locked():
                    self._count(self._link.shm_channel.signal_end(handle))
                    self.ring_locked()
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
            channel = self._link.shm_channel
            if channel is not None:
                if self._link.table.signals_wanted and self._channel_live_locked():
                    handle = self._handle_locked(request_id)
                    self._count(channel.signal_route(handle, token, layer, [int(e) for e in experts]))
                    self._written_locked(with_acquire)
                return
        message = cache_pb2.DemandRequest(
            route=cache_pb2.Route(
                request_id=request_id, token=token, decoder_layer=layer, experts=[int(e) for e in experts]
            )
        )
        self._queue(message, with_acquire)

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
            channel = self._link.shm_channel
            if channel is not None:
                if self._link.table.signals_wanted and self._channel_live_locked():
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
                    self._written_locked(with_acquire)
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
        self._queue(cache_pb2.DemandRequest(layer_ahead=message), with_acquire)

    def _written_locked(self, with_acquire: bool) -> None:
        """A record went into the channel: its doorbell rings now, or with the acquire that follows."""
        self._doorbell_due = True
        if not with_acquire:
            self.ring_locked()

    def _queue(self, message: cache_pb2.DemandRequest, with_acquire: bool) -> None:
        """A Route / LayerAhead for the Demand stream: held for the next Acquire, or sent now."""
        with self._lock:
            if with_acquire:
                self._carried.append(message)
            else:
                self._signal_locked(message)

    # -- for the client and the link (their lock held) ---------------------------------------------
    def reannounce_locked(self, stream: DemandStream) -> None:
        """A new Demand stream: the old one's messages may be lost (or the daemon is new), so
        say which requests run now."""
        self._handles.clear()
        for request_id in sorted(self._live_requests):
            if self._link.shm_channel is not None:
                self._channel_begin_locked(request_id)
            else:
                stream.send(
                    cache_pb2.DemandRequest(request_begin=cache_pb2.RequestBegin(request_id=request_id))
                )
        self.ring_locked()

    def acquire_locked(
        self, ticket: int, layer: int, misses: list[int], trace_context: dict[str, str] | None
    ) -> cache_pb2.DemandRequest:
        """The Acquire of ``misses`` for the Demand stream, carrying the signals held for it."""
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
        self.sent += len(carried)
        return request

    def _handle_locked(self, request_id: str) -> int:
        """The channel handle of ``request_id`` (begun on the channel now if it was not)."""
        handle = self._handles.get(request_id)
        if handle is None:
            handle = self._channel_begin_locked(request_id)
        return handle

    def _channel_begin_locked(self, request_id: str) -> int:
        handle = next(self._next_handle) & 0xFFFFFFFF
        self._handles[request_id] = handle
        self._count(self._link.shm_channel.signal_begin(handle, request_id))
        self._doorbell_due = True
        return handle

    def _count(self, written: bool) -> None:
        if written:
            self.sent += 1
        else:
            self.dropped += 1  # the ring was full: the daemon was behind

    def _channel_live_locked(self) -> bool:
        """Whether a daemon thread serves the channel now (a stream is open); a signal written
        while none does would be lost with the ledger, so it is dropped and counted instead."""
        if self._link.stream is None or self._link.stream.ended:
            self.dropped += 1
            return False
        return True

    def ring_locked(self, due: bool = False) -> None:
        """Wake the daemon's channel thread for what was written to the channel (one syscall, and
        only while it sleeps); ``due``: something else was written there (a demand)."""
        if (due or self._doorbell_due) and self._link.shm_channel is not None:
            self._doorbell_due = False
            self._link.shm_channel.ring_doorbell()

    def _signal_locked(self, request: cache_pb2.DemandRequest) -> None:
        """Queue a one-way message on the open Demand stream; with none open, drop it. Opening a
        stream may take an Attach round trip, which has no place on the decode step: the next
        acquire opens one (and re-announces the current request). Signals held for an Acquire go
        first, so that the daemon sees every message in the order it was made."""
        self.flush_carried_locked()
        self._send_signal_locked(request)

    def flush_carried_locked(self) -> None:
        """Send the signals held for an Acquire on their own."""
        carried, self._carried = self._carried, []
        for signal in carried:
            self._send_signal_locked(signal)

    def _send_signal_locked(self, request: cache_pb2.DemandRequest) -> None:
        stream = self._link.stream
        if stream is None or stream.ended:
            self.dropped += 1
            return
        stream.send(request)
        self.sent += 1
