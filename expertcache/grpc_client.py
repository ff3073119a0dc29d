"""Settings shared by the long-lived background gRPC clients (compute's activation reporter,
the daemon's hint subscriber): both keep one stream to the predictor open across its restarts
and outages, and neither may ever block the request path while doing so.
"""

from __future__ import annotations

import grpc

from expertcache.security import ClientSecurity, client_channel

RECONNECT_INITIAL_S = 0.1
RECONNECT_MAX_S = 5.0

# A restarted peer should be found within seconds, not after gRPC's default 2-minute backoff cap.
_RECONNECT_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


def reconnecting_channel(address: str, security: ClientSecurity | None) -> grpc.Channel:
    """The channel such a client keeps: gRPC's own reconnects back off within seconds too."""
    return client_channel(address, security, _RECONNECT_CHANNEL_OPTIONS)


def next_backoff(backoff_s: float) -> float:
    """The wait after ``backoff_s`` failed: doubled, capped at ``RECONNECT_MAX_S``."""
    return min(backoff_s * 2, RECONNECT_MAX_S)
