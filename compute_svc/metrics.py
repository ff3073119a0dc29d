"""Compute-service metrics, in a ``prometheus_client`` registry (``expertcache.prom``).

The metrics and what each counts: docs/compute.md."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

from prometheus_client import Gauge
from prometheus_client.core import CounterMetricFamily, Metric

from expertcache.prom import BATCH_BUCKETS, REQUEST_BUCKETS_S, Registry, ScrapeCollector


class StepCounters(Protocol):
    """What one forward's expert cache activity reports (``experts.moe.CacheCounters``)."""

    @property
    def stall_s(self) -> float: ...
    @property
    def layers(self) -> int: ...
    @property
    def host_transfers(self) -> int: ...
    @property
    def event_waits(self) -> int: ...
    @property
    def by_tier(self) -> Mapping[Any, int]: ...  # keyed by an enum of tiers (its ``value`` is the label)
    @property
    def acquire_waits(self) -> Sequence[float]: ...


class HttpMetrics:
    """The HTTP API's metrics (``compute_svc.http.api`` and ``compute_svc.http.guard``): ``route``
    is one of its paths or "other"."""

    def __init__(self, registry: Registry) -> None:
        self.requests = registry.counter(
            "moe_compute_http_requests_total",
            "HTTP API requests, by route and status code.",
            ("route", "status"),
        )
        self.duration = registry.histogram(
            "moe_compute_http_request_duration_seconds",
            "HTTP API requests from arrival to the last byte of the answer (of the stream, when streaming).",
            REQUEST_BUCKETS_S,
            labels=("route",),
        )
        self.refused = registry.counter(
            "moe_compute_http_refused_total",
            "HTTP API requests refused by a bound: http_max_requests, max_body_bytes.",
            ("limit",),
        )
        self.cut = registry.counter(
            "moe_compute_http_cut_total",
            "HTTP API requests ended by the server: stall (an event not taken for stream_stall_timeout_s), "
            "request_timeout (no body within request_timeout_s).",
            ("reason",),
        )

    def record(self, route: str, status: int, duration_s: float) -> None:
        self.requests.labels(route=route, status=str(status)).inc()
        self.duration.labels(route=route).observe(duration_s)


class ComputeMetrics:
    """Thread-safe (``prometheus_client``'s own locking): written by the worker (tokens, steps)
    and gRPC threads (queue, refused requests), read by the ``/metrics`` server."""

    def __init__(self) -> None:
        self.registry = Registry()
        r = self.registry.registry
        self.tokens = self.registry.counter("moe_compute_tokens_total", "Generated tokens.")
        self.token_latency = self.registry.histogram(
            "moe_compute_token_latency_seconds",
            "Time from a request's previous token (or arrival) to a token.",
        )
        self.ttft = self.registry.histogram(
            "moe_compute_time_to_first_token_seconds", "Time from a request's arrival to its first token."
        )
        self.request_duration = self.registry.histogram(
            "moe_compute_request_duration_seconds",
            "Time from a request's arrival to its end (requests that produced a token).",
            REQUEST_BUCKETS_S,
        )
        self.acquire_wait = self.registry.histogram(
            "moe_compute_acquire_wait_seconds", "Time one MoE layer waited for its experts (one acquire)."
        )
        self.batch_requests = self.registry.histogram(
            "moe_compute_step_batch_requests", "Requests advanced together in one step.", BATCH_BUCKETS
        )
        self.expert_acquires = self.registry.counter(
            "moe_compute_expert_acquires_total",
            "Experts used, by the tier they were found in.",
            ("tier",),
        )
        self.stall_seconds = self.registry.counter(
            "moe_compute_stall_seconds_total", "Time spent waiting for experts."
        )
        self.moe_layers = self.registry.counter("moe_compute_moe_layers_total", "MoE layer forwards.")
        self.host_syncs = self.registry.counter(
            "moe_compute_host_syncs_total",
            "Host waits for the device: transfer (routing to the host, one per MoE layer) and "
            "event_wait (a wave's kernels before its slots are reused).",
            ("kind",),
        )
        self.requests = self.registry.counter(
            "moe_compute_requests_total", "Finished requests, by finish reason.", ("finish_reason",)
        )
        self.queue_depth = Gauge(
            "moe_compute_queue_depth", "Requests waiting for a place in the batch.", registry=r
        )
        self.http = HttpMetrics(self.registry)

    def record_token(self, latency_s: float, *, first: bool = False) -> None:
        self.tokens.inc()
        self.token_latency.observe(latency_s)
        if first:
            self.ttft.observe(latency_s)

    def record_step(self, counters: StepCounters, batch_requests: int = 1, batch_tokens: int = 1) -> None:
        """One forward's expert cache activity (shared by the requests of the step)."""
        self.stall_seconds.inc(counters.stall_s)
        self.moe_layers.inc(counters.layers)
        if counters.host_transfers:
            self.host_syncs.labels(kind="transfer").inc(counters.host_transfers)
        if counters.event_waits:
            self.host_syncs.labels(kind="event_wait").inc(counters.event_waits)
        for tier, count in counters.by_tier.items():
            self.expert_acquires.labels(tier=tier.value).inc(count)
        for wait_s in counters.acquire_waits:
            self.acquire_wait.observe(wait_s)
        self.batch_requests.observe(batch_requests)

    def record_finish(self, reason: str, duration_s: float | None = None) -> None:
        self.requests.labels(finish_reason=reason).inc()
        if duration_s is not None:
            self.request_duration.observe(duration_s)

    def set_queue_depth(self, depth: int) -> None:
        self.queue_depth.set(depth)

    def watch_activations(self, counts: Callable[[], Mapping[str, int]]) -> None:
        """Expose the activation reporter's counts: ``counts()`` is read at each scrape."""
        self.registry.add(ScrapeCollector(lambda: _reporter_counters(counts())))

    def value(self, name: str, **labels: str) -> float:
        """One sample's current value (tests, logs); 0 when absent."""
        return self.registry.registry.get_sample_value(name, labels) or 0.0

    def render(self) -> str:
        """The Prometheus text exposition of every metric (what ``/metrics`` serves)."""
        return self.registry.render()


def _reporter_counters(stats: Mapping[str, int]) -> Iterator[Metric]:
    for name, help_text in (
        ("moe_compute_activations_sent", "Token activations sent to the predictor."),
        ("moe_compute_activations_dropped", "Token activations dropped (reporter queue full)."),
        ("moe_compute_predictor_outages", "Observe streams to the predictor that ended in an outage."),
    ):
        yield CounterMetricFamily(name, help_text, value=stats[name])
