"""The predictor's domain: live requests, EAMC insertion, hint publishing (no gRPC here).

::

    Observe (gRPC threads)                         background thread (every sync_interval_s)
    ──────────────────────                         ───────────────────────────────────────────
    activation ─▶ validate ─▶ live request         pending inserts ─▶ Eamc.insert ─▶ store
                              (EAM += token,       Eamc.sync() per model (other replicas' inserts)
                               RequestPredictor)   expire quiet requests (live_request_ttl_s)
                   │ subscribers of (model, pod)?
                   ▼
               scores [L, E] ─▶ top hint_top_n per layer ≥ min_score ─▶ Subscription.offer
                   (request_done: EAM queued for insertion, woken at once)      │ coalesce per
                                                                                ▼ (request, layer)
                                                                  SubscribeHints stream: get()

Decisions:
- ``observe`` never talks to the store: inserting a finished EAM (Redis round trips, the
  most-similar search) happens on the background thread, woken as soon as a request ends. So a
  store outage never slows or fails Observe.
- Store unavailable on insert: the EAM stays in a bounded retry queue and is retried every
  ``sync_interval_s``; beyond ``max_pending_inserts`` the oldest is dropped (counted). Each
  failure is counted (``store_errors``) and logged once per outage, not per attempt.
- A request quiet for ``live_request_ttl_s`` is dropped without inserting its partial EAM.
- Hints are only computed for a token when some subscriber follows its (model, pod): nobody
  would read them otherwise.
- Activations carry all layers of one token; a request's tokens must arrive with increasing
  ``token_index`` (gaps allowed: a reporter may drop tokens).
- Shapes are registered (``register_model``; ``model_shapes`` at start), never taken from an
  activation: an unregistered model fails with ModelNotRegistered before anything is allocated,
  and an activation is checked against the registered shape (lengths first, then values) before
  it touches any state. The registry lives in the store (shared by replicas, reloaded every
  sync) and within the limits of the config (max_layers, max_experts, max_models,
  max_eamc_bytes).
- Requests are keyed by (model, caller, pod, request_id, nonce) (``RequestKey``): a client's
  request_id, reused by a retry or by another client, is another request. A refused message
  (LimitReached, BadActivation, ModelNotRegistered) ends its request's reporting
  (``end_refused``: its state dropped, its later messages ignored until its request_done), never
  the Observe stream, which compute shares between all its requests.
- Memory bounds: per client (``max_client_live_requests`` / ``max_client_live_bytes``: one
  more request is refused, LimitReached), in all (``max_live_requests`` /
  ``max_live_bytes``: the least recently active request is dropped), the insert retry queue
  (``max_pending_inserts`` / ``max_pending_insert_bytes``: the oldest dropped), subscribers
  (``max_subscribers``, each queue bounded by ``subscriber_queue_requests``). Every refusal is
  counted by reason (``moe_predictor_refused_total``, GetStats ``refused``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from expertcache import prom, telemetry
from expertcache.live_config import live_changes
from predictor_svc.config import MODEL_ID_RE, PredictorConfig
from predictor_svc.eam import HEADER_BYTES, EamShape
from predictor_svc.eamc import Eamc
from predictor_svc.errors import (
    BadActivation,
    CorruptEntry,
    LimitReached,
    ModelConflict,
    ModelNotRegistered,
    PredictorStopping,
    RegistrationDisabled,
    RequestEnded,
    StoreUnavailable,
)
from predictor_svc.metrics import PredictorMetrics
from predictor_svc.predict import PredictionConfig, RequestPredictor
from predictor_svc.store.base import EamcStore

logger = logging.getLogger(__name__)

REFUSAL_LOG_INTERVAL_S = 1.0  # refused requests are logged at most this often (the rest counted)
HINT_SOURCE = "combined"  # the request's own history mixed with the EAMC match (predict.py)
# Live state per (layer, expert) cell of a request: its EAM (uint32), its history (float32) and
# up to three cached score maps (float32) of RequestPredictor; plus a fixed overhead.
LIVE_BYTES_PER_CELL = 20
LIVE_BYTES_FIXED = 2048


def live_request_bytes(shape: EamShape) -> int:
    """Bytes one live request of ``shape`` may hold (what the live-byte limits count)."""
    return LIVE_BYTES_FIXED + LIVE_BYTES_PER_CELL * shape.cells


def shape_text(shape: EamShape) -> str:
    return f"{shape.layers}x{shape.experts}x{shape.top_k}"


def parse_shape_text(text: str) -> EamShape | None:
    """``"24x32x4"`` -> EamShape; None when malformed (a registry entry written by something else)."""
    try:
        layers, experts, top_k = (int(part) for part in text.split("x"))
        return EamShape(layers, experts, top_k)
    except ValueError:
        return None


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


@dataclass(frozen=True, slots=True)
class Hint:
    moe_layer: int  # index among the model's MoE layers
    expert: int
    score: float


@dataclass(frozen=True)
class HintBatch:
    """Hints for some layers of one request: each layer's hints replace earlier ones for it."""

    request_id: str
    token_index: int
    hints: tuple[Hint, ...]
    request_done: bool = False
    trace_context: Mapping[str, str] = field(default_factory=dict)  # W3C: the span that published it
    nonce: str = ""  # the request's Activation.request_nonce


