"""Lookahead bookkeeping of ``ActivationSignals``: the predictions kept per request until their layer
is routed, and how precise each depth has proved (overall and per prior bucket of the predicted
expert's own estimate: a guess the request did not expect is more often wrong).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

PRIOR_WEIGHT = 4.0  # predicted experts' worth of the lookahead precision prior
PRIOR_BUCKET_EDGES = (0.05, 0.15, 0.4)
_BUCKET_EDGES = list(PRIOR_BUCKET_EDGES)


def prior_bucket(p: float) -> int:
    """The ``PRIOR_BUCKET_EDGES`` bucket of an estimate ``p``."""
    return bisect.bisect_right(_BUCKET_EDGES, p)


@dataclass
class Lookahead:
    """One kept prediction (``LayerPrediction`` as stored for its request)."""

    token: int
    depth: int
    entries: np.ndarray  # int64 [n]
    scores: np.ndarray  # float32 [n]
    keys: list[int]  # entries, as a list
    buckets: list[int]  # [n]: PRIOR_BUCKET_EDGES bucket of each entry's estimate before it


class DepthPrecision:
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


class LookaheadPrecision:
    """Every depth's ``DepthPrecision``, fading by ``half_life`` scored predictions. ``prior`` (the
    precision of a depth not scored yet) is passed at each call: it is a live setting."""

    def __init__(self, half_life: float) -> None:
        self._depths: dict[int, DepthPrecision] = {}
        self._growth = float(0.5 ** (-1.0 / half_life))

    def score(self, la: Lookahead, routed: set[int], prior: float) -> None:
        """``la``'s layer was routed to the entries ``routed``."""
        stats = self._depths.get(la.depth)
        if stats is None:
            stats = self._depths[la.depth] = DepthPrecision(prior, self._growth)
        stats.score(la.keys, la.buckets, routed)

    def by_bucket(self, depth: int, prior: float) -> np.ndarray:
        """float64 [buckets] the precision of ``depth`` for every prior bucket."""
        stats = self._depths.get(depth)
        if stats is None:
            return np.full(len(PRIOR_BUCKET_EDGES) + 1, prior)
        return stats.by_bucket()

    def precision(self, depth: int, prior: float) -> float:
        stats = self._depths.get(depth)
        if stats is None:
            return prior
        return stats.precision()

    def depths(self) -> list[int]:
        """The depths scored so far, nearest first."""
        return sorted(self._depths)


__all__ = [
    "PRIOR_BUCKET_EDGES",
    "PRIOR_WEIGHT",
    "DepthPrecision",
    "Lookahead",
    "LookaheadPrecision",
    "prior_bucket",
]
