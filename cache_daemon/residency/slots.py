"""The arena's slots as the shared slot table records them (``Slots``), and the allocator of free
slots. The native table is the only record of each entry's state, slot and pins: nothing here
mirrors it (docs/residency.md, "Slots"). Called under the residency lock.
"""

from __future__ import annotations

from expertcache.keys import ExpertKey
from expertcache.native import SlotTable, TableState

# An entry's state is the table's own (``TableState``); EVICTING exists only inside the daemon's
# own try_evict call, under its lock, so outside it reads as RESIDENT.
_STATE = {
    int(TableState.ABSENT): TableState.ABSENT,
    int(TableState.LOADING): TableState.LOADING,
    int(TableState.RESIDENT): TableState.RESIDENT,
    int(TableState.EVICTING): TableState.RESIDENT,
}


class Slots:
    """Entry state and slot (read from ``table``) and the free-slot allocator over ``num_slots``."""

    def __init__(self, table: SlotTable, num_slots: int, num_experts: int) -> None:
        self.table = table
        self.num_slots = num_slots
        self.num_experts = num_experts
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        # Slots that may be in use at once (the live device budget); the arena has num_slots.
        # Above it (after a shrink) no slot is free until enough entries have left.
        self.limit = num_slots

    # -- keys ------------------------------------------------------------------------------------
    def index(self, key: ExpertKey) -> int:
        return key.entry(self.num_experts)

    def key_of(self, index: int) -> ExpertKey:
        return ExpertKey.of_entry(index, self.num_experts)

    # -- reads -----------------------------------------------------------------------------------
    def state(self, key: ExpertKey) -> TableState:
        return _STATE[int(self.table.state(self.index(key)))]

    def slot(self, key: ExpertKey) -> int:
        return int(self.table.slot(self.index(key)))

    def generation(self, key: ExpertKey) -> int:
        return int(self.table.generation(self.index(key)))

    def pins(self, key: ExpertKey) -> int:
        """Every pin on ``key``: compute's shared-memory pins and the daemon's sessions' holds."""
        return int(self.table.pins(self.index(key)))

    def is_resident(self, key: ExpertKey) -> bool:
        return int(self.table.state(self.index(key))) == int(TableState.RESIDENT)

    def evictable(self, key: ExpertKey) -> bool:
        """RESIDENT with no pin of anyone (the same check ``try_evict`` makes atomically)."""
        i = self.index(key)
        return int(self.table.state(i)) == int(TableState.RESIDENT) and self.table.pins(i) == 0

    @property
    def free(self) -> int:
        """Slots a load may take now: free ones, within ``limit``."""
        return max(0, self.limit - self.used)

    @property
    def unbudgeted_free(self) -> int:
        """Free slots of the arena, ignoring ``limit``."""
        return len(self._free)

    def free_for(self, n: int) -> int:
        """Slots a demand for ``n`` new experts may take now. A demand wider than ``limit``
        (compute sizes its waves by the arena, not by the live budget) may overshoot it by what
        it needs, after everything else is evicted: demand beats the budget, and later
        admissions evict back below it."""
        return min(len(self._free), max(0, max(self.limit, n) - self.used))

    @property
    def used(self) -> int:
        """Slots some entry names, or held back for a late copy."""
        return self.num_slots - len(self._free)

    def occupied(self) -> dict[int, tuple[ExpertKey, TableState]]:
        """slot → (key, state) of every slot in use (one pass over the table)."""
        out = {}
        for i, (state, slot) in enumerate(zip(self.table.states(), self.table.slots(), strict=True)):
            if slot >= 0 and state != int(TableState.ABSENT):
                out[int(slot)] = (self.key_of(i), _STATE[int(state)])
        return out

    # -- transitions -----------------------------------------------------------------------------
    def begin_load(self, key: ExpertKey) -> int:
        """ABSENT → LOADING into a free slot (the caller made sure there is one); returns it."""
        slot = self._free.pop()
        try:
            self.table.begin_load(self.index(key), slot)
        except BaseException:
            self._free.append(slot)
            raise
        return slot

    def finish_load(self, key: ExpertKey) -> None:
        """LOADING → RESIDENT (wakes compute threads waiting on the entry)."""
        self.table.finish_load(self.index(key))

    def abort_load(self, key: ExpertKey, slot: int, *, free_slot: bool = True) -> None:
        """LOADING → ABSENT; ``slot`` is free again, unless ``free_slot`` is False (a copy into it
        may still land: ``release_slot`` frees it once it has)."""
        self.table.abort_load(self.index(key))
        if free_slot:
            self._free.append(slot)

    def release_slot(self, slot: int) -> None:
        """A slot held back by ``abort_load(free_slot=False)`` is free again."""
        self._free.append(slot)

    def try_evict(self, key: ExpertKey) -> bool:
        """RESIDENT → ABSENT unless pinned (compute may pin concurrently: the table decides)."""
        i = self.index(key)
        slot = int(self.table.slot(i))
        if not self.table.try_evict(i):
            return False
        self._free.append(slot)
        return True

    def hold(self, key: ExpertKey, n: int = 1) -> None:
        """Add ``n`` daemon pins (a session's) to a LOADING or RESIDENT entry."""
        self.table.hold(self.index(key), n)

    def unhold(self, key: ExpertKey, n: int = 1) -> None:
        """Drop ``n`` daemon pins (wakes a daemon waiting for slots when the count reaches 0)."""
        if n > 0:
            self.table.unpin_many([self.index(key)] * n)


__all__ = ["TableState", "Slots"]
