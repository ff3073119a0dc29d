"""MoE-Infinity's activation-aware priorities (arXiv 2401.14361), implemented as the paper states,
over the predictor's hints (``ActivationSignals.hints``). The formulas, with a worked example, are
in ``docs/daemon.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from cache_daemon.decisions.policy.base import PolicyShape, ShapedPolicy

if TYPE_CHECKING:
    from cache_daemon.decisions.signals import ActivationSignals

EPSILON = 1e-3
"""The paper's ``epsilon``: keeps experts without a matched probability ordered by layer."""


class MoEInfinityPolicy(ShapedPolicy):
    name = "moe-infinity"
    needs_signals = True
    prefetch_order = "score"  # the paper's priorities, not deadlines

    def __init__(
        self,
        shape: PolicyShape | None = None,
        signals: ActivationSignals | None = None,
        *,
        epsilon: float = EPSILON,
    ) -> None:
        super().__init__(shape, signals)
        self.epsilon = epsilon
        # The paper prefetches for every later layer of the token, by priority.
        self.prefetch_horizon_layers = self.shape.num_layers
        L = self.shape.num_layers
        layer_of = np.repeat(np.arange(L, dtype=np.float64), self.shape.num_experts)
        self._layer_weight = 1.0 - layer_of / L  # (1 - i/L) per entry
        self._layer_of = layer_of
        self._stamp = np.zeros(self.shape.num_entries, np.int64)

    def _accessed(self, entry: int) -> None:
        self._stamp[entry] = self._clock

    def _keep_scores(self, entries: np.ndarray) -> np.ndarray:
        assert self.signals is not None
        p = self.signals.hints[entries].astype(np.float64)
        return (p + self.epsilon) * self._layer_weight[entries]

    def _tiebreak(self, entries: np.ndarray) -> np.ndarray:
        return self._stamp[entries].astype(np.float64)

    def prefetch_scores(self, min_probability: float) -> np.ndarray:
        """float64 [N] the paper's prefetch score ``p * (1 - (i - l)/L)`` for the layers ``i``
        after the current layer ``l`` of this token; 0 for the layers already passed. The paper
        prefetches by rank, not against a bar: ``min_probability`` is not used."""
        assert self.signals is not None
        L = self.shape.num_layers
        _token, layer = self.signals.position
        ahead = self._layer_of - layer
        p = self.signals.hints.astype(np.float64)
        return np.where(ahead > 0, p * (1.0 - ahead / L), 0.0)
