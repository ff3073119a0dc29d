"""Compute-service exceptions; each documents the gRPC status it travels as.

The shared ones (``InvalidArgument``, ``DataLoss``, ...) come from ``expertcache.errors`` and are
re-exported here so compute modules import their errors from one place. ``ErrorInterceptor``
(``expertcache.grpc_server``) maps ``grpc_code`` to the status; no domain module imports grpc.
"""

from __future__ import annotations

from expertcache.errors import (
    DataLoss,
    DeadlineExceeded,
    ExpertCacheError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)

__all__ = [
    "ArenaMismatch",
    "Cancelled",
    "DaemonUnavailable",
    "DataLoss",
    "DeadlineExceeded",
    "ExpertCacheError",
    "FailedPrecondition",
    "InvalidArgument",
    "NotFound",
    "QueueFull",
    "ResourceExhausted",
    "Unavailable",
]


class DaemonUnavailable(Unavailable):
    """The cache daemon cannot be reached at its address. gRPC ``UNAVAILABLE``.

    At start-up the process exits with status 2 and this message (it names the address).
    """


class QueueFull(ResourceExhausted):
    """``max_waiting_requests`` requests already wait for a place in the batch. gRPC ``RESOURCE_EXHAUSTED``."""


class ArenaMismatch(FailedPrecondition):
    """The daemon's arena cannot be read from this process (device kind, GPU, size).

    gRPC ``FAILED_PRECONDITION``; raised at start-up, before serving.
    """


class Cancelled(ExpertCacheError):
    """The client went away; its request was stopped. gRPC ``CANCELLED``."""

    grpc_code = "CANCELLED"