@dataclass(frozen=True)
class ModelInfo:
    model_id: str
    eamc_entries: int
    layers: int
    num_experts: int
    top_k: int
    live_requests: int


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
    models: tuple[ModelInfo, ...] = ()
    live_bytes: int = 0
    eamc_bytes: int = 0
    eamc_reserved_bytes: int = 0
    pending_insert_bytes: int = 0
    refused: dict[str, int] = field(default_factory=dict)


# -- subscribers -----------------------------------------------------------------------------
# Memory of unsent hints, as the subscriber queue bound counts it: per hint (a slotted Hint,
# its float, its tuple slot) and per (request, layer) entry.
HINT_BYTES = 96
LAYER_BYTES = 128


def _layer_bytes(hints: tuple[Hint, ...]) -> int:
    return LAYER_BYTES + HINT_BYTES * len(hints)


@dataclass
class _Pending:
    token_index: int
    layers: dict[int, tuple[Hint, ...]] = field(default_factory=dict)
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
        layers: dict[int, tuple[Hint, ...]],
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

    def get(self, timeout_s: float | None = None) -> HintBatch | None:
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
        return HintBatch(request_id, pending.token_index, hints, pending.done, pending.trace_context, nonce)

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


# -- models and live requests ----------------------------------------------------------------
class _Model:
    """One model's geometry and EAMC (``Eamc`` is thread-safe: the background thread syncs and
    inserts while Observe threads predict)."""

    def __init__(self, model_id: str, shape: EamShape, eamc: Eamc) -> None:
        self.model_id = model_id
        self.shape = shape
        self.eamc = eamc


