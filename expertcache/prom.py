"""Prometheus ``/metrics`` for each service, with ``prometheus-client``, in one style:

- counters are ``prometheus_client.Counter`` objects (``counter``, ``Registry.counter``), kept by
  the service's metrics object; code counts on them (``.inc(n)``, ``.labels(tier).inc(n)``) and
  ``GetStats`` reads those same objects (``value``, ``values``): one source of truth, nothing
  counted twice;
- gauges are read from the service's stats at scrape time: a ``ScrapeCollector`` yields them
  (``gauge``), never a copy kept up to date beside the stats;
- histograms, which ``GetStats`` does not carry, are ``Registry.histogram`` objects.

Each service has its own ``Registry`` (never the process-global one, so two services in one
process, as in tests, do not collide). Names follow the Prometheus conventions, in every service:
``moe_<service>_`` first, base units in the name (``_seconds``, ``_bytes``, never milliseconds),
``_total`` on counters, no colons (those are for recording rules). ``serve`` starts the HTTP
endpoint (``metrics_port``; 0 = off) on ``metrics_address`` (default 127.0.0.1: only what runs
beside the service can scrape it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

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


def counter(
    name: str, help_text: str, labels: tuple[str, ...] = (), registry: CollectorRegistry | None = None
) -> Counter:
    """A counter named with its ``_total`` suffix (as ``/metrics`` shows it); ``registry`` None:
    registered later, or exposed through a collector (the daemon's per-tier counters)."""
    if not name.endswith("_total"):
        raise InvalidArgument(f"counter {name!r} must be named with a _total suffix")
    return Counter(name, help_text, labelnames=labels, registry=registry)


def values(metric: Counter) -> dict[tuple[str, ...], float]:
    """Every label set's current value (label values in ``labelnames`` order), as a scrape reads
    them: for ``GetStats``, never on a hot path."""
    return {
        tuple(s.labels.values()): s.value
        for family in metric.collect()
        for s in family.samples
        if s.name.endswith("_total")
    }


def value(metric: Counter, *labels: str) -> float:
    """The current value of ``metric`` for ``labels`` (its label values); 0 when never counted."""
    return values(metric).get(labels, 0.0)


def gauge(name: str, help_text: str, samples: float | dict[str, float], label: str = "") -> GaugeMetricFamily:
    """A gauge read at scrape time: one value, or one per value of ``label`` (``{"device": 4}``)."""
    if not label:
        return GaugeMetricFamily(name, help_text, value=samples)
    family = GaugeMetricFamily(name, help_text, labels=(label,))
    for label_value, v in samples.items():
        family.add_metric([label_value], v)
    return family


class ScrapeCollector(Collector):
    """What a service reads from its stats at each scrape (gauges, and the daemon's per-tier
    counters as GetStats reports them): ``read()`` yields the families."""

    def __init__(self, read: Callable[[], Iterable[Metric]]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        yield from self._read()


class Registry:
    """A service's metrics: its own ``CollectorRegistry`` (never the process-global one, so two
    services in one process, as in tests, do not collide)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)

    def add(self, collector: Collector) -> None:
        self.registry.register(collector)

    def counter(self, name: str, help_text: str, labels: tuple[str, ...] = ()) -> Counter:
        return counter(name, help_text, labels, self.registry)

    def histogram(
        self, name: str, help_text: str, buckets: tuple[float, ...] = LATENCY_BUCKETS_S, labels: tuple = ()
    ) -> Histogram:
        if not name.endswith(("_seconds", "_bytes", "_tokens", "_requests", "_experts")):
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
