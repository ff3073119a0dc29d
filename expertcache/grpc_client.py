"""Settings shared by the long-lived background gRPC clients (compute's activation reporter,
the daemon's hint subscriber): both keep one stream to the predictor open across its restarts
and outages, and neither may ever block the request path while doing so. And ``wait_ready``,
the wait for a server to answer that the project's gRPC clients share (the reporter,
``DaemonClient.connect``, ``feed_trace``).
"""

from __future__ import annotations

import grpc
from grpc_health.v1.health_pb2 import HealthCheckRequest
from grpc_health.v1.health_pb2_grpc import HealthStub

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


def wait_ready(channel: grpc.Channel, timeout_s: float) -> bool:
    """Whether the server behind ``channel`` answers within ``timeout_s``: a health Check that
    waits for the connection (``wait_for_ready``). Any answer counts, whatever it says (NOT_SERVING,
    or UNIMPLEMENTED from a server without health): the peer is up. Unlike
    ``grpc.channel_ready_future``, nothing is subscribed to the channel's connectivity, so no gRPC
    polling thread is left to ask the channel for its state after it is closed (it raised
    "Channel closed!" there)."""
    try:
        HealthStub(channel).Check(HealthCheckRequest(), timeout=timeout_s, wait_for_ready=True)
    except grpc.RpcError as exc:
        code = exc.code() if hasattr(exc, "code") else None
        return code not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE, None)
    return True


def next_backoff(backoff_s: float) -> float:
    """The wait after ``backoff_s`` failed: doubled, capped at ``RECONNECT_MAX_S``."""
    return min(backoff_s * 2, RECONNECT_MAX_S)
