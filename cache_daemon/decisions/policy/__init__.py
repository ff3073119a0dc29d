"""The eviction policies a daemon can run, picked by name from ``POLICIES`` (one file per policy).

The references that need the future (Belady, the next-token oracle) are the trace replay's own
(``replay.policies``).

>>> make_policy("lru").name
'lru'
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cache_daemon.decisions.policy.activation_aware import ActivationAwarePolicy
from cache_daemon.decisions.policy.base import EvictionPolicy, PolicyShape, ShapedPolicy
from cache_daemon.decisions.policy.lfu import LFUPolicy
from cache_daemon.decisions.policy.lru import LRUPolicy
from cache_daemon.decisions.policy.moe_infinity import MoEInfinityPolicy

if TYPE_CHECKING:
    from cache_daemon.decisions.signals import ActivationSignals

POLICIES: dict[str, type[EvictionPolicy]] = {
    "lru": LRUPolicy,
    "lfu": LFUPolicy,
    "moe-infinity": MoEInfinityPolicy,
    "activation-aware": ActivationAwarePolicy,
}


def make_policy(
    name: str,
    shape: PolicyShape | None = None,
    signals: ActivationSignals | None = None,
) -> EvictionPolicy:
    """A fresh policy object for ``name``, constructed as ``cls(shape, signals)``.

    An unknown name raises ``ValueError`` listing the known ones; a policy that reads predictions
    (all but ``lru`` and ``lfu``) without ``signals`` raises ``ValueError`` naming what it needs.
    """
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; known policies: {', '.join(sorted(POLICIES))}"
        ) from None
    return cls(shape, signals)  # type: ignore[call-arg]


__all__ = [
    "POLICIES",
    "ActivationAwarePolicy",
    "EvictionPolicy",
    "LFUPolicy",
    "LRUPolicy",
    "MoEInfinityPolicy",
    "PolicyShape",
    "ShapedPolicy",
    "make_policy",
]
