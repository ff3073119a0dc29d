"""Prometheus ``/metrics`` for each service, with ``prometheus-client``.

One source of truth: the daemon's and the predictor's counters stay the plain
``expertcache.counters.Counter`` objects their ``GetStats`` reads, and ``CountersCollector``
exposes those very objects at scrape time (nothing is counted twice). Gauges (resident and
pinned slots, EAMC size, live requests, ...) are read from the service's stats at scrape time by
a callback. Histograms, which ``GetStats`` does not carry, are ``prometheus_client.Histogram``
objects in the service's ``Registry``.

Names follow the Prometheus conventions, in every service: ``moe_<service>_`` first, base units
in the name (``_seconds``, ``_bytes``, never milliseconds), ``_total`` on counters, no colons
(those are for recording rules). ``serve`` starts the HTTP endpoint (``metrics_port``; 0 = off) on
``metrics_address`` (default 127.0.0.1: only what runs beside the service can scrape it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from prometheus_client import (
    CollectorRegistry,
    Histogram,
    disable_created_metrics,
    generate_latest,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from expertcache.counters import Counter
from expertcache.errors import InvalidArgument

logger = logging.getLogger(__name__)

# No ``*_created`` series beside each counter and histogram: Prometheus does not need them.
disable_created_metrics()

# Acquire waits and token latencies: from a device hit (tens of microseconds) to a store read
# of a large expert under load (seconds).
LATENCY_BUCKETS_S = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
REQUEST_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)


@dataclass(frozen=True)
class Gauge:
    """One gauge sample read at scrape time."""

    name: str
    help: str
    value: float
    labels: dict[str, str] = field(default_factory=dict)


def counter_family(counter: Counter) -> CounterMetricFamily:
    """``counter`` as a Prometheus counter family (``prometheus_client`` adds ``_total`` back)."""
    if not counter.name.endswith("_total"):
        raise InvalidArgument(f"counter {counter.name!r} must be named with a _total suffix")
    family = CounterMetricFamily(counter.name.removesuffix("_total"), counter.help, labels=counter.labelnames)
    for labels, value in counter.samples():
        family.add_metric([labels[n] for n in counter.labelnames], value)
    return family


def gauge_families(gauges: Iterable[Gauge]) -> list[GaugeMetricFamily]:
    families: dict[str, GaugeMetricFamily] = {}
    for g in gauges:
        family = families.get(g.name)
        if family is None:
            family = families[g.name] = GaugeMetricFamily(g.name, g.help, labels=tuple(g.labels))
        family.add_metric(list(g.labels.values()), g.value)
    return list(families.values())


class CountersCollector(Collector):
    """Exposes a service's ``Counter`` objects and its stats gauges, read at each scrape."""

    def __init__(
        self, counters: Callable[[], Iterable[Counter]], gauges: Callable[[], Iterable[Gauge]] | None = None
    ) -> None:
        self._counters = counters
        self._gauges = gauges

    def collect(self) -> Iterator[Metric]:
        for counter in self._counters():
            yield counter_family(counter)
        if self._gauges is not None:
            yield from gauge_families(self._gauges())


class Registry:
    """A service's metrics: its own ``CollectorRegistry`` (never the process-global one, so two
    services in one process, as in tests, do not collide)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)

    def add(self, collector: Collector) -> None:
        self.registry.register(collector)

    def histogram(
        self, name: str, help_text: str, buckets: tuple[float, ...] = LATENCY_BUCKETS_S, labels: tuple = ()
    ) -> Histogram:
        if not name.endswith(("_seconds", "_bytes", "_tokens", "_requests")):
            raise InvalidArgument(f"histogram {name!r} must end with its unit (_seconds, _bytes, ...)")
        return Histogram(name, help_text, labelnames=labels, buckets=buckets, registry=self.registry)

    def render(self) -> str:
        """The text exposition format, as ``/metrics`` serves it."""
        return generate_latest(self.registry).decode()


class MetricsServer:
    """The running ``/metrics`` endpoint of one service."""

    def __init__(self, httpd, thread) -> None:
        self._httpd = httpd
        self._thread = thread

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5.0)


def serve(registry: Registry, address: str, port: int, service: str) -> MetricsServer | None:
    """Serve ``registry`` at ``http://address:port/metrics``; None when ``port`` is 0 (off).
    ``OSError`` names the address when it cannot bind."""
    if port == 0:
        return None
    try:
        httpd, thread = start_http_server(port, addr=address, registry=registry.registry)
    except OSError as exc:
        raise OSError(f"cannot serve {service} metrics on {address}:{port} (metrics_port): {exc}") from exc
    server = MetricsServer(httpd, thread)
    logger.info("serving %s metrics on http://%s:%d/metrics", service, address, server.port)
    return server
