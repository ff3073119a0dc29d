"""The predictor's domain: live requests and their hints (no gRPC here), and the wiring of its parts.

``PredictorService`` holds the model catalog, the hint subscriptions and the insert queue and is the
only entry the server uses; Observe validates against the registered shape and never waits on the
store. Its design and decisions: docs/predictor.md.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from expertcache import prom, telemetry
from expertcache.live_config import live_changes
from predictor_svc.catalog import Model, ModelCatalog, ModelStats
from predictor_svc.config import PredictorConfig
from predictor_svc.eam import EamShape
from predictor_svc.errors import (
    BadActivation,
    LimitReached,
    ModelNotRegistered,
    PredictorStopping,
    RequestEnded,
)
from predictor_svc.inserts import InsertQueue
from predictor_svc.metrics import GaugeStats, PredictorMetrics
from predictor_svc.predict import PredictionConfig, RequestPredictor
from predictor_svc.store.base import EamcStore
from predictor_svc.subscriptions import HINT_SOURCE, Subscription, Subscriptions, top_hints

logger = logging.getLogger(__name__)

REFUSAL_LOG_INTERVAL_S = 1.0  # refused requests are logged at most this often (the rest counted)
# Live state per (layer, expert) cell of a request: its EAM (uint32), its history (float32) and
# up to three cached score maps (float32) of RequestPredictor; plus a fixed overhead.
LIVE_BYTES_PER_CELL = 20
LIVE_BYTES_FIXED = 2048


def live_request_bytes(shape: EamShape) -> int:
    """Bytes one live request of ``shape`` may hold (what the live-byte limits count)."""
    return LIVE_BYTES_FIXED + LIVE_BYTES_PER_CELL * shape.cells


# -- domain types ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Activation:
    """One token's routing of one request (the wire ``Activation``, converted at the edge).

    ``experts``: flat ``[layers * top_k]`` ints, ``experts[l * top_k + j]`` = j-th expert of MoE
    layer l (an index among the model's MoE layers, as everywhere in the predictor).
    """

    request_id: str
    model_id: str
    pod: str
    token_index: int
    experts: Sequence[int]
    top_k: int
    request_done: bool = False
    num_moe_layers: int = 0
    num_experts: int = 0
    client: str = ""  # who sent it (server.client_of): the key of the per-client limits
    trace_context: Mapping[str, str] = field(default_factory=dict)  # W3C, of the request's trace
    nonce: str = ""  # the reporter's per-run nonce (Activation.request_nonce)

    @property
    def key(self) -> RequestKey:
        """What the predictor keys the request by: nothing a client chooses alone. The caller
        (peer or certificate), the pod and the nonce make a client's request_id its own: another
        client's, or a retry's, same request_id is another request."""
        return RequestKey(self.model_id, self.client, self.pod, self.request_id, self.nonce)


class RequestKey(NamedTuple):
    model_id: str
    client: str
    pod: str
    request_id: str
    nonce: str


@dataclass(frozen=True)
class ServiceStats:
    eamc_entries: int
    live_requests: int
    queries: int
    mean_match_s: float
    store_kind: str
    store_errors: int
    observed_tokens: int
    requests_done: int
    entries_inserted: int
    inserts_pending: int
    inserts_dropped: int
    requests_expired: int
    hint_batches_published: int
    hints_replaced: int
    hints_dropped: int
    subscribers: int
    store_degraded: bool
    models: tuple[ModelStats, ...] = ()
    live_bytes: int = 0
    eamc_bytes: int = 0
    eamc_reserved_bytes: int = 0
    pending_insert_bytes: int = 0
    refused: dict[str, int] = field(default_factory=dict)


def routing_of(a: Activation, shape: EamShape, refuse: Callable[[str], None]) -> np.ndarray:
    """The routing of ``a`` as int64 [L, K] of the registered ``shape``; BadActivation naming
    the field otherwise (its reason counted through ``refuse``). Sizes are checked before
    anything is converted or allocated."""
    m, r = a.model_id, a.request_id
    for name, value, registered in (
        ("top_k", a.top_k, shape.top_k),
        ("num_moe_layers", a.num_moe_layers, shape.layers),
        ("num_experts", a.num_experts, shape.experts),
    ):
        if value and value != registered:
            refuse("bad_shape")
            raise BadActivation(
                f"Activation.{name} = {value} but model {m!r} is registered with {name}={registered} "
                f"(request {r!r})"
            )
    n, expected = len(a.experts), shape.layers * shape.top_k
    if n != expected:
        refuse("bad_shape")
        raise BadActivation(
            f"Activation.experts has {n} entries but model {m!r} is registered with {shape.layers} "
            f"layers x top_k={shape.top_k} = {expected} (request {r!r})"
        )
    experts = np.asarray(a.experts, dtype=np.int64).reshape(shape.layers, shape.top_k)
    if int(experts.max()) >= shape.experts:
        flat = int(np.argmax(experts.reshape(-1) >= shape.experts))
        refuse("out_of_range")
        raise BadActivation(
            f"Activation.experts[{flat}] = {int(experts.reshape(-1)[flat])} is out of range: model "
            f"{m!r} has {shape.experts} experts (request {r!r})"
        )
    return experts


# -- live requests ---------------------------------------------------------------------------
class _LiveRequest:
    def __init__(
        self,
        model: Model,
        key: RequestKey,
        predictor: RequestPredictor,
        now: float,
    ) -> None:
        self.model = model
        self.key = key
        self.request_id = key.request_id
        self.nonce = key.nonce
        self.pod = key.pod
        self.client = key.client
        self.nbytes = live_request_bytes(model.shape)
        self.predictor = predictor  # holds the request's EAM (uint32 [L, E]) and token count
        self.last_token_index = -1
        self.last_seen = now
        self.lock = threading.Lock()


# -- the service -----------------------------------------------------------------------------
class PredictorService:
    """Live EAMs, the EAMC per model, hint subscribers. Thread-safe; design in docs/predictor.md."""

    def __init__(
        self,
        config: PredictorConfig,
        store: EamcStore,
        *,
        metrics: PredictorMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        background: bool = True,
    ) -> None:
        self.config = config
        self.metrics = metrics or PredictorMetrics()
        store.time_round_trips(
            lambda op, seconds: self.metrics.store_round_trip.labels(op=op).observe(seconds)
        )
        self._clock = clock
        self._prediction_config = _prediction_config(config)
        self._lock = threading.Lock()  # live requests, per-client usage, ended requests
        self._live: OrderedDict[RequestKey, _LiveRequest] = OrderedDict()  # LRU order
        # Requests whose reporting a refusal ended: their messages are ignored until their
        # request_done (bounded like the live requests; the oldest mark is forgotten first).
        self._ended: OrderedDict[RequestKey, None] = OrderedDict()
        self._refusal_logged_at = float("-inf")
        self._refusals_unlogged = 0
        self._live_bytes = 0
        self._clients: dict[str, list[int]] = {}  # client -> [live requests, live bytes]
        self._closed = False
        self.catalog = ModelCatalog(config, store, self.metrics)
        self.subscriptions = Subscriptions(config, self.metrics)
        self.inserts = InsertQueue(config, self.catalog, self.metrics, clock, self.expire)
        self.inserts.sync_catalog()  # the store down: degraded, the background thread retries
        if background:
            self.inserts.start()
        else:
            self.inserts.mark_loaded()  # nothing loads behind the caller's back: it syncs when it wants

    @property
    def loaded(self) -> threading.Event:
        """Set once every model's EAMC was loaded from the store (or the store found down): the
        predictor is ready (health SERVING) only then, not while it predicts from nothing."""
        return self.inserts.loaded

    # -- Observe ---------------------------------------------------------------------------
    def observe(self, activation: Activation) -> bool:
        """Apply one token's routing; True when it ended its request.

        Raises BadActivation naming the field; nothing is changed then.
        """
        if self._closed:
            raise PredictorStopping("the predictor is shutting down")
        a = activation
        if not a.request_id:
            raise BadActivation("Activation.request_id is empty")
        if not a.model_id:
            raise BadActivation(f"Activation.model_id is empty (request {a.request_id!r})")
        key = a.key
        with self._lock:
            if key in self._ended:
                if a.request_done:
                    del self._ended[key]
                self._refuse("after_refusal")
                raise RequestEnded(
                    f"request {a.request_id!r} of model {a.model_id!r} was refused earlier: its messages are "
                    "ignored until its request_done"
                )
        model = self.catalog.get(a.model_id)
        if model is None:
            self._refuse("unregistered_model")
            raise ModelNotRegistered(
                f"Activation.model_id {a.model_id!r} is not registered (request {a.request_id!r}): "
                "call RegisterModel first (or configure model_shapes)"
            )
        experts = None
        if len(a.experts) or not a.request_done:
            experts = routing_of(a, model.shape, self._refuse)  # int64 [L, K]
        now = self._clock()
        with self._lock:
            live = self._live.get(key)
            if live is not None:
                self._live.move_to_end(key)  # LRU order: max_live_requests drops the quietest
        if experts is None:  # request_done with no routing
            if live is not None:
                with live.lock:
                    self._check_index(a, live)
                    live.last_token_index = max(live.last_token_index, a.token_index)
                self._finish(live, a.token_index)
            self.metrics.observed_tokens.inc()
            return True
        if live is None:
            live = self._open_request(model, a, now)
        with live.lock:
            self._check_index(a, live)
            live.predictor.observe(experts)  # counts the token into its EAM
            live.last_token_index = a.token_index
            live.last_seen = now
        self.metrics.observed_tokens.inc()
        if not a.request_done:
            self._publish(live, a.token_index, a.trace_context)
            return False
        self._finish(live, a.token_index)
        return True

    def _check_index(self, a: Activation, live: _LiveRequest) -> None:
        if a.token_index <= live.last_token_index and not (
            a.request_done and not len(a.experts) and a.token_index == live.last_token_index
        ):
            self._refuse("token_index")
            raise BadActivation(
                f"Activation.token_index = {a.token_index} does not follow the last token index "
                f"{live.last_token_index} of request {a.request_id!r} (must increase)"
            )

    def _admit(self, client: str, nbytes: int, a: Activation) -> None:
        """Raise LimitReached when ``client`` may not open one more live request (holds _lock)."""
        count, held = self._clients.get(client, (0, 0))
        cfg = self.config
        who = f"client {client!r}" if client else "this client"
        if count >= cfg.max_client_live_requests:
            self._refuse("client_live_requests")
            raise LimitReached(
                f"{who} already has {count} live requests, the limit max_client_live_requests="
                f"{cfg.max_client_live_requests}: request {a.request_id!r} of model {a.model_id!r} refused "
                "(finish requests with request_done)"
            )
        if held + nbytes > cfg.max_client_live_bytes:
            self._refuse("client_live_bytes")
            raise LimitReached(
                f"{who} holds {held} bytes of live requests; request {a.request_id!r} of model "
                f"{a.model_id!r} needs {nbytes} more, beyond max_client_live_bytes={cfg.max_client_live_bytes}"
            )
        if nbytes > cfg.max_live_bytes:
            self._refuse("client_live_bytes")
            raise LimitReached(
                f"request {a.request_id!r} of model {a.model_id!r} needs {nbytes} bytes of live state, "
                f"beyond max_live_bytes={cfg.max_live_bytes}"
            )

    def _open_request(self, model: Model, a: Activation, now: float) -> _LiveRequest:
        nbytes = live_request_bytes(model.shape)
        key = a.key
        with self._lock:  # refuse before allocating anything
            if key not in self._live:
                self._admit(a.client, nbytes, a)
        predictor = RequestPredictor(model.eamc, model.shape, self._prediction_config)
        live = _LiveRequest(model, key, predictor, now)
        evicted: list[_LiveRequest] = []
        with self._lock:
            existing = self._live.get(key)
            if existing is not None:  # another stream opened it meanwhile
                return existing
            self._admit(a.client, nbytes, a)  # again: other streams of the client meanwhile
            self._add_live(live)
            while (
                len(self._live) > self.config.max_live_requests
                or self._live_bytes > self.config.max_live_bytes
            ):
                _key, old = self._live.popitem(last=False)
                self._forget_live(old)
                evicted.append(old)
        for old in evicted:
            self.metrics.requests_expired.inc()
            logger.warning(
                "dropping live request %r of model %r: more than max_live_requests=%d or max_live_bytes=%d "
                "live (EAM not inserted)",
                old.request_id,
                old.model.model_id,
                self.config.max_live_requests,
                self.config.max_live_bytes,
            )
        return live

    def _add_live(self, live: _LiveRequest) -> None:
        """Track ``live`` and its bytes (holds _lock)."""
        self._live[live.key] = live
        self._live_bytes += live.nbytes
        usage = self._clients.setdefault(live.client, [0, 0])
        usage[0] += 1
        usage[1] += live.nbytes

    def _forget_live(self, live: _LiveRequest) -> None:
        """Release the accounting of ``live``, already removed from ``_live`` (holds _lock)."""
        self._live_bytes -= live.nbytes
        usage = self._clients.get(live.client)
        if usage is not None:
            usage[0] -= 1
            usage[1] -= live.nbytes
            if usage[0] <= 0:
                del self._clients[live.client]

    def _refuse(self, reason: str) -> None:
        self.metrics.refused.labels(reason).inc()

    def end_refused(self, a: Activation, why: BaseException) -> None:
        """``a`` was refused (``why``): its request's reporting ends here, not its stream's. Its
        live state is dropped (its EAM not inserted), its subscribers get a done marker, and its
        further messages are ignored (RequestEnded) until its request_done."""
        key = a.key
        with self._lock:
            live = self._live.pop(key, None)
            if live is not None:
                self._forget_live(live)
                self.subscriptions.end_request(
                    a.model_id, a.pod, a.request_id, max(live.last_token_index, 0), a.nonce
                )
            if not a.request_done:
                self._ended[key] = None
                self._ended.move_to_end(key)
                while len(self._ended) > self.config.max_live_requests:
                    self._ended.popitem(last=False)
            now = self._clock()
            if now - self._refusal_logged_at < REFUSAL_LOG_INTERVAL_S:
                self._refusals_unlogged += 1
                return
            self._refusal_logged_at, unlogged, self._refusals_unlogged = now, self._refusals_unlogged, 0
        logger.warning(
            "request %r of model %r from %s refused, its reporting ends (other requests go on): %s%s",
            a.request_id,
            a.model_id,
            a.client or "this client",
            why,
            f" ({unlogged} more refusals since the last logged one)" if unlogged else "",
        )

    def _finish(self, live: _LiveRequest, token_index: int) -> None:
        with self._lock:
            if self._live.get(live.key) is not live:
                return  # finished or expired meanwhile
            del self._live[live.key]
            self._forget_live(live)
            self.subscriptions.end_request(
                live.model.model_id, live.pod, live.request_id, token_index, live.nonce
            )
            self.metrics.requests_done.inc()
        self.inserts.add(live.model, live.request_id, live.predictor.eam, live.predictor.tokens)

    def _publish(
        self, live: _LiveRequest, token_index: int, trace_context: Mapping[str, str] | None = None
    ) -> None:
        subs = self.subscriptions.following(live.model.model_id, live.pod)
        if not subs:
            return
        start = time.perf_counter()
        with live.lock:
            scores = np.asarray(live.predictor.scores(HINT_SOURCE), dtype=np.float32)  # [L, E]
        layers = top_hints(scores, self.config.hint_top_n, self.config.min_score)
        elapsed = time.perf_counter() - start
        self.metrics.match_seconds.inc(elapsed)
        self.metrics.match_duration.observe(elapsed)
        self.metrics.queries.inc()
        carrier = None
        if telemetry.ENABLED and trace_context:
            # Under the observe span (current): the daemon's apply_hints span joins the trace.
            span = telemetry.tracer().start_span(
                "publish_hints",
                attributes={
                    "expertcache.request_id": live.request_id,
                    "expertcache.token_index": token_index,
                    "expertcache.hint_layers": len(layers),
                    "expertcache.hints": sum(len(h) for h in layers.values()),
                    "expertcache.match_s": elapsed,
                },
            )
            carrier = telemetry.inject(span)
            span.end()
        for sub in subs:
            sub.offer(live.request_id, token_index, layers, carrier, live.nonce)

    # -- subscribers -----------------------------------------------------------------------
    def subscribe(self, model_id: str, pod: str) -> Subscription:
        """A new subscription to the hints of requests of ``model_id`` served by ``pod``."""
        if not model_id:
            raise BadActivation("SubscribeHintsRequest.model_id is empty")
        if self._closed:
            raise PredictorStopping("the predictor is shutting down")
        if self.catalog.get(model_id) is None:
            self._refuse("unregistered_model")
            raise ModelNotRegistered(
                f"SubscribeHintsRequest.model_id {model_id!r} is not registered: call RegisterModel first "
                "(or configure model_shapes)"
            )
        return self.subscriptions.open(model_id, pod)

    # -- registration --------------------------------------------------------------------------
    def register_model(
        self, model_id: str, layers: int, experts: int, top_k: int, client: str = ""
    ) -> tuple[EamShape, bool]:
        """RegisterModel (``ModelCatalog.register``); the new model's EAMC loads at once."""
        if self._closed:
            raise PredictorStopping("the predictor is shutting down")
        registered = self.catalog.register(model_id, layers, experts, top_k, client)
        self.inserts.wake()
        return registered

    # -- expiry --------------------------------------------------------------------------------
    def expire(self) -> int:
        """Drop requests quiet for longer than ``live_request_ttl_s``; their EAMs are not inserted."""
        limit = self._clock() - self.config.live_request_ttl_s
        with self._lock:
            stale = [key for key, live in self._live.items() if live.last_seen < limit]
            for key in stale:
                self._forget_live(self._live.pop(key))
        for model_id, _client, _pod, request_id, _nonce in stale:
            self.metrics.requests_expired.inc()
            logger.info(
                "live request %r of model %r quiet for %.0fs: dropped (EAM not inserted)",
                request_id,
                model_id,
                self.config.live_request_ttl_s,
            )
        return len(stale)

    # -- live configuration ------------------------------------------------------------------
    def reload(self, fresh: PredictorConfig, origin: str) -> tuple[str, ...]:
        """Adopt the live fields of ``fresh`` (validated whole already; a changed restart-only
        field is logged and left out); returns the fields changed. A smaller ``eamc_capacity``
        keeps the entries already stored: the collection stops growing, and each new insert
        replaces its most similar entry."""
        changes = live_changes(PredictorConfig, self.config, fresh, origin)
        if not changes:
            return ()
        with self._lock:
            new = dataclasses.replace(self.config, **changes)
            self.config = new
            self._prediction_config = _prediction_config(new)
        self.catalog.reconfigure(new)
        self.inserts.reconfigure(new)  # the sync loop picks up sync_interval_s and the bounds now
        logger.info("config updated from %s: %s", origin, ", ".join(f"{k}={v!r}" for k, v in changes.items()))
        return tuple(changes)

    # -- stats and lifecycle -----------------------------------------------------------------
    def stats(self) -> ServiceStats:
        with self._lock:
            live_by_model: dict[str, int] = {}
            for model_id, *_rest in self._live:
                live_by_model[model_id] = live_by_model.get(model_id, 0) + 1
            live = len(self._live)
            live_bytes = self._live_bytes
        pending, pending_bytes = self.inserts.pending()
        models, eamc_bytes, reserved = self.catalog.stats(live_by_model)
        m = self.metrics
        return ServiceStats(
            eamc_entries=sum(i.eamc_entries for i in models),
            live_requests=live,
            queries=int(prom.value(m.queries)),
            mean_match_s=m.mean_match_s(),
            store_kind=self.config.store_kind,
            store_errors=m.store_errors_total(),
            observed_tokens=int(prom.value(m.observed_tokens)),
            requests_done=int(prom.value(m.requests_done)),
            entries_inserted=int(prom.value(m.entries_inserted)),
            inserts_pending=pending,
            inserts_dropped=int(prom.value(m.inserts_dropped)),
            requests_expired=int(prom.value(m.requests_expired)),
            hint_batches_published=int(prom.value(m.hint_batches)),
            hints_replaced=int(prom.value(m.hints_replaced)),
            hints_dropped=int(prom.value(m.hints_dropped)),
            subscribers=self.subscriptions.count(),
            store_degraded=self.inserts.degraded,
            models=models,
            live_bytes=live_bytes,
            eamc_bytes=eamc_bytes,
            eamc_reserved_bytes=reserved,
            pending_insert_bytes=pending_bytes,
            refused=m.refused_by_reason(),
        )

    def gauge_stats(self) -> GaugeStats:
        """What the ``/metrics`` gauges show (``metrics.registry``), from one ``stats()``."""
        stats = self.stats()
        return GaugeStats(
            eamc_entries={m.model_id: m.eamc_entries for m in stats.models},
            live_requests=stats.live_requests,
            inserts_pending=stats.inserts_pending,
            subscribers=stats.subscribers,
            store_degraded=stats.store_degraded,
        )

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the background thread (after one last insert attempt) and end every subscription."""
        if self._closed:
            return
        self._closed = True
        self.inserts.close(timeout_s)
        self.subscriptions.close_all()


def _prediction_config(config: PredictorConfig) -> PredictionConfig:
    """The predictor's ``PredictionConfig``: its defaults, with ``match_top_n`` where it applies."""
    base = PredictionConfig()
    names = {f.name for f in dataclasses.fields(base)}
    for name in ("top_n", "match_top_n", "top_n_matches"):
        if name in names:
            return dataclasses.replace(base, **{name: config.match_top_n})
    return base
