"""Hint subscribers: who follows which (model, pod), what each has not read yet, and how a
prediction becomes hints (``top_hints``).

Each stream's unsent hints are coalesced per (request, layer) and bounded: a slow subscriber loses
its oldest ones (counted), it never slows Observe (docs/predictor.md).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from predictor_svc.config import PredictorConfig
from predictor_svc.errors import LimitReached
from predictor_svc.metrics import PredictorMetrics

logger = logging.getLogger(__name__)

HINT_SOURCE = "combined"  # the request's own history mixed with the EAMC match (predict.py)
# Memory of unsent hints, as the subscriber queue bound counts it: per hint (a slotted
# PredictedExpert, its float, its tuple slot) and per (request, layer) entry.
HINT_BYTES = 96
LAYER_BYTES = 128


@dataclass(frozen=True, slots=True)
class PredictedExpert:
    """One hint: ``expert`` of MoE layer ``moe_layer`` is predicted with ``score`` in [0, 1]."""

    moe_layer: int  # index among the model's MoE layers
    expert: int
    score: float


@dataclass(frozen=True)
class PublishedHints:
    """Hints for some layers of one request: each layer's hints replace earlier ones for it."""

    request_id: str
    token_index: int
    hints: tuple[PredictedExpert, ...]
    request_done: bool = False
    trace_context: Mapping[str, str] = field(default_factory=dict)  # W3C: the span that published it
    nonce: str = ""  # the request's Activation.request_nonce


def _layer_bytes(hints: tuple[PredictedExpert, ...]) -> int:
    return LAYER_BYTES + HINT_BYTES * len(hints)


@dataclass
class _Pending:
    token_index: int
    layers: dict[int, tuple[PredictedExpert, ...]] = field(default_factory=dict)
    done: bool = False
    nbytes: int = LAYER_BYTES
    trace_context: Mapping[str, str] = field(default_factory=dict)


class Subscription:
    """One SubscribeHints stream: a bounded, coalescing queue of unsent hints.

    Unsent hints are kept per request and layer; a newer offer for a (request, layer) replaces
    the older one (counted as replaced). At most ``max_requests`` requests are pending: offering
    for one more drops the oldest request's unsent hints (counted as dropped), and so does going
    beyond ``max_bytes`` of unsent hints (0 = no byte bound; the newest request is always kept).
    ``offer`` never blocks on the reader, so a slow subscriber never slows Observe.
    """

    def __init__(
        self,
        model_id: str,
        pod: str,
        max_requests: int,
        metrics: PredictorMetrics,
        on_close: Callable[[Subscription], None] | None = None,
        max_bytes: int = 0,
    ) -> None:
        self.model_id = model_id
        self.pod = pod
        self._max_requests = max_requests
        self._max_bytes = max_bytes
        self._bytes = 0  # estimated bytes of the unsent hints (HINT_BYTES, LAYER_BYTES)
        self._metrics = metrics
        self._on_close = on_close
        self._cond = threading.Condition()
        self._pending: OrderedDict[tuple[str, str], _Pending] = OrderedDict()  # (request_id, nonce)
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def pending_requests(self) -> int:
        with self._cond:
            return len(self._pending)

    def pending_bytes(self) -> int:
        with self._cond:
            return self._bytes

    def _drop_oldest(self) -> None:
        _old_id, old = self._pending.popitem(last=False)
        self._bytes -= old.nbytes
        self._metrics.hints_dropped.inc(len(old.layers))

    def _slot(self, request: tuple[str, str], token_index: int) -> _Pending:
        pending = self._pending.get(request)
        if pending is None:
            if len(self._pending) >= self._max_requests:
                self._drop_oldest()
            pending = self._pending[request] = _Pending(token_index)
            self._bytes += pending.nbytes
        return pending

    def _trim(self, keep: _Pending) -> None:
        """Drop the oldest requests' unsent hints while beyond ``max_bytes`` (never ``keep``)."""
        while self._max_bytes and self._bytes > self._max_bytes and len(self._pending) > 1:
            if next(iter(self._pending.values())) is keep:
                self._pending.move_to_end(next(iter(self._pending)))
                continue
            self._drop_oldest()

    def offer(
        self,
        request_id: str,
        token_index: int,
        layers: dict[int, tuple[PredictedExpert, ...]],
        trace_context: Mapping[str, str] | None = None,
        nonce: str = "",
    ) -> None:
        """Queue ``layers`` (layer → hints, best first) of ``request_id`` (the run ``nonce``),
        replacing unsent ones. ``trace_context`` (the publishing span's, when traced) goes out
        with the batch."""
        with self._cond:
            if self._closed:
                return
            pending = self._slot((request_id, nonce), token_index)
            replaced = 0
            for layer, hints in layers.items():
                old = pending.layers.get(layer)
                if old is not None:
                    replaced += 1
                    pending.nbytes -= _layer_bytes(old)
                    self._bytes -= _layer_bytes(old)
                pending.nbytes += _layer_bytes(hints)
                self._bytes += _layer_bytes(hints)
            if replaced:
                self._metrics.hints_replaced.inc(replaced)
            pending.layers.update(layers)
            pending.token_index = max(pending.token_index, token_index)
            if trace_context:
                pending.trace_context = trace_context
            self._trim(pending)
            self._cond.notify()

    def offer_done(self, request_id: str, token_index: int, nonce: str = "") -> None:
        """The request ended: its unsent hints are moot; send a done marker instead."""
        with self._cond:
            if self._closed:
                return
            pending = self._slot((request_id, nonce), token_index)
            if pending.layers:
                self._metrics.hints_replaced.inc(len(pending.layers))
                pending.layers.clear()
                self._bytes -= pending.nbytes - LAYER_BYTES
                pending.nbytes = LAYER_BYTES
            pending.done = True
            pending.token_index = max(pending.token_index, token_index)
            self._cond.notify()

    def get(self, timeout_s: float | None = None) -> PublishedHints | None:
        """The oldest request's unsent hints as one batch; None on timeout or once closed."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._pending or self._closed, timeout_s):
                return None
            if self._closed:
                return None
            (request_id, nonce), pending = self._pending.popitem(last=False)
            self._bytes -= pending.nbytes
        hints = tuple(h for layer in sorted(pending.layers) for h in pending.layers[layer])
        self._metrics.hint_batches.inc()
        return PublishedHints(
            request_id, pending.token_index, hints, pending.done, pending.trace_context, nonce
        )

    def close(self) -> None:
        """Idempotent; wakes a reader blocked in ``get``."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._pending.clear()
            self._bytes = 0
            self._cond.notify_all()
        if self._on_close is not None:
            self._on_close(self)


