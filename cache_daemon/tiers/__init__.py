"""The daemon's memory tiers: device arena (``device``), host cache (``host``), store (``store``).

``base`` holds the ``MemoryTier`` interface and its ownership contract.
"""

from cache_daemon.tiers.base import MemoryTier, Tier
from cache_daemon.tiers.device import (
    ARENAS,
    ArenaHandle,
    ArenaKind,
    DeviceArena,
    create_arena,
)
from cache_daemon.tiers.host import HostTier
from cache_daemon.tiers.store import StoreReader

__all__ = [
    "ARENAS",
    "ArenaHandle",
    "ArenaKind",
    "DeviceArena",
    "HostTier",
    "MemoryTier",
    "StoreReader",
    "Tier",
    "create_arena",
]
