"""The bounds of a gRPC server's transport: what one peer, one address and all of them together may
hold open, and for how long a call may sit without doing its part.

A hostile or broken client does not need large messages to take a server down: it can open
streams and never send their request, or open them and never read the answers. Every service's
server (``expertcache.grpc_server``) therefore runs on gRPC's asyncio core, where a stream waiting
for bytes holds no thread, and counts its streams here:

- ``max_concurrent_streams`` per connection is HTTP/2's own SETTINGS limit (the client queues
  beyond it);
- ``max_streams_per_address`` and ``max_connections_per_address`` bound one client host (a
  connection is counted while it carries a stream; idle ones are shed by ``max_connection_idle_s``);
- ``max_streams`` bounds the server; beyond any of these a call is refused at once with
  RESOURCE_EXHAUSTED naming the limit;
- the health service has a budget of its own (``HEALTH_STREAMS``) that data-plane calls never use,
  so a probe answers whatever they do;
- ``request_timeout_s``: a call whose (first) request message has not arrived this long after its
  headers ends with DEADLINE_EXCEEDED;
- ``stream_stall_timeout_s``: a response the client has not taken for this long (its HTTP/2
  window full) ends the stream with DEADLINE_EXCEEDED and releases what it held (for Generate, its
  batch place and pins): other streams never wait for it;
- keepalive is enforced both ways, and connections are closed after ``max_connection_idle_s``
  without a stream and after ``max_connection_age_s`` (with ``max_connection_age_grace_s`` for the
  streams they carry).

``TransportStats`` counts what was refused and cut, for each service's ``/metrics``.
"""

from __future__ import annotations

import threading
from collections import Counter as Tally
from dataclasses import dataclass

from expertcache.config_fields import TransportFields
from expertcache.errors import InvalidArgument, ResourceExhausted
from expertcache.prom import counter

HEALTH_STREAMS = 64  # concurrent health calls, never shared with the data plane
HEALTH_SERVICE = "/grpc.health.v1.Health/"


