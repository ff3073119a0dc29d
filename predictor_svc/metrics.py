"""The predictor's counters (``prometheus_client``, ``expertcache.prom``) and its ``/metrics``.

Code counts on ``PredictorMetrics`` and GetStats reads it; ``registry`` adds the gauges of a
``GaugeStats`` snapshot, taken per scrape through a function so that this module imports no
service. The metrics, one by one: docs/predictor.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client.core import Metric

from expertcache.prom import Registry, ScrapeCollector, gauge, value, values

REFUSAL_REASONS = (
    "unregistered_model",  # Observe / SubscribeHints of a model nobody registered
    "bad_shape",  # an activation or registration disagreeing with the registered shape
    "out_of_range",  # an expert index >= the model's num_experts
    "max_layers",
    "max_experts",
    "max_models",
    "max_eamc_bytes",
    "registration_disabled",
    "client_models",
    "client_live_requests",
    "client_live_bytes",
    "max_subscribers",
)


class PredictorMetrics:
    """Every counter the predictor keeps, in its ``registry``; one instance per service."""

    def __init__(self) -> None:
        self.registry = Registry()
        c = self.registry.counter
        self.observed_tokens = c("moe_predictor_observed_tokens_total", "Activation messages accepted.")
        self.requests_done = c("moe_predictor_requests_done_total", "Requests finished with request_done.")
        self.requests_expired = c(
            "moe_predictor_requests_expired_total",
            "Live requests dropped without request_done (TTL or max_live_requests); EAM not inserted.",
        )
        self.entries_inserted = c(
            "moe_predictor_entries_inserted_total", "EAMs written to the store by this replica."
        )
        self.inserts_dropped = c(
            "moe_predictor_inserts_dropped_total",
            "Finished EAMs not inserted (too short or retry queue full).",
        )
        self.store_errors = c("moe_predictor_store_errors_total", "Store operations that failed.", ("op",))
        self.queries = c("moe_predictor_queries_total", "Predictions computed.")
        self.match_seconds = c("moe_predictor_match_seconds_total", "Seconds spent computing predictions.")
        self.hint_batches = c("moe_predictor_hint_batches_total", "Hint batches handed to subscribers.")
        self.hints_replaced = c(
            "moe_predictor_hints_replaced_total", "Unsent (request, layer) hints replaced by newer ones."
        )
        self.hints_dropped = c(
            "moe_predictor_hints_dropped_total",
            "Unsent (request, layer) hints dropped: subscriber queue full.",
        )
        self.refused = c(
            "moe_predictor_refused_total",
            "Registrations, activations and subscriptions refused, by reason.",
            ("reason",),
        )
        self.match_duration = self.registry.histogram(
            "moe_predictor_match_duration_seconds",
            "Time to compute one prediction (EAMC match and top hints).",
        )
        self.store_round_trip = self.registry.histogram(
            "moe_predictor_store_round_trip_seconds",
            "Time of one round trip to the EAMC store (Redis), by operation.",
            labels=("op",),
        )

    def refused_by_reason(self) -> dict[str, int]:
        return {reason: int(v) for (reason,), v in values(self.refused).items()}

    def store_errors_total(self) -> int:
        return int(sum(values(self.store_errors).values()))

    def mean_match_s(self) -> float:
        queries = value(self.queries)
        return value(self.match_seconds) / queries if queries else 0.0


@dataclass(frozen=True)
class GaugeStats:
    """What the gauges show, read at each scrape: a plain snapshot, so that this module needs no
    service (the service's ``gauge_stats`` makes one from its ``stats()``)."""

    eamc_entries: Mapping[str, int]  # model id -> EAMC entries
    live_requests: int
    inserts_pending: int
    subscribers: int
    store_degraded: bool


def _scrape(stats: GaugeStats) -> Iterator[Metric]:
    """The gauges, from one snapshot."""
    yield gauge("moe_predictor_eamc_entries", "EAMC entries per model.", dict(stats.eamc_entries), "model")
    yield gauge("moe_predictor_live_requests", "Requests observed and not finished.", stats.live_requests)
    yield gauge(
        "moe_predictor_inserts_pending", "Finished EAMs waiting to be inserted.", stats.inserts_pending
    )
    yield gauge("moe_predictor_subscribers", "Open SubscribeHints streams.", stats.subscribers)
    yield gauge("moe_predictor_store_degraded", "1 while the EAMC store fails.", float(stats.store_degraded))


def registry(metrics: PredictorMetrics, stats: Callable[[], GaugeStats]) -> Registry:
    """The predictor's ``/metrics``: its counters (the ones GetStats reads), histograms, and the
    gauges of one ``stats()`` call per scrape."""
    reg = Registry()
    reg.add(metrics.registry.registry)  # a CollectorRegistry is a collector too
    reg.add(ScrapeCollector(lambda: _scrape(stats())))
    return reg
