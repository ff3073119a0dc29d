"""The read side of ``ActivationSignals`` (``UseEstimates``): what the eviction policies and the
prefetch scheduler ask of it (positions, lookahead, use probabilities, next-use estimates), with
the state those answers read. Each answer is derived once per change of that state (``version``):
a policy and the scheduler read the same arrays many times between two routed layers.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, TypeVar

import numpy as np

from cache_daemon.decisions.lookahead import Lookahead, LookaheadPrecision
from cache_daemon.decisions.request_signals import RequestSignals
from expertcache import native
from expertcache.layers import LayerMap

if TYPE_CHECKING:
    from cache_daemon.decisions.next_visit import NextVisitModel
    from cache_daemon.decisions.signals_config import SignalsConfig

T = TypeVar("T")


class SignalsGrid:
    """The entries of one tier's model, ``num_layers * num_experts`` (an entry is ``layer *
    num_experts + expert``), and the order in which ``layer_map`` visits its MoE layers (default:
    every layer, in order)."""

    def __init__(self, num_layers: int, num_experts: int, layer_map: LayerMap | None = None) -> None:
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
        self.rank = layer_map.ranks()  # [num_layers] MoE index per layer, -1 dense
        self.rank_of = np.repeat(self.rank, num_experts)  # [N] the rank of each entry's layer
        self._distances: dict[int, np.ndarray] = {}  # position layer -> distance_from(layer)

    def distance_from(self, layer: int) -> np.ndarray:
        """int64 [N] MoE layers from a position at ``layer`` until each entry's layer is visited
        next, in ``1..M`` (dense layers, never visited: M + 1); read-only, made once per layer."""
        d = self._distances.get(layer)
        if d is None:
            M, rank_of = self.num_moe, self.rank_of
            d = (rank_of - self.rank[layer] - 1) % M + 1
            d = np.where(rank_of >= 0, d, M + 1)
            d.flags.writeable = False
            self._distances[layer] = d
        return d


class DerivedValues:
    """Values derived from the signals' state, each computed once per ``version``."""

    def __init__(self) -> None:
        self.version = 0  # bumped on every change, so a waiting prefetcher knows to re-decide
        self._values: dict[str, object] = {}

    def bump(self) -> None:
        self.version += 1
        self._values.clear()

    def get(self, name: str, compute: Callable[[], T]) -> T:
        """The value ``name`` of this version, ``compute()``d at its first read (an array
        read-only)."""
        v = self._values.get(name)
        if v is None:
            v = compute()
            if isinstance(v, np.ndarray):
                v.flags.writeable = False
            self._values[name] = v
        return v


class Estimator(Protocol):
    """A use-probability estimate plugged into ``ActivationSignals`` in place of the built-in one
    (the replay's ``replay.hazard.HazardEstimator``); the daemon plugs in none."""

    def attach(self, signals: UseEstimates) -> None: ...

    def begin_request(self, request_id: str) -> None: ...

    def observe(self, request_id: str, layer: int, entries: np.ndarray, token: int) -> None:
        """Layer ``layer`` of ``token`` routed to ``entries`` (int64, before the signals move)."""
        ...

    def long_run(self, signals: UseEstimates) -> list[np.ndarray]:
        """Per live request, float32 [N] per-visit use probability beyond the next visit."""
        ...

    def next_use(self, signals: UseEstimates) -> np.ndarray:
        """float64 [N] expected layer steps to each entry's next use (a fresh array)."""
        ...


