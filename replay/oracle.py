"""``oracle-next-token``: activation-aware eviction told the exact routing of the next tokens.

A reference for trace replay only, like ``belady``: it answers "how much better could eviction
get with perfect short-term prediction?" Entries used within the next ``horizon_tokens`` tokens
(``horizon_tokens * num_layers`` layer steps from the position) get their exact next-use step
from the trace (``FutureUses``) and leave last, furthest next use first; every other entry is
ranked by activation-aware's own eviction key, after them (it is known not to be used before).
The replay runs it with demand fetching only, as Belady: the row measures eviction, not
speculation.

No online predictor (EAMC match, the request's history, layer-ahead) knows the next token's
routing exactly, so on the same trace and budget an online policy is not expected to load fewer
bytes than this row; the replay prints it beside Belady to show how much of the gap to Belady
short-term prediction could close at all.

Example (L = 24, horizon 1): at step 100 (token 4, layer 4) entries used next at steps 110 and
120 are kept, and of the two the one of step 120 leaves first; every entry not used before step
124 leaves before either, in activation-aware's order. ``next_use`` (the prefetch's estimate)
stays exact within the horizon and activation-aware's estimate plus the horizon beyond it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from cache_daemon.decisions.policy.activation_aware import ActivationAwarePolicy
from cache_daemon.decisions.policy.base import PolicyShape
from replay.belady import FuturePolicy, FutureUses

if TYPE_CHECKING:
    from cache_daemon.decisions.signals import ActivationSignals


KNOWN_USE = 1e12
"""Subtracted from the exact next use of the entries used within the horizon: activation-aware's
key of any other entry (a log-probability, or a next-use estimate with a plugged-in estimator)
lies far above, so they all leave first."""


class NextTokenOraclePolicy(FuturePolicy, ActivationAwarePolicy):
    name = "oracle-next-token"
    refusal = "oracle-next-token knows the future"

    def __init__(
        self,
        shape: PolicyShape | None = None,
        signals: ActivationSignals | None = None,
        *,
        future: FutureUses | None = None,
        horizon_tokens: int = 1,
    ) -> None:
        if horizon_tokens < 1:
            raise ValueError(f"horizon_tokens must be >= 1, got {horizon_tokens}")
        super().__init__(shape, signals, future=future)
        self.horizon_tokens = horizon_tokens

    def next_use(self) -> np.ndarray:
        """float64 [N] layer steps to each entry's next use: exact within the horizon, else the
        activation-aware estimate plus the horizon."""
        assert self.signals is not None
        step = max(self.signals.step, 0)
        exact = self.future.next_use(step) - step
        horizon = self.horizon_tokens * self.shape.num_layers
        estimate = super().next_use()
        return np.where(exact <= horizon, exact.astype(np.float64), estimate + horizon)

    def eviction_key(self) -> np.ndarray:
        """float64 [N] higher leaves first: the entries used within the horizon after every other,
        furthest next use first; the others by activation-aware's own key."""
        assert self.signals is not None
        step = max(self.signals.step, 0)
        exact = self.future.next_use(step) - step
        horizon = self.horizon_tokens * self.shape.num_layers
        return np.where(exact <= horizon, exact.astype(np.float64) - KNOWN_USE, super().eviction_key())
