"""Per-request expert prediction from the request's own history and the EAMC.

Scores float32 [L, E] in [0, 1] from three sources: ``history`` (the request's recency-weighted
routing frequency), ``eamc`` (the best EAMC matches' frequencies) and ``combined`` (the two mixed
by ``history_weight``). The formulas: docs/predictor.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from predictor_svc.eam import EamShape, add_token, new_eam
from predictor_svc.eamc import Eamc

Source = Literal["eamc", "history", "combined"]
SOURCES: tuple[Source, ...] = ("eamc", "history", "combined")


@dataclass(frozen=True)
class PredictionConfig:
    """How a request's prediction is formed.

    top_n: EAMC entries whose frequencies are averaged (>= 1).
    sharpness: exponent on the similarities used as weights (> 0; higher trusts the best
        match more).
    history_decay: per-token decay d of the history (0 < d < 1).
    history_weight: weight a of history in ``combined`` (0..1).
    history_min_tokens: tokens before history enters ``combined`` (>= 1).
    """

    top_n: int = 8
    sharpness: float = 4.0
    history_decay: float = 0.7
    history_weight: float = 0.5
    history_min_tokens: int = 1

    def __post_init__(self) -> None:
        if self.top_n < 1:
            raise ValueError(f"top_n must be >= 1, got {self.top_n}")
        if not self.sharpness > 0:
            raise ValueError(f"sharpness must be > 0, got {self.sharpness}")
        if not 0 < self.history_decay < 1:
            raise ValueError(f"history_decay must be in (0, 1), got {self.history_decay}")
        if not 0 <= self.history_weight <= 1:
            raise ValueError(f"history_weight must be in [0, 1], got {self.history_weight}")
        if self.history_min_tokens < 1:
            raise ValueError(f"history_min_tokens must be >= 1, got {self.history_min_tokens}")


def combine(
    history: np.ndarray,
    eamc: np.ndarray,
    tokens: np.ndarray | int,
    eamc_empty: bool,
    config: PredictionConfig,
) -> np.ndarray:
    """The ``combined`` source. history/eamc float32 [..., L, E]; tokens int or [...] (complete
    tokens behind each prediction)."""
    if eamc_empty:
        return history.astype(np.float32, copy=True)
    tokens = np.asarray(tokens)
    a = np.where(tokens >= config.history_min_tokens, config.history_weight, 0.0).astype(np.float32)
    a = a.reshape(a.shape + (1, 1))
    return a * history + (1 - a) * eamc


def _counts(shape: EamShape, experts: np.ndarray) -> np.ndarray:
    eam = new_eam(shape)
    add_token(eam, experts)
    return eam


def _seen_prefix(experts: np.ndarray) -> int:
    """Number of leading layers whose row has any routed expert."""
    seen = (np.asarray(experts) >= 0).any(axis=1)
    return int(np.argmin(seen)) if not seen.all() else len(seen)


class RequestPredictor:
    """The prediction state of one live request. Not thread-safe (one per request)."""

    def __init__(self, eamc: Eamc | None, shape: EamShape, config: PredictionConfig) -> None:
        self.eamc = eamc
        self.shape = shape
        self.config = config
        self.eam = new_eam(shape)  # uint32 [L, E], complete tokens only
        self.tokens = 0
        self._history = np.zeros((shape.layers, shape.experts), dtype=np.float32)
        self._history_weight = 0.0  # sum of the decayed token weights
        self._partial: np.ndarray | None = None  # int [L, K] of the current token, -1 unseen
        self._cache: dict[str, np.ndarray] = {}

    def observe(self, token_experts: np.ndarray) -> None:
        """Record one token's routing, ``token_experts`` int [L, K]. Rows of -1 mark layers not
        routed yet: such a partial token replaces the previous partial view of the current
        token; a token with every layer routed completes it."""
        experts = np.asarray(token_experts)
        if experts.shape != (self.shape.layers, self.shape.top_k):
            raise ValueError(
                f"token_experts must be [{self.shape.layers}, {self.shape.top_k}], got {experts.shape}"
            )
        counts = _counts(self.shape, experts)  # validates ids
        self._cache.clear()
        if (experts >= 0).any(axis=1).all():
            self.eam += counts
            self.tokens += 1
            d = self.config.history_decay
            self._history = d * self._history + np.minimum(counts, 1).astype(np.float32)
            self._history_weight = d * self._history_weight + 1.0
            self._partial = None
        else:
            self._partial = experts.copy()

    def scores(self, source: Source = "combined") -> np.ndarray:
        """float32 [L, E] in [0, 1] for the coming layers / next token from ``source``."""
        if source not in SOURCES:
            raise ValueError(f"unknown prediction source {source!r}; valid: {list(SOURCES)}")
        if source not in self._cache:
            self._cache[source] = self._compute(source)
        return self._cache[source]

    def top(self, layer: int, k: int, source: Source = "combined") -> list[int]:
        """The ``k`` experts of ``layer`` with the highest score, best first."""
        if not 0 <= layer < self.shape.layers:
            raise ValueError(f"layer must be in [0, {self.shape.layers}), got {layer}")
        if not 1 <= k <= self.shape.experts:
            raise ValueError(f"k must be in [1, {self.shape.experts}], got {k}")
        row = self.scores(source)[layer]
        return [int(e) for e in np.argsort(-row, kind="stable")[:k]]

    def _compute(self, source: Source) -> np.ndarray:
        if source == "history":
            if self._history_weight == 0:
                return np.zeros((self.shape.layers, self.shape.experts), dtype=np.float32)
            return self._history / np.float32(self._history_weight)
        if source == "eamc":
            if self.eamc is None:
                return np.zeros((self.shape.layers, self.shape.experts), dtype=np.float32)
            query = self.eam
            layers_seen = self.shape.layers if self.tokens else 0
            if self._partial is not None:
                query = self.eam + _counts(self.shape, self._partial)
                if not self.tokens:
                    layers_seen = _seen_prefix(self._partial)
            return self.eamc.predict(query, layers_seen, self.config.top_n, self.config.sharpness).astype(
                np.float32
            )
        empty = self.eamc is None or self.eamc.entries == 0
        return combine(self.scores("history"), self.scores("eamc"), self.tokens, empty, self.config)


def predict_request(
    eamc: Eamc | None, shape: EamShape, config: PredictionConfig, experts: np.ndarray
) -> dict[Source, np.ndarray]:
    """Scores a ``RequestPredictor`` would give before each token of a whole request, batched.

    ``experts`` int [T, L, K] (the request's routing). Returns per source float32 [T, L, E]:
    row t is ``RequestPredictor.scores(source)`` after observing tokens 0..t-1 (complete
    tokens). One EAMC matrix product for all T tokens; same formulas as ``RequestPredictor``
    (checked equal in tests/unit/predictor/test_predict.py).
    """
    experts = np.asarray(experts)
    t_count = experts.shape[0]
    layers, n_exp = shape.layers, shape.experts
    onehot = np.zeros((t_count, layers, n_exp), dtype=np.uint32)
    tt, ll, _ = np.nonzero(experts >= 0)
    np.add.at(onehot, (tt, ll, experts[experts >= 0].astype(np.intp)), 1)
    before = np.zeros_like(onehot)  # EAM of tokens < t
    np.cumsum(onehot[:-1], axis=0, out=before[1:])
    d = config.history_decay
    history = np.zeros((t_count, layers, n_exp), dtype=np.float32)
    h = np.zeros((layers, n_exp), dtype=np.float32)
    w = 0.0
    for t in range(1, t_count):
        h = d * h + np.minimum(onehot[t - 1], 1).astype(np.float32)
        w = d * w + 1.0
        history[t] = h / np.float32(w)
    eamc_scores = np.zeros_like(history)
    empty = eamc is None or eamc.entries == 0
    if not empty:
        eamc_scores[0] = eamc.predict(before[0], 0, config.top_n, config.sharpness)
        if t_count > 1:
            eamc_scores[1:] = eamc.predict(before[1:], layers, config.top_n, config.sharpness)
    tokens = np.arange(t_count)
    return {
        "eamc": eamc_scores,
        "history": history,
        "combined": combine(history, eamc_scores, tokens, empty, config),
    }