class UseEstimates:
    """The queries of ``ActivationSignals`` over the state they read: the grid, the live requests,
    the position of the last ``observe`` and what was learned across requests (the inputs, in
    ``ActivationSignals``, change it)."""

    def __init__(self, grid: SignalsGrid, config: SignalsConfig, estimator: Estimator | None) -> None:
        self.grid = grid
        self.config = config
        self.estimator = estimator
        self.next_visit_model: NextVisitModel | None = None
        self._derived = DerivedValues()
        self._prior = np.zeros(grid.num_entries, np.float32)  # slow cross-request estimate
        self._requests: OrderedDict[str, RequestSignals] = OrderedDict()  # live, least recent first
        self._current: RequestSignals | None = None  # the request of the last observe
        self._position = (-1, grid.layer_map.moe_layers[-1])  # (token, layer) of the last observe
        self._needed = np.zeros(0, np.int64)  # entries routed at the current position
        # Running precision of lookahead per depth (and per prior bucket), fading per scoring.
        self._precision = LookaheadPrecision(config.precision_half_life)

    @property
    def num_layers(self) -> int:
        return self.grid.num_layers

    @property
    def num_experts(self) -> int:
        return self.grid.num_experts

    @property
    def num_entries(self) -> int:
        return self.grid.num_entries

    @property
    def num_moe(self) -> int:
        return self.grid.num_moe

    @property
    def layer_map(self) -> LayerMap:
        return self.grid.layer_map

    @property
    def version(self) -> int:
        """Bumped on every change, so a waiting prefetcher knows to re-decide."""
        return self._derived.version

    def _bump(self) -> None:
        self._derived.bump()

    def _cached(self, name: str, compute: Callable[[], T]) -> T:
        return self._derived.get(name, compute)

    @property
    def position(self) -> tuple[int, int]:
        """``(token, layer)`` of the last ``observe``."""
        return self._position

    @property
    def step(self) -> int:
        """The position as one number, ``token * M + MoE index of the layer``."""
        token, layer = self._position
        return token * self.grid.num_moe + int(self.grid.rank[layer])

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
            out = np.zeros(self.grid.num_entries, np.float32)
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
        M, rank = self.grid.num_moe, self.grid.rank
        return int((rank[layer] - rank[self._position[1]] - 1) % M + 1)

    def layer_distance(self) -> np.ndarray:
        """int64 [N] MoE layers until each entry's layer is visited next, in ``1..M`` (dense
        layers, never visited: M + 1)."""

        return self.grid.distance_from(self._position[1])

    def request_probabilities(self) -> list[np.ndarray]:
        """Per live request, float32 [N] its per-visit use probability beyond the next visit:
        its history blended with its fresh hints."""

        def compute() -> list:
            if self.estimator is not None:
                return self.estimator.long_run(self)
            out = list(self._request_rows()[0])
            if not out:
                out.append(self._prior * self.config.prior_weight)
            return out

        return self._cached("per_request", compute)

    def request_next_probabilities(self) -> list[np.ndarray]:
        """Per live request, float32 [N] its probability of use at each layer's next visit, before
        lookahead, where the request routed the layer before: the learned model's estimate, or
        else the transition estimate blended with the request's fresh hints (each weighted by
        ``transition_weight`` against the history); elsewhere its history blended with its fresh
        hints. The learned estimate is not blended with hints: on the shared trace that cost
        0.6% more bytes at 25% (the model already reads what the hints add)."""
        if self.estimator is not None or self.config.transition_weight == 0.0 or not self._requests:
            return self.request_probabilities()
        return list(self._request_rows()[1])

    def _request_rows(self) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
        """Per live request, its long-run and (with a transition weight above 0) next-visit
        estimates, in one native pass over its entries each (``native.request_estimates``: the
        same arithmetic as numpy's ``(1 - w) * history + w * history_long``, blended with the
        next-visit estimate and the fresh hints, element for element)."""

        def compute() -> tuple:
            cfg = self.config
            n = self.grid.num_entries
            learned = self.next_visit_model is not None
            with_next = cfg.transition_weight > 0.0
            longs, nexts = [], []
            for req in self._requests.values():
                long_run = np.empty(n, np.float32)
                next_visit = np.empty(n, np.float32) if with_next else None
                native.request_estimates(
                    req.history,
                    req.history_long,
                    req.next_p,
                    req.hints,
                    req.hint_token,
                    req.token,
                    req.has_hints,
                    cfg.long_history_weight,
                    cfg.transition_weight,
                    cfg.hint_weight,
                    cfg.hint_ttl_tokens,
                    learned,
                    long_run,
                    next_visit,
                )
                for row in (long_run, next_visit):
                    if row is not None:
                        row.flags.writeable = False
                longs.append(long_run)
                nexts.append(next_visit)
            return tuple(longs), tuple(nexts)

        return self._cached("request_rows", compute)

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

    def tail_probability(self) -> np.ndarray:
        """float32 [N] per-visit probability that any live request uses each entry at the visits
        after its layer's next one: per request, the larger of the learned model's horizon head
        (``NextVisitModel.step``'s ``tail``, where it has estimated the entry) and the request's
        long-run estimate. The larger: the head alone underestimates what a request keeps using
        (docs/daemon.md, "The horizon head", has the replay's figures). Without a model with a
        horizon head (or with a plugged-in estimator), ``long_run_probability`` itself."""
        model = self.next_visit_model
        if (
            model is None
            or not model.has_horizon
            or self.estimator is not None
            or self.config.transition_weight == 0.0
            or not self._requests
        ):
            return self.long_run_probability()

        def compute() -> np.ndarray:
            rows = [  # tail_p is -1 where the model has not estimated the entry
                np.maximum(req.tail_p, long_run)
                for req, long_run in zip(self._requests.values(), self.request_probabilities(), strict=True)
            ]
            return self._any_of(rows)

        return self._cached("tail", compute)

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
            # Per prediction, in order: p[layer's row] *= 1 - precision(depth); p[entries] =
            # maximum(p[entries], conf), in one native pass.
            native.apply_lookahead(
                p,
                self.grid.num_experts,
                [
                    (layer, 1.0 - self.precision(depth), entries, conf)
                    for (layer, depth, entries, _scores), conf in zip(
                        la, self.lookahead_confidence(), strict=True
                    )
                ],
            )
            return p

        return self._cached("use_p", compute)

    def next_use_layers(self) -> np.ndarray:
        """float64 [N] expected layer steps until each entry's next use (see the glossary); the
        entries in use now get 0."""

        def compute() -> np.ndarray:
            if self.estimator is not None:
                t = self.estimator.next_use(self)
            else:  # distance + M * (1 - p_next) / max(p_long, floor), in float64, in one pass
                t = np.empty(self.grid.num_entries, np.float64)
                native.next_use_layers(
                    self.layer_distance(),
                    self.use_probability(),
                    self.long_run_probability(),
                    self.grid.num_moe,
                    self.config.probability_floor,
                    t,
                )
            if self._needed.size:
                t[self._needed] = 0.0
            return t

        return self._cached("next_use", compute)

    def idle_log_survival(self) -> np.ndarray:
        """float64 [N] the log of the probability that each entry goes unused over the next
        ``eviction_horizon_tokens * M`` layer steps: used at its layer's next visit with
        ``use_probability`` and at each later visit within the horizon with
        ``tail_probability``, independently (0 where the next visit is beyond the horizon);
        the entries in use now get -inf. The activation-aware policy evicts the highest first."""

        def compute() -> np.ndarray:
            t = np.empty(self.grid.num_entries, np.float64)
            native.idle_log_survival(
                self.layer_distance(),
                self.use_probability(),
                self.tail_probability(),
                self.grid.num_moe,
                self.config.eviction_horizon_tokens * self.grid.num_moe,
                t,
            )
            if self._needed.size:
                t[self._needed] = -np.inf
            return t

        return self._cached("idle_log_survival", compute)

    def _passed(self, req: RequestSignals, token: int, layer: int) -> bool:
        """Whether ``(token, layer)`` is at or before the request's position (visit order)."""
        if token != req.token:
            return token < req.token
        rank = self.grid.rank
        return req.layer >= 0 and rank[layer] <= rank[req.layer]


__all__ = ["DerivedValues", "Estimator", "SignalsGrid", "UseEstimates"]
