"""The policies a replay can run: the daemon's (``POLICIES``) and the references that need the future.

The references (``REFERENCE_POLICIES``: Belady's MIN, the next-token oracle) are built with the
``FutureUses`` of the routes being replayed; a daemon never has them, so
``cache_daemon.decisions.policy`` does not know their names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from cache_daemon.decisions.policy import POLICIES, EvictionPolicy, PolicyShape, make_policy
from replay.belady import BeladyPolicy, FuturePolicy, FutureUses
from replay.oracle import NextTokenOraclePolicy

if TYPE_CHECKING:
    from cache_daemon.decisions.signals import ActivationSignals

REFERENCE_POLICIES: dict[str, type[FuturePolicy]] = {
    "belady": BeladyPolicy,
    "oracle-next-token": NextTokenOraclePolicy,
}
"""References that need the future (``FutureUses`` of a trace): ``belady``, ``oracle-next-token``."""

REPLAY_POLICIES: tuple[str, ...] = (*POLICIES, *REFERENCE_POLICIES)
"""Every policy name a replay accepts: the daemon's first, then the references."""


def make_replay_policy(
    name: str,
    shape: PolicyShape,
    signals: ActivationSignals,
    routes: np.ndarray,
    **kwargs,
) -> EvictionPolicy:
    """A fresh policy ``name`` for replaying ``routes`` (int [tokens, layers, top_k]): a reference
    gets their ``FutureUses``; a daemon policy is ``make_policy``'s, or constructed with ``kwargs``
    when there are some (``bench.replay_tune``'s parameter sweeps). An unknown name raises
    ``ValueError`` listing ``REPLAY_POLICIES``."""
    if name in REFERENCE_POLICIES:
        return REFERENCE_POLICIES[name](
            shape, signals, future=FutureUses(routes, shape.num_experts), **kwargs
        )
    if name not in POLICIES:
        raise ValueError(f"unknown eviction policy {name!r}; known policies: {', '.join(REPLAY_POLICIES)}")
    if kwargs:
        return POLICIES[name](shape, signals, **kwargs)  # type: ignore[call-arg]
    return make_policy(name, shape, signals)


__all__ = ["REFERENCE_POLICIES", "REPLAY_POLICIES", "make_replay_policy"]
