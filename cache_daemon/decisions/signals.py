"""Activation signals: what the daemon knows about the experts the live requests will use next.

Three predictions, each with its own horizon, land here and are read by the eviction policies and
the prefetch scheduler (the daemon and the trace replay run this same code):

::

    compute ──observe(layer, experts, token)────────▶ history    (each request's own routing, with recency)
                                                  └─▶ next visit (the learned model of next_visit: a layer's
                                                                   next routing from every layer's latest,
                                                                   fitted offline; without one, the
                                                                   transitions: what a layer routes after
                                                                   what it routed, learned across requests)
    compute ──set_lookahead([LayerPrediction])──────▶ lookahead  (routers of layers l+1 .. l+d on layer l's
                                                                   state, one prediction per depth d)
    predictor ──set_hints([(layer, expert, score)])─▶ hints      (EAMC match of the request)
                                                          │
             use_probability(), next_use_layers(), lookahead() ▼  policies · PrefetchScheduler

State is kept per live request (``RequestSignals``: its history, hints and lookahead), and the
outputs combine the live requests: an entry's use probability is the chance that *any* of them
uses it, ``1 - prod_r (1 - p_r)``, so an expert several requests want is worth more. A daemon
serving one request at a time has one live request; a batch of them is the same code.

Glossary (worked example with 4 MoE layers × 8 experts, all layers MoE):

- *entry*: ``layer * num_experts + expert`` (``ExpertKey.entry``); every array here is
  ``[num_layers * num_experts]`` indexed by entry. ``ExpertKey(2, 5)`` is entry 21.
- *layer*: the tier's own layer numbering (decoder layers in the daemon, trace layers in the
  replay); ``LayerMap`` gives the order in which the MoE layers are visited, so DeepSeek's dense
  layers are skipped when distances are counted.
- *position*: ``(token, layer)`` of the last ``observe``; before any, ``(-1, last MoE layer)``.
- *layer distance* of an entry: MoE layers until its layer is visited next, in ``1..M``
  (M = MoE layers). At position ``(7, 1)``: layer 2 is 1 away, layer 1 is 4 away.
- *depth*: for a lookahead prediction, how many MoE layers ahead of the layer whose hidden state
  it used (1 = the next layer). Each depth's *precision* (share of its predicted experts that
  were then routed) is measured online from the ``observe`` of the predicted layer, overall and
  per *prior bucket* (``PRIOR_BUCKET_EDGES`` of the predicted expert's use probability before
  the prediction): a predicted expert's confidence is its bucket's precision.
- *history*: per request, a short (``history_half_life_tokens``) and a long recency-weighted
  use estimate per visit, blended (``long_history_weight``).
- *use probability* (``p_next``): estimated probability that an entry is routed at its layer's
  next visit: the learned model's estimate from every layer's latest routing in the request
  (``next_visit.NextVisitModel``, when the daemon has one) or else the transition estimate from
  the layer's last routing (``transitions.TransitionModel``, blended with fresh hints), where
  the request routed the layer before; else the history blended with fresh hints; overridden by
  lookahead.
- *next use* (in layer steps): an online stand-in for Belady's "time of next use",
  ``distance + M * (1 - p_next) / max(p_long, floor)``: the expected wait of a geometric process
  whose first trial has probability ``p_next`` and later ones ``p_long`` (the history blended
  with fresh hints). A guess of an expert new to the request (``p_long`` near 0) thus expects a
  long wait and does not displace experts the request keeps using.

Staleness: a lookahead prediction for a ``(token, layer)`` at or before its request's position is
dropped; hints older than ``hint_ttl_tokens`` tokens are ignored.

Not thread-safe and does no I/O: callers (the daemon's residency lock, the replay loop) serialise.
"""

from __future__ import annotations

import bisect
import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from cache_daemon.decisions.next_visit import NextVisitModel
from cache_daemon.decisions.transitions import TransitionModel
from expertcache.keys import ExpertKey
from expertcache.layers import LayerMap

if TYPE_CHECKING:
    from cache_daemon.decisions.estimators import Estimator

logger = logging.getLogger(__name__)

DEFAULT_REQUEST = ""  # the request of routing that names none
PRIOR_WEIGHT = 4.0  # predicted experts' worth of the lookahead precision prior
# Lookahead precision is also kept per bucket of the predicted expert's own estimate before the
# prediction (its next-visit probability for the request): a guess of an expert the request was
# not expected to use is more often wrong, and the bucket's measured precision says by how much.
PRIOR_BUCKET_EDGES = (0.05, 0.15, 0.4)
_BUCKET_EDGES = list(PRIOR_BUCKET_EDGES)


