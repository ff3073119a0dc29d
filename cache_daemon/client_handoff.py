"""Handing a compute process its slot table and client region, and to nobody else.

The slot table and each client's region are memfds (csrc/include/expertcache/slot_table.h): no
path in a shared directory another process could open. ``Attach`` claims a client ledger and
answers with a one-time token; the client trades it on the handoff socket (``expertcache.handoff``,
SCM_RIGHTS) for two descriptors: the table, sealed so that it maps read-only, and the ledger's
region, made anew for this claim. A token is good once, for the claim it was issued with, and
only while that claim is unbound and not taken back.

::

    compute                         daemon
    Attach(shm_fast_path) ────────▶ claim ledger c (new region, epoch E), token T
                          ◀──────── (c, E, handoff socket, T)
    connect, send T ──────────────▶ T → (c, E): still claimed and unbound at E?
                          ◀──────── {"client_index": c, "client_epoch": E} + [table fd, region fd]
    Demand stream (c, E) ─────────▶ bind_client: the ledger is the stream's until it ends
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from cache_daemon.residency.clients import UNBOUND_CLAIM_EXPIRY_S, ClientLedger
from expertcache.errors import FailedPrecondition
from expertcache.handoff import HANDOFF_TOKEN_BYTES, Grant, HandoffServer

logger = logging.getLogger(__name__)

# Tokens outstanding at once, at most (older ones are forgotten first; their claims expire).
MAX_TOKENS = 1024


class ClientHandoff:
    """The tokens issued at Attach and the socket that redeems them."""

    def __init__(self, fds_for: Callable[[ClientLedger], list[int] | None]) -> None:
        # The table's and the ledger's region's descriptors, if the ledger is still claimed,
        # unbound, at that epoch (checked and duplicated at once: Residency.handoff_fds).
        self._fds_for = fds_for
        self._lock = threading.Lock()
        self._tokens: OrderedDict[bytes, tuple[ClientLedger, float]] = OrderedDict()
        self._server: HandoffServer | None = None

    @property
    def path(self) -> str:
        """The socket's path; empty until ``start``."""
        return self._server.path if self._server is not None else ""

    def start(self, path: str) -> None:
        server = HandoffServer(path, self._grant)
        server.start()
        self._server = server
        logger.info("handing client regions over unix://%s", path)

    def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
        with self._lock:
            self._tokens.clear()

    def issue(self, ledger: ClientLedger) -> bytes:
        """A one-time token for ``ledger`` (just claimed)."""
        token = secrets.token_bytes(HANDOFF_TOKEN_BYTES)
        with self._lock:
            self._tokens[token] = (ledger, time.monotonic())
            while len(self._tokens) > MAX_TOKENS:
                self._tokens.popitem(last=False)
        return token

    def _grant(self, token: bytes, peer_pid: int) -> Grant:
        with self._lock:
            found = self._tokens.pop(token, None)
        if found is None:
            raise FailedPrecondition("unknown or already used handoff token: Attach again")
        ledger, issued = found
        fds = self._fds_for(ledger) if time.monotonic() - issued <= UNBOUND_CLAIM_EXPIRY_S else None
        if fds is None:
            raise FailedPrecondition(
                f"client ledger {ledger.index} (epoch {ledger.epoch}) is no longer yours: Attach again"
            )
        logger.debug("handed client ledger %d to pid %d", ledger.index, peer_pid)
        payload = json.dumps({"client_index": ledger.index, "client_epoch": ledger.epoch}).encode()
        return Grant(payload=payload, fds=fds)


__all__ = ["MAX_TOKENS", "ClientHandoff"]
