"""Service logs (expertcache.logs): JSON lines with the span's ids and a record's structured fields."""

from __future__ import annotations

import io
import json
import logging

import pytest
from opentelemetry.sdk.trace import TracerProvider

from expertcache import telemetry
from expertcache.logs import JsonFormatter, resolve_format


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def record(msg: str = "request %s done", **extra) -> logging.LogRecord:
    rec = logging.LogRecord("compute_svc.generation", logging.INFO, __file__, 1, msg, ("r-1",), None)
    for key, value in extra.items():
        setattr(rec, key, value)
    return rec


def test_auto_is_json_unless_on_a_terminal():
    assert resolve_format("auto", Tty()) == "text"
    assert resolve_format("auto", io.StringIO()) == "json"
    assert resolve_format("text", io.StringIO()) == "text"
    with pytest.raises(ValueError, match="log_format must be one of auto, json, text, got 'xml'"):
        resolve_format("xml")


def test_json_line_carries_message_and_request_fields():
    line = json.loads(JsonFormatter().format(record(request={"request_id": "r-1", "tokens": 3})))
    assert line["message"] == "request r-1 done"
    assert line["level"] == "INFO" and line["logger"] == "compute_svc.generation"
    assert line["request"] == {"request_id": "r-1", "tokens": 3}
    assert "trace_id" not in line  # tracing off


def test_json_line_carries_the_span_ids_while_tracing():
    telemetry.install(TracerProvider())
    try:
        span = telemetry.tracer().start_span("Generate")
        ctx = span.get_span_context()
        named = json.loads(JsonFormatter().format(record(span=span)))
        assert named["trace_id"] == f"{ctx.trace_id:032x}" and named["span_id"] == f"{ctx.span_id:016x}"
        with telemetry.tracer().start_as_current_span("step") as current:
            line = json.loads(JsonFormatter().format(record()))
        assert line["span_id"] == f"{current.get_span_context().span_id:016x}"
        span.end()
    finally:
        telemetry.shutdown()
