"""The eviction policy interface: which unpinned expert leaves a full tier.

A policy only orders keys; it never owns memory and never decides whether a key *may* leave.
The tier (``Residency`` for the device arena, ``HostTier`` for host memory) tells it what
entered and left, and asks it for victims among the keys it says are evictable (resident and
unpinned), so "a pinned expert is never evicted" is enforced in one place, by the tier.

Policies are not thread-safe: every call is made under the owning tier's lock.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

from expertcache.keys import ExpertKey


class EvictionPolicy(ABC):
    """Orders the keys resident in one tier for eviction."""

    name: str = ""

    @abstractmethod
    def on_insert(self, key: ExpertKey) -> None:
        """``key`` became resident in the tier."""

    @abstractmethod
    def on_access(self, key: ExpertKey) -> None:
        """``key`` was served from the tier (a hit)."""

    @abstractmethod
    def on_remove(self, key: ExpertKey) -> None:
        """``key`` left the tier (evicted, removed or failed); unknown keys are ignored."""

    @abstractmethod
    def choose_victims(self, n: int, evictable: Callable[[ExpertKey], bool]) -> list[ExpertKey]:
        """Up to ``n`` distinct keys, best victim first, each with ``evictable(key)`` true.

        Returns fewer than ``n`` when fewer keys are evictable. The caller evicts them (and
        then calls ``on_remove``); choosing does not change the policy's state.
        """

    @abstractmethod
    def __len__(self) -> int:
        """Number of keys the policy is tracking."""
