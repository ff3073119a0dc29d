"""Least-frequently-used eviction, the policy MoE-Infinity's released code runs.

Each entry counts its uses (inserts and hits) since the policy was created; the counts survive
eviction, so a frequently used expert that was pushed out comes back with its history. The
resident entry with the fewest uses leaves first; ties go to the least recently used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from cache_daemon.decisions.policy.base import PolicyShape, ShapedPolicy

if TYPE_CHECKING:
    from cache_daemon.decisions.signals import ActivationSignals


class LFUPolicy(ShapedPolicy):
    name = "lfu"

    def __init__(self, shape: PolicyShape | None = None, signals: ActivationSignals | None = None) -> None:
        super().__init__(shape, signals)
        self._counts = np.zeros(self.shape.num_entries, np.int64)
        self._stamp = np.zeros(self.shape.num_entries, np.int64)

    def _accessed(self, entry: int) -> None:
        self._counts[entry] += 1
        self._stamp[entry] = self._clock

    def count(self, entry: int) -> int:
        """Uses counted for ``entry``."""
        return int(self._counts[entry])

    def _keep_scores(self, entries: np.ndarray) -> np.ndarray:
        return self._counts[entries].astype(np.float64)

    def _tiebreak(self, entries: np.ndarray) -> np.ndarray:
        return self._stamp[entries].astype(np.float64)