@dataclass(frozen=True)
class TransportLimits:
    """One server's transport bounds (the services' ``TransportFields``, where each is explained
    and its default written); 0 turns a time off."""

    max_concurrent_streams: int
    max_streams_per_address: int
    max_connections_per_address: int
    max_streams: int
    request_timeout_s: float
    stream_stall_timeout_s: float
    keepalive_time_s: float
    keepalive_timeout_s: float
    min_ping_interval_s: float
    max_connection_idle_s: float
    max_connection_age_s: float
    max_connection_age_grace_s: float

    @classmethod
    def from_config(cls, config: object = None, **overrides: float) -> TransportLimits:
        """The limits of a service config that inherits ``TransportFields`` (their defaults, the
        one place they are written, when ``config`` is None), with ``overrides``."""
        config = config if config is not None else TransportFields()
        return cls(**{name: overrides.get(name, getattr(config, name)) for name in cls.__dataclass_fields__})

    def check(self) -> None:
        for name in (
            "max_concurrent_streams",
            "max_streams_per_address",
            "max_connections_per_address",
            "max_streams",
        ):
            if getattr(self, name) < 1:
                raise InvalidArgument(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if isinstance(value, float) and not value >= 0:
                raise InvalidArgument(f"{name} must be a number of seconds >= 0, got {value}")
        if self.max_streams_per_address > self.max_streams:
            raise InvalidArgument(
                f"max_streams_per_address ({self.max_streams_per_address}) exceeds max_streams ({self.max_streams})"
            )

    def server_options(self) -> list[tuple[str, int]]:
        """gRPC core channel arguments of the server."""

        def ms(seconds: float) -> int:
            return int(seconds * 1000)

        options = [
            ("grpc.max_concurrent_streams", self.max_concurrent_streams),
            ("grpc.http2.max_ping_strikes", 2),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", ms(self.min_ping_interval_s)),
            ("grpc.keepalive_permit_without_calls", 0),
        ]
        if self.keepalive_time_s > 0:
            options += [
                ("grpc.keepalive_time_ms", ms(self.keepalive_time_s)),
                ("grpc.keepalive_timeout_ms", ms(self.keepalive_timeout_s)),
            ]
        if self.max_connection_idle_s > 0:
            options.append(("grpc.max_connection_idle_ms", ms(self.max_connection_idle_s)))
        if self.max_connection_age_s > 0:
            options += [
                ("grpc.max_connection_age_ms", ms(self.max_connection_age_s)),
                ("grpc.max_connection_age_grace_ms", ms(self.max_connection_age_grace_s)),
            ]
        return options


def peer_address(peer: str) -> tuple[str, str]:
    """``(address, connection)`` of a gRPC peer string: ``ipv4:10.0.0.7:51234`` →
    ``("ipv4:10.0.0.7", "ipv4:10.0.0.7:51234")``. A unix socket peer has no port: every caller of
    the socket is one address and its connections cannot be told apart."""
    if peer.startswith(("ipv4:", "ipv6:")):
        address, _, port = peer.rpartition(":")
        if port.isdigit() and address not in ("ipv4", "ipv6"):
            return address, peer
    return peer, peer


class TransportStats:
    """What the transport refused and cut, by reason; ``grpc_server.create_server`` registers
    them in the service's ``/metrics`` registry."""

    def __init__(self) -> None:
        self.refused = counter(
            "moe_grpc_refused_total",
            "Calls refused by the transport's bounds before reaching a handler, by limit.",
            ("limit",),
        )
        self.cut = counter(
            "moe_grpc_cut_total",
            "Calls ended by the transport: request_timeout (no request message), stall (a response "
            "not taken by the client for stream_stall_timeout_s).",
            ("reason",),
        )


class _Ticket:
    __slots__ = ("address", "connection", "health")

    def __init__(self, address: str, connection: str, health: bool) -> None:
        self.address = address
        self.connection = connection
        self.health = health


class StreamAccounting:
    """The streams a server holds, per connection, per client address and in all; ``admit``
    refuses a call that would pass a bound. Thread-safe (admission runs on the server's loop,
    gauges are read by scrapes)."""

    def __init__(self, limits: TransportLimits, stats: TransportStats | None = None) -> None:
        self.limits = limits
        self.stats = stats or TransportStats()
        self._lock = threading.Lock()
        self._streams = 0
        self._health = 0
        self._by_address: Tally[str] = Tally()
        self._by_connection: Tally[str] = Tally()
        self._connections: dict[str, set[str]] = {}

    def admit(self, peer: str, method: str) -> _Ticket:
        """A ticket to ``release`` when the call ends; ``ResourceExhausted`` naming the bound."""
        address, connection = peer_address(peer)
        health = method.startswith(HEALTH_SERVICE)
        limits = self.limits
        with self._lock:
            if health:
                if self._health >= HEALTH_STREAMS:
                    problem = ("health", f"{HEALTH_STREAMS} health calls are already in progress")
                else:
                    self._health += 1
                    return _Ticket(address, connection, True)
            elif self._streams >= limits.max_streams:
                problem = (
                    "max_streams",
                    f"the server holds its maximum of {limits.max_streams} streams (max_streams)",
                )
            elif self._by_address[address] >= limits.max_streams_per_address:
                problem = (
                    "max_streams_per_address",
                    f"{address} holds its maximum of {limits.max_streams_per_address} streams "
                    "(max_streams_per_address)",
                )
            elif (
                connection not in self._connections.get(address, ())
                and len(self._connections.get(address, ())) >= limits.max_connections_per_address
            ):
                problem = (
                    "max_connections_per_address",
                    f"{address} has its maximum of {limits.max_connections_per_address} connections with "
                    "streams open (max_connections_per_address)",
                )
            else:
                self._streams += 1
                self._by_address[address] += 1
                self._by_connection[connection] += 1
                self._connections.setdefault(address, set()).add(connection)
                return _Ticket(address, connection, False)
        self.stats.refused.labels(problem[0]).inc()
        raise ResourceExhausted(f"{method} refused: {problem[1]}; retry later")

    def release(self, ticket: _Ticket) -> None:
        with self._lock:
            if ticket.health:
                self._health -= 1
                return
            self._streams -= 1
            self._by_address[ticket.address] -= 1
            if self._by_address[ticket.address] <= 0:
                del self._by_address[ticket.address]
            self._by_connection[ticket.connection] -= 1
            if self._by_connection[ticket.connection] <= 0:
                del self._by_connection[ticket.connection]
                connections = self._connections.get(ticket.address)
                if connections is not None:
                    connections.discard(ticket.connection)
                    if not connections:
                        del self._connections[ticket.address]

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {
                "streams": self._streams,
                "health": self._health,
                "addresses": len(self._by_address),
                "connections": len(self._by_connection),
            }
