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


MIN_PREFETCH_PROBABILITY = 0.7
"""Speculative prefetch only for entries at least this likely to be used at their next visit: a
wasted prefetch costs the link as much as a demand fetch, and its victim. Measured on the shared
trace at 25% without lookahead (requests 64..69, ``bench.replay``, eviction then by expected next
use): with the learned next-visit model, thresholds 0.3 / 0.5 / 0.7 load 1.722 / 1.600 / 1.567 x
Belady's bytes (prefetch accuracy 0.56 / 0.76 / 0.89) at 27.6 / 27.9 / 28.2 ms per token; with
the routing transitions, 1.647 / 1.664 / 1.663 x at 28.7 / 28.6 / 28.6 ms. Where the link is the
bottleneck bytes are time, so the bar is the high one. Higher still (0.85, with the scheduler's
``min_precision``): 5% fewer bytes end to end for 2-3% of speed (``PrefetchConfig.min_precision``)."""


class ActivationAwarePolicy(ShapedPolicy):
    name = "activation-aware"
    needs_signals = True

    def __init__(
        self,
        shape: PolicyShape | None = None,
        signals: ActivationSignals | None = None,
        *,
        min_probability: float = MIN_PREFETCH_PROBABILITY,
    ) -> None:
        super().__init__(shape, signals)
        if not 0.0 <= min_probability <= 1.0:
            raise ValueError(f"min_probability must be in [0, 1], got {min_probability}")
        self.min_probability = min_probability
        self._stamp = np.zeros(self.shape.num_entries, np.int64)
        self._pf_cache: tuple[int, np.ndarray] | None = None

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

    def prefetch_scores(self) -> np.ndarray:
        """float64 [N] ``1 / (1 + next_use)`` for entries with use probability at their next visit
        of at least ``min_probability``, else 0: soonest expected use first."""
        assert self.signals is not None
        if self._pf_cache is None or self._pf_cache[0] != self.signals.version:
            p = self.signals.use_probability()
            score = np.where(p >= self.min_probability, 1.0 / (1.0 + self.next_use()), 0.0)
            self._pf_cache = (self.signals.version, score)
        return self._pf_cache[1]
