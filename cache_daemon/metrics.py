"""The daemon's counters (``DaemonMetrics``, ``prometheus_client`` counters read by ``GetStats``)
and its ``/metrics`` (``registry``), whose per-tier counters and gauges come from a stats function
(``ScrapeStats``) so that this module imports neither the daemon nor its tiers. The table of
names and meanings is in ``docs/daemon.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, Metric

from expertcache.prom import Registry, ScrapeCollector, counter, gauge

TIERS = ("device", "host", "store")


@dataclass(frozen=True)
class TierCounters:
    """One tier's children of the per-tier counters (``DaemonMetrics.tier[name]``)."""

    hits: Any
    misses: Any
    bytes_in: Any
    evictions: Any

    @classmethod
    def bind(cls, metrics: DaemonMetrics, tier: str) -> TierCounters:
        return cls(
            *(getattr(metrics, name).labels(tier) for name in ("hits", "misses", "bytes_in", "evictions"))
        )


class DaemonMetrics:
    """Every counter the daemon keeps, in its ``registry``; one instance per daemon, shared by its
    components."""

    def __init__(self) -> None:
        self.registry = Registry()
        # Per tier: not registered; /metrics takes them from the stats, as GetStats reports them.
        self.hits = counter("moe_cache_hits_total", "Experts served from each tier.", ("tier",))
        self.misses = counter(
            "moe_cache_misses_total", "Experts looked up in a tier and not found.", ("tier",)
        )
        self.bytes_in = counter("moe_cache_bytes_in_total", "Bytes copied into each tier.", ("tier",))
        self.evictions = counter("moe_cache_evictions_total", "Experts evicted from each tier.", ("tier",))
        # Each tier's children, bound once: every Acquire and every load counts them, and
        # ``labels()`` takes a lock and a lookup (about 3 µs) at each call.
        self.tier = {t: TierCounters.bind(self, t) for t in TIERS}
        c = self.registry.counter
        self.demands = c("moe_cache_demands_total", "Acquire requests handled.")
        self.checksum_failures = c(
            "moe_cache_checksum_failures_total", "Store reads that failed their CRC-32 check."
        )
        self.store_read_seconds = c(
            "moe_cache_store_read_seconds_total", "Seconds spent reading and checking store blobs."
        )
        self.arena_copy_seconds = c(
            "moe_cache_arena_copy_seconds_total",
            "Seconds spent copying experts from host memory into arena slots (host tier or staging).",
        )
        self.store_read_bytes = c("moe_cache_store_read_bytes_total", "Bytes read from the store.")
        self.prefetch_started = c(
            "moe_cache_prefetch_started_total", "Prefetch loads started, per prediction kind.", ("kind",)
        )
        self.prefetch_used = c(
            "moe_cache_prefetch_used_total", "Prefetched experts used before eviction.", ("kind",)
        )
        self.prefetch_wasted = c(
            "moe_cache_prefetch_wasted_total", "Prefetched experts evicted without being used.", ("kind",)
        )
        self.prefetch_cancelled = c(
            "moe_cache_prefetch_cancelled_total",
            "Queued prefetch reads cancelled to give their slot to a demand.",
            ("kind",),
        )
        self.prefetch_start_delay_seconds = c(
            "moe_cache_prefetch_start_delay_seconds_total",
            "Seconds from the change that asked for a prefetch decision (compute's signals: from when the "
            "daemon read them) to each prefetch load's start, "
            "summed over the loads started (over moe_cache_prefetch_started_total: the mean lag).",
            ("kind",),
        )
        self.prefetch_promoted = c(
            "moe_cache_prefetch_promoted_total",
            "Prefetch loads joined by a demand and promoted to demand priority.",
            ("kind",),
        )
        self.signals = c(
            "moe_cache_signals_total", "One-way prediction messages received from compute.", ("kind",)
        )
        self.clients_revoked = c(
            "moe_cache_clients_revoked_total",
            "Client sessions ended because their shared-memory region broke the pin protocol.",
        )
        self.channel_failures = c(
            "moe_cache_channel_failures_total",
            "Client channels ended by an internal error (their demand answered INTERNAL).",
        )
        # Histograms (not in GetStats).
        self.acquire_wait = self.registry.histogram(
            "moe_cache_acquire_wait_seconds", "Time from an Acquire's arrival to its AcquireDone."
        )
        self.acquire_experts = self.registry.histogram(
            "moe_cache_acquire_experts",
            "Experts named by one Acquire.",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
        )


_TIER_COUNTERS = (
    ("moe_cache_hits", "Experts served from each tier.", "hits"),
    ("moe_cache_misses", "Experts looked up in a tier and not found.", "misses"),
    ("moe_cache_bytes_in", "Bytes copied into each tier.", "bytes_in"),
    ("moe_cache_evictions", "Experts evicted from each tier.", "evictions"),
)


@dataclass(frozen=True)
class TierScrape:
    """One tier's values on ``/metrics``, as ``GetStats`` reports them."""

    tier: str  # a name of ``TIERS``
    hits: int
    misses: int
    bytes_in: int
    evictions: int
    capacity_slots: int
    resident: int


@dataclass(frozen=True)
class ScrapeStats:
    """What one ``/metrics`` scrape shows besides the registered counters, taken at once
    (``CacheDaemon.scrape_stats``)."""

    tiers: tuple[TierScrape, ...]
    pinned: int  # device slots pinned by compute
    inflight_bytes: int  # bytes of every expert load in flight
    reader_queued: int  # store read chunks queued
    reader_in_flight: int  # store read chunks in flight
    hint_requests: int | None = None  # requests on the hint board; None: not subscribed


def _scrape(stats: ScrapeStats) -> Iterator[Metric]:
    """The per-tier counters and the gauges, from one ``ScrapeStats``."""
    for name, help_text, attr in _TIER_COUNTERS:
        family = CounterMetricFamily(name, help_text, labels=("tier",))
        for t in stats.tiers:
            family.add_metric([t.tier], getattr(t, attr))
        yield family
    yield gauge("moe_cache_pinned_slots", "Device slots pinned by compute now.", stats.pinned)
    slotted = [t for t in stats.tiers if t.tier != "store"]
    yield gauge(
        "moe_cache_capacity_slots",
        "Slots of each tier.",
        {t.tier: t.capacity_slots for t in slotted},
        "tier",
    )
    yield gauge(
        "moe_cache_resident_slots",
        "Experts resident in each tier now.",
        {t.tier: t.resident for t in slotted},
        "tier",
    )
    yield gauge("moe_cache_inflight_bytes", "Bytes of every expert load in flight.", stats.inflight_bytes)
    yield gauge("moe_cache_reader_queued", "Store read chunks queued.", stats.reader_queued)
    yield gauge("moe_cache_reader_in_flight", "Store read chunks in flight.", stats.reader_in_flight)
    if stats.hint_requests is not None:
        yield gauge("moe_cache_hint_requests", "Requests on the hint board.", stats.hint_requests)


def registry(metrics: DaemonMetrics, stats: Callable[[], ScrapeStats]) -> Registry:
    """The daemon's ``/metrics``: the counters of ``metrics`` (the ones GetStats reads), and the
    per-tier counters and gauges of a fresh ``stats()`` at each scrape, and the histograms."""
    reg = Registry()
    reg.add(metrics.registry.registry)  # a CollectorRegistry is a collector too
    reg.add(ScrapeCollector(lambda: _scrape(stats())))
    return reg
