"""A memory budget of the daemon (``Budget``): its config field, its bytes, its ceiling and its slots.

One place sizes both budgets (device arena, host tier), so the config check, the start and a live
update refuse the same faults with the same message; ``docs/daemon.md`` explains the ceilings.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

from cache_daemon.errors import BudgetTooSmall
from expertcache.errors import InvalidArgument


class BudgetFields(Protocol):
    """The config fields the budgets are read from (``cache_daemon.config.DaemonConfig``'s)."""

    @property
    def device_budget_bytes(self) -> int: ...

    @property
    def device_budget_max_bytes(self) -> int: ...

    @property
    def host_budget_bytes(self) -> int: ...

    @property
    def host_budget_max_bytes(self) -> int: ...


@dataclass(frozen=True)
class Budget:
    """``bytes`` of the budget in config field ``name``, live up to ``ceiling`` bytes (field
    ``ceiling_name``, resolved: the starting bytes when that field is 0). ``optional``: 0 bytes
    turns the tier off (the host tier) instead of being too small for one blob."""

    name: str
    bytes: int
    ceiling_name: str
    ceiling: int
    optional: bool = False

    @classmethod
    def device(cls, config: BudgetFields) -> Budget:
        return cls._of(config, "device_budget_bytes", "device_budget_max_bytes", optional=False)

    @classmethod
    def host(cls, config: BudgetFields) -> Budget:
        return cls._of(config, "host_budget_bytes", "host_budget_max_bytes", optional=True)

    @classmethod
    def _of(cls, config: BudgetFields, name: str, ceiling_name: str, *, optional: bool) -> Budget:
        value = getattr(config, name)
        return cls(name, value, ceiling_name, getattr(config, ceiling_name) or value, optional)

    def resized(self, value: int) -> Budget:
        """The same budget at ``value`` bytes, within the ceiling allocated at start (a live change)."""
        return dataclasses.replace(self, bytes=value)

    def check_ceiling(self) -> None:
        """``InvalidArgument`` naming both fields and values when the bytes are above the ceiling."""
        if self.bytes > self.ceiling:
            raise InvalidArgument(
                f"config field {self.name!r} = {self.bytes} is above its ceiling {self.ceiling_name} = "
                f"{self.ceiling} (memory allocated at start; {self.ceiling_name} = 0 makes the starting "
                f"{self.name} the ceiling): raise {self.ceiling_name} and restart the daemon to grow further"
            )

    def slots(self, blob_bytes: int, cap: int | None = None) -> int:
        """``bytes // blob_bytes`` slots, at most ``cap`` (a store may hold fewer blobs); 0 for an
        optional budget of 0 bytes. Below one blob otherwise raises ``BudgetTooSmall``."""
        if self.optional and not self.bytes:
            return 0
        slots = self.bytes // blob_bytes
        if slots < 1:
            raise BudgetTooSmall(
                f"config field {self.name!r} = {self.bytes} is smaller than one expert blob "
                f"(blob_bytes={blob_bytes}): set {self.name} to at least {blob_bytes}"
            )
        return min(slots, cap) if cap is not None else slots

    def ceiling_slots(self, blob_bytes: int, cap: int | None = None) -> int:
        """The slots allocated at start: ``slots`` of the ceiling (named by its own field)."""
        return dataclasses.replace(self, name=self.ceiling_name, bytes=self.ceiling).slots(blob_bytes, cap)


__all__ = ["Budget", "BudgetFields"]
