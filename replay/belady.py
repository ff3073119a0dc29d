"""Belady's MIN, the offline optimum of demand fetching, for trace replay only.

Evicts the resident expert whose next use is furthest in the future, which needs the future:
a ``FutureUses`` built from the trace being replayed. Positions are *steps*,
``token * num_layers + layer`` over the replayed token sequence (the replay passes the same token
numbers to ``ActivationSignals.observe``). No other policy loads fewer bytes on the same trace and
budget, so its bytes are the floor's numerator.

Example: steps 0..5 over 1 layer; entry 3 used at steps 1 and 4, entry 7 at step 2 → at step 1,
entry 7's next use is 2 and entry 3's is 4 (after step 1 is observed: 3's next is 4).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from cache_daemon.decisions.policy.base import EvictionPolicy, PolicyShape, ShapedPolicy

if TYPE_CHECKING:
    from cache_daemon.decisions.signals import ActivationSignals

NEVER = np.iinfo(np.int64).max // 4
"""Next-use step of an entry with no further use."""


class FutureUses:
    """Every future use step of every entry, from routes ``[tokens, layers, top_k]`` (int).

    ``next_use(step)`` answers for all entries at once and must be asked with non-decreasing
    steps (pointers only move forward, so a whole replay costs one pass over the trace).
    """

    def __init__(self, routes: np.ndarray, num_experts: int) -> None:
        routes = np.asarray(routes)
        if routes.ndim != 3:
            raise ValueError(f"routes must be [tokens, layers, top_k], got shape {routes.shape}")
        tokens, layers, top_k = routes.shape
        if routes.size and (routes.min() < 0 or routes.max() >= num_experts):
            raise ValueError(f"routes hold experts outside 0..{num_experts - 1}")
        self.num_layers = layers
        self.num_experts = num_experts
        self.tokens = tokens
        n = layers * num_experts
        step = np.arange(tokens, dtype=np.int64)[:, None] * layers + np.arange(layers)[None, :]
        entry = np.arange(layers, dtype=np.int64)[None, :, None] * num_experts + routes.astype(np.int64)
        flat_entry = entry.reshape(-1)
        flat_step = np.broadcast_to(step[:, :, None], routes.shape).reshape(-1)
        order = np.lexsort((flat_step, flat_entry))
        self._steps = np.append(flat_step[order], NEVER)  # grouped by entry, ascending steps
        counts = np.bincount(flat_entry, minlength=n)
        self._start = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        self._end = self._start + counts
        self._ptr = self._start.copy()
        self._next = np.where(counts > 0, self._steps[np.minimum(self._ptr, len(self._steps) - 1)], NEVER)
        self._asked = -1

    def require_shape(self, shape: PolicyShape) -> None:
        """Raise ``ValueError`` unless these uses are of a model of ``shape``."""
        if (self.num_layers, self.num_experts) != (shape.num_layers, shape.num_experts):
            raise ValueError(
                f"FutureUses is {self.num_layers} x {self.num_experts} but the policy shape is "
                f"{shape.num_layers} x {shape.num_experts}"
            )

    def next_use(self, step: int) -> np.ndarray:
        """int64 [N] each entry's first use at or after ``step`` (``NEVER`` if none)."""
        if step < self._asked:
            raise ValueError(f"FutureUses asked for step {step} after step {self._asked}")
        self._asked = step
        stale = np.flatnonzero(self._next < step)
        for e in stale:
            p = self._ptr[e]
            end = self._end[e]
            while p < end and self._steps[p] < step:
                p += 1
            self._ptr[e] = p
            self._next[e] = self._steps[p] if p < end else NEVER
        return self._next


class FuturePolicy(EvictionPolicy):
    """Base of the reference policies: constructed with the trace's ``FutureUses`` (checked against
    the shape), which no running daemon has. ``refusal`` says why one is refused without it."""

    refusal = "a reference policy needs the future"
    future: FutureUses

    def __init__(
        self,
        shape: PolicyShape | None = None,
        signals: ActivationSignals | None = None,
        *,
        future: FutureUses | None = None,
    ) -> None:
        if future is None:
            raise ValueError(f"{self.refusal}: trace replay only (it needs FutureUses)")
        super().__init__(shape, signals)  # type: ignore[call-arg]
        future.require_shape(self.shape)  # type: ignore[attr-defined]
        self.future = future


class BeladyPolicy(FuturePolicy, ShapedPolicy):
    name = "belady"
    refusal = "belady is the offline optimum"
    needs_signals = True

    def next_use(self) -> np.ndarray:
        """int64 [N] next use step of every entry, from the current position on."""
        assert self.signals is not None
        return self.future.next_use(max(self.signals.step, 0))

    def _keep_scores(self, entries: np.ndarray) -> np.ndarray:
        return -self.next_use()[entries].astype(np.float64)
