"""The read side of ``ActivationSignals``: what the eviction policies and the prefetch scheduler
ask of it (positions, lookahead, use probabilities, next-use estimates). The terms are those of
``cache_daemon.decisions.signals``' glossary.

Every answer is derived from the signals' state and cached until the next change (``version``):
a policy and the scheduler read the same arrays many times between two routed layers.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

import numpy as np

from cache_daemon.decisions.lookahead import Lookahead, LookaheadPrecision
from cache_daemon.decisions.request_signals import RequestSignals

if TYPE_CHECKING:
    from cache_daemon.decisions.next_visit import NextVisitModel
    from cache_daemon.decisions.signals import Estimator, SignalsConfig
    from expertcache.layers import LayerMap


class UseEstimates:
    """The queries of ``ActivationSignals`` (which sets the state declared here and changes it)."""

    num_layers: int
    num_experts: int
    num_entries: int
    num_moe: int
    layer_map: LayerMap
    config: SignalsConfig
    version: int  # bumped on every change, so a waiting prefetcher knows to re-decide
    estimator: Estimator | None
    next_visit_model: NextVisitModel | None
    _rank: np.ndarray  # [num_layers] MoE index per layer, -1 dense
    _rank_of: np.ndarray  # [N]
    _prior: np.ndarray  # slow cross-request estimate
    _requests: OrderedDict[str, RequestSignals]  # live, least recent first
    _current: RequestSignals | None  # the request of the last observe
    _token: int
    _layer: int
    _needed: np.ndarray  # entries routed at the current position
    _cache: dict[str, object]  # derived values of the current version
    _precision: LookaheadPrecision

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

    @property
    def history(self) -> np.ndarray:
        """float32 [N] recency-weighted use estimate of the current request (the prior, scaled, when
        there is none); read-only."""
        req = self._current
        v = (
            req.blended_history(self.config.long_history_weight)
            if req is not None
            else self._prior * self.config.prior_weight
        )
        v.flags.writeable = False
        return v

    @property
    def hints(self) -> np.ndarray:
        """float32 [N] fresh hint scores, the best over the live requests (0 where none or stale)."""

        def compute() -> np.ndarray:
            out = np.zeros(self.num_entries, np.float32)
            for req in self._requests.values():
                if req.has_hints:
                    np.maximum(out, req.fresh_hints(self.config.hint_ttl_tokens), out=out)
            return out

        return self._cached("hints", compute)

    def _fresh_lookahead(self) -> list[tuple[int, Lookahead]]:
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
        return self._precision.by_bucket(depth, self.config.lookahead_prior_precision)

    def precision(self, depth: int, bucket: int | None = None) -> float:
        """Running precision of lookahead at ``depth``: the share of its predicted experts that the
        layer then routed (``lookahead_prior_precision`` until some were scored). With
        ``bucket``: of the predicted experts whose estimate before the prediction fell in that
        ``PRIOR_BUCKET_EDGES`` bucket (shrunk towards the depth's precision by ``PRIOR_WEIGHT``
        experts' worth)."""
        if bucket is not None:
            return float(self._bucket_precisions(depth)[bucket])
        return self._precision.precision(depth, self.config.lookahead_prior_precision)

    def precisions(self) -> dict[int, float]:
        return {d: self.precision(d) for d in self._precision.depths()}

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
            cfg = self.config
            out = [
                req.with_hints(hist, cfg.hint_weight, cfg.hint_ttl_tokens) for req, hist in self._histories()
            ]
            if not out:
                out.append(self._prior * self.config.prior_weight)
            return out

        return self._cached("per_request", compute)

    def _histories(self) -> list[tuple[RequestSignals, np.ndarray]]:
        """Per live request, its blended history (``RequestSignals.blended_history``), once per
        version: the long-run and the next-visit estimates both start from it."""
        w = self.config.long_history_weight
        return self._cached(
            "histories", lambda: [(req, req.blended_history(w)) for req in self._requests.values()]
        )

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
            hw, ttl = self.config.hint_weight, self.config.hint_ttl_tokens
            out = []
            for req, hist in self._histories():
                blend = tw * req.next_p + (np.float32(1.0) - tw) * hist
                if learned:  # hints only where the model has no estimate yet
                    p = np.where(req.next_p >= 0.0, blend, req.with_hints(hist, hw, ttl))
                else:
                    p = req.with_hints(np.where(req.next_p >= 0.0, blend, hist).astype(np.float32), hw, ttl)
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

    def _passed(self, req: RequestSignals, token: int, layer: int) -> bool:
        """Whether ``(token, layer)`` is at or before the request's position (visit order)."""
        if token != req.token:
            return token < req.token
        return req.layer >= 0 and self._rank[layer] <= self._rank[req.layer]


__all__ = ["UseEstimates"]
