"""Exceptions shared by every service. Each documents the gRPC status it travels as.

Domain code raises these; the gRPC edge (``expertcache.grpc_server``) maps ``grpc_code`` to a
status, so no domain module imports grpc. Messages name the bad field or value.
"""

from __future__ import annotations


class ExpertCacheError(Exception):
    """Base class. Travels as ``INTERNAL`` unless a subclass says otherwise."""

    grpc_code = "INTERNAL"


class InvalidArgument(ExpertCacheError):
    """A request field is missing or out of range. gRPC ``INVALID_ARGUMENT``.

    ``field``: the request field at fault where one is (``max_new_tokens``, ``stop``,
    ``messages[2].role``, ...), for an edge that names it apart from the message (the HTTP API's
    ``param``); None when the fault is not one field's. gRPC sends the message only."""

    grpc_code = "INVALID_ARGUMENT"

    def __init__(self, *args: object, field: str | None = None) -> None:
        super().__init__(*args)
        self.field = field


class NotFound(ExpertCacheError):
    """A named thing (file, layer, expert) does not exist. gRPC ``NOT_FOUND``."""

    grpc_code = "NOT_FOUND"


class FailedPrecondition(ExpertCacheError):
    """The system is not in a state to serve the call. gRPC ``FAILED_PRECONDITION``."""

    grpc_code = "FAILED_PRECONDITION"


class ResourceExhausted(ExpertCacheError):
    """A budget or queue is full. gRPC ``RESOURCE_EXHAUSTED``."""

    grpc_code = "RESOURCE_EXHAUSTED"


class Unavailable(ExpertCacheError):
    """A peer service cannot be reached. gRPC ``UNAVAILABLE``."""

    grpc_code = "UNAVAILABLE"


class DataLoss(ExpertCacheError):
    """Stored bytes are corrupt (checksum mismatch, short file). gRPC ``DATA_LOSS``."""

    grpc_code = "DATA_LOSS"


class DeadlineExceeded(ExpertCacheError):
    """A wait ran past its limit. gRPC ``DEADLINE_EXCEEDED``."""

    grpc_code = "DEADLINE_EXCEEDED"


class Unsupported(InvalidArgument):
    """An input the project does not handle (e.g. an unsupported architecture)."""
