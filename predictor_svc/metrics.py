"""The predictor's counters: ``prometheus_client`` counters (``expertcache.prom``).

============================================  =====  ==========================================
name                                          label  meaning
============================================  =====  ==========================================
``moe_predictor_observed_tokens_total``              Activation messages accepted
``moe_predictor_requests_done_total``                requests finished with request_done
``moe_predictor_requests_expired_total``             live requests dropped (TTL or
                                                     max_live_requests); EAM not inserted
``moe_predictor_entries_inserted_total``             EAMs written to the store by this replica
``moe_predictor_inserts_dropped_total``              finished EAMs not inserted (too short, or
                                                     the retry queue overflowed)
``moe_predictor_store_errors_total``          op     store operations that failed
                                                     (op = insert | sync | save)
``moe_predictor_queries_total``                      predictions computed
``moe_predictor_match_seconds_total``                seconds spent computing predictions
``moe_predictor_hint_batches_total``                 hint batches handed to subscribers
``moe_predictor_hints_replaced_total``               unsent (request, layer) hints replaced by
                                                     newer ones (coalescing)
``moe_predictor_hints_dropped_total``                unsent (request, layer) hints dropped
                                                     because a subscriber's queue was full
``moe_predictor_refused_total``               reason registrations, activations and
                                                     subscriptions refused (reason: see
                                                     ``REFUSAL_REASONS``)
============================================  =====  ==========================================

Mean match time = ``match_seconds_total / queries_total`` (what GetStats reports).

Code counts on these objects and ``GetStats`` reads them. ``/metrics`` (``registry``) shows these
very counters, gauges read from the stats at scrape time (``moe_predictor_eamc_entries{model}``, ``moe_predictor_live_requests``,
``moe_predictor_inserts_pending``, ``moe_predictor_subscribers``, ``moe_predictor_store_degraded``)
and the histograms ``moe_predictor_match_duration_seconds`` (one prediction) and
``moe_predictor_store_round_trip_seconds{op}`` (one Redis call: insert, load, changes, register,
models, count; the embedded store has no round trip).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import Metric

from expertcache.prom import Registry, ScrapeCollector, gauge, value, values

if TYPE_CHECKING:
    from predictor_svc.service import PredictorService

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


def _scrape(service: PredictorService) -> Iterator[Metric]:
    """The gauges, from one ``stats()``."""
    stats = service.stats()
    yield gauge(
        "moe_predictor_eamc_entries",
        "EAMC entries per model.",
        {m.model_id: m.eamc_entries for m in stats.models},
        "model",
    )
    yield gauge("moe_predictor_live_requests", "Requests observed and not finished.", stats.live_requests)
    yield gauge(
        "moe_predictor_inserts_pending", "Finished EAMs waiting to be inserted.", stats.inserts_pending
    )
    yield gauge("moe_predictor_subscribers", "Open SubscribeHints streams.", stats.subscribers)
    yield gauge("moe_predictor_store_degraded", "1 while the EAMC store fails.", float(stats.store_degraded))


def registry(service: PredictorService) -> Registry:
    """The predictor's ``/metrics``: its counters (the ones GetStats reads), gauges, histograms."""
    reg = Registry()
    reg.add(service.metrics.registry.registry)  # a CollectorRegistry is a collector too
    reg.add(ScrapeCollector(lambda: _scrape(service)))
    return reg
