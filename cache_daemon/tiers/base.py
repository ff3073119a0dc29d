"""The memory-tier interface, and the names of the three tiers.

::

    Acquire ──▶ Residency (device slot table) ──miss──▶ HostTier ──miss──▶ StoreReader
                     │ owns                               │ owns              │ owns
                     ▼                                    ▼                   ▼
                DeviceArena slots                 host slots (pinned      layer files
                (shm / CUDA IPC)                  with CUDA)              (O_DIRECT)

A tier maps ``ExpertKey`` → bytes of one blob (``blob_bytes`` long). ``MemoryTier`` is the
keyed contract shared by the host tier and the store, after LMCache's
``StorageBackendInterface``. The device tier is ``cache_daemon.residency.Residency`` over a
``DeviceArena``: it keeps the same rules, but its pins belong to Demand sessions and compute's
shared-memory pins, its Acquire can wait, and it loads ahead of demand (prefetch), so it has its
own richer API.

Ownership contract (every tier):

- The tier owns its buffers. ``get`` returns a *view* into tier memory that stays valid only
  while the caller holds a pin on that key (``pin`` returned True, or the pinning variant of a
  call said so); after ``unpin`` the tier may overwrite or free it at any time.
- A pinned key is never evicted, removed or overwritten. ``remove`` of a pinned key returns
  False and changes nothing.
- Pins are counted: each successful ``pin`` needs exactly one ``unpin``.
- ``put`` copies from the caller's buffer; the caller keeps ownership of it. A put that finds
  no free or evictable slot returns False instead of waiting (tiers below the arena are caches:
  missing a put costs a later re-read, never correctness).
- The allocator (free slots, victims) is private to the tier.
- ``close`` frees everything; no view may be used afterwards.
- Methods are thread-safe.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod

import torch

from expertcache.keys import ExpertKey


class Tier(enum.Enum):
    """Where an expert's bytes are found. Values are the ``tier`` label of the metrics."""

    DEVICE = "device"
    HOST = "host"
    STORE = "store"


class MemoryTier(ABC):
    """A keyed store of fixed-size blobs; see the module docstring for the ownership rules."""

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
