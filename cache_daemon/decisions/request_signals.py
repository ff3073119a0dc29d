"""The per-request part of ``ActivationSignals``: one live request's history, hints, lookahead
and position, and the estimates read from them alone.

Every array is ``[num_layers * num_experts]`` indexed by entry, like the signals'.
"""

from __future__ import annotations

import numpy as np

from cache_daemon.decisions.lookahead import Lookahead, prior_bucket


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
        # Per-visit chance of use after the next visit, from the learned model's horizon head; -1: none.
        self.tail_p = np.full(n, -1.0, np.float32)
        # For the learned next-visit model: the latest routing of every MoE layer, one-hot in
        # visit order (float32 [M * E]; empty without a model).
        self.latest = np.zeros(model_latest, np.float32)
        self.hints = np.zeros(n, np.float32)
        self.hint_token = np.full(n, np.iinfo(np.int64).min // 2, np.int64)
        self.has_hints = False
        self.lookahead: dict[int, Lookahead] = {}  # predicted layer → its nearest prediction
        self.scoring: dict[int, list[Lookahead]] = {}  # predicted layer → every depth's, to score

    def blended_history(self, long_weight: float) -> np.ndarray:
        """float32 [N] the per-visit use estimate: the short and long recency-weighted histories,
        blended (a fresh array)."""
        w = np.float32(long_weight)
        return (np.float32(1.0) - w) * self.history + w * self.history_long

    def fresh_hints(self, ttl_tokens: int) -> np.ndarray:
        """float32 [N] the hint scores at most ``ttl_tokens`` old (0 elsewhere)."""
        fresh = (self.token - self.hint_token) <= ttl_tokens
        return np.where(fresh, self.hints, np.float32(0.0))

    def prior_buckets(self, entries: list[int], long_weight: float, use_next: bool) -> list[int]:
        """The ``PRIOR_BUCKET_EDGES`` bucket of each entry's next-visit estimate (its transition
        estimate when ``use_next`` and there is one, else its history), before any lookahead."""
        w = long_weight
        out = []
        for e in entries:  # a few experts: scalar reads beat numpy calls (and blended_history's N) here
            p = float(self.next_p[e]) if use_next else -1.0
            if p < 0.0:  # no transition estimate (a layer not routed yet, or transitions off)
                p = (1.0 - w) * float(self.history[e]) + w * float(self.history_long[e])  # blended, at e
            out.append(prior_bucket(p))
        return out


__all__ = ["RequestSignals"]
