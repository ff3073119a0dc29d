"""Service logs (expertcache.logs): JSON lines with the span's ids and a record's structured fields."""

from __future__ import annotations

import io
import json
import logging

import pytest
from opentelemetry.sdk.trace import TracerProvider

from expertcache import telemetry
from expertcache.logs import JsonFormatter, RateLimitedLog, resolve_format


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def record(msg: str = "request %s done", **extra) -> logging.LogRecord:
    rec = logging.LogRecord("compute_svc.engine.generation", logging.INFO, __file__, 1, msg, ("r-1",), None)
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
    assert line["level"] == "INFO" and line["logger"] == "compute_svc.engine.generation"
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


def test_rate_limited_log_writes_one_line_per_key_per_interval_and_counts_the_rest(caplog):
    now = [100.0]
    log = RateLimitedLog(logging.getLogger("test.refusals"), 10.0, max_keys=2, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="test.refusals"):
        assert log.log(logging.WARNING, "bad token", "refused %s", "call 1")
        assert not log.log(logging.WARNING, "bad token", "refused %s", "call 2")
        assert not log.log(logging.WARNING, "bad token", "refused %s", "call 3")
        assert log.log(logging.WARNING, "too big", "refused %s", "call 4")  # another key
        now[0] += 9.9
        assert not log.log(logging.WARNING, "bad token", "refused %s", "call 5")
        now[0] += 0.1
        assert log.log(logging.WARNING, "bad token", "refused %s", "call 6")
        assert log.log(logging.INFO, "quiet", "below the logger's level") is False
    assert [r.getMessage() for r in caplog.records] == [
        "refused call 1",
        "refused call 4",
        "refused call 6 (and 3 more like it since the last line, not logged)",
    ]


def test_rate_limited_log_remembers_a_bounded_number_of_keys():
    now = [0.0]
    log = RateLimitedLog(logging.getLogger("test.keys"), 10.0, max_keys=2, clock=lambda: now[0])
    for key in ("a", "b", "c"):
        log.log(logging.ERROR, key, "x")
    assert len(log._keys) == 2
    assert log.log(logging.ERROR, "a", "x")  # "a" was forgotten first: written again


def test_rate_limited_log_keeps_the_exception_of_a_written_line(caplog):
    log = RateLimitedLog(logging.getLogger("test.exc"), 10.0)
    with caplog.at_level(logging.ERROR, logger="test.exc"):
        log.log(logging.ERROR, "k", "unhandled error in %s", "/m", exc_info=ValueError("boom"))
    assert caplog.records[0].exc_info[1].args == ("boom",)
