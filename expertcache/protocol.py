"""The compute ↔ daemon contract beyond the proto messages, written once for both sides.

The Demand call's metadata naming a client ledger, where an expert was found (``Tier``, with its
codes on the wire and in the client channel), the status of a refused demand or a failed load
(gRPC's status numbers), and a demand's trace context in the channel. The channel itself is
native (``expertcache.native.ClientChannel``, csrc/include/expertcache/channel.h).
"""

from __future__ import annotations

import enum

from moe.cache.v1 import cache_pb2

# Demand call metadata naming the caller's client ledger (cache.proto, Demand).
CLIENT_INDEX_KEY = "expertcache-client-index"
CLIENT_EPOCH_KEY = "expertcache-client-epoch"


class Tier(enum.Enum):
    """Where an expert's bytes were found. Values are the ``tier`` label of the metrics."""

    DEVICE = "device"
    HOST = "host"
    STORE = "store"
    UNKNOWN = "unknown"  # a source compute was not told: a code the daemon did not send, or an expert in flight a native span waited for itself


# Where a demanded expert was when the daemon found it (ClientChannel.set_source / source).
SOURCE_UNKNOWN = 0
SOURCE_DEVICE = 1
SOURCE_HOST = 2
SOURCE_STORE = 3
CHANNEL_CODE = {Tier.DEVICE: SOURCE_DEVICE, Tier.HOST: SOURCE_HOST, Tier.STORE: SOURCE_STORE}
TIER_OF_CHANNEL_CODE = {code: tier for tier, code in CHANNEL_CODE.items()}
# The same on the Demand stream (cache.proto's Tier).
PB_TIER = {
    Tier.DEVICE: cache_pb2.TIER_DEVICE,
    Tier.HOST: cache_pb2.TIER_HOST,
    Tier.STORE: cache_pb2.TIER_STORE,
}
TIER_OF_PB = {code: tier for tier, code in PB_TIER.items()}

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


# A demand's W3C trace context (``traceparent``, then ``tracestate`` if it fits), at most this
# many bytes (csrc/include/expertcache/channel.h kChannelTraceBytes): a traced demand takes the
# channel as any other, and the daemon's spans join its trace.
TRACE_CONTEXT_BYTES = 256
_TRACE_KEYS = ("traceparent", "tracestate")


def encode_trace_context(context: dict[str, str] | None) -> bytes:
    """``{"traceparent": ..., "tracestate": ...}`` → the demand's trace bytes (b"" for none).
    A ``tracestate`` that does not fit is left out; a ``traceparent`` that does not is too."""
    if not context:
        return b""
    out = b""
    for key in _TRACE_KEYS:
        value = context.get(key)
        if value:
            line = f"{key}={value}\n".encode("ascii", "replace")
            if len(out) + len(line) > TRACE_CONTEXT_BYTES:
                break
            out += line
    return out


def decode_trace_context(data: bytes) -> dict[str, str]:
    """The demand's trace bytes → a W3C carrier; what is not ``key=value`` of a known key is
    ignored (the bytes come from the client)."""
    out: dict[str, str] = {}
    for line in data[:TRACE_CONTEXT_BYTES].decode("ascii", "replace").split("\n"):
        key, sep, value = line.partition("=")
        if sep and key in _TRACE_KEYS and value:
            out[key] = value
    return out


def status_of(grpc_code: str) -> int:
    """The channel status of an error whose ``grpc_code`` is ``grpc_code`` (INTERNAL if unknown)."""
    return STATUS_CODES.get(grpc_code, STATUS_CODES["INTERNAL"])


__all__ = [
    "CHANNEL_CODE",
    "CLIENT_EPOCH_KEY",
    "CLIENT_INDEX_KEY",
    "GATHER_BELOW_BYTES",
    "PB_TIER",
    "SOURCE_DEVICE",
    "SOURCE_HOST",
    "SOURCE_STORE",
    "SOURCE_UNKNOWN",
    "STATUS_CODES",
    "STATUS_NAMES",
    "STATUS_OK",
    "TIER_OF_CHANNEL_CODE",
    "TIER_OF_PB",
    "TRACE_CONTEXT_BYTES",
    "Tier",
    "decode_trace_context",
    "encode_trace_context",
    "status_of",
]
