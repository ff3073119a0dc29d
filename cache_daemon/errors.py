"""Errors the cache daemon raises. Each subclasses a shared ``expertcache.errors`` class and so
travels as that class's gRPC status (mapped once by ``expertcache.grpc_server.ErrorInterceptor``).
"""

from __future__ import annotations

from expertcache.errors import DataLoss, DeadlineExceeded, FailedPrecondition, InvalidArgument, Unavailable


class BudgetTooSmall(InvalidArgument):
    """A memory budget cannot hold even one expert blob. ``INVALID_ARGUMENT``; exit code 2 at start."""


class BadAcquire(InvalidArgument):
    """An Acquire names an unknown layer/expert, a duplicate, or more experts than can ever fit.
    ``INVALID_ARGUMENT``."""


class ChecksumMismatch(DataLoss):
    """A blob read from the store does not match its manifest CRC-32. ``DATA_LOSS``."""


class ShortRead(DataLoss):
    """A store file ends before the blob it should hold, or cannot be read. ``DATA_LOSS``."""


class StoreIncomplete(DataLoss):
    """The store directory lacks its manifest or a layer file. ``DATA_LOSS``; exit code 2 at start."""


class AcquireTimeout(DeadlineExceeded):
    """An Acquire waited longer than ``acquire_timeout_s`` for slots or loads. ``DEADLINE_EXCEEDED``."""


class SessionClosed(FailedPrecondition):
    """A call used a Demand session that was already closed (stream ended). ``FAILED_PRECONDITION``."""


class SlotNotReadable(FailedPrecondition):
    """A slot was read that is not RESIDENT and pinned by the reader. ``FAILED_PRECONDITION``."""


class ArenaUnavailable(FailedPrecondition):
    """The device arena cannot be created (no memory for it, no CUDA device). ``FAILED_PRECONDITION``."""


class ShuttingDown(Unavailable):
    """The daemon is stopping; waiting Acquires end with this. ``UNAVAILABLE``."""


class CopyInFlight(ArenaUnavailable):
    """A host→device copy into an arena slot outlived its timeout and is still queued on the GPU.

    The load's waiters fail with this (FAILED_PRECONDITION), but the slot and the copy's source
    must stay untouched until the copy lands: ``wait_done()`` blocks until it has, and
    ``cleanups`` are what the loader runs then (unpinning the source)."""

    def __init__(self, message: str, wait_done=None) -> None:
        super().__init__(message)
        self.wait_done = wait_done or (lambda: None)
        self.cleanups: list = []
