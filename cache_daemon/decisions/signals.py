"""Activation signals: what the daemon knows about the experts the live requests will use next.

``ActivationSignals`` takes compute's routing (``observe``) and lookahead (``set_lookahead``) and
the predictor's hints (``set_hints``), per live request, and answers the eviction policies and the
prefetch scheduler through its read side (``use_estimates``); the daemon and the trace replay run
this same code. Not thread-safe and no I/O: callers serialise. The glossary (entry, position,
layer distance, depth, next use) is in ``docs/daemon.md``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from cache_daemon.decisions.lookahead import Lookahead
from cache_daemon.decisions.next_visit import NextVisitModel
from cache_daemon.decisions.request_signals import RequestSignals
from cache_daemon.decisions.signals_config import SignalsConfig
from cache_daemon.decisions.transitions import TransitionModel
from cache_daemon.decisions.use_estimates import Estimator, SignalsGrid, UseEstimates
from expertcache.keys import ExpertKey
from expertcache.layers import LayerMap

logger = logging.getLogger(__name__)

DEFAULT_REQUEST = ""  # the request of routing that names none


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


class ActivationSignals(UseEstimates):
    """Prediction state of one tier's model: history, lookahead and hints, per live request.

    ``num_layers`` × ``num_experts`` is the tier's entry grid (``SignalsGrid``); ``layer_map`` says which of the
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
        super().__init__(
            SignalsGrid(num_layers, num_experts, layer_map), config or SignalsConfig(), estimator
        )
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
        self._model_latest = 0  # per request, the model's view of every layer's latest routing
        # Every entry's key, made once: the scheduler and the policies ask for keys by entry
        # thousands of times a second (a fresh ExpertKey each was 6% of a replay's time).
        self._keys = tuple(
            ExpertKey(layer, expert) for layer in range(num_layers) for expert in range(num_experts)
        )
        self.set_next_visit_model(next_visit_model)
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
            req.tail_p[:] = -1.0
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
        if 0 <= entry < self.num_entries:
            return self._keys[entry]
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
        grid = self.grid
        E = grid.num_experts
        rank = grid.rank[layer] if 0 <= layer < grid.num_layers else -1
        if rank < 0:
            raise ValueError(f"layer {layer} is not a MoE layer of {list(grid.layer_map.moe_layers)}")
        ex = np.asarray(experts, dtype=np.int64).reshape(-1)
        listed = ex.tolist()  # a few experts: Python's min and max beat numpy's calls here
        if listed and (min(listed) < 0 or max(listed) >= E):
            raise ValueError(f"experts {listed} outside 0..{E - 1}")
        req = self._request(request_id)
        self._current = req
        self._requests.move_to_end(req.request_id)
        base = layer * E
        entries = base + ex
        cfg = self.config
        decay, long_decay, prior_decay = self._decays
        sl = slice(base, base + E)
        h = req.history[sl]
        h *= decay
        h[ex] += 1.0 - decay
        hl = req.history_long[sl]
        hl *= long_decay
        hl[ex] += 1.0 - long_decay
        model = self.next_visit_model
        if model is not None and cfg.transition_weight > 0.0:
            model.step(
                rank, ex, req.latest, h, hl, req.next_p[sl], req.tail_p[sl] if model.has_horizon else None
            )
        elif cfg.transition_weight > 0.0:
            self.transitions.step(
                layer, req.last_routed.get(layer), ex, h, hl, cfg.long_history_weight, req.next_p[sl]
            )
        req.last_routed[layer] = ex  # kept either way: the transitions take over if the model goes
        p = self._prior[base : base + E]
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
        self._position = (int(token), int(layer))
        self._needed = entries
        self._bump()

    def set_lookahead(
        self, predictions: Iterable[LayerPrediction], token: int, request_id: str | None = None
    ) -> None:
        """Compute's lookahead for token ``token``: one prediction per depth. A prediction for a
        position the request has passed is dropped; for a layer already predicted at this token,
        the nearer depth wins (it saw a later hidden state)."""
        req = self._request(request_id)
        grid = self.grid
        cfg = self.config
        changed = False
        for pred in predictions:
            layer = int(pred.layer)
            rank = grid.rank[layer] if 0 <= layer < grid.num_layers else -1
            if rank < 0:
                raise ValueError(f"lookahead for layer {layer}, not a MoE layer")
            if int(pred.depth) < 1:
                raise ValueError(f"lookahead depth must be >= 1, got {pred.depth}")
            ex = np.asarray(pred.experts, dtype=np.int64).reshape(-1)
            sc = np.asarray(pred.scores, dtype=np.float32).reshape(-1)
            if ex.shape != sc.shape:
                raise ValueError(f"lookahead experts {ex.shape} and scores {sc.shape} differ in length")
            listed = ex.tolist()  # a few experts: Python's min and max beat numpy's calls here
            if listed and (min(listed) < 0 or max(listed) >= grid.num_experts):
                raise ValueError(f"lookahead experts {listed} outside 0..{grid.num_experts - 1}")
            if self._passed(req, int(token), layer):
                continue
            entries = layer * grid.num_experts + ex
            base = layer * grid.num_experts
            keys = [base + e for e in listed]
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
