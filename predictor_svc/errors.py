"""Exceptions of the predictor service. Each documents the gRPC status it travels as.

Domain code raises these; the gRPC edge maps ``grpc_code`` to a status (the same pattern as
``expertcache.errors``), so no domain module imports grpc. Messages name the bad field, value,
URL or byte range.
"""

from __future__ import annotations

from expertcache.errors import (
    DataLoss,
    ExpertCacheError,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)


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


class ModelNotRegistered(FailedPrecondition):
    """An Observe or SubscribeHints names a model that was never registered (RegisterModel or
    ``model_shapes``). gRPC ``FAILED_PRECONDITION``; nothing is stored."""


class ModelConflict(ExpertCacheError):
    """RegisterModel of a registered model with another shape. gRPC ``ALREADY_EXISTS``."""

    grpc_code = "ALREADY_EXISTS"


class RegistrationDisabled(ExpertCacheError):
    """RegisterModel of an unconfigured model with ``allow_registration`` false. gRPC
    ``PERMISSION_DENIED``."""

    grpc_code = "PERMISSION_DENIED"


class LimitReached(ResourceExhausted):
    """A configured bound (max_models, max_eamc_bytes, per-client live requests or bytes,
    max_subscribers) would be exceeded; the message names the limit and its value. gRPC
    ``RESOURCE_EXHAUSTED``; nothing is changed."""


class RequestEnded(FailedPrecondition):
    """A message of a request whose reporting a refusal ended (``PredictorService.end_refused``):
    ignored until the request's request_done."""
