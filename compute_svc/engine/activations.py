"""Each token's routing, captured in the forward and reported to the predictor off the hot path.

::

    ExpertRuntime.forward(layer l) ──routing_observer──▶ RoutingCapture   (one [T, K] per layer)
    GenerationEngine, after each forward: capture.take(segments) ─▶ StepRouting [t, L, K] per request
        ├─▶ ActivationReporter.on_step   (bounded queue put; full → drop and count)
        └─▶ TraceRecorder.on_step        (compute_svc.engine.trace_recorder)
    reporter thread: queue ─▶ Activation messages ─▶ one long Observe stream ─▶ predictor
                     (stream broken or predictor absent → back off, reconnect; never blocks a step)

Glossary: T tokens of one forward (the prompt at prefill, 1 when decoding), L MoE layers (indices
into the manifest's ``moe_layers``, not decoder layer numbers), K = top-k. A request's token
``i`` is its position: prompt tokens are 0..P-1, the forward of generated token ``g`` (which
feeds it back) is position P + g. Example: prompt of 3 tokens, 2 generated → steps of T=3
(positions 0, 1, 2) and T=1 (position 3); the last generated token is never fed back.

Before each Observe stream (on every connect) the reporter registers the model's shape with
``RegisterModel`` (the predictor takes shapes only from its registry); a refusal is logged and
retried with backoff, and tokens queued meanwhile are dropped as in an outage.

The reporter keeps a single Observe stream open for all requests (the proto lets one stream
carry interleaved requests); ``request_done`` rides on an extra message after the request's
last token, which is never dropped, so the predictor learns of the end even of a cancelled or
failed request. Each run of a request carries its own random ``request_nonce``: the predictor
keys requests by (this client, pod, request_id, nonce), so a request_id used again (a client's
retry) never looks like one request's tokens going back; and a message the predictor refuses
ends that request's reporting there, never the shared stream.
"""

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

from expertcache.grpc_client import RECONNECT_INITIAL_S, RECONNECT_MAX_S, next_backoff, reconnecting_channel
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


