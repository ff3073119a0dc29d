"""Who pins what, and giving it back: Demand sessions, compute's client ledgers, the channel
servers of bound clients and the loads they wait for (``Sessions``). A killed client's pins are
reclaimed when its stream ends (docs/residency.md, "Clients").
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from cache_daemon.errors import BadAcquire, SessionClosed, ShuttingDown
from cache_daemon.metrics import DaemonMetrics
from cache_daemon.residency.channel import ChannelPort, ChannelServer
from cache_daemon.residency.clients import ClientLedger, ClientLedgers, Session
from cache_daemon.residency.slots import Slots
from cache_daemon.tiers.base import Tier
from expertcache.keys import ExpertKey
from expertcache.native import SlotTable

logger = logging.getLogger(__name__)

# A client's stray pins (on entries not LOADING or RESIDENT) must be seen again this much later,
# on the same entry, before its session is ended: far longer than any pin call takes.
STRAY_CONFIRM_S = 0.05

# How long closing a session waits for its channel's thread to end (it ends at its next check:
# an admission waiting for slots is woken by the close, a copy in progress finishes).
CHANNEL_JOIN_S = 10.0


@dataclass(eq=False, repr=False)
class Sessions:
    """The open Demand sessions, the client ledgers, the channel servers of the bound ones and
    which of them wait for which load; ``closing`` once the daemon shuts down. Methods without
    their own ``with cond`` run under the residency lock (``cond``)."""

    _cond: threading.Condition
    _table: SlotTable
    _slots: Slots
    _metrics: DaemonMetrics
    _kick: Callable[[], None]  # tells the prefetcher (and every waiting admission) that pins were dropped
    closing: bool = field(default=False, init=False)
    _ledgers: ClientLedgers = field(init=False)
    _open: set[Session] = field(default_factory=set, init=False)
    # the channel servers of bound ledgers; which channel servers wait for which load
    _channels: dict[Session, ChannelServer] = field(default_factory=dict, init=False)
    _client_waits: dict[ExpertKey, list[tuple[ChannelServer, int]]] = field(default_factory=dict, init=False)
    # suspect ledgers: their stray pins, and when those were seen
    _strays: dict[int, tuple[frozenset[int], float]] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self._ledgers = ClientLedgers(self._table)

    @property
    def count(self) -> int:
        """Open sessions."""
        return len(self._open)

    # -- client ledgers (shm pins of compute processes) ----------------------------------
    def claim_client(self) -> ClientLedger:
        """A free client ledger for an attaching compute process, with a new region of its own
        (``ResourceExhausted`` if none)."""
        with self._cond:
            return self._ledgers.claim()

    def handoff_fds(self, ledger: ClientLedger) -> list[int] | None:
        """New descriptors of the table and of ``ledger``'s region, for the client that claimed
        it; None unless it is still claimed, unbound, at that epoch (checked under the lock that
        claims, so a region is never handed to the wrong client)."""
        with self._cond:
            if not self._ledgers.unbound(ledger):
                return None
            table_fd = self._table.table_fd()
            try:
                return [table_fd, self._table.client_fd(ledger.index)]
            except BaseException:
                os.close(table_fd)
                raise

    def bind_client(self, session: Session, ledger: ClientLedger, port: ChannelPort) -> None:
        """Tie ``ledger`` (claimed at Attach) to ``session`` and start its channel's server (over
        ``port``): when the session closes, the ledger's shm pins are reclaimed.
        ``FailedPrecondition`` if it is not claimed, bound elsewhere, or at another epoch."""
        with self._cond:
            self.check_open(session)
            self._ledgers.bind(session, ledger)
            server = ChannelServer(port, session, ledger, self._table.channel(ledger.index))
            self._channels[session] = server
        server.start()

    def audit_clients(self) -> bool:
        """Under the lock, when admission lacks slots: end the session of every client whose
        region pins entries that are neither LOADING nor RESIDENT on two audits at least
        ``STRAY_CONFIRM_S`` apart (a real pin is there only inside a pin call, for a few
        instructions: such a client writes its pins at will, and could hold every slot).
        Returns True while a suspect awaits its second audit (the caller audits again soon)."""
        now = time.monotonic()
        suspects: dict[int, tuple[frozenset[int], float]] = {}
        revoke: list[tuple[int, Session, int]] = []
        for index, session in self._ledgers.bound():
            if session.revoked:  # its close is under way: counted once
                continue
            _pinned, stray = self._table.audit_client(index)
            if not stray:
                continue
            seen = self._strays.get(index)
            if seen is not None and now - seen[1] >= STRAY_CONFIRM_S and seen[0] & set(stray):
                revoke.append((index, session, len(stray)))
            else:
                suspects[index] = seen if seen is not None else (frozenset(stray), now)
        self._strays = suspects
        for index, session, n in revoke:
            session.revoked = True
            self._metrics.clients_revoked.inc()
            logger.warning(
                "ending the session of client ledger %d (%s): its region pins %d%s entries that are not "
                "resident, twice %.2fs apart (its pins are not what the protocol writes)",
                index,
                session,
                n,
                "+" if n >= 64 else "",
                STRAY_CONFIRM_S,
            )
            # Not here: closing joins the channel's thread, which may wait for this lock.
            threading.Thread(
                target=self.close_session, args=(session,), name=f"expertcache-revoke-{index}", daemon=True
            ).start()
        return bool(suspects)

    # -- sessions -----------------------------------------------------------------------
    def open_session(self, name: str = "") -> Session:
        session = Session(name)
        with self._cond:
            if self.closing:
                raise ShuttingDown("the cache daemon is shutting down")
            self._open.add(session)
        return session

    def close_session(self, session: Session) -> None:
        """Drop every pin ``session`` holds and end it. Idempotent; any thread."""
        with self._cond:
            if session.closed:
                return
            session.closed = True
            for key, n in session.held.items():
                self._slots.unhold(key, n)
            session.held.clear()
            self._open.discard(session)
            ledger, session.ledger = session.ledger, None
            server = self._channels.pop(session, None)
            if server is not None:
                self._forget_client_waits(server)
            self._kick()
        if server is not None:
            server.wake()  # it sees the session closed and ends
        if ledger is not None:
            # Outside the lock: reclaim may wait (bounded) for a client inside a pin call.
            removed = self._ledgers.reclaim(ledger)
            if server is not None:
                # Before the ledger (and its channel) can go to the next client: the thread must
                # not answer an old demand in a channel a new client already uses.
                server.join(CHANNEL_JOIN_S)
            with self._cond:
                self._ledgers.release(ledger)
                self._cond.notify_all()
            if removed:
                logger.info("reclaimed %d shm pin(s) of client ledger %d (%s)", removed, ledger, session)

    def close(self) -> list[ChannelServer]:
        """Under the lock, at shutdown: refuse new sessions and end every wait; returns the
        channel servers to wake."""
        self.closing = True
        return list(self._channels.values())

    def _forget_client_waits(self, client: ChannelServer) -> None:
        for key in list(self._client_waits):
            waiters = [w for w in self._client_waits[key] if w[0] is not client]
            if waiters:
                self._client_waits[key] = waiters
            else:
                del self._client_waits[key]

    def check_open(self, session: Session) -> None:
        if self.closing:
            raise ShuttingDown("the cache daemon is shutting down")
        if session.closed:
            raise SessionClosed(f"Demand session {session.name or session.id} is closed")

    # -- release ----------------------------------------------------------------------------
    def release(self, session: Session, keys: Iterable[ExpertKey]) -> None:
        """Drop one pin per key. A key the session does not pin raises ``BadAcquire`` and
        releases nothing."""
        keys = list(keys)
        with self._cond:
            self.check_open(session)
            counts: dict[ExpertKey, int] = {}
            for key in keys:
                counts[key] = counts.get(key, 0) + 1
                if counts[key] > session.pins(key):
                    raise BadAcquire(f"Release of expert {key}, which this stream does not pin")
            for key in keys:
                self.drop_pin(session, key)
            self._kick()

    def drop_pin(self, session: Session, key: ExpertKey) -> None:
        if session.drop(key):  # not already dropped (the load failed, or the session was closed)
            self._slots.unhold(key)

    # -- client channels waiting for loads (under the lock) -------------------------------------
    def wait_for_loads(
        self, client: ChannelServer, keys: Iterable[ExpertKey], position: dict[ExpertKey, int]
    ) -> None:
        """``client`` is told as each load of ``keys`` lands (or fails), at its ``position``."""
        for key in keys:
            self._client_waits.setdefault(key, []).append((client, position[key]))

    def load_landed(self, key: ExpertKey, source: Tier) -> None:
        for client, position in self._client_waits.pop(key, ()):
            client.loaded(position, source)

    def load_failed(self, key: ExpertKey, error: BaseException) -> None:
        """Every pin on ``key`` goes (sessions' and waiting clients'); the clients hear why."""
        for session in self._open:
            n = session.held.pop(key, 0)
            self._slots.unhold(key, n)
        for client, _position in self._client_waits.pop(key, ()):
            client.failed(key, error)


__all__ = ["CHANNEL_JOIN_S", "STRAY_CONFIRM_S", "Sessions"]
