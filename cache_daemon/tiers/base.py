"""The memory-tier interface (``MemoryTier``), and the names of the three tiers (``Tier``).

The host tier and the store share one keyed contract: views valid only while pinned, a pinned key
never evicted, counted pins (docs/residency.md, "The tiers below").
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from expertcache.keys import ExpertKey
from expertcache.protocol import Tier


class MemoryTier(ABC):
    """A keyed store of fixed-size blobs; its ownership rules are in docs/residency.md."""

    tier: Tier

    @abstractmethod
    def contains(self, key: ExpertKey) -> bool:
        """Whether ``key``'s blob is in this tier now (it may leave at once unless pinned)."""

    @abstractmethod
    def pin(self, key: ExpertKey) -> bool:
        """Pin ``key`` if present (returns True) so it stays and its view stays valid."""

    @abstractmethod
    def unpin(self, key: ExpertKey) -> None:
        """Drop one pin taken by ``pin`` (or by a pinning put)."""

    @abstractmethod
    def get(self, key: ExpertKey) -> torch.Tensor:
        """``[blob_bytes]`` uint8 bytes of ``key``: a view valid while pinned (see each tier)."""

    @abstractmethod
    def put(self, key: ExpertKey, data: torch.Tensor) -> bool:
        """Copy ``data`` (``[blob_bytes]`` uint8) in as ``key``; False when there is no room."""

    def prefetch(self, key: ExpertKey) -> None:  # noqa: B027 - an optional hook, no-op by default
        """Hint that ``key`` will be needed soon; a no-op in the host tier and the store. The
        daemon's prefetching is the device tier's (``cache_daemon.residency.prefetcher``), which
        reads through these tiers; demand loads never depend on this hook."""

    @abstractmethod
    def remove(self, key: ExpertKey) -> bool:
        """Drop ``key`` unless pinned; True if it was removed."""

    @abstractmethod
    def close(self) -> None:
        """Release every resource; the tier is unusable afterwards."""
