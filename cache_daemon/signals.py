"""Activation signals: what the daemon knows about the experts the running request will use next.

Three predictions, each with its own horizon, land here and are read by the eviction policies and
the prefetch scheduler (both daemon and trace replay share this object's code):

::

    compute ──observe(layer, experts, token)──────────▶ history  (the request's own routing, with recency)
    compute ──set_layer_ahead(layer, experts, scores)─▶ layer_ahead (router of layer l+1 on layer l's state)
    predictor ──set_hints([(layer, expert, score)])───▶ hints    (EAMC match / next-token guesses)
                                                           │
                        use_probability(), next_use_layers() ▼  policies · PrefetchScheduler

Glossary (worked example with 24 layers × 32 experts):

- *entry*: the int ``layer * num_experts + expert``; ``ExpertKey(2, 5)`` is entry ``2*32+5 = 69``.
  Every array here is ``[num_layers * num_experts]`` indexed by entry.
- *position*: ``(token, layer)`` of the last ``observe``; before any, ``(-1, num_layers - 1)``, so the
  next visit is layer 0 of token 0. After ``observe(3, [..], token=7)`` the position is ``(7, 3)``.
- *layer distance* of an entry: layer steps until its layer is visited next, in ``1..num_layers``
  (at position ``(7, 3)``, layer 4 is 1 step away, layer 3 is 24 steps away, layer 2 is 23).
- *use probability*: estimated probability that the entry is routed to at its layer's next visit.
- *next use* (in layer steps): an online stand-in for Belady's "time of next use". With the
  ``ema`` estimator (default) ``distance + num_layers * (1 - p_next) / max(p_long, floor)``, the
  expected wait of a geometric process whose first trial has probability ``p_next`` and later
  trials ``p_long`` (``p_long``: the recency-weighted history blended with fresh hints); with the
  ``hazard`` estimator ``distance + num_layers * W``, ``W`` the expected further visits before
  use from an online-learned hazard table (``HazardTable``).

Staleness: a layer-ahead prediction for a ``(token, layer)`` at or before the position is ignored;
hints older than ``hint_ttl_tokens`` tokens are ignored.

Not thread-safe and does no I/O: callers (the daemon's prefetch lock, the replay loop) serialise.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from expertcache.keys import ExpertKey

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SignalsConfig:
    """Tuning of ``ActivationSignals``; few and generic on purpose (no per-trace constants)."""

    history_half_life_tokens: float = field(default=8.0, metadata={"min": 0.05, "max": 1e6})
    """Half-life, in tokens, of the request's recency-weighted use estimate of an entry: after
    ``h`` tokens without use an entry's estimate halves (recency and in-request frequency at
    once; 1, 2, 4, 8, 16, 32 tried on a tuning window, 8 best — see bench/replay_tune.py)."""

    prior_half_life_tokens: float = field(default=2000.0, metadata={"min": 1.0, "max": 1e9})
    """Half-life, in tokens, of the slow cross-request estimate a new request starts from."""

    prior_weight: float = field(default=0.5, metadata={"min": 0.0, "max": 1.0})
    """Weight of the cross-request estimate in the history of a request that just began (it then
    decays with the request's own half-life as the request's routing accumulates)."""

    hint_weight: float = field(default=0.3, metadata={"min": 0.0, "max": 1.0})
    """Weight of a fresh EAMC / next-token hint score blended into the history estimate."""

    hint_ttl_tokens: int = field(default=64, metadata={"min": 0, "max": 1 << 30})
    """Hints older than this many tokens are ignored (stale)."""

    layer_ahead_confidence: float = field(default=0.9, metadata={"min": 0.0, "max": 1.0})
    """Probability assigned to an expert that the layer-ahead router predicted, for its next
    visit; experts of that layer it did not predict keep ``(1 - confidence)`` of their estimate."""

    estimator: str = field(default="ema", metadata={"choices": ("hazard", "ema")})
    """How the use probability at an entry's next visit is estimated: ``hazard`` learns it online
    from the routing seen so far, per state (recency, request frequency, hint score) — see
    ``HazardTable``; ``ema`` uses the recency-weighted history blended with hints."""

    hazard_prior_count: float = field(default=8.0, metadata={"min": 0.0, "max": 1e9})
    """Pseudo-observations at the base rate ``top_k / num_experts`` in each hazard cell, so a
    cell seen rarely stays near the base rate."""

    probability_floor: float = field(default=1e-3, metadata={"min": 1e-9, "max": 1.0})
    """Lower bound on a long-run use probability (keeps next-use estimates finite)."""

    def __post_init__(self) -> None:
        for name, spec in self.__dataclass_fields__.items():
            value = getattr(self, name)
            if "choices" in spec.metadata:
                if value not in spec.metadata["choices"]:
                    raise ValueError(
                        f"SignalsConfig.{name} must be one of {list(spec.metadata['choices'])}, got {value!r}"
                    )
                continue
            lo, hi = spec.metadata["min"], spec.metadata["max"]
            if not (lo <= value <= hi):
                raise ValueError(f"SignalsConfig.{name} must be in [{lo}, {hi}], got {value!r}")


RECENCY_BUCKETS = 8  # tokens since the last use: 1, 2, 3-4, 5-8, 9-16, 17-32, 33-64, 65+
COLD = RECENCY_BUCKETS  # not used yet in this request
RATE_EDGES = np.array([0.1, 0.2, 0.35, 0.5])  # uses per token in this request
HINT_EDGES = np.array([0.05, 0.2, 0.5])  # fresh hint score (below 0.05: none)
MAX_RECENCY = 1 << (RECENCY_BUCKETS - 2)  # 64: the last bucket starts above it


def recency_bucket(d: np.ndarray) -> np.ndarray:
    """int64 bucket of ``d`` >= 1 tokens since the last use: ceil(log2 d), capped."""
    d = np.maximum(np.asarray(d, np.int64), 1)
    return np.minimum(np.ceil(np.log2(d)).astype(np.int64), RECENCY_BUCKETS - 1)


class HazardTable:
    """Online estimate of P(an entry is used at a visit of its layer | its state at that visit).

    State = (recency bucket or COLD, request-frequency bucket, hint bucket): 9 × 5 × 4 cells,
    generic log-scale edges, learned from every visit observed so far (nothing from the future),
    smoothed by ``prior_count`` pseudo-visits at the base rate ``top_k / num_experts``.

    ``wait[r, f, h, d]`` is the expected number of *further* visits before the use, starting at a
    visit with recency ``d`` (1..MAX_RECENCY + 1, the last standing for "more") — the recursion
    ``W(d) = (1 - h(d)) * (1 + W(d + 1))`` along the recency an unused entry ages through;
    index 0 holds COLD (``(1 - h) / h``, it stays cold).
    """

    def __init__(self, prior_count: float) -> None:
        shape = (RECENCY_BUCKETS + 1, len(RATE_EDGES) + 1, len(HINT_EDGES) + 1)
        self.prior_count = prior_count
        self.visits = np.zeros(shape, np.float64)
        self.uses = np.zeros(shape, np.float64)
        self.base_rate = 0.125
        self.hazard = np.full(shape, self.base_rate)
        self.wait = np.zeros((shape[1], shape[2], MAX_RECENCY + 2), np.float64)
        self.refresh()

    def observe(self, cells: tuple[np.ndarray, np.ndarray, np.ndarray], used: np.ndarray) -> None:
        """One layer visit: ``cells`` (recency, rate, hint buckets) int64 [E], ``used`` bool [E]."""
        r, f, h = cells
        np.add.at(self.visits, (r, f, h), 1.0)
        np.add.at(self.uses, (r[used], f[used], h[used]), 1.0)

    def refresh(self) -> None:
        """Recompute hazards and waits from the counts (once per token is plenty)."""
        a = self.prior_count
        self.hazard = (self.uses + a * self.base_rate) / (self.visits + a)
        hz = np.clip(self.hazard, 1e-6, 1.0)
        w = self.wait
        last = hz[RECENCY_BUCKETS - 1]  # [f, h] hazard beyond MAX_RECENCY
        w[:, :, MAX_RECENCY + 1] = (1.0 - last) / last
        buckets = recency_bucket(np.arange(1, MAX_RECENCY + 1))
        for d in range(MAX_RECENCY, 0, -1):
            hd = hz[buckets[d - 1]]
            w[:, :, d] = (1.0 - hd) * (1.0 + w[:, :, d + 1])
        cold = hz[COLD]
        w[:, :, 0] = (1.0 - cold) / cold


class ActivationSignals:
    """Prediction state of one tier's model: history, layer-ahead and hints, per entry.

    ``num_layers`` × ``num_experts`` must match the model the tier caches (MoE layer indices
    in manifest order, as ``ExpertKey.layer``).
    """

    def __init__(self, num_layers: int, num_experts: int, *, config: SignalsConfig | None = None) -> None:
        if num_layers < 1 or num_experts < 1:
            raise ValueError(f"num_layers and num_experts must be >= 1, got {num_layers} and {num_experts}")
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.num_entries = num_layers * num_experts
        self.config = config or SignalsConfig()
        n = self.num_entries
        cfg = self.config
        # Per visit of a layer, the decay of its entries' estimates (one visit per token).
        self._decay = float(0.5 ** (1.0 / cfg.history_half_life_tokens))
        self._prior_decay = float(0.5 ** (1.0 / cfg.prior_half_life_tokens))
        self._history = np.zeros(n, np.float32)  # request's recency-weighted use per visit
        self._prior = np.zeros(n, np.float32)  # slow cross-request estimate
        self._last_use = np.full(n, -1, np.int64)  # token of the last observed use (-1: never)
        self._uses = np.zeros(n, np.int64)  # uses in the current request
        self._hints = np.zeros(n, np.float32)
        self._hint_token = np.full(n, np.iinfo(np.int64).min // 2, np.int64)
        self._la_experts = np.zeros(0, np.int64)  # entries predicted by layer-ahead
        self._la_scores = np.zeros(0, np.float32)
        self._la_pos: tuple[int, int] | None = None  # (token, layer) the prediction is for
        self._token = -1
        self._layer = num_layers - 1
        self._needed = np.zeros(0, np.int64)  # entries routed at the current position
        self._request: str | None = None
        self.version = 0  # bumped on every change, so a waiting prefetcher knows to re-decide
        self._cache: dict[str, np.ndarray] = {}  # derived arrays of the current version
        self._layer_of = np.repeat(np.arange(num_layers, dtype=np.int64), num_experts)
        self._req_start = 0  # first token of the current request
        self._req_fresh = True  # no token of the current request observed yet
        self._req_last = np.full(n, -1, np.int64)  # last use in this request (-1: none yet)
        self._table = HazardTable(cfg.hazard_prior_count)
        self._table_token = -1

    def _bump(self) -> None:
        self.version += 1
        self._cache.clear()

    def _cached(self, name: str, compute) -> np.ndarray:
        v = self._cache.get(name)
        if v is None:
            v = compute()
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

    # -- inputs ----------------------------------------------------------------------------------

    def begin_request(self, request_id: str) -> None:
        """A request starts: its history restarts from the cross-request prior."""
        self._request = request_id
        self._history[:] = self._prior * self.config.prior_weight
        self._uses[:] = 0
        self._req_fresh = True
        self._req_last[:] = -1
        self._hints[:] = 0.0
        self._la_pos = None
        self._bump()

    def end_request(self, request_id: str) -> None:
        """The request ended; its hints and layer-ahead prediction are dropped (history stays
        as the recency state, since the next request on the same model starts near it)."""
        if self._request == request_id:
            self._request = None
        self._hints[:] = 0.0
        self._la_pos = None
        self._bump()

    def observe(self, layer: int, experts: Sequence[int] | np.ndarray, token: int) -> None:
        """Layer ``layer`` of token ``token`` was routed to ``experts`` (int, distinct).

        Moves the position to ``(token, layer)`` and updates the layer's history: each of its
        entries decays by one visit and the routed ones gain ``1 - decay``.
        """
        self._check_layer(layer)
        ex = np.asarray(experts, dtype=np.int64).reshape(-1)
        if ex.size and (ex.min() < 0 or ex.max() >= self.num_experts):
            raise ValueError(f"experts {ex.tolist()} outside 0..{self.num_experts - 1}")
        base = layer * self.num_experts
        sl = slice(base, base + self.num_experts)
        entries = base + ex
        if self._req_fresh:
            self._req_start = int(token)
            self._req_fresh = False
            self._table.base_rate = max(len(ex), 1) / self.num_experts
        if token != self._table_token:
            self._table.refresh()
            self._table_token = int(token)
        used = np.zeros(self.num_experts, bool)
        used[ex] = True
        self._table.observe(self._cells(sl, int(token)), used)
        self._history[sl] *= self._decay
        self._history[entries] += 1.0 - self._decay
        self._prior[sl] *= self._prior_decay
        self._prior[entries] += 1.0 - self._prior_decay
        self._last_use[entries] = token
        self._req_last[entries] = token
        self._uses[entries] += 1
        self._token = int(token)
        self._layer = int(layer)
        self._needed = entries
        self._bump()

    def set_layer_ahead(
        self,
        layer: int,
        experts: Sequence[int] | np.ndarray,
        scores: Sequence[float] | np.ndarray,
        token: int,
    ) -> None:
        """Compute's prediction of layer ``layer`` of token ``token`` (router of that layer on the
        previous layer's state). A newer prediction replaces the older one; one for a position
        already passed is ignored."""
        self._check_layer(layer)
        if (token, layer) <= (self._token, self._layer):
            return
        ex = np.asarray(experts, dtype=np.int64).reshape(-1)
        sc = np.asarray(scores, dtype=np.float32).reshape(-1)
        if ex.shape != sc.shape:
            raise ValueError(f"layer-ahead experts {ex.shape} and scores {sc.shape} differ in length")
        if ex.size and (ex.min() < 0 or ex.max() >= self.num_experts):
            raise ValueError(f"experts {ex.tolist()} outside 0..{self.num_experts - 1}")
        self._la_experts = layer * self.num_experts + ex
        self._la_scores = sc
        self._la_pos = (int(token), int(layer))
        self._bump()

    def set_hints(
        self,
        hints: Iterable[tuple[int, int, float]],
        token: int,
        *,
        layers: Iterable[int] | None = None,
    ) -> None:
        """EAMC / next-token hints ``(layer, expert, score)`` received at token ``token``.

        As on the predictor's board, newer hints for a layer replace older ones: the layers in
        ``layers`` (default: those the hints name) are cleared first, so a layer sent with no
        hints drops its stale ones.
        """
        hints = list(hints)
        names = {int(h[0]) for h in hints} if layers is None else {int(x) for x in layers}
        for layer in names:  # validate everything before changing anything
            self._check_layer(layer)
        entries = [self.entry_of(ExpertKey(int(layer), int(expert))) for layer, expert, _s in hints]
        changed = False
        for layer in names:
            sl = slice(layer * self.num_experts, (layer + 1) * self.num_experts)
            self._hints[sl] = 0.0
            changed = True
        for e, (_layer, _expert, score) in zip(entries, hints, strict=True):
            self._hints[e] = float(score)
            self._hint_token[e] = int(token)
            changed = True
        if changed:
            self._bump()

    # -- outputs ---------------------------------------------------------------------------------

    @property
    def position(self) -> tuple[int, int]:
        """``(token, layer)`` of the last ``observe``."""
        return (self._token, self._layer)

    @property
    def step(self) -> int:
        """The position as one number, ``token * num_layers + layer``."""
        return self._token * self.num_layers + self._layer

    @property
    def request_id(self) -> str | None:
        return self._request

    @property
    def needed(self) -> np.ndarray:
        """int64 [k] entries routed at the current position (in use now)."""
        return self._needed

    @property
    def history(self) -> np.ndarray:
        """float32 [N] recency-weighted use estimate from the request's own routing (read-only view)."""
        v = self._history.view()
        v.flags.writeable = False
        return v

    @property
    def last_use(self) -> np.ndarray:
        """int64 [N] token of each entry's last observed use, -1 if never."""
        v = self._last_use.view()
        v.flags.writeable = False
        return v

    @property
    def uses(self) -> np.ndarray:
        """int64 [N] uses of each entry in the current request."""
        v = self._uses.view()
        v.flags.writeable = False
        return v

    @property
    def hints(self) -> np.ndarray:
        """float32 [N] fresh hint scores (0 where none or stale)."""

        def compute() -> np.ndarray:
            fresh = (self._token - self._hint_token) <= self.config.hint_ttl_tokens
            return np.where(fresh, self._hints, np.float32(0.0)).astype(np.float32, copy=False)

        return self._cached("hints", compute)

    @property
    def layer_ahead(self) -> np.ndarray:
        """float32 [N] layer-ahead scores for the predicted layer (0 elsewhere or when stale)."""
        out = np.zeros(self.num_entries, np.float32)
        la = self.layer_ahead_prediction()
        if la is not None:
            out[la[0]] = la[1]
        return out

    def layer_ahead_prediction(self) -> tuple[np.ndarray, np.ndarray, int] | None:
        """``(entries int64 [k], scores float32 [k], layer)`` of the fresh layer-ahead prediction,
        or ``None`` when there is none or its position has passed."""
        if self._la_pos is None or self._la_pos <= (self._token, self._layer):
            return None
        return self._la_experts, self._la_scores, self._la_pos[1]

    def layer_distance(self) -> np.ndarray:
        """int64 [N] layer steps until each entry's layer is visited next, in ``1..num_layers``."""
        return self._cached("distance", lambda: (self._layer_of - self._layer - 1) % self.num_layers + 1)

    def long_run_probability(self) -> np.ndarray:
        """float32 [N] per-visit use probability beyond the next visit: history blended with hints."""

        def compute() -> np.ndarray:
            if self.config.estimator == "hazard":
                return self._next_visit()[0].astype(np.float32)
            p = self._history.copy()
            w = self.config.hint_weight
            if w > 0.0:
                h = self.hints
                p = np.where(h > 0.0, (1.0 - w) * p + w * h, p)
            return p.astype(np.float32, copy=False)

        return self._cached("long_run", compute)

    def use_probability(self) -> np.ndarray:
        """float32 [N] estimated probability that each entry is used at its layer's next visit:
        the long-run estimate, overridden for the layer-ahead layer by the prediction."""

        def compute() -> np.ndarray:
            p = self.long_run_probability().copy()
            la = self.layer_ahead_prediction()
            if la is not None:
                entries, _scores, layer = la
                conf = self.config.layer_ahead_confidence
                sl = slice(layer * self.num_experts, (layer + 1) * self.num_experts)
                p[sl] *= 1.0 - conf
                p[entries] = np.maximum(p[entries], conf)
            return p

        return self._cached("use_p", compute)

    def next_use_layers(self) -> np.ndarray:
        """float64 [N] expected layer steps until each entry's next use (see the glossary); the
        entries in use now get 0."""

        def compute() -> np.ndarray:
            L = self.num_layers
            if self.config.estimator == "hazard":
                _h, wait, wait_after = self._next_visit()
                t = self.layer_distance() + L * wait
                la = self.layer_ahead_prediction()
                if la is not None:
                    # The prediction replaces the hazard of its layer's next visit.
                    p = self.use_probability()[self._la_slice(la[2])].astype(np.float64)
                    sl = self._la_slice(la[2])
                    t[sl] = self.layer_distance()[sl] + L * (1.0 - p) * (1.0 + wait_after[sl])
                if self._needed.size:
                    t[self._needed] = 0.0
                return t
            p_next = self.use_probability().astype(np.float64)
            p_long = np.maximum(self.long_run_probability().astype(np.float64), self.config.probability_floor)
            t = self.layer_distance().astype(np.float64) + L * (1.0 - p_next) / p_long
            if self._needed.size:
                t[self._needed] = 0.0
            return t

        return self._cached("next_use", compute)

    def _cells(self, sl: slice | np.ndarray, visit_token: int | np.ndarray):
        """Hazard cells (recency, rate, hint buckets) of entries ``sl`` at a visit in ``visit_token``."""
        last = self._req_last[sl]
        d = visit_token - last
        r = np.where(last >= 0, recency_bucket(d), COLD)
        tokens = np.maximum(visit_token - self._req_start, 1)
        f = np.searchsorted(RATE_EDGES, self._uses[sl] / tokens, side="right")
        h = np.searchsorted(HINT_EDGES, self.hints[sl], side="right")
        return r, f, h

    def _next_visit(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per entry: (hazard at its next visit, wait from that visit, wait from the visit after),
        the waits in visits (see ``HazardTable``)."""

        def compute() -> np.ndarray:
            t = self._token
            visit = np.where(self._layer_of > self._layer, t, t + 1)
            if self._req_fresh:
                visit = np.full(self.num_entries, max(t + 1, 0))
            r, f, h = self._cells(slice(None), visit)
            last = self._req_last
            d = np.where(last >= 0, np.minimum(visit - last, MAX_RECENCY + 1), 0)
            d_after = np.where(last >= 0, np.minimum(d + 1, MAX_RECENCY + 1), 0)
            tab = self._table
            return np.stack([tab.hazard[r, f, h], tab.wait[f, h, d], tab.wait[f, h, d_after]])

        out = self._cached("next_visit", compute)
        return out[0], out[1], out[2]

    def _la_slice(self, layer: int) -> slice:
        return slice(layer * self.num_experts, (layer + 1) * self.num_experts)

    def _check_layer(self, layer: int) -> None:
        if not (0 <= layer < self.num_layers):
            raise ValueError(f"layer {layer} outside 0..{self.num_layers - 1}")


__all__ = ["ActivationSignals", "SignalsConfig"]
