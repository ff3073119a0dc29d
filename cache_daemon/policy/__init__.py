"""Eviction policies, picked by name from ``POLICIES`` (one file per policy).

>>> make_policy("lru").name
'lru'
"""

from __future__ import annotations

from cache_daemon.policy.base import EvictionPolicy
from cache_daemon.policy.lru import LRUPolicy

POLICIES: dict[str, type[EvictionPolicy]] = {
    "lru": LRUPolicy,
}


def make_policy(name: str) -> EvictionPolicy:
    """A fresh policy object for ``name``; an unknown name raises ``ValueError`` listing the known ones."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; known policies: {', '.join(sorted(POLICIES))}"
        ) from None
    return cls()


__all__ = ["POLICIES", "EvictionPolicy", "LRUPolicy", "make_policy"]
