"""Exceptions of the predictor service. Each documents the gRPC status it travels as.

Domain code raises these; the gRPC edge maps ``grpc_code`` to a status (the same pattern as
``expertcache.errors``), so no domain module imports grpc. Messages name the bad field, value,
URL or byte range.
"""

from __future__ import annotations

from expertcache.errors import DataLoss, FailedPrecondition, InvalidArgument, Unavailable


class StoreUnavailable(Unavailable):
    """The EAMC store (Redis) cannot be reached or answered with an error. gRPC ``UNAVAILABLE``.

    Callers count and log it; the in-memory index keeps serving what it already has.
    """


class CorruptEntry(DataLoss):
    """A stored EAM blob or embedded-store file does not decode (bad magic, unknown version,
    truncated, size not matching layers × experts). gRPC ``DATA_LOSS``."""


class Conflict(FailedPrecondition):
    """The collection changed under an insert (victim gone, capacity reached differently).

    The caller re-syncs and retries; it only reaches a client if the retries run out.
    gRPC ``FAILED_PRECONDITION``.
    """


class BadActivation(InvalidArgument):
    """An Activation or SubscribeHintsRequest field is missing, out of range, or inconsistent with
    the model's shape or the request's earlier tokens; the message names the field. gRPC
    ``INVALID_ARGUMENT`` (service.py, H6)."""


class PredictorStopping(Unavailable):
    """The predictor is shutting down; open streams end with this. gRPC ``UNAVAILABLE`` (H6)."""
