"""Routing transitions (``TransitionModel``): what a layer will route at its next visit, given what
it routed at this one, learned per layer across requests. The estimate and an example are in
``docs/daemon.md``. No I/O and no threads; ``ActivationSignals`` owns one and serialises calls.
"""

from __future__ import annotations

import numpy as np

from expertcache.native import TransitionTable


class TransitionModel:
    """Per-layer counts of routing transitions between consecutive visits of a request (the
    arithmetic is the native ``TransitionTable``'s: it runs once per routed layer on the
    daemon's hot path)."""

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        *,
        prior_count: float = 4.0,
        history_exponent: float = 0.25,
        half_life_visits: float = 4096.0,
    ) -> None:
        if num_layers < 1 or num_experts < 1:
            raise ValueError(f"num_layers and num_experts must be >= 1, got {num_layers} and {num_experts}")
        if not prior_count > 0.0:
            raise ValueError(f"prior_count must be > 0, got {prior_count}")
        if not history_exponent >= 0.0:
            raise ValueError(f"history_exponent must be >= 0, got {history_exponent}")
        if not half_life_visits > 0.0:
            raise ValueError(f"half_life_visits must be > 0, got {half_life_visits}")
        self.num_layers = num_layers
        self.num_experts = num_experts
        self._table = TransitionTable(
            num_layers, num_experts, prior_count, history_exponent, half_life_visits
        )

    def step(
        self,
        layer: int,
        previous: np.ndarray | None,
        current: np.ndarray,
        history: np.ndarray,
        history_long: np.ndarray,
        long_weight: float,
        out: np.ndarray,
    ) -> None:
        """Layer ``layer`` routed ``current`` (int64 experts) at a visit whose previous visit in the
        same request routed ``previous`` (None: none, nothing is counted); writes the probability
        of each expert at the layer's next visit into ``out`` (float32 [E], contiguous), given
        the request's history row ``(1 - long_weight) * history + long_weight * history_long``
        (float32 [E] each, contiguous)."""
        self._table.step(layer, previous, current, history, history_long, long_weight, out)


__all__ = ["TransitionModel"]
