"""Each token's routing, captured in the forward and reported to the predictor off the hot path.

``RoutingCapture`` collects one forward's routing; ``ActivationReporter`` streams it to the
predictor over one long Observe stream, lossy, never blocking a step. Flow and glossary:
docs/compute.md."""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import grpc
import torch
from moe.predictor.v1 import predictor_pb2, predictor_pb2_grpc

from expertcache.grpc_client import (
    RECONNECT_INITIAL_S,
    RECONNECT_MAX_S,
    next_backoff,
    reconnecting_channel,
    wait_ready,
)
from expertcache.layers import LayerMap
from expertcache.security import ClientSecurity

logger = logging.getLogger(__name__)


# -- capture ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepRouting:
    """Routing of one forward of one request."""

    request_id: str
    first_token: int  # position of row 0 in the request
    experts: torch.Tensor  # [T, L, K] int64, on the CPU
    weights: torch.Tensor | None  # [T, L, K] router weights (float), on the CPU; None unless asked


class RoutingCapture:
    """The ``ExpertRuntime.routing_observer``: keeps the current forward's routing per MoE layer.

    Called from the single generation thread only. ``moe_layers`` are the decoder layer numbers
    of the MoE layers (manifest order); a forward must route each exactly once.
    """

    def __init__(self, moe_layers: Sequence[int]) -> None:
        self._layers = LayerMap(tuple(moe_layers))  # the predictor numbers MoE layers, not decoder ones
        self._experts: list[torch.Tensor | None] = [None] * len(moe_layers)
        self._weights: list[torch.Tensor | None] = [None] * len(moe_layers)

    @property
    def num_layers(self) -> int:
        return self._layers.num_moe

    def __call__(self, layer: int, top_k_index: torch.Tensor, top_k_weights: torch.Tensor | None) -> None:
        """top_k_index [T, K] int64, top_k_weights [T, K] (None when not asked), both on the host
        (the runtime's one transfer of the layer); ``layer`` is a decoder layer number."""
        i = self._layers.moe_index(layer)
        self._experts[i] = top_k_index
        self._weights[i] = top_k_weights

    def begin(self) -> None:
        """Forget the previous forward (a failed forward may have left a partial one)."""
        self._experts = [None] * len(self._experts)
        self._weights = [None] * len(self._weights)

    def take(self, segments: Sequence, with_weights: bool) -> list[StepRouting]:
        """The forward just finished, one ``StepRouting`` [t, L, K] per request of ``segments``
        (``compute_svc.experts.moe.StepSegment``: whose rows are where, at which positions); [] when some
        layer did not route."""
        if any(e is None for e in self._experts):
            logger.warning("a forward did not route every MoE layer: its routing is not reported")
            return []
        experts = torch.stack(self._experts, dim=1)  # type: ignore[arg-type]  # [T, L, K], host
        weights = torch.stack(self._weights, dim=1) if with_weights else None  # type: ignore[arg-type]
        self.begin()
        return [
            StepRouting(
                seg.request_id,
                seg.position,
                experts[seg.start : seg.start + seg.rows],
                weights[seg.start : seg.start + seg.rows] if weights is not None else None,
            )
            for seg in segments
        ]


# -- reporter -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Step:
    routing: StepRouting
    nonce: str  # the request run's Activation.request_nonce


@dataclass(frozen=True)
class _Done:
    request_id: str
    nonce: str


@dataclass(frozen=True)
class ReportedModel:
    """The model as the predictor knows it: named on every activation, its shape registered with
    ``RegisterModel`` on each connect (``num_moe_layers`` or ``num_experts`` 0: nothing to register)."""

    model_id: str
    pod: str
    top_k: int
    num_experts: int = 0
    num_moe_layers: int = 0

    def registration(self) -> predictor_pb2.RegisterModelRequest | None:
        if not (self.num_moe_layers and self.num_experts):
            return None  # the predictor must have the model configured (model_shapes)
        return predictor_pb2.RegisterModelRequest(
            model_id=self.model_id,
            num_moe_layers=self.num_moe_layers,
            num_experts=self.num_experts,
            top_k=self.top_k,
        )


