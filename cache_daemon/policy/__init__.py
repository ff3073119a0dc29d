"""Eviction policies, picked by name from ``POLICIES`` (one file per policy).

>>> make_policy("lru").name
'lru'
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cache_daemon.policy.activation_aware import ActivationAwarePolicy
from cache_daemon.policy.base import EvictionPolicy, PolicyShape, ShapedPolicy
from cache_daemon.policy.belady import BeladyPolicy, FutureUses
from cache_daemon.policy.lfu import LFUPolicy
from cache_daemon.policy.lru import LRUPolicy
from cache_daemon.policy.moe_infinity import MoEInfinityPolicy

if TYPE_CHECKING:
    from cache_daemon.signals import ActivationSignals

POLICIES: dict[str, type[EvictionPolicy]] = {
    "lru": LRUPolicy,
    "lfu": LFUPolicy,
    "moe-infinity": MoEInfinityPolicy,
    "activation-aware": ActivationAwarePolicy,
    "belady": BeladyPolicy,
}

ONLINE_POLICIES: tuple[str, ...] = ("lru", "lfu", "moe-infinity", "activation-aware")
"""The policies a daemon can run (``belady`` needs the future)."""


def make_policy(
    name: str,
    shape: PolicyShape | None = None,
    signals: ActivationSignals | None = None,
    *,
    future: FutureUses | None = None,
) -> EvictionPolicy:
    """A fresh policy object for ``name``, constructed as ``cls(shape, signals)``.

    An unknown name raises ``ValueError`` listing the known ones; ``belady`` without ``future``
    raises ``ValueError("belady is the offline optimum: trace replay only ...")``; a policy that
    reads predictions (``moe-infinity``, ``activation-aware``, ``belady``) without ``signals``
    raises ``ValueError`` naming what it needs.
    """
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; known policies: {', '.join(sorted(POLICIES))}"
        ) from None
    if cls is BeladyPolicy:
        if future is None:
            raise ValueError("belady is the offline optimum: trace replay only (it needs FutureUses)")
        return BeladyPolicy(shape, signals, future=future)
    return cls(shape, signals)  # type: ignore[call-arg]


__all__ = [
    "ONLINE_POLICIES",
    "POLICIES",
    "ActivationAwarePolicy",
    "BeladyPolicy",
    "EvictionPolicy",
    "FutureUses",
    "LFUPolicy",
    "LRUPolicy",
    "MoEInfinityPolicy",
    "PolicyShape",
    "ShapedPolicy",
    "make_policy",
]