class ActivationReporter:
    """Streams every token's routing to the predictor's Observe, asynchronously and lossy.

    ``on_step``/``on_request_end`` are called from the generation thread and never block:
    the queue holds at most ``queue_tokens`` tokens; a step that does not fit is dropped whole
    and counted in ``dropped_tokens`` (``moe_compute_activations_dropped_total``). End markers
    are not counted against the bound and never dropped (one per request).
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
        batch_tokens: int = 256,
        security: ClientSecurity | None = None,
    ) -> None:
        if queue_tokens < 1:
            raise ValueError(f"queue_tokens must be >= 1, got {queue_tokens}")
        self.address = address
        self.model_id = model_id
        self.pod = pod
        self.top_k = top_k
        self.num_experts = num_experts
        self.num_moe_layers = num_moe_layers  # with num_experts: registered on connect (0: not)
        self.queue_tokens = queue_tokens
        self.batch_tokens = batch_tokens
        self._cond = threading.Condition()
        self._queue: deque[_Step | _Done] = deque()
        self._queued_tokens = 0
        # Requests with queued tokens and no end marker yet → the nonce of their run: the
        # predictor keys a request by (this client, pod, request_id, nonce), so a request_id
        # used again (a client's retry) is another request there, whatever became of the first.
        self._reported: dict[str, str] = {}
        self._next_index: dict[
            tuple[str, str], int
        ] = {}  # (request, nonce) → position after its last sent token
        self._trace: dict[str, dict[str, str]] = {}  # traced request → its W3C trace context
        self._closing = False
        self._flush_deadline = 0.0
        # Counters (read with stats(); written under _cond or by the sender thread only).
        self.sent_tokens = 0
        self.dropped_tokens = 0
        self.requests_done = 0
        self.outages = 0
        self.connected = False
        self._channel = reconnecting_channel(address, security)
        self._stub = predictor_pb2_grpc.PredictorStub(self._channel)
        # The Observe call whose request iterator may take from the queue (None: none); every
        # change is notified on _cond, so that an iterator of an ended call stops waiting.
        self._calls = 0
        self._open_call: int | None = None
        self._thread = threading.Thread(target=self._run, name="activation-reporter", daemon=True)
        self._thread.start()

    # -- generation thread ----------------------------------------------------------------------
    def on_step(self, step: StepRouting) -> None:
        """Queue one forward's routing; drop it when the queue is full (never blocks)."""
        tokens = int(step.experts.shape[0])
        with self._cond:
            if self._closing or self._queued_tokens + tokens > self.queue_tokens:
                self.dropped_tokens += tokens
                return
            nonce = self._reported.get(step.request_id)
            if nonce is None:
                nonce = self._reported[step.request_id] = secrets.token_hex(8)
            self._queue.append(_Step(step, nonce))
            self._queued_tokens += tokens
            self._cond.notify()

    def on_request_end(self, request_id: str) -> None:
        """The request finished, was cancelled or failed: the predictor may close its EAM."""
        with self._cond:
            # A request none of whose tokens was queued has nothing to close at the predictor.
            if self._closing or request_id not in self._reported:
                return
            self._queue.append(_Done(request_id, self._reported.pop(request_id)))
            self._cond.notify()

    # -- stats ----------------------------------------------------------------------------------
    def counter_values(self) -> dict[str, int]:
        """The reporter's counters, by metric name (without ``_total``; ``compute_svc.metrics``)."""
        with self._cond:
            return {
                "moe_compute_activations_sent": self.sent_tokens,
                "moe_compute_activations_dropped": self.dropped_tokens,
                "moe_compute_predictor_outages": self.outages,
            }

    def set_trace_context(self, request_id: str, carrier: dict[str, str]) -> None:
        """The request is traced: its activations carry ``carrier`` (W3C) so that the predictor's
        spans join its trace (``expertcache.telemetry``). Forgotten at its end marker."""
        with self._cond:
            self._trace[request_id] = carrier

    @property
    def queued_tokens(self) -> int:
        with self._cond:
            return self._queued_tokens

    # -- sender thread --------------------------------------------------------------------------
    def _take(self, call: int) -> _Step | _Done | None:
        """Next queued item for Observe call ``call``; None once that call ended or we close.
        Waits on ``_cond``: woken by a queued item, the call's end and ``close``."""
        with self._cond:
            while not self._queue:
                if self._open_call != call or self._closing:
                    return None
                self._cond.wait()
            if self._closing and time.monotonic() >= self._flush_deadline:
                return None
            item = self._queue.popleft()
            if isinstance(item, _Step):
                self._queued_tokens -= int(item.routing.experts.shape[0])
            return item

    def _messages(self, call: int) -> Iterator[predictor_pb2.Activation]:
        """The request iterator of Observe call ``call`` (runs in gRPC's request-consumer thread)."""
        while True:
            item = self._take(call)
            if item is None:
                return
            if isinstance(item, _Done):
                index = self._next_index.pop((item.request_id, item.nonce), 0)
                self.requests_done += 1
                message = predictor_pb2.Activation(
                    request_id=item.request_id,
                    model_id=self.model_id,
                    pod=self.pod,
                    token_index=index,
                    request_done=True,
                    request_nonce=item.nonce,
                )
                with self._cond:
                    carrier = self._trace.pop(item.request_id, None)
                if carrier:
                    message.trace_context.update(carrier)
                yield message
                self._mark_connected()
                continue
            nonce, item = item.nonce, item.routing
            rows = item.experts.reshape(item.experts.shape[0], -1).tolist()  # [T, L*K]
            layers = int(item.experts.shape[1])
            carrier = self._trace.get(item.request_id) if self._trace else None
            for offset, row in enumerate(rows):
                message = predictor_pb2.Activation(
                    request_id=item.request_id,
                    model_id=self.model_id,
                    pod=self.pod,
                    token_index=item.first_token + offset,
                    experts=row,
                    top_k=self.top_k,
                    num_moe_layers=layers,
                    num_experts=self.num_experts,
                    request_nonce=nonce,
                )
                if carrier and offset == len(rows) - 1:
                    # One traced activation per step (its last row): a long prompt's chunk makes
                    # one predictor span, not one per prompt token.
                    message.trace_context.update(carrier)
                yield message
                # gRPC asks for the next message once the previous one was written: the stream works.
                self._mark_connected()
                self.sent_tokens += 1
            self._next_index[(item.request_id, nonce)] = item.first_token + len(rows)

    def _mark_connected(self) -> None:
        if not self.connected:
            self.connected = True
            if self.outages:
                logger.info("predictor %s reachable again: reporting resumed", self.address)

    def _outage(self, reason: str) -> None:
        """Log once per outage (a working stream broke, or the first attempt failed)."""
        if self.connected or self.outages == 0:
            self.outages += 1
            logger.warning(
                "predictor %s unreachable (%s); activations are dropped while it is down, "
                "retrying with backoff",
                self.address,
                reason,
            )
        self.connected = False

    def _run(self) -> None:
        backoff = RECONNECT_INITIAL_S
        while True:
            with self._cond:
                if self._closing and (not self._queue or time.monotonic() >= self._flush_deadline):
                    return
            # Start a stream only on a connected channel: a call on a dead one would still pull
            # (and lose) messages from the queue, which must keep them, or drop and count them.
            try:
                grpc.channel_ready_future(self._channel).result(timeout=backoff)
            except grpc.FutureTimeoutError:
                self._outage("not connected")
                with self._cond:
                    if self._closing:
                        return
                backoff = next_backoff(backoff)
                continue
            refused = self._register()
            if refused:
                self._outage(refused)
                with self._cond:
                    if self._closing:
                        return
                    self._cond.wait(backoff)
                backoff = next_backoff(backoff)
                continue
            with self._cond:
                self._calls += 1
                call = self._open_call = self._calls
            try:
                # One long stream: it returns when _messages ends (on close) or raises when the
                # predictor goes away.
                summary = self._stub.Observe(self._messages(call))
                self._end_call(call)
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
                self._end_call(call)
                self._outage(f"{exc.code().name}: {exc.details()}" if hasattr(exc, "code") else str(exc))
                with self._cond:
                    if self._closing:
                        return
                    self._cond.wait(RECONNECT_INITIAL_S)

    def _end_call(self, call: int) -> None:
        """Observe call ``call`` is over: its request iterator stops waiting for the queue."""
        with self._cond:
            if self._open_call == call:
                self._open_call = None
            self._cond.notify_all()

    def _register(self) -> str:
        """RegisterModel before a stream; "" when registered (or nothing to register), else why not."""
        if not (self.num_moe_layers and self.num_experts):
            return ""  # the predictor must have the model configured (model_shapes)
        request = predictor_pb2.RegisterModelRequest(
            model_id=self.model_id,
            num_moe_layers=self.num_moe_layers,
            num_experts=self.num_experts,
            top_k=self.top_k,
        )
        try:
            self._stub.RegisterModel(request, timeout=10)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            if code == grpc.StatusCode.UNIMPLEMENTED:
                return ""  # a predictor from before the registry: shapes travel in the activations
            return f"RegisterModel {self.model_id!r}: {code.name if code else exc}: " + (
                exc.details() if hasattr(exc, "details") else ""
            )
        return ""

    def close(self, flush_timeout_s: float = 2.0) -> None:
        """Send what is queued (up to ``flush_timeout_s``), end the stream and stop the thread."""
        with self._cond:
            self._closing = True
            self._flush_deadline = time.monotonic() + flush_timeout_s
            self._cond.notify_all()
        self._thread.join(flush_timeout_s + RECONNECT_MAX_S)
        self._channel.close()