@dataclass(frozen=True)
class SignalsConfig:
    """Tuning of ``ActivationSignals``; few and generic on purpose (no per-trace constants)."""

    history_half_life_tokens: float = field(default=4.0, metadata={"min": 0.05, "max": 1e6})
    """Half-life, in tokens, of a request's short recency-weighted use estimate of an entry: after
    ``h`` tokens without use an entry's estimate halves (recency and in-request frequency at
    once; swept on a tuning window separate from the reported one, bench/replay_tune.py)."""

    long_history_half_life_tokens: float = field(default=32.0, metadata={"min": 0.05, "max": 1e6})
    """Half-life, in tokens, of the request's long use estimate, blended with the short one."""

    long_history_weight: float = field(default=0.5, metadata={"min": 0.0, "max": 1.0})
    """Weight of the long estimate in a request's history (0: the short one alone)."""

    transition_weight: float = field(default=1.0, metadata={"min": 0.0, "max": 1.0})
    """Weight of the next-visit estimate (the learned ``next_visit.NextVisitModel`` when there is
    one, else the routing transitions of ``transitions.TransitionModel``: what a layer routes at
    its next visit given what it routed at its last) in the probability of use at a layer's next
    visit; the rest is the history's. 0 turns both off."""

    transition_prior_count: float = field(default=4.0, metadata={"min": 1e-3, "max": 1e9})
    """Pseudo-visits at the base rate behind each learned transition (an unseen pair says nothing)."""

    transition_history_exponent: float = field(default=0.25, metadata={"min": 0.0, "max": 16.0})
    """Weight of the request's own history, as a soft prior, in the transition estimate."""

    transition_half_life_visits: float = field(default=4096.0, metadata={"min": 1.0, "max": 1e12})
    """Half-life, in visits of a layer, of its transition counts (learned across requests)."""

    prior_half_life_tokens: float = field(default=2000.0, metadata={"min": 1.0, "max": 1e9})
    """Half-life, in tokens, of the slow cross-request estimate a new request starts from."""

    prior_weight: float = field(default=0.5, metadata={"min": 0.0, "max": 1.0})
    """Weight of the cross-request estimate in the history of a request that just began (it then
    decays with the request's own half-life as the request's routing accumulates)."""

    hint_weight: float = field(default=0.3, metadata={"min": 0.0, "max": 1.0})
    """Weight of a fresh EAMC hint score blended into the history estimate."""

    hint_ttl_tokens: int = field(default=64, metadata={"min": 0, "max": 1 << 30})
    """Hints older than this many tokens are ignored (stale)."""

    lookahead_prior_precision: float = field(default=0.8, metadata={"min": 0.0, "max": 1.0})
    """Precision assumed for a lookahead depth before any of its predictions was scored: above
    the scheduler's ``min_precision`` (0.7), so that a new depth is tried and then kept or cut by
    what it measures."""

    precision_half_life: float = field(default=64.0, metadata={"min": 1.0, "max": 1e9})
    """Half-life, in scored predictions, of each depth's running precision estimate."""

    probability_floor: float = field(default=1e-3, metadata={"min": 1e-9, "max": 1.0})
    """Lower bound on a long-run use probability (keeps next-use estimates finite)."""

    max_live_requests: int = field(default=256, metadata={"min": 1, "max": 1 << 20})
    """Live requests kept; beyond it the least recently observed one is dropped (its end was
    lost)."""

    def __post_init__(self) -> None:
        for name, spec in self.__dataclass_fields__.items():
            value = getattr(self, name)
            lo, hi = spec.metadata["min"], spec.metadata["max"]
            if not (lo <= value <= hi):
                raise ValueError(f"SignalsConfig.{name} must be in [{lo}, {hi}], got {value!r}")


@dataclass(frozen=True)
class LayerPrediction:
    """One depth of lookahead: ``experts`` (int64 [n], distinct) of layer ``layer`` predicted
    ``depth`` MoE layers early, with router ``scores`` (float32 [n], in [0, 1])."""

    layer: int
    depth: int
    experts: np.ndarray
    scores: np.ndarray


@dataclass
class _Lookahead:
    token: int
    depth: int
    entries: np.ndarray  # int64 [n]
    scores: np.ndarray  # float32 [n]
    keys: list[int]  # entries, as a list
    buckets: list[int]  # [n]: PRIOR_BUCKET_EDGES bucket of each entry's estimate before it