class Subscriptions:
    """The open subscriptions by the (model, pod) they follow; thread-safe.

    Its config is the one at start: ``max_subscribers``, ``subscriber_queue_requests`` and
    ``subscriber_queue_bytes`` are restart-only fields.
    """

    def __init__(self, config: PredictorConfig, metrics: PredictorMetrics) -> None:
        self._config = config
        self._metrics = metrics
        self._lock = threading.Lock()
        self._subs: dict[tuple[str, str], list[Subscription]] = {}

    def open(self, model_id: str, pod: str) -> Subscription:
        """A new subscription to ``model_id``'s requests served by ``pod``; LimitReached beyond
        ``max_subscribers``. The caller checked the model is registered."""
        cfg = self._config
        sub = Subscription(
            model_id,
            pod,
            cfg.subscriber_queue_requests,
            self._metrics,
            self._remove,
            cfg.subscriber_queue_bytes,
        )
        with self._lock:
            open_subs = self._count()
            if open_subs >= cfg.max_subscribers:
                self._metrics.refused.labels("max_subscribers").inc()
                raise LimitReached(
                    f"{open_subs} hint subscribers are open, the limit max_subscribers="
                    f"{cfg.max_subscribers}: subscription to model {model_id!r} refused"
                )
            self._subs.setdefault((model_id, pod), []).append(sub)
        logger.info("hint subscriber for model %r pod %r", model_id, pod)
        return sub

    def _remove(self, sub: Subscription) -> None:
        with self._lock:
            subs = self._subs.get((sub.model_id, sub.pod), [])
            if sub in subs:
                subs.remove(sub)
            if not subs:
                self._subs.pop((sub.model_id, sub.pod), None)

    def following(self, model_id: str, pod: str) -> list[Subscription]:
        """The subscriptions that want hints of ``model_id``'s requests on ``pod`` (maybe none)."""
        with self._lock:
            return list(self._subs.get((model_id, pod), ()))

    def end_request(self, model_id: str, pod: str, request_id: str, token_index: int, nonce: str) -> None:
        """The request ended: every follower gets its done marker instead of its unsent hints."""
        for sub in self.following(model_id, pod):
            sub.offer_done(request_id, token_index, nonce)

    def count(self) -> int:
        with self._lock:
            return self._count()

    def _count(self) -> int:
        return sum(len(group) for group in self._subs.values())

    def close_all(self) -> None:
        """End every stream (shutdown): their readers wake with nothing more to send."""
        with self._lock:
            subs = [s for group in self._subs.values() for s in group]
        for sub in subs:
            sub.close()


def top_hints(scores: np.ndarray, top_n: int, min_score: float) -> dict[int, tuple[PredictedExpert, ...]]:
    """Per layer, the ``top_n`` highest-scoring experts with score >= ``min_score`` (and > 0), best first.

    ``scores``: float32 [L, E] in [0, 1]. Every layer appears (possibly with no hints), so an
    empty tuple replaces stale hints for a layer the prediction no longer supports.
    """
    layers, experts = scores.shape
    n = min(top_n, experts)
    # argpartition then a sort of only n columns per layer: O(L·E) instead of a full sort.
    part = (
        np.argpartition(-scores, n - 1, axis=1)[:, :n]
        if n < experts
        else np.tile(np.arange(experts), (layers, 1))
    )
    part_scores = np.take_along_axis(scores, part, axis=1)
    order = np.argsort(-part_scores, axis=1, kind="stable")
    best = np.take_along_axis(part, order, axis=1)
    best_scores = np.take_along_axis(part_scores, order, axis=1)
    out: dict[int, tuple[PredictedExpert, ...]] = {}
    for layer in range(layers):
        out[layer] = tuple(
            PredictedExpert(layer, int(e), float(s))
            for e, s in zip(best[layer], best_scores[layer], strict=True)
            if s >= min_score and s > 0.0  # a zero score predicts nothing
        )
    return out