@dataclass
class ReporterCounters:
    """The reporter's counts (``counter_values``): ``dropped_tokens`` is written under the outbox's
    lock, the others by the sender thread only."""

    sent_tokens: int = 0
    dropped_tokens: int = 0
    requests_done: int = 0
    outages: int = 0
    connected: bool = False


class _Outbox:
    """The bounded queue from the generation thread to the sender, and the one Observe call that
    may take from it.

    Holds at most ``capacity`` tokens; a step that does not fit is dropped whole and counted. End
    markers are not counted against the bound and never dropped (one per request). Each request
    with queued tokens and no end marker yet has the nonce of its run: the predictor keys a request
    by (this client, pod, request_id, nonce), so a request_id used again (a client's retry) is
    another request there, whatever became of the first.
    """

    def __init__(self, capacity: int, counters: ReporterCounters) -> None:
        self.capacity = capacity
        self._counters = counters
        self._cond = threading.Condition()
        self._items: deque[_Step | _Done] = deque()
        self._tokens = 0
        self._nonces: dict[str, str] = {}
        self._closing = False
        self._flush_deadline = 0.0
        # The Observe call whose request iterator may take from the queue (None: none); every
        # change is notified on _cond, so that an iterator of an ended call stops waiting.
        self._calls = 0
        self._open_call: int | None = None

    @property
    def tokens(self) -> int:
        with self._cond:
            return self._tokens

    def put(self, step: StepRouting) -> None:
        """Queue one forward's routing; drop it when it does not fit (never blocks)."""
        tokens = int(step.experts.shape[0])
        with self._cond:
            if self._closing or self._tokens + tokens > self.capacity:
                self._counters.dropped_tokens += tokens
                return
            nonce = self._nonces.get(step.request_id)
            if nonce is None:
                nonce = self._nonces[step.request_id] = secrets.token_hex(8)
            self._items.append(_Step(step, nonce))
            self._tokens += tokens
            self._cond.notify()

    def put_end(self, request_id: str) -> None:
        """Queue the request's end marker; a request none of whose tokens was queued has nothing
        to close at the predictor."""
        with self._cond:
            if self._closing or request_id not in self._nonces:
                return
            self._items.append(_Done(request_id, self._nonces.pop(request_id)))
            self._cond.notify()

    def take(self, call: int) -> _Step | _Done | None:
        """Next item for Observe call ``call``; None once that call ended or we close. Waits:
        woken by a queued item, the call's end and ``close``."""
        with self._cond:
            while not self._items:
                if self._open_call != call or self._closing:
                    return None
                self._cond.wait()
            if self._closing and time.monotonic() >= self._flush_deadline:
                return None
            item = self._items.popleft()
            if isinstance(item, _Step):
                self._tokens -= int(item.routing.experts.shape[0])
            return item

    def open_call(self) -> int:
        """A new Observe call, the one that takes from now on."""
        with self._cond:
            self._calls += 1
            self._open_call = self._calls
            return self._open_call

    def end_call(self, call: int) -> None:
        """Observe call ``call`` is over: its request iterator stops waiting for the queue."""
        with self._cond:
            if self._open_call == call:
                self._open_call = None
            self._cond.notify_all()

    def finished(self) -> bool:
        """Closing, and nothing left to send or no time left to send it."""
        with self._cond:
            return self._closing and (not self._items or time.monotonic() >= self._flush_deadline)

    def closing(self) -> bool:
        with self._cond:
            return self._closing

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` unless closing (woken by ``close``); True when closing."""
        with self._cond:
            if self._closing:
                return True
            self._cond.wait(timeout_s)
            return False

    def close(self, flush_timeout_s: float) -> None:
        """Refuse new items; what is queued may still be taken for ``flush_timeout_s``."""
        with self._cond:
            self._closing = True
            self._flush_deadline = time.monotonic() + flush_timeout_s
            self._cond.notify_all()


class _SentRequests:
    """The sender's bookkeeping per request: the position after each run's last sent token, and
    the W3C trace context of traced requests (set from the generation thread)."""

    def __init__(self) -> None:
        self._next_index: dict[tuple[str, str], int] = {}  # (request, nonce) → next position
        self._lock = threading.Lock()
        self._trace: dict[str, dict[str, str]] = {}  # traced request → its W3C trace context

    def set_trace(self, request_id: str, carrier: dict[str, str]) -> None:
        with self._lock:
            self._trace[request_id] = carrier

    def trace(self, request_id: str) -> dict[str, str] | None:
        return self._trace.get(request_id) if self._trace else None

    def sent(self, request_id: str, nonce: str, next_index: int) -> None:
        self._next_index[(request_id, nonce)] = next_index

    def end(self, request_id: str, nonce: str) -> tuple[int, dict[str, str] | None]:
        """The run is over: the position after its last sent token, and its trace context."""
        index = self._next_index.pop((request_id, nonce), 0)
        with self._lock:
            return index, self._trace.pop(request_id, None)


class ActivationReporter:
    """Streams every token's routing to the predictor's Observe, asynchronously and lossy.

    ``on_step``/``on_request_end`` are called from the generation thread and never block: the
    queue (``_Outbox``) holds at most ``queue_tokens`` tokens; a step that does not fit is
    dropped whole and counted in ``counters.dropped_tokens``
    (``moe_compute_activations_dropped_total``).
    """

    def __init__(
        self,
        address: str,
        model_id: str,
        pod: str,
        top_k: int,
        queue_tokens: int,
        *,
        num_experts: int = 0,
        num_moe_layers: int = 0,
        security: ClientSecurity | None = None,
    ) -> None:
        if queue_tokens < 1:
            raise ValueError(f"queue_tokens must be >= 1, got {queue_tokens}")
        self.address = address
        self.model = ReportedModel(model_id, pod, top_k, num_experts, num_moe_layers)
        self.counters = ReporterCounters()
        self._outbox = _Outbox(queue_tokens, self.counters)
        self._requests = _SentRequests()
        self._channel = reconnecting_channel(address, security)
        self._stub = predictor_pb2_grpc.PredictorStub(self._channel)
        self._thread = threading.Thread(target=self._run, name="activation-reporter", daemon=True)
        self._thread.start()

    # -- generation thread ----------------------------------------------------------------------
    def on_step(self, step: StepRouting) -> None:
        """Queue one forward's routing; drop it when the queue is full (never blocks)."""
        self._outbox.put(step)

    def on_request_end(self, request_id: str) -> None:
        """The request finished, was cancelled or failed: the predictor may close its EAM."""
        self._outbox.put_end(request_id)

    # -- stats ----------------------------------------------------------------------------------
    def counter_values(self) -> dict[str, int]:
        """The reporter's counters, by metric name (without ``_total``; ``compute_svc.metrics``)."""
        counters = self.counters
        return {
            "moe_compute_activations_sent": counters.sent_tokens,
            "moe_compute_activations_dropped": counters.dropped_tokens,
            "moe_compute_predictor_outages": counters.outages,
        }

    def set_trace_context(self, request_id: str, carrier: dict[str, str]) -> None:
        """The request is traced: its activations carry ``carrier`` (W3C) so that the predictor's
        spans join its trace (``expertcache.telemetry``). Forgotten at its end marker."""
        self._requests.set_trace(request_id, carrier)

    @property
    def queued_tokens(self) -> int:
        return self._outbox.tokens

    # -- sender thread --------------------------------------------------------------------------
    def _messages(self, call: int) -> Iterator[predictor_pb2.Activation]:
        """The request iterator of Observe call ``call`` (runs in gRPC's request-consumer thread)."""
        model, counters = self.model, self.counters
        while True:
            item = self._outbox.take(call)
            if item is None:
                return
            if isinstance(item, _Done):
                index, carrier = self._requests.end(item.request_id, item.nonce)
                counters.requests_done += 1
                message = predictor_pb2.Activation(
                    request_id=item.request_id,
                    model_id=model.model_id,
                    pod=model.pod,
                    token_index=index,
                    request_done=True,
                    request_nonce=item.nonce,
                )
                if carrier:
                    message.trace_context.update(carrier)
                yield message
                self._mark_connected()
                continue
            nonce, item = item.nonce, item.routing
            rows = item.experts.reshape(item.experts.shape[0], -1).tolist()  # [T, L*K]
            layers = int(item.experts.shape[1])
            carrier = self._requests.trace(item.request_id)
            for offset, row in enumerate(rows):
                message = predictor_pb2.Activation(
                    request_id=item.request_id,
                    model_id=model.model_id,
                    pod=model.pod,
                    token_index=item.first_token + offset,
                    experts=row,
                    top_k=model.top_k,
                    num_moe_layers=layers,
                    num_experts=model.num_experts,
                    request_nonce=nonce,
                )
                if carrier and offset == len(rows) - 1:
                    # One traced activation per step (its last row): a long prompt's chunk makes
                    # one predictor span, not one per prompt token.
                    message.trace_context.update(carrier)
                yield message
                # gRPC asks for the next message once the previous one was written: the stream works.
                self._mark_connected()
                counters.sent_tokens += 1
            self._requests.sent(item.request_id, nonce, item.first_token + len(rows))

    def _mark_connected(self) -> None:
        counters = self.counters
        if not counters.connected:
            counters.connected = True
            if counters.outages:
                logger.info("predictor %s reachable again: reporting resumed", self.address)

    def _outage(self, reason: str) -> None:
        """Log once per outage (a working stream broke, or the first attempt failed)."""
        counters = self.counters
        if counters.connected or counters.outages == 0:
            counters.outages += 1
            logger.warning(
                "predictor %s unreachable (%s); activations are dropped while it is down, "
                "retrying with backoff",
                self.address,
                reason,
            )
        counters.connected = False

    def _run(self) -> None:
        outbox = self._outbox
        backoff = RECONNECT_INITIAL_S
        while True:
            if outbox.finished():
                return
            # Start a stream only on a connected channel: a call on a dead one would still pull
            # (and lose) messages from the queue, which must keep them, or drop and count them.
            if not wait_ready(self._channel, backoff):
                self._outage("not connected")
                if outbox.closing():
                    return
                backoff = next_backoff(backoff)
                continue
            refused = self._register()
            if refused:
                self._outage(refused)
                if outbox.wait(backoff):
                    return
                backoff = next_backoff(backoff)
                continue
            call = outbox.open_call()
            try:
                # One long stream: it returns when _messages ends (on close) or raises when the
                # predictor goes away.
                summary = self._stub.Observe(self._messages(call))
                outbox.end_call(call)
                logger.debug("Observe stream closed: %d activations accepted", summary.activations)
                if summary.requests_refused:
                    logger.warning(
                        "the predictor refused %d requests' reporting on the last Observe stream (%d "
                        "messages), the first: %s",
                        summary.requests_refused,
                        summary.activations_refused,
                        summary.first_refusal,
                    )
                backoff = RECONNECT_INITIAL_S
            except grpc.RpcError as exc:
                outbox.end_call(call)
                self._outage(f"{exc.code().name}: {exc.details()}" if hasattr(exc, "code") else str(exc))
                if outbox.wait(RECONNECT_INITIAL_S):
                    return

    def _register(self) -> str:
        """RegisterModel before a stream; "" when registered (or nothing to register), else why not."""
        request = self.model.registration()
        if request is None:
            return ""
        try:
            self._stub.RegisterModel(request, timeout=10)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            if code == grpc.StatusCode.UNIMPLEMENTED:
                return ""  # a predictor from before the registry: shapes travel in the activations
            return f"RegisterModel {self.model.model_id!r}: {code.name if code else exc}: " + (
                exc.details() if hasattr(exc, "details") else ""
            )
        return ""

    def close(self, flush_timeout_s: float = 2.0) -> None:
        """Send what is queued (up to ``flush_timeout_s``), end the stream and stop the thread."""
        self._outbox.close(flush_timeout_s)
        self._thread.join(flush_timeout_s + RECONNECT_MAX_S)
        self._channel.close()