class _DepthPrecision:
    """Running precision of one lookahead depth, overall and per prior bucket. Counts are kept in
    growing units (each scoring adds ``unit``, which grows by 1 / decay per scoring; rescaled
    before it overflows), which is the same as fading every count by the decay per scoring."""

    __slots__ = ("unit", "growth", "hits", "predicted", "by")

    def __init__(self, prior: float, growth: float) -> None:
        self.unit = 1.0
        self.growth = growth
        # The prior starts as PRIOR_WEIGHT experts' worth and fades like the counts.
        self.hits = prior * PRIOR_WEIGHT
        self.predicted = PRIOR_WEIGHT
        self.by = [0.0] * (2 * (len(PRIOR_BUCKET_EDGES) + 1))  # hits, predicted of bucket b at 2b, 2b+1

    def score(self, keys: list[int], buckets: list[int], routed: set[int]) -> None:
        unit = self.unit * self.growth
        if unit > 1e12:
            f = 1.0 / unit
            self.hits *= f
            self.predicted *= f
            self.by = [x * f for x in self.by]
            unit = 1.0
        self.unit = unit
        by = self.by
        for e, b in zip(keys, buckets, strict=True):
            if e in routed:
                self.hits += unit
                by[2 * b] += unit
            by[2 * b + 1] += unit
        self.predicted += unit * len(keys)

    def precision(self) -> float:
        return self.hits / self.predicted

    def by_bucket(self) -> np.ndarray:
        """float64 [buckets] each bucket's precision, shrunk towards the depth's by PRIOR_WEIGHT
        experts' worth."""
        overall = self.precision()
        w = PRIOR_WEIGHT * self.unit
        by = self.by
        return np.array([(by[i] + w * overall) / (by[i + 1] + w) for i in range(0, len(by), 2)])


