"""The eviction policy interface (``EvictionPolicy``): which unpinned expert leaves a full tier.

A policy only orders keys; the tier tells it what entered and left and asks for victims among
the keys it says are evictable, so "a pinned expert is never evicted" is enforced by the tier
alone. Policies are not thread-safe: every call is made under the owning tier's lock.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from expertcache.keys import ExpertKey

if TYPE_CHECKING:
    from cache_daemon.decisions.signals import ActivationSignals


@dataclass(frozen=True)
class PolicyShape:
    """The model's routed-expert grid: ``num_layers`` MoE layers × ``num_experts`` experts."""

    num_layers: int
    num_experts: int

    def __post_init__(self) -> None:
        if self.num_layers < 1 or self.num_experts < 1:
            raise ValueError(
                f"PolicyShape needs num_layers >= 1 and num_experts >= 1, got {self.num_layers} x {self.num_experts}"
            )

    @property
    def num_entries(self) -> int:
        return self.num_layers * self.num_experts


def first_evictable(
    order: Iterable[ExpertKey], n: int, evictable: Callable[[ExpertKey], bool]
) -> list[ExpertKey]:
    """The first ``n`` keys of ``order`` (a policy's victim order, best first) that are
    ``evictable``: ``choose_victims`` of a policy that keeps an order. Walks no further than it
    must (the tier's pinned keys are skipped one by one)."""
    victims: list[ExpertKey] = []
    if n <= 0:
        return victims
    for key in order:
        if evictable(key):
            victims.append(key)
            if len(victims) == n:
                break
    return victims


class EvictionPolicy(ABC):
    """Orders the keys resident in one tier for eviction."""

    name: str = ""
    needs_signals: bool = False  # True: the constructor refuses ``signals=None``
    signals: ActivationSignals | None = None  # the signals the policy reads, if any
    prefetch_horizon_layers: int | None = None
    """How far ahead (layer steps) ``prefetch_scores`` candidates are taken; None = the
    scheduler's ``horizon_layers``."""
    prefetch_order: str = "deadline"
    """How the scheduler orders this policy's candidates: ``deadline`` (nearest layer first, then
    likeliest) or ``score`` (its own ``prefetch_scores``, highest first, after lookahead)."""

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

    def seed(self, keys: Iterable[ExpertKey]) -> None:
        """Start tracking ``keys`` already resident (a runtime policy switch): inserted in the
        given order, oldest first, so nothing resident is lost to the new policy."""
        for key in keys:
            self.on_insert(key)

    def prefetch_scores(self, min_probability: float) -> np.ndarray | None:
        """float64 [N] the policy's own speculative prefetch score per entry (0 = no), or None
        when the policy prefetches nothing beyond layer-ahead predictions (the default). A policy
        that estimates use probabilities scores only the entries at least ``min_probability``
        likely to be used at their next visit (the scheduler's one bar,
        ``PrefetchConfig.min_probability``)."""
        return None

    def keep_value(self, keys: Iterable[ExpertKey]) -> np.ndarray:
        """float64 [len(keys)] how much the policy wants to keep each key, higher = keep (the
        prefetch scheduler compares a candidate's value against its would-be victim's with
        ``prefetch_value``). The default ranks by the policy's own victim order."""
        keys = list(keys)
        order = self.choose_victims(len(self), lambda k: True)
        rank = {k: i for i, k in enumerate(order)}
        return np.array([float(rank.get(k, len(order))) for k in keys], np.float64)


