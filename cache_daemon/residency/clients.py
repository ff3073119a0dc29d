"""The residency's clients: Demand sessions and their pins (``Session``), compute's client
ledgers (``ClientLedgers``), and the recency of compute's shared-memory hits (``Recency``), so a
dead compute process never leaves slots pinned and LRU stays LRU (docs/residency.md, "Clients").
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

from cache_daemon.decisions.policy import EvictionPolicy
from cache_daemon.residency.slots import Slots
from expertcache.errors import FailedPrecondition, ResourceExhausted
from expertcache.keys import ExpertKey
from expertcache.native import SlotTable, TableState

logger = logging.getLogger(__name__)

# A client ledger claimed at Attach but never tied to a Demand stream is taken back after this
# long, when every ledger is in use (the client died between Attach and Demand).
UNBOUND_CLAIM_EXPIRY_S = 30.0
# At most this share of the ledgers is claimed and not yet tied to a stream: an Attach beyond it
# takes back the oldest unbound claim, so a flood of Attach calls churns among unbound claims and
# never exhausts the ledgers that working clients hold.
MAX_UNBOUND_SHARE = 0.5


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
        self.revoked = False  # ended by the audit of its client's region; closing in a thread
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
        self._warned_at = -1e9

    def claim(self) -> ClientLedger:
        """A free ledger for an attaching compute process, with a new region (the table's
        ``claim_channel``); ``ResourceExhausted`` if none."""
        table = self._table
        now = time.monotonic()
        unbound = sorted((since, i) for i, (bound, since) in self._claims.items() if bound is None)
        free = next((i for i in range(table.num_clients) if i not in self._claims), None)
        take_back = None
        if unbound and len(unbound) >= max(1, int(table.num_clients * MAX_UNBOUND_SHARE)):
            take_back = unbound[0][1]  # too many Attach calls without a stream: the oldest goes
        elif free is None:
            # A ledger claimed long ago and never tied to a stream: its client died after Attach.
            take_back = next((i for since, i in unbound if now - since > UNBOUND_CLAIM_EXPIRY_S), None)
            if take_back is None:
                raise ResourceExhausted(
                    f"all {table.num_clients} client ledgers of the slot table are in use by attached "
                    "compute processes; detach one or attach with the shm fast path off"
                )
        if take_back is not None:
            if now - self._warned_at > 10.0:
                self._warned_at = now
                logger.warning(
                    "taking back client ledger %d, claimed %.1fs ago and never tied to a Demand stream "
                    "(%d unbound claims)",
                    take_back,
                    now - self._claims[take_back][1],
                    len(unbound),
                )
            table.reclaim_client(take_back)
            del self._claims[take_back]
            free = take_back if free is None else free
        epoch = table.claim_channel(free)  # a new region: nothing of a previous client in it
        self._claims[free] = (None, now)
        return ClientLedger(free, int(epoch))

    def unbound(self, ledger: ClientLedger) -> bool:
        """``ledger`` is claimed at its epoch and not yet tied to a stream."""
        claim = self._claims.get(ledger.index)
        return (
            claim is not None and claim[0] is None and self._table.client_epoch(ledger.index) == ledger.epoch
        )

    def bound(self) -> list[tuple[int, Session]]:
        """(index, session) of every ledger tied to a stream."""
        return [(i, bound) for i, (bound, _since) in self._claims.items() if bound is not None]

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
    """Feeds the policy the accesses compute made through the table (its regions' stamps)."""

    def __init__(self, table: SlotTable, slots: Slots) -> None:
        self._table = table
        self._slots = slots
        self._synced = 0  # access stamps up to here (monotonic ns) are known to the policy

    def sync(self, policy: EvictionPolicy, on_used) -> None:
        """Tell ``policy`` about every table hit since the last sync, in stamp order;
        ``on_used(key)`` for each (a prefetch of it paid off)."""
        entries, self._synced = self._table.accessed_since(self._synced)
        for index in entries:
            key = self._slots.key_of(index)
            if self._slots.state(key) is TableState.RESIDENT:
                policy.on_access(key)
                on_used(key)


__all__ = [
    "MAX_UNBOUND_SHARE",
    "UNBOUND_CLAIM_EXPIRY_S",
    "ClientLedger",
    "ClientLedgers",
    "Recency",
    "Session",
]
