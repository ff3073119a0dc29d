"""The client channel's codes, shared by compute (``compute_svc.daemon.client``) and the daemon
(``cache_daemon.residency.channel``).

The channel itself is native (``expertcache.native.ClientChannel``, csrc/include/expertcache/
channel.h): one per client ledger of the shared slot table, carrying compute's demands and
one-way signals to the daemon in shared memory, futex-woken. Here are the numbers both sides
write into it: the tier a demanded expert came from, and the status of a refused demand or a
failed load (gRPC's status numbers, so that compute raises what a Demand stream would have).
"""

from __future__ import annotations

# Where a demanded expert was when the daemon found it (ClientChannel.set_source / source).
SOURCE_UNKNOWN = 0
SOURCE_DEVICE = 1
SOURCE_HOST = 2
SOURCE_STORE = 3
SOURCE_NAMES = {SOURCE_DEVICE: "device", SOURCE_HOST: "host", SOURCE_STORE: "store"}
SOURCE_OF_TIER = {name: code for code, name in SOURCE_NAMES.items()}

# Experts smaller than this that a demand misses are handed over together: the daemon answers
# once they have all landed from the host tier, and compute runs them as one batch (a batch costs
# compute a fixed ~0.1 ms of calls, more than such a copy takes). Larger ones are announced as
# each lands, so that compute on one overlaps the copy of the next.
GATHER_BELOW_BYTES = 1 << 20

# A demand's reply status / a failed load's status: 0 = admitted, else the gRPC status number of
# the error (expertcache.errors' grpc_code names).
STATUS_OK = 0
STATUS_CODES = {
    "INVALID_ARGUMENT": 3,
    "DEADLINE_EXCEEDED": 4,
    "NOT_FOUND": 5,
    "RESOURCE_EXHAUSTED": 8,
    "FAILED_PRECONDITION": 9,
    "INTERNAL": 13,
    "UNAVAILABLE": 14,
    "DATA_LOSS": 15,
}
STATUS_NAMES = {number: name for name, number in STATUS_CODES.items()}


def status_of(grpc_code: str) -> int:
    """The channel status of an error whose ``grpc_code`` is ``grpc_code`` (INTERNAL if unknown)."""
    return STATUS_CODES.get(grpc_code, STATUS_CODES["INTERNAL"])


__all__ = [
    "GATHER_BELOW_BYTES",
    "SOURCE_DEVICE",
    "SOURCE_HOST",
    "SOURCE_NAMES",
    "SOURCE_OF_TIER",
    "SOURCE_STORE",
    "SOURCE_UNKNOWN",
    "STATUS_CODES",
    "STATUS_NAMES",
    "STATUS_OK",
    "status_of",
]
