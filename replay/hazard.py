"""The hazard-table use estimator, an ``Estimator`` for trace replay (the daemon runs the signals' own).

``HazardEstimator`` learns online P(an entry is used at a visit of its layer | its state at that
visit), state = (recency bucket or COLD, request-frequency bucket, hint bucket): 9 × 5 × 4 cells
on generic log-scale edges, from every visit observed so far (nothing from the future), smoothed
by ``prior_count`` pseudo-visits at the base rate ``top_k / num_experts``. It plugs into
``ActivationSignals(estimator=...)``; ``bench.replay_tune --estimators hazard`` compares it with
the built-in estimate on a trace.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from cache_daemon.decisions.signals import ActivationSignals

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
    """Visit and use counts per state cell, and the expected waits they imply.

    ``wait[f, h, d]`` is the expected number of *further* visits before the use, starting at a
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


class HazardEstimator:
    """The hazard-table estimator of the request being observed (one request at a time)."""

    def __init__(self, prior_count: float = 8.0) -> None:
        self.table = HazardTable(prior_count)
        self._signals: ActivationSignals | None = None
        self._table_token = -1

    def attach(self, signals: ActivationSignals) -> None:
        self._signals = signals
        n = signals.num_entries
        self._last = np.full(n, -1, np.int64)  # last use in this request (-1: none yet)
        self._uses = np.zeros(n, np.int64)
        self._start = 0
        self._fresh = True

    def begin_request(self, request_id: str) -> None:
        self._last[:] = -1
        self._uses[:] = 0
        self._fresh = True

    def _cells(self, sl: slice | np.ndarray, visit_token: int | np.ndarray):
        """Hazard cells (recency, rate, hint buckets) of entries ``sl`` at a visit in ``visit_token``."""
        assert self._signals is not None
        last = self._last[sl]
        d = visit_token - last
        r = np.where(last >= 0, recency_bucket(d), COLD)
        tokens = np.maximum(visit_token - self._start, 1)
        f = np.searchsorted(RATE_EDGES, self._uses[sl] / tokens, side="right")
        h = np.searchsorted(HINT_EDGES, self._signals.hints[sl], side="right")
        return r, f, h

    def observe(self, request_id: str, layer: int, entries: np.ndarray, token: int) -> None:
        sig = self._signals
        assert sig is not None
        E = sig.num_experts
        sl = slice(layer * E, (layer + 1) * E)
        if self._fresh:
            self._start = token
            self._fresh = False
            self.table.base_rate = max(len(entries), 1) / E
        if token != self._table_token:
            self.table.refresh()
            self._table_token = token
        used = np.zeros(E, bool)
        used[entries - layer * E] = True
        self.table.observe(self._cells(sl, token), used)
        self._last[entries] = token
        self._uses[entries] += 1

    def _next_visit(self, sig: ActivationSignals) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        t, layer = sig.position
        grid = sig.grid
        visit = np.where(grid.rank_of > grid.rank[layer], t, t + 1)  # later in this token, or the next
        if self._fresh:
            visit = np.full(sig.num_entries, max(t + 1, 0))
        r, f, h = self._cells(slice(None), visit)
        last = self._last
        d = np.where(last >= 0, np.minimum(visit - last, MAX_RECENCY + 1), 0)
        d_after = np.where(last >= 0, np.minimum(d + 1, MAX_RECENCY + 1), 0)
        tab = self.table
        return tab.hazard[r, f, h], tab.wait[f, h, d], tab.wait[f, h, d_after]

    def long_run(self, signals: ActivationSignals) -> list[np.ndarray]:
        return [self._next_visit(signals)[0].astype(np.float32)]

    def next_use(self, signals: ActivationSignals) -> np.ndarray:
        M = signals.num_moe
        _h, wait, wait_after = self._next_visit(signals)
        dist = signals.layer_distance()
        t = dist + M * wait
        p = signals.use_probability().astype(np.float64)
        E = signals.num_experts
        for layer, _depth, _entries, _scores in signals.lookahead():
            # The prediction replaces the hazard of its layer's next visit.
            sl = slice(layer * E, (layer + 1) * E)
            t[sl] = dist[sl] + M * (1.0 - p[sl]) * (1.0 + wait_after[sl])
        return t


__all__ = ["HazardEstimator", "HazardTable", "recency_bucket"]
