"""Next-visit model files (``replay.learn_next_visit``'s format) written for tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from cache_daemon.decisions.next_visit import NextVisitModel
from cache_daemon.decisions.signals import SignalsConfig
from replay.learn_next_visit import write


def write_next_visit_model(path: Path, layers: int, experts: int) -> Path:
    """A model of random weights for ``layers`` MoE layers x ``experts`` experts, with the default
    signals' half-lives and prior: the daemon loads it, or refuses it for another shape."""
    cfg = SignalsConfig()
    rng = np.random.default_rng(0)
    write(
        NextVisitModel(
            rng.normal(size=(layers, (layers + 2) * experts, experts)).astype(np.float32),
            rng.normal(size=(layers, experts)).astype(np.float32),
            layers,
            cfg.history_half_life_tokens,
            cfg.long_history_half_life_tokens,
            cfg.prior_weight,
        ),
        path,
    )
    return path
