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

Modules: this one (the inputs: requests, ``observe``, ``set_lookahead``, ``set_hints``),
``use_estimates`` (the outputs, read by the policies and the scheduler), ``request_signals`` (one
request's state), ``lookahead`` (kept predictions and each depth's precision).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from cache_daemon.decisions.lookahead import Lookahead, LookaheadPrecision
from cache_daemon.decisions.next_visit import NextVisitModel
from cache_daemon.decisions.request_signals import RequestSignals
from cache_daemon.decisions.transitions import TransitionModel
from cache_daemon.decisions.use_estimates import UseEstimates
from expertcache.keys import ExpertKey
from expertcache.layers import LayerMap

logger = logging.getLogger(__name__)

DEFAULT_REQUEST = ""  # the request of routing that names none


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


class Estimator(Protocol):
    """What ``ActivationSignals`` asks of a plugged-in estimator (the replay's: ``replay.hazard``)."""

    def attach(self, signals: ActivationSignals) -> None: ...

    def begin_request(self, request_id: str) -> None: ...

    def observe(self, request_id: str, layer: int, entries: np.ndarray, token: int) -> None:
        """Layer ``layer`` of ``token`` routed to ``entries`` (int64, before the signals move)."""
        ...

    def long_run(self, signals: ActivationSignals) -> list[np.ndarray]:
        """Per live request, float32 [N] per-visit use probability beyond the next visit."""
        ...

    def next_use(self, signals: ActivationSignals) -> np.ndarray:
        """float64 [N] expected layer steps to each entry's next use (a fresh array)."""
        ...


class ActivationSignals(UseEstimates):
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
        self._precision = LookaheadPrecision(self.config.precision_half_life)
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
            prior = cfg.lookahead_prior_precision
            for la in scoring:
                if la.token == token:
                    self._precision.score(la, routed, prior)
        if self.estimator is not None:
            self.estimator.observe(req.request_id, layer, entries, int(token))
        req.token, req.layer = int(token), int(layer)
        self._token, self._layer = int(token), int(layer)
        self._needed = entries
        self._bump()

    def set_lookahead(
        self, predictions: Iterable[LayerPrediction], token: int, request_id: str | None = None
    ) -> None:
        """Compute's lookahead for token ``token``: one prediction per depth. A prediction for a
        position the request has passed is dropped; for a layer already predicted at this token,
        the nearer depth wins (it saw a later hidden state)."""
        req = self._request(request_id)
        cfg = self.config
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
            buckets = req.prior_buckets(keys, cfg.long_history_weight, cfg.transition_weight > 0.0)
            la = Lookahead(int(token), int(pred.depth), entries, sc, keys, buckets)
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


__all__ = [
    "ActivationSignals",
    "Estimator",
    "LayerPrediction",
    "SignalsConfig",
    "next_visit_model_mismatch",
]
