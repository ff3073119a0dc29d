"""Plain, thread-safe, Prometheus-named counters, shared by the services.

Each service keeps its own counters (``cache_daemon.metrics``, ``predictor_svc.metrics``) built
from this ``Counter``; ``GetStats`` reads them, and ``expertcache.prom`` exposes the same objects
on ``/metrics`` (one source of truth).

>>> c = Counter("moe_example_total", "Example.", ("kind",))
>>> c.inc(2, kind="a")
>>> c.samples()
[({'kind': 'a'}, 2)]
"""

from __future__ import annotations

import threading
from collections.abc import Iterable


class Counter:
    """A monotonically increasing value per label set (``tier=...`` or none)."""

    def __init__(self, name: str, help_text: str, labelnames: Iterable[str] = ()) -> None:
        self.name = name
        self.help = help_text
        self.labelnames = tuple(labelnames)
        self._lock = threading.Lock()
        self._values: dict[tuple[str, ...], float] = {}

    def _labels(self, labels: dict[str, str]) -> tuple[str, ...]:
        # Called at every increment of a hot path: look the names up rather than compare sets.
        try:
            key = tuple([labels[n] for n in self.labelnames])
        except KeyError:
            key = None
        if key is None or len(labels) != len(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {tuple(labels)}")
        return key

    def inc(self, amount: float = 1, **labels: str) -> None:
        if amount < 0:
            raise ValueError(f"{self.name} can only increase (got {amount})")
        key = self._labels(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0) + amount

    def value(self, **labels: str) -> float:
        key = self._labels(labels)
        with self._lock:
            return self._values.get(key, 0)

    def samples(self) -> list[tuple[dict[str, str], float]]:
        with self._lock:
            items = sorted(self._values.items())
        return [(dict(zip(self.labelnames, k, strict=True)), v) for k, v in items]
