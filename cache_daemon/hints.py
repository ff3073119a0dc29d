"""Prefetch hints from the predictor: a subscriber thread (``HintSubscriber``) and the board it keeps
up to date (``HintBoard``: per live request, the latest hints of each MoE layer), which hands each
batch to the residency. Never on the demand path: a missing predictor only leaves the board
empty. ``docs/daemon.md`` shows the flow.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import grpc
from moe.predictor.v1 import predictor_pb2, predictor_pb2_grpc

from expertcache import telemetry
from expertcache.grpc_client import RECONNECT_INITIAL_S, RECONNECT_MAX_S, next_backoff, reconnecting_channel
from expertcache.security import ClientSecurity

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Hint:
    moe_layer: int  # index among the model's MoE layers (manifest order), not a decoder layer
    expert: int
    score: float  # predicted probability of use, in [0, 1]


@dataclass(frozen=True)
class HintBatch:
    request_id: str
    hints: tuple[Hint, ...]
    request_done: bool = False


@dataclass(frozen=True)
class HintStats:
    batches: int  # batches applied
    hints: int  # hints applied
    replaced: int  # (request, layer) hint lists replaced by a newer batch
    dropped: int  # requests forgotten: stale, over max_requests (done ones are not counted)
    requests: int  # requests on the board now
    subscribed: bool  # the current SubscribeHints stream has delivered a batch and is open


class HintBoard:
    """Latest hints per (request, layer); thread-safe (the subscriber writes, the prefetcher reads)."""

    def __init__(
        self,
        *,
        max_requests: int = 1024,
        stale_after_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        on_batch: Callable[[HintBatch], None] | None = None,
    ) -> None:
        """``on_batch`` is called with every batch after it is applied (outside the board's lock,
        on the subscriber's thread): how hints reach the prefetcher as events."""
        if max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {max_requests}")
        self.max_requests = max_requests
        self.stale_after_s = stale_after_s
        self._clock = clock
        self._lock = threading.Lock()
        # request → (last update time, layer → ((expert, score), ...) by descending score);
        # ordered by last update, oldest first.
        self._requests: OrderedDict[str, tuple[float, dict[int, tuple[tuple[int, float], ...]]]] = (
            OrderedDict()
        )
        self._batches = self._hints = self._replaced = self._dropped = 0
        self.subscribed = False
        self._on_batch = on_batch

    def apply(self, batch: HintBatch) -> None:
        self._apply(batch)
        if self._on_batch is not None:
            try:
                self._on_batch(batch)
            except Exception:  # noqa: BLE001 - a consumer bug must not stop the subscription
                logger.exception("hint batch of request %r was not taken by its consumer", batch.request_id)

    def _apply(self, batch: HintBatch) -> None:
        now = self._clock()
        with self._lock:
            self._batches += 1
            self._prune(now)
            if batch.request_done:
                self._requests.pop(batch.request_id, None)
                return
            by_layer: dict[int, list[tuple[int, float]]] = {}
            for hint in batch.hints:
                by_layer.setdefault(hint.moe_layer, []).append((hint.expert, hint.score))
            self._hints += len(batch.hints)
            _, layers = self._requests.pop(batch.request_id, (now, {}))
            for layer, hints in by_layer.items():
                if layer in layers:
                    self._replaced += 1
                layers[layer] = tuple(sorted(hints, key=lambda h: -h[1]))
            self._requests[batch.request_id] = (now, layers)
            while len(self._requests) > self.max_requests:
                self._requests.popitem(last=False)
                self._dropped += 1

    def _prune(self, now: float) -> None:
        """Forget requests quiet for stale_after_s (oldest first; caller holds the lock)."""
        while self._requests:
            request_id, (updated, _) = next(iter(self._requests.items()))
            if now - updated < self.stale_after_s:
                break
            del self._requests[request_id]
            self._dropped += 1

    def snapshot(self) -> dict[str, dict[int, tuple[tuple[int, float], ...]]]:
        """request → MoE layer → ((expert, score), ...) by descending score, stale requests left out."""
        with self._lock:
            self._prune(self._clock())
            return {rid: dict(layers) for rid, (_, layers) in self._requests.items()}

    def stats(self) -> HintStats:
        with self._lock:
            return HintStats(
                batches=self._batches,
                hints=self._hints,
                replaced=self._replaced,
                dropped=self._dropped,
                requests=len(self._requests),
                subscribed=self.subscribed,
            )


def batch_from_pb(pb: predictor_pb2.HintBatch) -> HintBatch:
    return HintBatch(
        request_id=pb.request_id,
        hints=tuple(Hint(h.moe_layer, h.expert, h.score) for h in pb.hints),
        request_done=pb.request_done,
    )


class HintSubscriber:
    """Keeps one SubscribeHints stream open (reconnecting with backoff) and feeds ``board``."""

    def __init__(
        self,
        address: str,
        model_id: str,
        pod: str,
        board: HintBoard,
        *,
        shape: tuple[int, int, int] | None = None,
        security: ClientSecurity | None = None,
    ) -> None:
        """``shape`` (MoE layers, experts, top_k): registered with RegisterModel before each
        stream (the predictor serves only registered models); None: the predictor must know the
        model already (configured, or registered by compute)."""
        self.address = address
        self.model_id = model_id
        self.shape = shape
        self.pod = pod
        self.board = board
        self.outages = 0
        self.streams = 0  # streams opened (1 + reconnects)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._call: grpc.Future | None = None
        self._channel = reconnecting_channel(address, security)
        self._stub = predictor_pb2_grpc.PredictorStub(self._channel)
        self._thread = threading.Thread(target=self._run, name="hint-subscriber", daemon=True)
        self._thread.start()

    def _apply_traced(self, pb: predictor_pb2.HintBatch) -> None:
        """An ``apply_hints`` span under the predictor's publish_hints (HintBatch.trace_context),
        which is in the trace of the request that caused the hints; linked to it too."""
        with telemetry.span_from_message(
            "apply_hints",
            pb.trace_context,
            telemetry.SpanKind.CONSUMER,
            {
                "expertcache.request_id": pb.request_id,
                "expertcache.token_index": pb.token_index,
                "expertcache.hints": len(pb.hints),
                "expertcache.request_done": pb.request_done,
            },
        ):
            self.board.apply(batch_from_pb(pb))

    def _run(self) -> None:
        backoff = RECONNECT_INITIAL_S
        healthy = True  # the last stream worked: the next failure starts an outage (logged once)
        while not self._stop.is_set():
            request = predictor_pb2.SubscribeHintsRequest(model_id=self.model_id, pod=self.pod)
            try:
                self._register()
                call = self._stub.SubscribeHints(request, wait_for_ready=True, timeout=None)
            except grpc.RpcError as exc:  # the registration failed: retried like a lost stream
                call = None
                reason = f"{exc.code().name}: {exc.details()}"
            if call is None:
                if healthy:
                    self.outages += 1
                    logger.warning(
                        "predictor %s: %s; the daemon serves without hints, retrying", self.address, reason
                    )
                    healthy = False
                self._stop.wait(backoff)
                backoff = next_backoff(backoff)
                continue
            with self._lock:
                if self._stop.is_set():
                    call.cancel()
                    return
                self._call = call
            try:
                batches: Iterable[predictor_pb2.HintBatch] = call
                for pb in batches:
                    if not self.board.subscribed:
                        self.board.subscribed = True
                        self.streams += 1
                        if not healthy:
                            logger.info("predictor %s: hint stream restored", self.address)
                        healthy = True
                        backoff = RECONNECT_INITIAL_S
                    if telemetry.ENABLED and pb.trace_context:
                        self._apply_traced(pb)
                    else:
                        self.board.apply(batch_from_pb(pb))
                reason = "stream ended"
            except grpc.RpcError as exc:
                if self._stop.is_set():
                    return
                reason = f"{exc.code().name}: {exc.details()}"
            self.board.subscribed = False
            if healthy:
                self.outages += 1
                logger.warning(
                    "predictor %s: hint stream lost (%s); the daemon serves without hints, retrying",
                    self.address,
                    reason,
                )
                healthy = False
            self._stop.wait(backoff)
            backoff = next_backoff(backoff)

    def _register(self) -> None:
        """RegisterModel; RpcError when the predictor is unreachable or refuses (the caller retries)."""
        if self.shape is None:
            return
        layers, experts, top_k = self.shape
        request = predictor_pb2.RegisterModelRequest(
            model_id=self.model_id, num_moe_layers=layers, num_experts=experts, top_k=top_k
        )
        try:
            self._stub.RegisterModel(request, timeout=10)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNIMPLEMENTED:  # UNIMPLEMENTED: a predictor without a registry
                raise

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            if self._call is not None:
                self._call.cancel()
        self._thread.join(RECONNECT_MAX_S + 1)
        self._channel.close()
