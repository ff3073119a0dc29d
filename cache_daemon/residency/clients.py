"""The residency's clients: Demand sessions and their pins, compute's client ledgers, and the
recency of compute's shared-memory hits.

- ``Session``: one Demand stream; ``held`` counts the pins it holds per key. Those pins are also
  in the slot table's shared count (``Slots.hold``), which is what eviction checks: the session
  keeps only what it must give back when it ends.
- ``ClientLedgers``: the table's per-client pin ledgers handed out at Attach and tied to a Demand
  stream, so a compute process that dies never leaves slots pinned.
- ``Recency``: compute's hits through the table never reach the daemon as calls; their access
  stamps are fed to the policy in stamp order before each decision, so LRU stays LRU.

Everything here is called under the residency lock, except ``ClientLedgers.reclaim`` (it may
wait, bounded, for a client inside a pin call).
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

from cache_daemon.decisions.policy import EvictionPolicy
from cache_daemon.residency.slots import Slots, SlotState
from expertcache.errors import FailedPrecondition, ResourceExhausted
from expertcache.keys import ExpertKey
from expertcache.native import SlotTable

logger = logging.getLogger(__name__)

# A client ledger claimed at Attach but never tied to a Demand stream is taken back after this
# long, when every ledger is in use (the client died between Attach and Demand).
UNBOUND_CLAIM_EXPIRY_S = 30.0


class Session:
    """The pins of one Demand stream. Made by ``Residency.open_session``.

    A session's ``acquire`` and ``release`` calls must not overlap (a stream handles one
    request at a time); ``close_session`` may come from any thread at any time.
    """

    _ids = itertools.count(1)

    def __init__(self, name: str) -> None:
        self.id = next(Session._ids)
        self.name = name
        self.closed = False
        self.held: dict[ExpertKey, int] = {}  # key -> pins this session holds (also in the table)
        self.ledger: int | None = None  # the client ledger tied to this stream (bind_client)

    def pins(self, key: ExpertKey) -> int:
        return self.held.get(key, 0)

    def add(self, key: ExpertKey) -> None:
        self.held[key] = self.held.get(key, 0) + 1

    def drop(self, key: ExpertKey) -> bool:
        """One pin less on ``key``; False if the session held none."""
        n = self.held.get(key, 0)
        if n <= 0:
            return False
        if n == 1:
            del self.held[key]
        else:
            self.held[key] = n - 1
        return True

    def __repr__(self) -> str:
        return f"Session({self.id}, {self.name!r})"


@dataclass(frozen=True)
class ClientLedger:
    """A client ledger of the shared slot table handed to one compute process at Attach."""

    index: int
    epoch: int


class ClientLedgers:
    """Which client ledgers of ``table`` are claimed, and by which session they are bound."""

    def __init__(self, table: SlotTable) -> None:
        self._table = table
        self._claims: dict[int, tuple[Session | None, float]] = {}  # index -> (bound session, claimed at)

    def claim(self) -> ClientLedger:
        """A free ledger for an attaching compute process (``ResourceExhausted`` if none)."""
        table = self._table
        now = time.monotonic()
        free = next((i for i in range(table.num_clients) if i not in self._claims), None)
        if free is None:
            # A ledger claimed long ago and never tied to a stream: its client died after Attach.
            free = next(
                (
                    i
                    for i, (bound, since) in sorted(self._claims.items())
                    if bound is None and now - since > UNBOUND_CLAIM_EXPIRY_S
                ),
                None,
            )
            if free is None:
                raise ResourceExhausted(
                    f"all {table.num_clients} client ledgers of slot table {table.path} are in "
                    "use by attached compute processes; detach one or attach with the shm fast path off"
                )
            logger.warning(
                "taking back client ledger %d, claimed %.0fs ago and never used",
                free,
                now - self._claims[free][1],
            )
            table.reclaim_client(free)
        self._claims[free] = (None, now)
        return ClientLedger(free, table.client_epoch(free))

    def bind(self, session: Session, ledger: ClientLedger) -> None:
        """Tie ``ledger`` (claimed at Attach) to ``session``; ``FailedPrecondition`` if it is not
        claimed, bound elsewhere, or at another epoch."""
        table = self._table
        claim = self._claims.get(ledger.index)
        epoch = table.client_epoch(ledger.index) if 0 <= ledger.index < table.num_clients else None
        if claim is None or claim[0] is not None or epoch != ledger.epoch or session.ledger is not None:
            raise FailedPrecondition(
                f"client ledger {ledger.index} (epoch {ledger.epoch}) is not an unused ledger claimed at "
                f"Attach (current epoch {epoch}): Attach again before opening a Demand stream"
            )
        self._claims[ledger.index] = (session, claim[1])
        session.ledger = ledger.index

    def reclaim(self, index: int) -> int:
        """End ledger ``index``'s epoch and drop its pins from the table (outside the lock: it may
        wait, bounded, for a client inside a pin call); returns the pins removed."""
        return int(self._table.reclaim_client(index))

    def release(self, index: int) -> None:
        """Ledger ``index`` is free for the next Attach (after ``reclaim``)."""
        self._claims.pop(index, None)


class Recency:
    """Feeds the policy the accesses compute made through the table (its access stamps)."""

    def __init__(self, table: SlotTable, slots: Slots) -> None:
        self._table = table
        self._slots = slots
        self._synced = table.clock  # access stamps up to here are known to the policy

    def sync(self, policy: EvictionPolicy, on_used) -> None:
        """Tell ``policy`` about every table hit since the last sync, in stamp order;
        ``on_used(key)`` for each (a prefetch of it paid off)."""
        clock = self._table.clock
        if clock == self._synced:
            return
        for index in self._table.accessed_since(self._synced):
            key = self._slots.key_of(index)
            if self._slots.state(key) is SlotState.RESIDENT:
                policy.on_access(key)
                on_used(key)
        self._synced = clock


__all__ = ["UNBOUND_CLAIM_EXPIRY_S", "ClientLedger", "ClientLedgers", "Recency", "Session"]
