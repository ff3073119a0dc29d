"""Handing a compute process its arena, slot table and client region, and to nobody else: a
one-time token from ``Attach`` is traded on the handoff socket (SCM_RIGHTS) for memfds, so no
path in a shared directory exists that another process could open. ``docs/daemon.md`` shows the
exchange.
"""

from __future__ import annotations

import json
import logging
import os
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

    def __init__(
        self,
        arena_fd: Callable[[], int | None] | None,
        fds_for: Callable[[ClientLedger], list[int] | None],
    ) -> None:
        # A new descriptor of the arena (None once it is closed); None when the arena is not
        # shared by descriptor (CUDA IPC).
        self._arena_fd = arena_fd
        # The table's and the ledger's region's descriptors, if the ledger is still claimed,
        # unbound, at that epoch (checked and duplicated at once: Residency.handoff_fds).
        self._fds_for = fds_for
        self._lock = threading.Lock()
        self._tokens: OrderedDict[bytes, tuple[ClientLedger | None, float]] = OrderedDict()
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

    def issue(self, ledger: ClientLedger | None) -> bytes:
        """A one-time token for the arena and ``ledger`` (just claimed), or for the arena alone;
        empty when there is nothing to hand over or the socket is not served."""
        if not self.path or (ledger is None and self._arena_fd is None):
            return b""
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
        if time.monotonic() - issued > UNBOUND_CLAIM_EXPIRY_S:
            raise FailedPrecondition("the handoff token expired: Attach again")
        names: list[str] = []
        fds: list[int] = []
        try:
            if self._arena_fd is not None:
                arena = self._arena_fd()
                if arena is None:
                    raise FailedPrecondition("the cache daemon is closing its arena: Attach again")
                names.append("arena")
                fds.append(arena)
            payload: dict[str, object] = {"descriptors": names}
            if ledger is not None:
                region = self._fds_for(ledger)
                if region is None:
                    raise FailedPrecondition(
                        f"client ledger {ledger.index} (epoch {ledger.epoch}) is no longer yours: Attach again"
                    )
                names += ["table", "region"]
                fds += region
                payload.update(client_index=ledger.index, client_epoch=ledger.epoch)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        logger.debug("handed %s to pid %d", "+".join(names), peer_pid)
        return Grant(payload=json.dumps(payload).encode(), fds=fds)


__all__ = ["MAX_TOKENS", "ClientHandoff"]
