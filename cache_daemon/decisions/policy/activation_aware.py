"""Activation-aware eviction (ours, the default): an online approximation of Belady. The resident
entry that ``ActivationSignals`` deems likeliest to go unused over the next few tokens
(``SignalsConfig.eviction_horizon_tokens``) leaves first; ties go to the least recently used. The
estimate, with an example, is in ``docs/daemon.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from cache_daemon.decisions.policy.base import PolicyShape, ShapedPolicy
from expertcache import native

if TYPE_CHECKING:
    from cache_daemon.decisions.signals import ActivationSignals


class ActivationAwarePolicy(ShapedPolicy):
    name = "activation-aware"
    needs_signals = True

    def __init__(
        self,
        shape: PolicyShape | None = None,
        signals: ActivationSignals | None = None,
    ) -> None:
        super().__init__(shape, signals)
        self._stamp = np.zeros(self.shape.num_entries, np.int64)
        self._pf_cache: tuple[tuple[int, float], np.ndarray] | None = None

    def _accessed(self, entry: int) -> None:
        self._stamp[entry] = self._clock

    def next_use(self) -> np.ndarray:
        """float64 [N] expected layer steps to each entry's next use (cached per signals version)."""
        assert self.signals is not None
        return self.signals.next_use_layers()

    def eviction_key(self) -> np.ndarray:
        """float64 [N] higher leaves first: the log-probability that each entry goes unused over
        the horizon (``UseEstimates.idle_log_survival``); with a plugged-in estimator (the
        replay's), which estimates only next uses, the expected next use."""
        assert self.signals is not None
        if self.signals.estimator is not None:
            return self.next_use()
        return self.signals.idle_log_survival()

    def _keep_scores(self, entries: np.ndarray) -> np.ndarray:
        return -self.eviction_key()[entries]

    def _tiebreak(self, entries: np.ndarray) -> np.ndarray:
        return self._stamp[entries].astype(np.float64)

    def _ordered_resident(self) -> np.ndarray:
        # The base's order (-eviction_key, then the stamp, stably) in one native pass.
        return native.victim_order(self._resident, self.eviction_key(), self._stamp)

    def prefetch_scores(self, min_probability: float) -> np.ndarray:
        """float64 [N] ``1 / (1 + next_use)`` for entries with use probability at their next visit
        of at least ``min_probability``, else 0: soonest expected use first."""
        assert self.signals is not None
        key = (self.signals.version, min_probability)
        if self._pf_cache is None or self._pf_cache[0] != key:
            p = self.signals.use_probability()
            score = np.where(p >= min_probability, 1.0 / (1.0 + self.next_use()), 0.0)
            self._pf_cache = (key, score)
        return self._pf_cache[1]
