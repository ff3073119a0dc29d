"""The HTTP front door's connections: how many one client and all of them together may hold open,
and how long a connection may sit without sending a whole request.

uvicorn bounds none of that; ``ConnectionGuard`` counts every connection. Rules: docs/compute.md."""

from __future__ import annotations

import asyncio
import logging
import math
import resource
from collections import OrderedDict
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from compute_svc.metrics import ComputeMetrics
from expertcache.errors import InvalidArgument
from expertcache.logs import RateLimitedLog

logger = logging.getLogger(__name__)

PROBE_CONNECTIONS = 64  # connections beyond http_max_requests: health probes, model listings
TRANSPORT_KEY = "expertcache.transport"  # the scope's extensions entry holding the connection's transport


def open_files_limit() -> int:
    """This process's soft limit on open file descriptors."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def descriptors_for_others(open_files: int) -> int:
    """Descriptors kept for everything but HTTP connections: gRPC, the daemon, files, threads."""
    return max(128, open_files // 4)


def accept_backlog(open_files: int) -> int:
    """The listen backlog, which is also how many connections asyncio accepts in one go, each a
    descriptor, before any of them is counted (uvicorn's 2,048 ran a 1,024-descriptor process out
    of them under a flood of connections)."""
    return min(512, max(16, open_files // 8))


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int  # all clients together
    max_connections_per_client: int  # one client address
    backlog: int  # the listen backlog: connections accepted in one go
    header_timeout_s: (
        float  # a request's headers must be whole this long after the connection or its first byte
    )

    @classmethod
    def derive(
        cls,
        *,
        max_requests: int,
        client_share: float,
        header_timeout_s: float,
        configured_max: int = 0,
        open_files: int | None = None,
    ) -> ConnectionLimits:
        """The limits of a server taking ``max_requests`` generation requests at once: at most
        ``configured_max`` connections (0: as many as the descriptors allow), never more than
        the open-files limit leaves; a client address gets ``client_share`` of them.
        ``InvalidArgument`` when the descriptors cannot carry ``max_requests`` plus probes."""
        open_files = open_files_limit() if open_files is None else open_files
        backlog = accept_backlog(open_files)
        room = open_files - descriptors_for_others(open_files) - backlog
        needed = max_requests + PROBE_CONNECTIONS
        if room < needed:
            raise InvalidArgument(
                f"the open-files limit ({open_files}, ulimit -n) leaves {room} descriptors for HTTP "
                f"connections, fewer than http_max_requests ({max_requests}) + {PROBE_CONNECTIONS} for "
                "probes: raise the limit or lower http_max_requests"
            )
        total = min(room, configured_max) if configured_max else room
        total = max(total, needed)
        per_client = max(PROBE_CONNECTIONS, math.ceil(client_share * total - 1e-9))
        return cls(
            max_connections=total,
            max_connections_per_client=min(per_client, total),
            backlog=backlog,
            header_timeout_s=header_timeout_s,
        )


class ConnectionGuard:
    """The one owner of the HTTP connections' bookkeeping; used on the server's event loop only."""

    def __init__(self, limits: ConnectionLimits, metrics: ComputeMetrics) -> None:
        self.limits = limits
        self.metrics = metrics
        self._log = RateLimitedLog(logger, 10.0)
        self._client_of: dict[GuardedH11Protocol, str] = {}
        self._count: dict[str, int] = {}  # connections of each client address
        self._idle: OrderedDict[GuardedH11Protocol, None] = OrderedDict()  # oldest first
        self._idle_of: dict[str, OrderedDict[GuardedH11Protocol, None]] = {}

    @property
    def connections(self) -> int:
        return len(self._client_of)

    def opened(self, conn: GuardedH11Protocol, client: str) -> bool:
        """Count a new connection, closing an idle one to make room; False: refused (every
        connection in its way has a request in progress)."""
        if self._count.get(client, 0) >= self.limits.max_connections_per_client:
            if not self._yield(self._idle_of.get(client), "max_connections_per_client"):
                return self._refuse(client, "max_connections_per_client")
        if len(self._client_of) >= self.limits.max_connections:
            if not self._yield(self._idle, "max_connections"):
                return self._refuse(client, "max_connections")
        self._client_of[conn] = client
        self._count[client] = self._count.get(client, 0) + 1
        self.idle(conn)
        return True

    def _yield(self, idle: OrderedDict | None, limit: str) -> bool:
        if not idle:
            return False
        victim = next(iter(idle))
        self.metrics.http.cut.labels(reason="idle_yielded").inc()
        self._log.log(
            logging.WARNING,
            f"yield:{limit}",
            "closed an idle HTTP connection from %s for a new one (%s %d reached)",
            self._client_of.get(victim, "?"),
            limit,
            getattr(self.limits, limit),
        )
        self.closed(victim)
        victim.transport.abort()
        return True

    def _refuse(self, client: str, limit: str) -> bool:
        self.metrics.http.refused.labels(limit=limit).inc()
        self._log.log(
            logging.WARNING,
            f"refuse:{limit}",
            "refused an HTTP connection from %s: %s %d reached, each with a request in progress",
            client,
            limit,
            getattr(self.limits, limit),
        )
        return False

    def busy(self, conn: GuardedH11Protocol) -> None:
        """``conn`` has a request in progress: it cannot be closed to make room."""
        self._idle.pop(conn, None)
        client = self._client_of.get(conn)
        if client is not None:
            self._idle_of.get(client, {}).pop(conn, None)

    def idle(self, conn: GuardedH11Protocol) -> None:
        client = self._client_of.get(conn)
        if client is None:
            return
        self._idle[conn] = None
        self._idle.move_to_end(conn)
        self._idle_of.setdefault(client, OrderedDict())[conn] = None

    def closed(self, conn: GuardedH11Protocol) -> None:
        """Forget ``conn`` (idempotent: a yielded connection is forgotten before its loss)."""
        client = self._client_of.pop(conn, None)
        if client is None:
            return
        self._idle.pop(conn, None)
        idle = self._idle_of.get(client)
        if idle is not None:
            idle.pop(conn, None)
            if not idle:
                del self._idle_of[client]
        left = self._count[client] - 1
        if left:
            self._count[client] = left
        else:
            del self._count[client]

    def cut(self, conn: GuardedH11Protocol, reason: str, what: str) -> None:
        self.metrics.http.cut.labels(reason=reason).inc()
        self._log.log(
            logging.WARNING,
            f"cut:{reason}",
            "closed the HTTP connection from %s: %s",
            self._client_of.get(conn, "?"),
            what,
        )


class GuardedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol under a ``ConnectionGuard`` (``guarded`` makes the class of one
    server). It also hands the app its transport (``scope["extensions"][TRANSPORT_KEY]``), so a
    stream can see how much of what it wrote the client has not taken."""

    guard: ConnectionGuard

    @classmethod
    def guarded(cls, guard: ConnectionGuard) -> type[GuardedH11Protocol]:
        return type("GuardedH11Protocol", (cls,), {"guard": guard})

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        inner = self.app

        async def app(scope, receive, send) -> None:
            scope.setdefault("extensions", {})[TRANSPORT_KEY] = self.transport
            await inner(scope, receive, send)

        self.app = app

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        client = self.client[0] if self.client else "?"
        if not self.guard.opened(self, client):
            transport.abort()
            return
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        self.guard.closed(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and (self.cycle is None or self.cycle.response_complete):
            self._arm_header_timer()  # the first byte of a keep-alive connection's next request
        super().data_received(data)

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        if self.cycle is not before and self.cycle is not None and not self.cycle.response_complete:
            self._disarm_header_timer()  # a whole request's headers are in
            self.guard.busy(self)

    def on_response_complete(self) -> None:
        unread_body = self.conn.their_state is h11.SEND_BODY
        self.guard.idle(self)
        super().on_response_complete()  # may start a pipelined request: busy again
        if unread_body and not self.transport.is_closing():
            # Answered before its body arrived (a refusal): the rest is not waited for.
            self.transport.close()

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        timeout = self.guard.limits.header_timeout_s
        if timeout > 0:
            self._header_timer = self.loop.call_later(timeout, self._header_timeout)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a request is in progress (its body has request_timeout_s)
        self.guard.cut(
            self,
            "header_timeout",
            f"no whole request within {self.guard.limits.header_timeout_s:g} s (http_header_timeout_s)",
        )
        self.transport.abort()