class _LiveRequest:
    def __init__(
        self,
        model: _Model,
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


@dataclass
class _PendingInsert:
    model: _Model
    request_id: str
    eam: np.ndarray  # uint32 [L, E]
    tokens: int


# -- the service -----------------------------------------------------------------------------
class PredictorService:
    """Live EAMs, the EAMC per model, hint subscribers. Thread-safe; see the module docstring."""

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
        self.store = store
        self.metrics = metrics or PredictorMetrics()
        if hasattr(store, "round_trip"):  # a store over the network (Redis): time its calls
            store.round_trip = lambda op, seconds: self.metrics.store_round_trip.labels(op=op).observe(
                seconds
            )
        self._clock = clock
        self._prediction_config = _prediction_config(config)
        self._lock = threading.Lock()  # models, live requests, subscribers, pending inserts
        self._models: dict[str, _Model] = {}
        self._live: OrderedDict[RequestKey, _LiveRequest] = OrderedDict()  # LRU order
        # Requests whose reporting a refusal ended: their messages are ignored until their
        # request_done (bounded like the live requests; the oldest mark is forgotten first).
        self._ended: OrderedDict[RequestKey, None] = OrderedDict()
        self._refusal_logged_at = float("-inf")
        self._refusals_unlogged = 0
        self._live_bytes = 0
        self._clients: dict[str, list[int]] = {}  # client -> [live requests, live bytes]
        self._subs: dict[tuple[str, str], list[Subscription]] = {}
        self._inserts: deque[_PendingInsert] = deque()
        self._insert_bytes = 0
        self._register_lock = threading.Lock()  # one registration at a time (store round trip)
        self._configured: dict[str, EamShape] = {}
        self._persisted: set[str] = set()  # configured models written to the store's registry
        self._skipped: set[str] = set()  # store registry entries not loaded (logged once)
        self._created_by: dict[str, int] = {}  # client -> models it registered here
        self._degraded = False
        self._closed = False
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._store_lock = threading.Lock()  # one thread at a time talks to the store
        # Set once every model's EAMC was loaded from the store (or the store found down): the
        # predictor is ready (health SERVING) only then, not while it predicts from nothing.
        self.loaded = threading.Event()
        for shape in config.shapes().values():
            eam_shape = EamShape(shape.layers, shape.experts, shape.top_k)
            self._configured[shape.model_id] = eam_shape
            self._model(shape.model_id, eam_shape)
        try:
            self.sync_registry()
        except (StoreUnavailable, CorruptEntry) as exc:  # degraded: the background thread retries
            self._store_failed("sync", exc)
        self._thread: threading.Thread | None = None
        if not background:
            self.loaded.set()  # nothing loads behind the caller's back: it syncs when it wants
        if background:
            self._thread = threading.Thread(target=self._run, name="predictor-sync", daemon=True)
            self._thread.start()

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
        model = self._models_get(a.model_id)
        if model is None:
            self._refuse("unregistered_model")
            raise ModelNotRegistered(
                f"Activation.model_id {a.model_id!r} is not registered (request {a.request_id!r}): "
                "call RegisterModel first (or configure model_shapes)"
            )
        experts = None
        if len(a.experts) or not a.request_done:
            experts = self._check_routing(a, model.shape)  # int64 [L, K]
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

    def _check_routing(self, a: Activation, shape: EamShape) -> np.ndarray:
        """The routing of ``a`` as int64 [L, K] of the registered ``shape``; BadActivation naming
        the field otherwise. Sizes are checked before anything is converted or allocated."""
        m, r = a.model_id, a.request_id
        for name, value, registered in (
            ("top_k", a.top_k, shape.top_k),
            ("num_moe_layers", a.num_moe_layers, shape.layers),
            ("num_experts", a.num_experts, shape.experts),
        ):
            if value and value != registered:
                self._refuse("bad_shape")
                raise BadActivation(
                    f"Activation.{name} = {value} but model {m!r} is registered with {name}={registered} "
                    f"(request {r!r})"
                )
        n, expected = len(a.experts), shape.layers * shape.top_k
        if n != expected:
            self._refuse("bad_shape")
            raise BadActivation(
                f"Activation.experts has {n} entries but model {m!r} is registered with {shape.layers} "
                f"layers x top_k={shape.top_k} = {expected} (request {r!r})"
            )
        experts = np.asarray(a.experts, dtype=np.int64).reshape(shape.layers, shape.top_k)
        if int(experts.max()) >= shape.experts:
            flat = int(np.argmax(experts.reshape(-1) >= shape.experts))
            self._refuse("out_of_range")
            raise BadActivation(
                f"Activation.experts[{flat}] = {int(experts.reshape(-1)[flat])} is out of range: model "
                f"{m!r} has {shape.experts} experts (request {r!r})"
            )
        return experts

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

    def _open_request(self, model: _Model, a: Activation, now: float) -> _LiveRequest:
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
                for sub in self._subs.get((a.model_id, a.pod), ()):
                    sub.offer_done(a.request_id, max(live.last_token_index, 0), a.nonce)
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
            for sub in self._subs.get((live.model.model_id, live.pod), ()):
                sub.offer_done(live.request_id, token_index, live.nonce)
            self.metrics.requests_done.inc()
            tokens = live.predictor.tokens
            if tokens < self.config.min_request_tokens:
                self.metrics.inserts_dropped.inc()
                logger.debug("request %r has %d tokens: not inserted", live.request_id, tokens)
                return
            self._inserts.append(_PendingInsert(live.model, live.request_id, live.predictor.eam, tokens))
            self._insert_bytes += live.predictor.eam.nbytes
            while len(self._inserts) > 1 and (
                len(self._inserts) > self.config.max_pending_inserts
                or self._insert_bytes > self.config.max_pending_insert_bytes
            ):
                dropped = self._inserts.popleft()
                self._insert_bytes -= dropped.eam.nbytes
                self.metrics.inserts_dropped.inc()
                logger.warning(
                    "insert retry queue full (max_pending_inserts=%d, max_pending_insert_bytes=%d): "
                    "dropping the EAM of request %r",
                    self.config.max_pending_inserts,
                    self.config.max_pending_insert_bytes,
                    dropped.request_id,
                )
        self._wake.set()

    def _publish(
        self, live: _LiveRequest, token_index: int, trace_context: Mapping[str, str] | None = None
    ) -> None:
        with self._lock:
            subs = list(self._subs.get((live.model.model_id, live.pod), ()))
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
        if self._models_get(model_id) is None:
            self._refuse("unregistered_model")
            raise ModelNotRegistered(
                f"SubscribeHintsRequest.model_id {model_id!r} is not registered: call RegisterModel first "
                "(or configure model_shapes)"
            )
        sub = Subscription(
            model_id,
            pod,
            self.config.subscriber_queue_requests,
            self.metrics,
            self._unsubscribe,
            max_bytes=self.config.subscriber_queue_bytes,
        )
        with self._lock:
            open_subs = sum(len(group) for group in self._subs.values())
            if open_subs >= self.config.max_subscribers:
                self._refuse("max_subscribers")
                raise LimitReached(
                    f"{open_subs} hint subscribers are open, the limit max_subscribers="
                    f"{self.config.max_subscribers}: subscription to model {model_id!r} refused"
                )
            self._subs.setdefault((model_id, pod), []).append(sub)
        logger.info("hint subscriber for model %r pod %r", model_id, pod)
        return sub

    def _unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            subs = self._subs.get((sub.model_id, sub.pod), [])
            if sub in subs:
                subs.remove(sub)
            if not subs:
                self._subs.pop((sub.model_id, sub.pod), None)

    # -- registration --------------------------------------------------------------------------
    def register_model(
        self, model_id: str, layers: int, experts: int, top_k: int, client: str = ""
    ) -> tuple[EamShape, bool]:
        """Register ``model_id``'s shape (RegisterModel): (shape, created). Idempotent for the same
        shape. Raises, changing nothing: InvalidArgument (BadActivation) for a bad field or
        beyond max_layers / max_experts, ModelConflict for another shape, RegistrationDisabled,
        LimitReached for max_models / max_eamc_bytes / max_client_models (models ``client`` created
        on this replica since it started), StoreUnavailable when the registry cannot be written
        (the client retries)."""
        if self._closed:
            raise PredictorStopping("the predictor is shutting down")
        cfg = self.config
        if not model_id:
            raise BadActivation("RegisterModelRequest.model_id is empty")
        if not MODEL_ID_RE.match(model_id):
            raise BadActivation(
                f"RegisterModelRequest.model_id {model_id[:160]!r} is not 1-128 characters of "
                "[A-Za-z0-9._:/@+-] starting with a letter or digit"
            )
        for name, value in (("num_moe_layers", layers), ("num_experts", experts), ("top_k", top_k)):
            if value < 1:
                raise BadActivation(
                    f"RegisterModelRequest.{name} is {value} (model {model_id!r}); must be >= 1"
                )
        if layers > cfg.max_layers:
            self._refuse("max_layers")
            raise BadActivation(
                f"RegisterModelRequest.num_moe_layers = {layers} (model {model_id!r}) exceeds the limit "
                f"max_layers={cfg.max_layers}"
            )
        if experts > cfg.max_experts:
            self._refuse("max_experts")
            raise BadActivation(
                f"RegisterModelRequest.num_experts = {experts} (model {model_id!r}) exceeds the limit "
                f"max_experts={cfg.max_experts}"
            )
        if top_k > experts:
            raise BadActivation(
                f"RegisterModelRequest.top_k = {top_k} exceeds num_experts = {experts} (model {model_id!r})"
            )
        shape = EamShape(layers, experts, top_k)
        with self._register_lock:
            known = self._models_get(model_id)
            if known is not None:
                return self._same_shape(model_id, known.shape, shape), False
            if not cfg.allow_registration:
                self._refuse("registration_disabled")
                raise RegistrationDisabled(
                    f"model {model_id!r} is not configured (model_shapes) and registration is disabled "
                    "(allow_registration=false)"
                )
            self._check_room(model_id, shape)
            created_by = self._created_by.get(client, 0)
            if created_by >= cfg.max_client_models:
                self._refuse("client_models")
                raise LimitReached(
                    f"client {client!r} has registered {created_by} models, the limit max_client_models="
                    f"{cfg.max_client_models}: model {model_id!r} not registered"
                )
            status, value = self.store.register_model(model_id, shape_text(shape), cfg.max_models)
            if status == "full":
                self._refuse("max_models")
                raise LimitReached(
                    f"the model registry already holds {value} models, the limit max_models={cfg.max_models}: "
                    f"model {model_id!r} not registered"
                )
            if status == "exists":  # another replica registered it meanwhile
                registered = parse_shape_text(value)
                if registered is None:
                    raise ModelConflict(
                        f"model {model_id!r} is registered with an unreadable shape {value!r}"
                    )
                self._same_shape(model_id, registered, shape)
            else:
                self._created_by[client] = created_by + 1
            self._model(model_id, shape)
        logger.info("registered model %r: %s", model_id, shape_text(shape))
        return shape, status == "created"

    def _same_shape(self, model_id: str, registered: EamShape, asked: EamShape) -> EamShape:
        if registered != asked:
            self._refuse("bad_shape")
            raise ModelConflict(
                f"model {model_id!r} is registered as {shape_text(registered)} (layers x experts x top_k), "
                f"not {shape_text(asked)}"
            )
        return registered

    def _check_room(self, model_id: str, shape: EamShape) -> None:
        """LimitReached when registering ``shape`` would pass max_models or max_eamc_bytes."""
        cfg = self.config
        with self._lock:
            count = len(self._models)
            reserved = sum(
                cfg.eamc_reservation(m.shape.layers, m.shape.experts) for m in self._models.values()
            )
        if count >= cfg.max_models:
            self._refuse("max_models")
            raise LimitReached(
                f"{count} models are registered, the limit max_models={cfg.max_models}: model {model_id!r} "
                "not registered"
            )
        need = cfg.eamc_reservation(shape.layers, shape.experts)
        if reserved + need > cfg.max_eamc_bytes:
            self._refuse("max_eamc_bytes")
            raise LimitReached(
                f"model {model_id!r} ({shape_text(shape)}) reserves {need} EAMC bytes (eamc_capacity="
                f"{cfg.eamc_capacity} entries), {reserved} are reserved already: beyond the limit "
                f"max_eamc_bytes={cfg.max_eamc_bytes}"
            )

    def sync_registry(self) -> None:
        """Write the models held here that the store's registry lacks (the configured ones at
        first, any of them again after a Redis restarted empty) and take the models other
        replicas registered (unless registration is disabled here). StoreUnavailable propagates
        (the caller counts it)."""
        registry = self.store.models()
        with self._lock:
            held = {model_id: model.shape for model_id, model in self._models.items()}
        for model_id, shape in held.items():
            if model_id in registry:
                if model_id in self._configured and parse_shape_text(registry[model_id]) != shape:
                    if model_id not in self._persisted:
                        logger.error(
                            "configured model %r is %s but the store's registry has %s: using the "
                            "configured shape",
                            model_id,
                            shape_text(shape),
                            registry[model_id],
                        )
                self._persisted.add(model_id)
                continue
            if model_id in self._persisted:
                logger.warning(
                    "model %r is missing from the store's registry: registering it again", model_id
                )
            # Models held here were admitted already: max_models does not refuse them again.
            self.store.register_model(model_id, shape_text(shape), 1 << 30)
            self._persisted.add(model_id)
        if not self.config.allow_registration:
            return
        for model_id, text in registry.items():
            if self._models_get(model_id) is not None or model_id in self._skipped:
                continue
            shape = parse_shape_text(text)
            try:
                if shape is None or not MODEL_ID_RE.match(model_id):
                    raise BadActivation(f"unreadable registry entry {text!r}")
                if shape.layers > self.config.max_layers or shape.experts > self.config.max_experts:
                    raise BadActivation(
                        f"{text} is beyond max_layers={self.config.max_layers} / max_experts={self.config.max_experts}"
                    )
                with self._register_lock:
                    self._check_room(model_id, shape)
                    self._model(model_id, shape)
            except (BadActivation, LimitReached) as exc:
                self._skipped.add(model_id)
                logger.warning("not loading registered model %r: %s", model_id, exc)

    # -- models ------------------------------------------------------------------------------
    def _models_get(self, model_id: str) -> _Model | None:
        with self._lock:
            return self._models.get(model_id)

    def _model(self, model_id: str, shape: EamShape) -> _Model:
        """The model's state, created (with its EAMC loaded from the store) on first use."""
        with self._lock:
            model = self._models.get(model_id)
            if model is not None:
                return model
            eamc = Eamc(self.store, model_id, shape, self.config.eamc_capacity)
            model = self._models[model_id] = _Model(model_id, shape, eamc)
        logger.info(
            "model %r: %d layers x %d experts, top_k %d", model_id, shape.layers, shape.experts, shape.top_k
        )
        self._wake.set()  # load its entries from the store soon
        return model

    # -- background: inserts, sync, expiry --------------------------------------------------
    def _run(self) -> None:
        next_sync = self._clock()
        while not self._stop.is_set():
            self._wake.wait(max(0.0, next_sync - self._clock()))
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                ok = self.flush_inserts()
                if self._clock() >= next_sync or not ok:
                    self.sync_now()
                    next_sync = self._clock() + self.config.sync_interval_s
            except Exception:  # noqa: BLE001 - the background thread must survive anything
                logger.exception("predictor background step failed")
                next_sync = self._clock() + self.config.sync_interval_s
            if not self._inserts_ok():
                # Store down: wait a full interval before retrying, do not spin on the wake event.
                self._stop.wait(self.config.sync_interval_s)

    def _inserts_ok(self) -> bool:
        with self._lock:
            return not (self._inserts and self._degraded)

    def flush_inserts(self) -> bool:
        """Insert queued finished EAMs in order; False when the store failed (they stay queued)."""
        with self._store_lock:
            while True:
                with self._lock:
                    if not self._inserts:
                        return True
                    item = self._inserts[0]
                try:
                    entry_id = item.model.eamc.insert(item.eam, item.tokens)
                except (StoreUnavailable, CorruptEntry) as exc:
                    self._store_failed("insert", exc)
                    return False
                except Exception as exc:  # noqa: BLE001 - e.g. Conflict after retries: try later
                    self._store_failed("insert", exc)
                    return False
                with self._lock:
                    if self._inserts and self._inserts[0] is item:
                        self._inserts.popleft()
                        self._insert_bytes -= item.eam.nbytes
                self._store_ok()
                self.metrics.entries_inserted.inc()
                logger.debug(
                    "request %r inserted as entry %s of %r", item.request_id, entry_id, item.model.model_id
                )

    def sync_now(self) -> None:
        """One background step: sync the model registry and every model's EAMC with the store,
        expire quiet requests."""
        with self._store_lock:
            try:
                self.sync_registry()
            except (StoreUnavailable, CorruptEntry) as exc:
                self._store_failed("sync", exc)
        with self._lock:
            models = list(self._models.values())
        with self._store_lock:
            for model in models:
                try:
                    model.eamc.sync()
                except (StoreUnavailable, CorruptEntry) as exc:
                    self._store_failed("sync", exc)
                else:
                    self._store_ok()
        self.loaded.set()
        self.expire()

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

    def _store_failed(self, op: str, exc: BaseException) -> None:
        self.metrics.store_errors.labels(op).inc()
        with self._lock:
            was, self._degraded = self._degraded, True
        if not was:
            logger.warning("EAMC store %s failed, predicting from memory until it is back: %s", op, exc)
        else:
            logger.debug("EAMC store %s still failing: %s", op, exc)

    def _store_ok(self) -> None:
        with self._lock:
            was, self._degraded = self._degraded, False
        if was:
            logger.warning("EAMC store is back")

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
            for model in self._models.values():
                model.eamc.capacity = new.eamc_capacity
        self._wake.set()  # the sync loop picks up sync_interval_s and the live-request bounds now
        logger.info("config updated from %s: %s", origin, ", ".join(f"{k}={v!r}" for k, v in changes.items()))
        return tuple(changes)

    # -- stats and lifecycle -----------------------------------------------------------------
    def stats(self) -> ServiceStats:
        with self._lock:
            models = list(self._models.values())
            live_by_model: dict[str, int] = {}
            for model_id, *_rest in self._live:
                live_by_model[model_id] = live_by_model.get(model_id, 0) + 1
            live = len(self._live)
            pending = len(self._inserts)
            pending_bytes = self._insert_bytes
            live_bytes = self._live_bytes
            subscribers = sum(len(s) for s in self._subs.values())
            degraded = self._degraded
        infos = []
        eamc_bytes = reserved = 0
        for model in models:
            entries = model.eamc.entries
            eamc_bytes += entries * (HEADER_BYTES + 4 * model.shape.cells)
            reserved += self.config.eamc_reservation(model.shape.layers, model.shape.experts)
            infos.append(
                ModelInfo(
                    model.model_id,
                    entries,
                    model.shape.layers,
                    model.shape.experts,
                    model.shape.top_k,
                    live_by_model.get(model.model_id, 0),
                )
            )
        m = self.metrics
        return ServiceStats(
            eamc_entries=sum(i.eamc_entries for i in infos),
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
            subscribers=subscribers,
            store_degraded=degraded,
            models=tuple(sorted(infos, key=lambda i: i.model_id)),
            live_bytes=live_bytes,
            eamc_bytes=eamc_bytes,
            eamc_reserved_bytes=reserved,
            pending_insert_bytes=pending_bytes,
            refused=m.refused_by_reason(),
        )

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the background thread (after one last insert attempt) and end every subscription."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.flush_inserts()  # finished requests reach the store before it is closed or saved
        with self._lock:
            subs = [s for group in self._subs.values() for s in group]
        for sub in subs:
            sub.close()


def top_hints(scores: np.ndarray, top_n: int, min_score: float) -> dict[int, tuple[Hint, ...]]:
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
    out: dict[int, tuple[Hint, ...]] = {}
    for layer in range(layers):
        out[layer] = tuple(
            Hint(layer, int(e), float(s))
            for e, s in zip(best[layer], best_scores[layer], strict=True)
            if s >= min_score and s > 0.0  # a zero score predicts nothing
        )
    return out


def _prediction_config(config: PredictorConfig) -> PredictionConfig:
    """The predictor's ``PredictionConfig``: its defaults, with ``match_top_n`` where it applies."""
    base = PredictionConfig()
    names = {f.name for f in dataclasses.fields(base)}
    for name in ("top_n", "match_top_n", "top_n_matches"):
        if name in names:
            return dataclasses.replace(base, **{name: config.match_top_n})
    return base