class ShapedPolicy(EvictionPolicy):
    """Base of the vectorised policies: a resident mask and per-entry arrays over the shape."""

    def __init__(self, shape: PolicyShape | None = None, signals: ActivationSignals | None = None) -> None:
        if shape is None:
            if signals is None:
                raise ValueError(
                    f"policy {self.name!r} needs the model shape (PolicyShape) or ActivationSignals"
                )
            shape = PolicyShape(signals.num_layers, signals.num_experts)
        if signals is not None and (signals.num_layers, signals.num_experts) != (
            shape.num_layers,
            shape.num_experts,
        ):
            raise ValueError(
                f"signals are {signals.num_layers} x {signals.num_experts} but the policy shape is "
                f"{shape.num_layers} x {shape.num_experts}"
            )
        if self.needs_signals and signals is None:
            raise ValueError(f"policy {self.name!r} needs ActivationSignals")
        self.shape = shape
        self.signals = signals
        self._E = shape.num_experts
        self._resident = np.zeros(shape.num_entries, bool)
        self._count = 0
        self._clock = 0  # bumped per insert/access: a total recency order
        # victim_order of the state it was computed in: (changes, signals version, order). The
        # keep-scores read only this policy's state (changed through on_insert / on_access /
        # on_remove, each of which bumps _changes) and the signals (whose version bumps on every
        # change), so one decision round asking for many victims sorts once.
        self._changes = 0
        self._order_cache: tuple[int, int, np.ndarray] | None = None

    def _entry(self, key: ExpertKey) -> int:
        if not (0 <= key.layer < self.shape.num_layers and 0 <= key.expert < self._E):
            raise ValueError(f"{key} is outside {self.shape.num_layers} layers x {self._E} experts")
        return key.entry(self._E)

    def _key(self, entry: int) -> ExpertKey:
        return ExpertKey.of_entry(entry, self._E)

    def on_insert(self, key: ExpertKey) -> None:
        e = self._entry(key)
        if not self._resident[e]:
            self._resident[e] = True
            self._count += 1
        self._clock += 1
        self._changes += 1
        self._inserted(e)

    def on_access(self, key: ExpertKey) -> None:
        e = self._entry(key)
        if self._resident[e]:
            self._clock += 1
            self._changes += 1
            self._accessed(e)

    def on_remove(self, key: ExpertKey) -> None:
        try:
            e = self._entry(key)
        except ValueError:
            return
        if self._resident[e]:
            self._resident[e] = False
            self._count -= 1
            self._changes += 1
            self._removed(e)

    def __len__(self) -> int:
        return self._count

    # Subclasses: keep-scores, higher = keep; victims are the lowest.
    def _inserted(self, entry: int) -> None:
        self._accessed(entry)

    def _accessed(self, entry: int) -> None:
        """Hook: a resident entry was used."""

    def _removed(self, entry: int) -> None:
        """Hook: an entry left."""

    @abstractmethod
    def _keep_scores(self, entries: np.ndarray) -> np.ndarray:
        """float64 [len(entries)] keep-score of resident ``entries`` (int64), higher = keep.
        Ties are broken by recency of insertion/access through ``_tiebreak``."""

    def _tiebreak(self, entries: np.ndarray) -> np.ndarray:
        """float64 [len(entries)] secondary key (higher = keep); default: entry index, so the
        order is deterministic."""
        return entries.astype(np.float64)

    def victim_order(self) -> np.ndarray:
        """int64 [resident] resident entries, best victim first (lowest keep-score); read-only,
        recomputed only when the policy or the signals changed since the last call."""
        version = self.signals.version if self.signals is not None else -1
        cached = self._order_cache
        if cached is not None and cached[0] == self._changes and cached[1] == version:
            return cached[2]
        entries = self._ordered_resident()
        entries.flags.writeable = False
        self._order_cache = (self._changes, version, entries)
        return entries

    def _ordered_resident(self) -> np.ndarray:
        """int64 [resident] the resident entries sorted by keep-score, then tiebreak (stably, from
        ascending entries); a policy may compute the same order faster."""
        entries = np.flatnonzero(self._resident)
        if entries.size:
            entries = entries[np.lexsort((self._tiebreak(entries), self._keep_scores(entries)))]
        return entries

    def choose_victims(self, n: int, evictable: Callable[[ExpertKey], bool]) -> list[ExpertKey]:
        if self._count == 0:
            return []
        return first_evictable((self._key(int(e)) for e in self.victim_order()), n, evictable)

    def keep_value(self, keys: Iterable[ExpertKey]) -> np.ndarray:
        entries = np.array([self._entry(k) for k in keys], np.int64)
        if entries.size == 0:
            return np.zeros(0, np.float64)
        return self._keep_scores(entries).astype(np.float64)

    def rank(self, keys: Iterable[ExpertKey]) -> list[ExpertKey]:
        """``keys`` ordered best victim first by this policy's keep-scores."""
        keys = list(keys)
        if not keys:
            return keys
        entries = np.array([self._entry(k) for k in keys], np.int64)
        order = np.lexsort((self._tiebreak(entries), self._keep_scores(entries)))
        return [keys[i] for i in order]
