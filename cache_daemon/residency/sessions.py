"""Demand sessions and client ledgers: who pins what, and giving it back.

A Demand stream opens a ``Session`` (its pins are counted in the slot table and recorded in the
session, to give them back at ``release`` or ``close_session``). A compute process that attached
with the shared-memory fast path claims a client ledger (``claim_client``) and ties it to its
Demand stream (``bind_client``), which starts its channel's thread; when the stream ends the
ledger's pins are reclaimed and the thread ends.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable

from cache_daemon.errors import BadAcquire, SessionClosed, ShuttingDown
from cache_daemon.residency.channel import ChannelServer
from cache_daemon.residency.clients import ClientLedger, Session
from cache_daemon.residency.state import ResidencyState
from expertcache.keys import ExpertKey

logger = logging.getLogger(__name__)

# A client's stray pins (on entries not LOADING or RESIDENT) must be seen again this much later,
# on the same entry, before its session is ended: far longer than any pin call takes.
STRAY_CONFIRM_S = 0.05

# How long closing a session waits for its channel's thread to end (it ends at its next check:
# an admission waiting for slots is woken by the close, a copy in progress finishes).
CHANNEL_JOIN_S = 10.0


class ClientSessions(ResidencyState):
    """Opening and closing Demand sessions, binding client ledgers, releasing pins."""

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

    def bind_client(self, session: Session, ledger: ClientLedger) -> None:
        """Tie ``ledger`` (claimed at Attach) to ``session``: when the session closes, the
        ledger's shm pins are reclaimed. ``FailedPrecondition`` if it is not claimed, bound
        elsewhere, or at another epoch."""
        with self._cond:
            self._check_open(session)
            self._ledgers.bind(session, ledger)
            server = ChannelServer(self, session, ledger, self._table.channel(ledger.index))
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
            if self._closing:
                raise ShuttingDown("the cache daemon is shutting down")
            self._sessions.add(session)
        return session

    def close_session(self, session: Session) -> None:
        """Drop every pin ``session`` holds and end it. Idempotent; any thread."""
        with self._cond:
            if session.closed:
                return
            session.closed = True
            for key, n in session.held.items():
                self.slots.unhold(key, n)
            session.held.clear()
            self._sessions.discard(session)
            ledger, session.ledger = session.ledger, None
            server = self._channels.pop(session, None)
            if server is not None:
                self._forget_client_waits(server)
            self._prefetcher.kick()
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

    def _forget_client_waits(self, client: ChannelServer) -> None:
        for key in list(self._client_waits):
            waiters = [w for w in self._client_waits[key] if w[0] is not client]
            if waiters:
                self._client_waits[key] = waiters
            else:
                del self._client_waits[key]

    def _check_open(self, session: Session) -> None:
        if self._closing:
            raise ShuttingDown("the cache daemon is shutting down")
        if session.closed:
            raise SessionClosed(f"Demand session {session.name or session.id} is closed")

    # -- release ----------------------------------------------------------------------------
    def release(self, session: Session, keys: Iterable[ExpertKey]) -> None:
        """Drop one pin per key. A key the session does not pin raises ``BadAcquire`` and
        releases nothing."""
        keys = list(keys)
        with self._cond:
            self._check_open(session)
            counts: dict[ExpertKey, int] = {}
            for key in keys:
                counts[key] = counts.get(key, 0) + 1
                if counts[key] > session.pins(key):
                    raise BadAcquire(f"Release of expert {key}, which this stream does not pin")
            for key in keys:
                self._drop_pin(session, key)
            self._prefetcher.kick()

    def _drop_pin(self, session: Session, key: ExpertKey) -> None:
        if session.drop(key):  # not already dropped (the load failed, or the session was closed)
            self.slots.unhold(key)


__all__ = ["CHANNEL_JOIN_S", "STRAY_CONFIRM_S", "ClientSessions"]
