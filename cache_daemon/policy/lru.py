"""Least-recently-used eviction: the expert whose last use is oldest leaves first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from cache_daemon.policy.base import EvictionPolicy
from expertcache.keys import ExpertKey


class LRUPolicy(EvictionPolicy):
    """Recency order kept in an ``OrderedDict``: oldest first, most recent last.

    ``choose_victims`` walks from the oldest entry and skips keys the tier says are pinned,
    so its cost grows with the number of pinned keys older than the victims (at most the
    number of slots).
    """

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[ExpertKey, None] = OrderedDict()

    def on_insert(self, key: ExpertKey) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_access(self, key: ExpertKey) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def on_remove(self, key: ExpertKey) -> None:
        self._order.pop(key, None)

    def choose_victims(self, n: int, evictable: Callable[[ExpertKey], bool]) -> list[ExpertKey]:
        victims: list[ExpertKey] = []
        if n <= 0:
            return victims
        for key in self._order:
            if evictable(key):
                victims.append(key)
                if len(victims) == n:
                    break
        return victims

    def __len__(self) -> int:
        return len(self._order)
