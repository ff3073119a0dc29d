"""Use-probability estimators that plug into ``ActivationSignals`` (the trace replay's, not the daemon's).

The daemon runs the signals' built-in estimate (recency-weighted history blended with hints),
which costs a few microseconds per routed layer. An ``Estimator`` replaces it where its extra
cost does not matter: ``bench.replay_tune --estimators hazard`` runs ``replay.hazard``'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from cache_daemon.decisions.signals import ActivationSignals


class Estimator(Protocol):
    """What ``ActivationSignals`` asks of a plugged-in estimator."""

    def attach(self, signals: ActivationSignals) -> None: ...

    def begin_request(self, request_id: str) -> None: ...

    def observe(self, request_id: str, layer: int, entries: np.ndarray, token: int) -> None:
        """Layer ``layer`` of ``token`` routed to ``entries`` (int64, before the signals move)."""
        ...

    def long_run(self, signals: ActivationSignals) -> list[np.ndarray]:
        """Per live request, float32 [N] per-visit use probability beyond the next visit."""
        ...

    def next_use(self, signals: ActivationSignals) -> np.ndarray:
        """float64 [N] expected layer steps to each entry's next use (a fresh array)."""
        ...


__all__ = ["Estimator"]
