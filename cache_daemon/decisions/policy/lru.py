"""Least-recently-used eviction: the expert whose last use is oldest leaves first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import numpy as np

from cache_daemon.decisions.policy.base import EvictionPolicy, PolicyShape, first_evictable
from expertcache.keys import ExpertKey

if TYPE_CHECKING:
    from cache_daemon.decisions.signals import ActivationSignals


class LRUPolicy(EvictionPolicy):
    """Recency order kept in an ``OrderedDict``: oldest first, most recent last.

    ``choose_victims`` walks from the oldest entry and skips keys the tier says are pinned,
    so its cost grows with the number of pinned keys older than the victims (at most the
    number of slots). Needs neither the shape nor the signals (both accepted for the common
    constructor).
    """

    name = "lru"

    def __init__(self, shape: PolicyShape | None = None, signals: ActivationSignals | None = None) -> None:
        self.shape = shape
        self.signals = signals
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
        return first_evictable(self._order, n, evictable)

    def keep_value(self, keys: Iterable[ExpertKey]) -> np.ndarray:
        """Recency rank (0 = least recent); untracked keys rank above every tracked one."""
        rank = {k: i for i, k in enumerate(self._order)}
        top = len(rank)
        return np.array([float(rank.get(k, top)) for k in keys], np.float64)

    def rank(self, keys: Iterable[ExpertKey]) -> list[ExpertKey]:
        """``keys`` ordered best victim first (least recent first)."""
        keys = list(keys)
        values = self.keep_value(keys)
        return [keys[i] for i in np.argsort(values, kind="stable")]

    def __len__(self) -> int:
        return len(self._order)