class RequestSignals:
    """The per-request part of the signals: history, hints, lookahead, position in the request."""

    def __init__(self, request_id: str, n: int, history: np.ndarray, model_latest: int = 0) -> None:
        self.request_id = request_id
        self.token = -1  # token of the last observe
        self.layer = -1
        self.history = history  # float32 [N]: recency-weighted use per visit, short half-life
        self.history_long = history.copy()  # float32 [N]: the same with the long half-life
        self.last_routed: dict[int, np.ndarray] = {}  # layer → experts (int64) of its last visit
        self.next_p = np.full(n, -1.0, np.float32)  # next-visit estimate (model or transitions); -1: none
        # For the learned next-visit model: the latest routing of every MoE layer, one-hot in
        # visit order (float32 [M * E]; empty without a model).
        self.latest = np.zeros(model_latest, np.float32)
        self.hints = np.zeros(n, np.float32)
        self.hint_token = np.full(n, np.iinfo(np.int64).min // 2, np.int64)
        self.has_hints = False
        self.lookahead: dict[int, _Lookahead] = {}  # predicted layer → its nearest prediction
        self.scoring: dict[int, list[_Lookahead]] = {}  # predicted layer → every depth's, to score


def next_visit_model_mismatch(
    m: NextVisitModel, num_moe: int, num_experts: int, config: SignalsConfig
) -> str | None:
    """What keeps signals of ``num_moe`` MoE layers x ``num_experts`` experts with ``config`` from
    running ``m`` (it was fitted for other layers, experts or histories), or None."""
    if (m.num_layers, m.num_experts) != (num_moe, num_experts):
        return (
            f"next-visit model is for {m.num_layers} MoE layers x {m.num_experts} experts, the model "
            f"served has {num_moe} x {num_experts}"
        )
    fitted = (m.short_half_life_tokens, m.long_half_life_tokens, m.history_start)
    ours = (config.history_half_life_tokens, config.long_history_half_life_tokens, config.prior_weight)
    if not np.allclose(fitted, ours, rtol=1e-6):
        return (
            f"next-visit model was fitted with history half-lives {fitted[0]:g} / {fitted[1]:g} tokens and "
            f"start {fitted[2]:g}; the signals use {ours[0]:g} / {ours[1]:g} and {ours[2]:g}"
        )
    return None


class ActivationSignals:
    """Prediction state of one tier's model: history, lookahead and hints, per live request.

    ``num_layers`` × ``num_experts`` is the tier's entry grid; ``layer_map`` says which of the
    ``num_layers`` layers are MoE layers and in which order they are visited (default: all of
    them, in order). ``next_visit_model`` (``next_visit.NextVisitModel``, fitted on recorded
    routing for these MoE layers and experts) estimates each layer's next visit in place of the
    routing transitions. ``estimator`` plugs in another use-probability estimate (the replay's
    ``HazardEstimator``); the daemon runs the built-in one.
    """

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        *,
        config: SignalsConfig | None = None,
        layer_map: LayerMap | None = None,
        estimator: Estimator | None = None,
        next_visit_model: NextVisitModel | None = None,
    ) -> None:
        if num_layers < 1 or num_experts < 1:
            raise ValueError(f"num_layers and num_experts must be >= 1, got {num_layers} and {num_experts}")
        layer_map = layer_map or LayerMap.dense(num_layers)
        if layer_map.num_layers != num_layers:
            raise ValueError(f"layer map covers {layer_map.num_layers} layers, the signals {num_layers}")
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.num_entries = num_layers * num_experts
        self.layer_map = layer_map
        self.num_moe = layer_map.num_moe
        self.config = config or SignalsConfig()
        n = self.num_entries
        self._rank = layer_map.ranks()  # [num_layers] MoE index per layer, -1 dense
        self._rank_of = np.repeat(self._rank, num_experts)  # [N]
        self._prior = np.zeros(n, np.float32)  # slow cross-request estimate
        self._requests: OrderedDict[str, RequestSignals] = OrderedDict()  # live, least recent first
        self._current: RequestSignals | None = None  # the request of the last observe
        self._token = -1
        self._layer = layer_map.moe_layers[-1]
        self._needed = np.zeros(0, np.int64)  # entries routed at the current position
        self.version = 0  # bumped on every change, so a waiting prefetcher knows to re-decide
        self._cache: dict[str, object] = {}  # derived values of the current version
        # Running precision of lookahead per depth (and per prior bucket), fading per scoring.
        self._precision: dict[int, _DepthPrecision] = {}
        self._precision_growth = float(0.5 ** (-1.0 / self.config.precision_half_life))
        cfg = self.config
        self.transitions = TransitionModel(
            num_layers,
            num_experts,
            prior_count=cfg.transition_prior_count,
            history_exponent=cfg.transition_history_exponent,
            half_life_visits=cfg.transition_half_life_visits,
        )
        # Per-visit decays of the short and long histories and of the cross-request prior.
        self._decays = tuple(
            0.5 ** (1.0 / h)
            for h in (
                cfg.history_half_life_tokens,
                cfg.long_history_half_life_tokens,
                cfg.prior_half_life_tokens,
            )
        )
        self.next_visit_model: NextVisitModel | None = None
        self._model_latest = 0
        self.set_next_visit_model(next_visit_model)
        self.estimator = estimator
        if estimator is not None:
            estimator.attach(self)

    def set_next_visit_model(self, model: NextVisitModel | None) -> None:
        """Estimate each layer's next visit with ``model`` from now on (None: the routing
        transitions). ``ValueError`` naming the mismatch, with nothing changed, when it was not
        fitted for these layers, experts and histories. The live requests' estimates of the old
        one are dropped: each layer is estimated afresh at its next visit (the history stands in
        until then), and the new model's view of every layer's latest routing starts with the
        layers routed from now on."""
        if model is not None:
            self._check_model(model)
        self.next_visit_model = model
        self._model_latest = self.num_moe * self.num_experts if model is not None else 0
        for req in self._requests.values():
            req.latest = np.zeros(self._model_latest, np.float32)
            req.next_p[:] = -1.0
        self._bump()

    def _check_model(self, m: NextVisitModel) -> None:
        problem = next_visit_model_mismatch(m, self.num_moe, self.num_experts, self.config)
        if problem:
            raise ValueError(problem)

    def _bump(self) -> None:
        self.version += 1
        self._cache.clear()

    def _cached(self, name: str, compute):
        v = self._cache.get(name)
        if v is None:
            v = compute()
            if isinstance(v, np.ndarray):
                v.flags.writeable = False
            self._cache[name] = v
        return v

    # -- keys ------------------------------------------------------------------------------------

    def entry_of(self, key: ExpertKey) -> int:
        """The entry index of ``key``; raises ``ValueError`` for a key outside the shape."""
        if not (0 <= key.layer < self.num_layers and 0 <= key.expert < self.num_experts):
            raise ValueError(f"{key} is outside {self.num_layers} layers x {self.num_experts} experts")
        return key.entry(self.num_experts)

    def key_of(self, entry: int) -> ExpertKey:
        """The key of entry index ``entry``."""
        return ExpertKey.of_entry(entry, self.num_experts)

    # -- requests ----------------------------------------------------------------------------------

    def begin_request(self, request_id: str) -> RequestSignals:
        """A request starts: its history starts from the cross-request prior."""
        state = self._requests.pop(request_id, None)
        state = RequestSignals(
            request_id, self.num_entries, self._prior * self.config.prior_weight, self._model_latest
        )
        self._requests[request_id] = state
        while len(self._requests) > self.config.max_live_requests:
            dropped, _ = self._requests.popitem(last=False)
            logger.debug("signals: request %r dropped (over max_live_requests)", dropped)
        self._current = state
        if self.estimator is not None:
            self.estimator.begin_request(request_id)
        self._bump()
        return state

    def end_request(self, request_id: str) -> None:
        """The request ended: its history, hints and lookahead go (the cross-request prior keeps
        what it taught)."""
        state = self._requests.pop(request_id, None)
        if state is not None and state is self._current:
            self._current = None
        self._bump()

    def _request(self, request_id: str | None) -> RequestSignals:
        """The state of ``request_id``; None: the request of the last observe, or else the most
        recently observed live one (messages that name no request, like LayerAhead)."""
        if request_id is None:
            if self._current is not None:
                return self._current
            if self._requests:
                return next(reversed(self._requests.values()))
            request_id = DEFAULT_REQUEST
        state = self._requests.get(request_id)
        if state is None:
            state = self.begin_request(request_id)  # its begin was lost, or it named none
        return state

    @property
    def request_id(self) -> str | None:
        """The request of the last ``observe`` (None when it ended)."""
        return None if self._current is None else self._current.request_id

    @property
    def live_requests(self) -> tuple[str, ...]:
        return tuple(self._requests)

    # -- inputs ----------------------------------------------------------------------------------

    def observe(
        self, layer: int, experts: Sequence[int] | np.ndarray, token: int, request_id: str | None = None
    ) -> None:
        """Layer ``layer`` of token ``token`` of the request was routed to ``experts`` (distinct).

        Moves the position to ``(token, layer)``, updates the request's history (each entry of
        the layer decays by one visit, the routed ones gain ``1 - decay``) and scores the
        lookahead predictions made for this layer.
        """
        rank = self._rank[layer] if 0 <= layer < self.num_layers else -1
        if rank < 0:
            raise ValueError(f"layer {layer} is not a MoE layer of {list(self.layer_map.moe_layers)}")
        ex = np.asarray(experts, dtype=np.int64).reshape(-1)
        listed = ex.tolist()  # a few experts: Python's min and max beat numpy's calls here
        if listed and (min(listed) < 0 or max(listed) >= self.num_experts):
            raise ValueError(f"experts {listed} outside 0..{self.num_experts - 1}")
        req = self._request(request_id)
        self._current = req
        self._requests.move_to_end(req.request_id)
        base = layer * self.num_experts
        entries = base + ex
        cfg = self.config
        decay, long_decay, prior_decay = self._decays
        sl = slice(base, base + self.num_experts)
        h = req.history[sl]
        h *= decay
        h[ex] += 1.0 - decay
        hl = req.history_long[sl]
        hl *= long_decay
        hl[ex] += 1.0 - long_decay
        model = self.next_visit_model
        if model is not None and cfg.transition_weight > 0.0:
            model.step(rank, ex, req.latest, h, hl, req.next_p[sl])
        elif cfg.transition_weight > 0.0:
            self.transitions.step(
                layer, req.last_routed.get(layer), ex, h, hl, cfg.long_history_weight, req.next_p[sl]
            )
        req.last_routed[layer] = ex  # kept either way: the transitions take over if the model goes
        p = self._prior[base : base + self.num_experts]
        p *= prior_decay
        p[ex] += 1.0 - prior_decay
        req.lookahead.pop(layer, None)
        scoring = req.scoring.pop(layer, ())
        if scoring:
            routed = {base + e for e in listed}
            for la in scoring:
                if la.token == token:
                    self._score_lookahead(la, routed)
        if self.estimator is not None:
            self.estimator.observe(req.request_id, layer, entries, int(token))
        req.token, req.layer = int(token), int(layer)
        self._token, self._layer = int(token), int(layer)
        self._needed = entries
        self._bump()

    def _score_lookahead(self, la: _Lookahead, routed: set[int]) -> None:
        stats = self._precision.get(la.depth)
        if stats is None:
            stats = self._precision[la.depth] = _DepthPrecision(
                self.config.lookahead_prior_precision, self._precision_growth
            )
        stats.score(la.keys, la.buckets, routed)

    def set_lookahead(
        self, predictions: Iterable[LayerPrediction], token: int, request_id: str | None = None
    ) -> None:
        """Compute's lookahead for token ``token``: one prediction per depth. A prediction for a
        position the request has passed is dropped; for a layer already predicted at this token,
        the nearer depth wins (it saw a later hidden state)."""
        req = self._request(request_id)
        changed = False
        for pred in predictions:
            layer = int(pred.layer)
            rank = self._rank[layer] if 0 <= layer < self.num_layers else -1
            if rank < 0:
                raise ValueError(f"lookahead for layer {layer}, not a MoE layer")
            if int(pred.depth) < 1:
                raise ValueError(f"lookahead depth must be >= 1, got {pred.depth}")
            ex = np.asarray(pred.experts, dtype=np.int64).reshape(-1)
            sc = np.asarray(pred.scores, dtype=np.float32).reshape(-1)
            if ex.shape != sc.shape:
                raise ValueError(f"lookahead experts {ex.shape} and scores {sc.shape} differ in length")
            if ex.size and (ex.min() < 0 or ex.max() >= self.num_experts):
                raise ValueError(f"lookahead experts {ex.tolist()} outside 0..{self.num_experts - 1}")
            if self._passed(req, int(token), layer):
                continue
            entries = layer * self.num_experts + ex
            keys = entries.tolist()
            la = _Lookahead(int(token), int(pred.depth), entries, sc, keys, self._prior_buckets(req, keys))
            scoring = req.scoring.setdefault(layer, [])
            if scoring and scoring[0].token != la.token:
                scoring.clear()  # left from a token whose layer was never observed
            scoring.append(la)  # every depth is scored when the layer is routed
            old = req.lookahead.get(layer)
            if old is not None and old.token == token and old.depth < la.depth:
                continue
            req.lookahead[layer] = la
            changed = True
        if changed:
            self._bump()

    def _prior_buckets(self, req: RequestSignals, entries: list[int]) -> list[int]:
        """The PRIOR_BUCKET_EDGES bucket of each entry's next-visit estimate for the request (its
        transition estimate, else its history), before any lookahead."""
        w = self.config.long_history_weight
        use_next = self.config.transition_weight > 0.0
        out = []
        for e in entries:  # a few experts: scalar reads beat numpy calls (and _history_of's N) here
            p = float(req.next_p[e]) if use_next else -1.0
            if p < 0.0:  # no transition estimate (a layer not routed yet, or transitions off)
                p = (1.0 - w) * float(req.history[e]) + w * float(req.history_long[e])  # _history_of at e
            out.append(bisect.bisect_right(_BUCKET_EDGES, p))
        return out

    def _passed(self, req: RequestSignals, token: int, layer: int) -> bool:
        """Whether ``(token, layer)`` is at or before the request's position (visit order)."""
        if token != req.token:
            return token < req.token
        return req.layer >= 0 and self._rank[layer] <= self._rank[req.layer]

    def set_hints(
        self,
        hints: Iterable[tuple[int, int, float]],
        token: int | None = None,
        *,
        layers: Iterable[int] | None = None,
        request_id: str | None = None,
    ) -> None:
        """EAMC hints ``(layer, expert, score)`` for the request, received at token ``token``
        (default: the request's position).

        As on the predictor's board, newer hints for a layer replace older ones: the layers in
        ``layers`` (default: those the hints name) are cleared first, so a layer sent with no
        hints drops its stale ones.
        """
        hints = list(hints)
        names = {int(h[0]) for h in hints} if layers is None else {int(x) for x in layers}
        for layer in names:  # validate everything before changing anything
            if not 0 <= layer < self.num_layers:
                raise ValueError(f"hint for layer {layer} outside 0..{self.num_layers - 1}")
        entries = [self.entry_of(ExpertKey(int(layer), int(expert))) for layer, expert, _s in hints]
        req = self._request(request_id)
        token = req.token if token is None else int(token)
        E = self.num_experts
        for layer in names:
            req.hints[layer * E : (layer + 1) * E] = 0.0
        for e, (_layer, _expert, score) in zip(entries, hints, strict=True):
            req.hints[e] = float(score)
            req.hint_token[e] = token
        req.has_hints = bool(hints) or req.has_hints
        if names:
            self._bump()

    # -- outputs ---------------------------------------------------------------------------------

    @property
    def position(self) -> tuple[int, int]:
        """``(token, layer)`` of the last ``observe``."""
        return (self._token, self._layer)

    @property
    def step(self) -> int:
        """The position as one number, ``token * M + MoE index of the layer``."""
        return self._token * self.num_moe + int(self._rank[self._layer])

    @property
    def needed(self) -> np.ndarray:
        """int64 [k] entries routed at the current position (in use now)."""
        return self._needed

    def _history_of(self, req: RequestSignals) -> np.ndarray:
        """float32 [N] the request's per-visit use estimate: its short and long recency-weighted
        histories, blended (a fresh array)."""
        w = np.float32(self.config.long_history_weight)
        return (np.float32(1.0) - w) * req.history + w * req.history_long

    @property
    def history(self) -> np.ndarray:
        """float32 [N] recency-weighted use estimate of the current request (the prior, scaled, when
        there is none); read-only."""
        req = self._current
        v = self._history_of(req) if req is not None else self._prior * self.config.prior_weight
        v.flags.writeable = False
        return v

    @property
    def hints(self) -> np.ndarray:
        """float32 [N] fresh hint scores, the best over the live requests (0 where none or stale)."""

        def compute() -> np.ndarray:
            out = np.zeros(self.num_entries, np.float32)
            for req in self._requests.values():
                if req.has_hints:
                    fresh = (req.token - req.hint_token) <= self.config.hint_ttl_tokens
                    np.maximum(out, np.where(fresh, req.hints, np.float32(0.0)), out=out)
            return out

        return self._cached("hints", compute)

    def _fresh_lookahead(self) -> list[tuple[int, _Lookahead]]:
        def compute() -> list:
            out = []
            for req in self._requests.values():
                for layer, la in req.lookahead.items():
                    if not self._passed(req, la.token, layer):
                        out.append((layer, la))
            dist = self.layer_distance_of
            out.sort(key=lambda t: (dist(t[0]), t[1].depth))
            return out

        return self._cached("fresh_lookahead", compute)

    def lookahead(self) -> list[tuple[int, int, np.ndarray, np.ndarray]]:
        """Fresh lookahead predictions of the live requests, nearest first: ``(layer, depth,
        entries int64 [n], scores float32 [n])``."""
        return self._cached(
            "lookahead",
            lambda: [(layer, la.depth, la.entries, la.scores) for layer, la in self._fresh_lookahead()],
        )

    def lookahead_confidence(self) -> list[np.ndarray]:
        """Aligned with ``lookahead()``: per prediction, float64 [n] the measured precision of its
        depth for each predicted expert's prior bucket (``precision(depth, bucket)``)."""

        def compute() -> list:
            tables: dict[int, np.ndarray] = {}  # depth -> its bucket precisions, once per depth
            out = []
            for _layer, la in self._fresh_lookahead():
                table = tables.get(la.depth)
                if table is None:
                    table = tables[la.depth] = self._bucket_precisions(la.depth)
                out.append(table[la.buckets])
            return out

        return self._cached("lookahead_conf", compute)

    def _bucket_precisions(self, depth: int) -> np.ndarray:
        """float64 [buckets] ``precision(depth, b)`` for every bucket."""
        stats = self._precision.get(depth)
        if stats is None:
            return np.full(len(PRIOR_BUCKET_EDGES) + 1, self.config.lookahead_prior_precision)
        return stats.by_bucket()

    def precision(self, depth: int, bucket: int | None = None) -> float:
        """Running precision of lookahead at ``depth``: the share of its predicted experts that the
        layer then routed (``lookahead_prior_precision`` until some were scored). With
        ``bucket``: of the predicted experts whose estimate before the prediction fell in that
        ``PRIOR_BUCKET_EDGES`` bucket (shrunk towards the depth's precision by ``PRIOR_WEIGHT``
        experts' worth)."""
        if bucket is not None:
            return float(self._bucket_precisions(depth)[bucket])
        stats = self._precision.get(depth)
        if stats is None:
            return self.config.lookahead_prior_precision
        return stats.precision()

    def precisions(self) -> dict[int, float]:
        return {d: self.precision(d) for d in sorted(self._precision)}

    def layer_distance_of(self, layer: int) -> int:
        """MoE layers until ``layer`` is visited next, in ``1..M``."""
        M = self.num_moe
        return int((self._rank[layer] - self._rank[self._layer] - 1) % M + 1)

    def layer_distance(self) -> np.ndarray:
        """int64 [N] MoE layers until each entry's layer is visited next, in ``1..M`` (dense
        layers, never visited: M + 1)."""

        def compute() -> np.ndarray:
            M = self.num_moe
            d = (self._rank_of - self._rank[self._layer] - 1) % M + 1
            return np.where(self._rank_of >= 0, d, M + 1)

        return self._cached("distance", compute)

    def request_probabilities(self) -> list[np.ndarray]:
        """Per live request, float32 [N] its per-visit use probability beyond the next visit:
        its history blended with its fresh hints."""

        def compute() -> list:
            if self.estimator is not None:
                return self.estimator.long_run(self)
            out = [self._with_hints(req, hist) for req, hist in self._histories()]
            if not out:
                out.append(self._prior * self.config.prior_weight)
            return out

        return self._cached("per_request", compute)

    def _histories(self) -> list[tuple[RequestSignals, np.ndarray]]:
        """Per live request, its blended history (``_history_of``), once per version: the long-run
        and the next-visit estimates both start from it."""
        return self._cached(
            "histories", lambda: [(req, self._history_of(req)) for req in self._requests.values()]
        )

    def _with_hints(self, req: RequestSignals, p: np.ndarray) -> np.ndarray:
        """``p`` (float32 [N]) blended with the request's fresh hints by ``hint_weight``."""
        w = self.config.hint_weight
        if w > 0.0 and req.has_hints:
            fresh = (req.token - req.hint_token) <= self.config.hint_ttl_tokens
            h = np.where(fresh, req.hints, np.float32(0.0))
            p = np.where(h > 0.0, (1.0 - w) * p + w * h, p).astype(np.float32)
        return p

    def request_next_probabilities(self) -> list[np.ndarray]:
        """Per live request, float32 [N] its probability of use at each layer's next visit, before
        lookahead, where the request routed the layer before: the learned model's estimate, or
        else the transition estimate blended with the request's fresh hints (each weighted by
        ``transition_weight`` against the history); elsewhere its history blended with its fresh
        hints. The learned estimate is not blended with hints: on the shared trace that cost
        0.6% more bytes at 25% (the model already reads what the hints add)."""

        def compute() -> list:
            tw = np.float32(self.config.transition_weight)
            if self.estimator is not None or tw == 0.0 or not self._requests:
                return self.request_probabilities()
            learned = self.next_visit_model is not None
            out = []
            for req, hist in self._histories():
                blend = tw * req.next_p + (np.float32(1.0) - tw) * hist
                if learned:  # hints only where the model has no estimate yet
                    p = np.where(req.next_p >= 0.0, blend, self._with_hints(req, hist))
                else:
                    p = self._with_hints(req, np.where(req.next_p >= 0.0, blend, hist).astype(np.float32))
                out.append(p.astype(np.float32, copy=False))
            return out

        return self._cached("per_request_next", compute)

    @staticmethod
    def _any_of(ps: list[np.ndarray]) -> np.ndarray:
        """Probability that any of the requests uses each entry, ``1 - prod (1 - p)``."""
        if len(ps) == 1:
            return ps[0].view()  # a view: the cache marks it read-only, not the request's array
        miss = np.ones(ps[0].shape, np.float32)
        for p in ps:
            miss *= 1.0 - np.clip(p, 0.0, 1.0)
        return (1.0 - miss).astype(np.float32)

    def long_run_probability(self) -> np.ndarray:
        """float32 [N] per-visit probability that any live request uses each entry, beyond the
        next visit."""

        return self._cached("long_run", lambda: self._any_of(self.request_probabilities()))

    def use_probability(self) -> np.ndarray:
        """float32 [N] estimated probability that each entry is used at its layer's next visit:
        the requests' next-visit estimates (``request_next_probabilities``) combined, overridden
        for each predicted layer by its lookahead (a predicted expert gets the depth's measured
        precision, the layer's others keep ``1 - precision`` of their estimate)."""

        def compute() -> np.ndarray:
            p = self._any_of(self.request_next_probabilities())
            la = self.lookahead()
            if not la:
                return p
            p = p.copy()
            E = self.num_experts
            for (layer, depth, entries, _scores), conf in zip(la, self.lookahead_confidence(), strict=True):
                sl = slice(layer * E, (layer + 1) * E)
                p[sl] *= 1.0 - self.precision(depth)
                p[entries] = np.maximum(p[entries], conf)
            return p

        return self._cached("use_p", compute)

    def next_use_layers(self) -> np.ndarray:
        """float64 [N] expected layer steps until each entry's next use (see the glossary); the
        entries in use now get 0."""

        def compute() -> np.ndarray:
            if self.estimator is not None:
                t = self.estimator.next_use(self)
            else:
                M = self.num_moe
                p_next = self.use_probability().astype(np.float64)
                p_long = np.maximum(
                    self.long_run_probability().astype(np.float64), self.config.probability_floor
                )
                t = self.layer_distance().astype(np.float64) + M * (1.0 - p_next) / p_long
            if self._needed.size:
                t[self._needed] = 0.0
            return t

        return self._cached("next_use", compute)


__all__ = [
    "ActivationSignals",
    "LayerPrediction",
    "RequestSignals",
    "SignalsConfig",
    "next_visit_model_mismatch",
]
