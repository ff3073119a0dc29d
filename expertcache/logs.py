"""Logging for the three services: text on a terminal, JSON lines otherwise (``log_format``).

A JSON line holds ``time`` (UTC, ISO 8601), ``level``, ``logger``, ``message``, the ids of the
span current when it was logged (``trace_id``, ``span_id``, hex as in OTLP) while tracing is on,
``exception`` when there is one, and the fields a record carries as structured extras: compute's
one line per finished request passes ``extra={"request": {...}}`` (request id, tokens, ttft,
duration, hits, misses), which lands as a ``request`` object.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time

from expertcache import telemetry

FORMATS = ("auto", "json", "text")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
EXTRA_FIELDS = ("request",)  # structured extras a record may carry
REFUSAL_LOG_INTERVAL_S = 10.0  # refused calls: at most one line per reason this often


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if telemetry.ENABLED:
            from opentelemetry import trace

            # A record may name its span (``extra={"span": span}``: a request's line, logged on
            # the scheduler's thread where its span is not current); else the current one.
            span = getattr(record, "span", None) or trace.get_current_span()
            ctx = span.get_span_context()
            if ctx.is_valid:
                entry["trace_id"] = f"{ctx.trace_id:032x}"
                entry["span_id"] = f"{ctx.span_id:016x}"
        for name in EXTRA_FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                entry[name] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def resolve_format(fmt: str, stream=None) -> str:
    """``json`` or ``text`` for ``fmt`` (``auto``: json unless ``stream``, default stderr, is a terminal)."""
    if fmt not in FORMATS:
        raise ValueError(f"log_format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if fmt != "auto":
        return fmt
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return "text" if isatty is not None and isatty() else "json"


def setup_logging(level: str, fmt: str = "auto") -> str:
    """Configure the root logger (stderr) at ``level`` in ``fmt``; returns the format chosen.

    Like ``logging.basicConfig``, it leaves a root logger that already has handlers as it is
    (a service's ``main`` called in-process by tests, under pytest's log capture)."""
    chosen = resolve_format(fmt)
    root = logging.getLogger()
    if root.handlers:
        return chosen
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if chosen == "json" else logging.Formatter(TEXT_FORMAT))
    root.addHandler(handler)
    root.setLevel(level)
    return chosen


class RateLimitedLog:
    """Log lines of one kind, at most one per ``key`` per ``interval_s``.

    For what clients cause per call (refused calls: a client retrying a bad token in a loop, or a
    flood of oversized requests, would otherwise write a line per call and fill the disk). The
    first line of a key is written at once; those within ``interval_s`` after it are counted, and
    the next line written for that key says how many were left out. ``key`` is the refusal's
    reason, not the client's input: at most ``max_keys`` are remembered (the oldest forgotten)."""

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = 10.0,
        *,
        max_keys: int = 256,
        clock=time.monotonic,
    ) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._max_keys = max_keys
        self._clock = clock
        self._lock = threading.Lock()
        self._keys: dict[str, list] = {}  # key -> [time of the last line, lines left out since]

    def log(self, level: int, key: str, msg: str, *args: object, exc_info=None) -> bool:
        """Log ``msg % args`` (with ``exc_info``) at ``level`` unless a line of ``key`` was written
        less than ``interval_s`` ago (then it is only counted); True when written."""
        if not self._logger.isEnabledFor(level):
            return False
        now = self._clock()
        with self._lock:
            state = self._keys.get(key)
            if state is not None and now - state[0] < self._interval_s:
                state[1] += 1
                return False
            suppressed = state[1] if state is not None else 0
            self._keys.pop(key, None)
            self._keys[key] = [now, 0]  # newest last: the first key is the oldest
            if len(self._keys) > self._max_keys:
                del self._keys[next(iter(self._keys))]
        if suppressed:
            msg = f"{msg} (and {suppressed} more like it since the last line, not logged)"
        self._logger.log(level, msg, *args, exc_info=exc_info)
        return True
