"""Eviction policies, picked by name from ``POLICIES`` (one file per policy).

>>> make_policy("lru").name
'lru'
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cache_daemon.decisions.policy.activation_aware import ActivationAwarePolicy
from cache_daemon.decisions.policy.base import EvictionPolicy, PolicyShape, ShapedPolicy
from cache_daemon.decisions.policy.belady import BeladyPolicy, FutureUses
from cache_daemon.decisions.policy.lfu import LFUPolicy
from cache_daemon.decisions.policy.lru import LRUPolicy
from cache_daemon.decisions.policy.moe_infinity import MoEInfinityPolicy
from cache_daemon.decisions.policy.oracle import NextTokenOraclePolicy

if TYPE_CHECKING:
    from cache_daemon.decisions.signals import ActivationSignals

POLICIES: dict[str, type[EvictionPolicy]] = {
    "lru": LRUPolicy,
    "lfu": LFUPolicy,
    "moe-infinity": MoEInfinityPolicy,
    "activation-aware": ActivationAwarePolicy,
    "belady": BeladyPolicy,
    "oracle-next-token": NextTokenOraclePolicy,
}

ONLINE_POLICIES: tuple[str, ...] = tuple(n for n, c in POLICIES.items() if not c.needs_future)
"""The policies a daemon can run: ``lru``, ``lfu``, ``moe-infinity``, ``activation-aware``."""

REPLAY_ONLY_POLICIES: tuple[str, ...] = tuple(n for n, c in POLICIES.items() if c.needs_future)
"""References that need the future (``FutureUses`` of a trace): ``belady``, ``oracle-next-token``."""


def make_policy(
    name: str,
    shape: PolicyShape | None = None,
    signals: ActivationSignals | None = None,
    *,
    future: FutureUses | None = None,
) -> EvictionPolicy:
    """A fresh policy object for ``name``, constructed as ``cls(shape, signals)``.

    An unknown name raises ``ValueError`` listing the known ones; a replay-only policy
    (``REPLAY_ONLY_POLICIES``) without ``future`` raises ``ValueError("... trace replay only ...")``;
    a policy that reads predictions (all but ``lru`` and ``lfu``) without ``signals`` raises
    ``ValueError`` naming what it needs.
    """
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; known policies: {', '.join(sorted(POLICIES))}"
        ) from None
    if cls.needs_future:
        if future is None:
            raise ValueError(f"{name} needs the future: trace replay only (it needs FutureUses)")
        return cls(shape, signals, future=future)  # type: ignore[call-arg]
    return cls(shape, signals)  # type: ignore[call-arg]


__all__ = [
    "ONLINE_POLICIES",
    "POLICIES",
    "REPLAY_ONLY_POLICIES",
    "ActivationAwarePolicy",
    "BeladyPolicy",
    "EvictionPolicy",
    "FutureUses",
    "LFUPolicy",
    "LRUPolicy",
    "MoEInfinityPolicy",
    "NextTokenOraclePolicy",
    "PolicyShape",
    "ShapedPolicy",
    "make_policy",
]
