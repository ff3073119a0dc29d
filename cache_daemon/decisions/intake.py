"""Incoming prediction signals: compute's Route and LayerAhead, the predictor's hint batches. Each
message is checked against the store's shape outside any lock (``InvalidArgument``, nothing
applied), then applied to the ``ActivationSignals`` under the caller's lock, and the prefetch
worker is woken once per batch (``docs/daemon.md``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from threading import Condition
from typing import TYPE_CHECKING

import numpy as np

from cache_daemon.decisions.signals import ActivationSignals, LayerPrediction
from expertcache.errors import InvalidArgument
from expertcache.layers import LayerMap

if TYPE_CHECKING:  # the board's module also holds the gRPC subscriber, which domain code never imports
    from prometheus_client import Counter

    from cache_daemon.hints import HintBatch


@dataclass(frozen=True, eq=False)
class RouteSignal:
    """A checked Route (``SignalIntake.check_route``): layer ``layer`` of token ``token`` was
    routed to ``experts`` (unique, sorted)."""

    request_id: str | None
    token: int
    layer: int
    experts: np.ndarray
    arrived: float = field(default_factory=lambda: time.monotonic())  # when it was checked


@dataclass(frozen=True, eq=False)
class LookaheadSignal:
    """A checked LayerAhead (``SignalIntake.check_layer_ahead``): one prediction per depth."""

    token: int
    predictions: tuple[LayerPrediction, ...]
    request_id: str | None
    arrived: float = field(default_factory=lambda: time.monotonic())  # when it was checked


class SignalIntake:
    """Checks incoming signals against the store and applies them to ``signals``.

    ``layers``: the store's layers (a signal for another is refused), its experts those of
    ``signals``. ``lock`` is the one that guards ``signals`` (the residency's); ``on_change`` runs
    under it after every applied batch (wakes the prefetch worker; given ``asked_at``, the arrival
    of the batch's first signal where it held compute's signals, else None); ``counter`` counts the
    signals applied by kind (``moe_cache_signals_total``)."""

    def __init__(
        self,
        signals: ActivationSignals,
        layers: LayerMap,
        lock: Condition,
        on_change: Callable[..., None],
        counter: Counter,
    ) -> None:
        self.signals = signals
        self._layers = layers
        self._num_experts = signals.num_experts
        self._lock = lock
        self._on_change = on_change
        self._counter = counter
        # Bound once: one of them counts every route and every lookahead (``labels()`` takes a
        # lock and a lookup at each call).
        self._routes = counter.labels("route")
        self._lookaheads = counter.labels("layer_ahead")
        self.hints_dropped = 0  # predictor hints naming no live request or no MoE layer

    # -- checks (no lock) --------------------------------------------------------------------------
    def check_route(self, request_id: str, token: int, layer: int, experts: Iterable[int]) -> RouteSignal:
        """A Route checked against the store (``InvalidArgument`` naming the value), to apply."""
        ex = self._check_prediction("Route", layer, experts)
        return RouteSignal(request_id or None, int(token), int(layer), ex)

    def check_layer_ahead(
        self, token: int, predictions: Iterable[LayerPrediction], request_id: str | None = None
    ) -> LookaheadSignal:
        """A LayerAhead checked against the store (``InvalidArgument`` naming the value), to apply."""
        checked = []
        depths: set[int] = set()
        for pred in predictions:
            what = f"LayerAhead prediction at depth {pred.depth}"
            if not 1 <= int(pred.depth) <= self._layers.num_moe:
                raise InvalidArgument(
                    f"LayerAhead depth {pred.depth} is outside 1..{self._layers.num_moe} (the store's MoE layers)"
                )
            if int(pred.depth) in depths:
                raise InvalidArgument(f"LayerAhead names depth {pred.depth} twice")
            depths.add(int(pred.depth))
            ex = self._check_prediction(what, pred.layer, pred.experts, unique=False)
            scores = pred.scores
            if not isinstance(scores, np.ndarray):
                scores = list(scores)
            sc = np.asarray(scores, dtype=np.float32)
            if sc.shape != ex.shape:
                raise InvalidArgument(
                    f"{what} for layer {pred.layer} has {ex.size} experts but {sc.size} scores: they must pair up"
                )
            if not np.isfinite(sc).all():
                raise InvalidArgument(f"{what} scores must be finite probabilities, got {sc.tolist()}")
            # Router outputs are probabilities up to rounding (and bias-corrected scores may stray):
            # a prediction is a hint, so clamp rather than fail compute's stream over it.
            checked.append(LayerPrediction(int(pred.layer), int(pred.depth), ex, np.clip(sc, 0.0, 1.0)))
        return LookaheadSignal(int(token), tuple(checked), request_id)

    def _check_prediction(
        self, what: str, layer: int, experts: Iterable[int], *, unique: bool = True
    ) -> np.ndarray:
        layer = int(layer)
        if not self._layers.is_moe(layer):
            raise InvalidArgument(
                f"{what} names layer {layer}, which is not a MoE layer of the store "
                f"(MoE layers: {list(self._layers.moe_layers)})"
            )
        # A few experts a layer: Python's ints, min, max and set beat numpy's calls here (a route
        # and a lookahead are checked at every layer of every token).
        if isinstance(experts, np.ndarray) and experts.ndim == 1 and experts.dtype.kind in "iu":
            listed = experts.tolist()  # the shared-memory channel's records
        else:
            listed = [int(e) for e in experts]
        if listed and (min(listed) < 0 or max(listed) >= self._num_experts):
            bad = next(e for e in listed if e < 0 or e >= self._num_experts)
            raise InvalidArgument(
                f"{what} for layer {layer} names expert {bad}; the store has experts 0..{self._num_experts - 1}"
            )
        distinct = set(listed)
        if unique:
            return np.array(sorted(distinct), np.int64)
        if len(distinct) != len(listed):
            raise InvalidArgument(f"{what} for layer {layer} names an expert twice: {listed}")
        return np.array(listed, np.int64)

    # -- applying (each takes the lock; the *_locked halves run under the caller's hold) ------------
    def observe(self, request_id: str, token: int, layer: int, experts: Iterable[int]) -> None:
        """Decoder layer ``layer`` of token ``token`` was routed to ``experts`` (hits included).
        ``InvalidArgument`` naming the value if the layer or an expert is not in the store."""
        self.apply([self.check_route(request_id, token, layer, experts)])

    def layer_ahead(
        self, token: int, predictions: Iterable[LayerPrediction], request_id: str | None = None
    ) -> None:
        """Compute's lookahead for token ``token`` of ``request_id`` (None: the request last
        routed): one prediction per depth, layers as in Acquire. ``InvalidArgument`` naming the
        value for a malformed one (nothing applied)."""
        self.apply([self.check_layer_ahead(token, predictions, request_id)])

    def begin_request(self, request_id: str) -> None:
        with self._lock:
            self.signals.begin_request(request_id)
            self._on_change()
        self._counter.labels("request_begin").inc()

    def end_request(self, request_id: str) -> None:
        with self._lock:
            self.signals.end_request(request_id)
            self._on_change()
        self._counter.labels("request_end").inc()

    def apply(self, signals: Iterable[RouteSignal | LookaheadSignal]) -> None:
        """Apply checked signals in order and wake the prefetcher once."""
        with self._lock:
            self.apply_locked(signals)

    def apply_locked(self, signals: Iterable[RouteSignal | LookaheadSignal], kick: bool = True) -> None:
        applied = False
        first = None  # the first signal's arrival
        for sig in signals:
            first = sig.arrived if first is None else min(first, sig.arrived)
            if isinstance(sig, RouteSignal):
                self.signals.observe(sig.layer, sig.experts, sig.token, sig.request_id)
                self._routes.inc()
            else:
                self.signals.set_lookahead(list(sig.predictions), sig.token, sig.request_id)
                self._lookaheads.inc()
            applied = True
        if applied and kick:
            self._on_change(asked_at=first)

    def apply_ops(self, ops: Iterable[tuple[str, object]]) -> None:
        """A client channel's drained records, in order, in one hold of the lock: ``("begin",
        request_id)``, ``("end", request_id)``, ``("signal", RouteSignal | LookaheadSignal)``."""
        with self._lock:
            self.apply_ops_locked(ops)

    def apply_ops_locked(self, ops: Iterable[tuple[str, object]]) -> None:
        """Under the lock: the prefetch worker's kick takes effect once the lock is released."""
        counts: dict[str, int] = {}
        applied = False
        first = None  # the first signal's arrival
        for op, value in ops:
            applied = True
            if op == "signal":
                arrived = value.arrived  # type: ignore[attr-defined]
                first = arrived if first is None else min(first, arrived)
            if op == "begin":
                self.signals.begin_request(value)  # type: ignore[arg-type]
                kind = "request_begin"
            elif op == "end":
                self.signals.end_request(value)  # type: ignore[arg-type]
                kind = "request_end"
            else:
                self.apply_locked((value,), kick=False)  # type: ignore[arg-type]
                continue
            counts[kind] = counts.get(kind, 0) + 1
        if applied:
            self._on_change(asked_at=first)
        for kind, n in counts.items():
            self._counter.labels(kind).inc(n)

    def apply_hints(self, batch: HintBatch) -> None:
        """A predictor hint batch (pushed by the hint board as it arrives): the request's hints,
        MoE layers translated to decoder layers, reach the signals and wake the prefetcher. Hints
        for a request that is not live here, or naming no MoE layer of the store, are dropped."""
        if batch.request_done:
            return
        layers = self._layers
        hints = []
        named: set[int] = set()
        dropped = 0
        for hint in batch.hints:
            if not 0 <= hint.moe_layer < layers.num_moe or not 0 <= hint.expert < self._num_experts:
                dropped += 1
                continue
            layer = layers.decoder(hint.moe_layer)
            named.add(layer)
            hints.append((layer, int(hint.expert), float(hint.score)))
        with self._lock:
            if batch.request_id not in self.signals.live_requests:
                self.hints_dropped += len(batch.hints)
                return
            self.hints_dropped += dropped
            self.signals.set_hints(hints, layers=named, request_id=batch.request_id)
            self._on_change()


__all__ = ["LookaheadSignal", "RouteSignal", "SignalIntake"]
