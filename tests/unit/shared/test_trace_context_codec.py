"""A demand's W3C trace context in the client channel (expertcache.protocol): what compute writes
fits the mailbox, and what the daemon reads from a hostile client is bounded and parsed safely."""

from __future__ import annotations

from expertcache.protocol import TRACE_CONTEXT_BYTES, decode_trace_context, encode_trace_context

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_a_context_round_trips():
    context = {"traceparent": PARENT, "tracestate": "vendor=opaque"}
    data = encode_trace_context(context)
    assert len(data) <= TRACE_CONTEXT_BYTES
    assert decode_trace_context(data) == context


def test_no_context_is_no_bytes():
    assert encode_trace_context(None) == b"" and encode_trace_context({}) == b""
    assert decode_trace_context(b"") == {}


def test_a_tracestate_that_does_not_fit_is_left_out():
    data = encode_trace_context({"traceparent": PARENT, "tracestate": "x=" + "y" * 400})
    assert len(data) <= TRACE_CONTEXT_BYTES
    assert decode_trace_context(data) == {"traceparent": PARENT}


def test_garbage_from_the_client_decodes_to_known_keys_only():
    garbage = bytes(range(256)) + b"\ntraceparent=" + PARENT.encode() + b"\nevil=1\n" + b"\xff" * 300
    decoded = decode_trace_context(garbage)
    assert set(decoded) <= {"traceparent", "tracestate"}
    assert decode_trace_context(b"evil=1\n=\nnoequals\n") == {}
