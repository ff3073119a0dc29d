"""The daemon's counters: ``prometheus_client`` counters (``expertcache.prom``).

=========================================  ======  =============================================
name                                       labels  meaning
=========================================  ======  =============================================
``moe_cache_hits_total``                   tier    experts served from ``tier`` (device: resident
                                                   at Acquire; host: found in host memory on a
                                                   device miss; store: blobs read from the store)
``moe_cache_misses_total``                 tier    device: not resident at Acquire; host: not in
                                                   host memory on a device miss
``moe_cache_bytes_in_total``               tier    bytes copied into ``tier`` (never the store)
``moe_cache_evictions_total``              tier    experts evicted to make room in ``tier``
``moe_cache_demands_total``                        Acquire requests handled
``moe_cache_checksum_failures_total``              store reads that failed their CRC-32
``moe_cache_store_read_seconds_total``             seconds spent reading (and checking) store blobs
``moe_cache_arena_copy_seconds_total``             seconds spent copying experts from host memory into the arena
``moe_cache_store_read_bytes_total``               bytes read from the store
``moe_cache_prefetch_started_total``       kind    prefetch loads started (kind: layer_ahead,
                                                   eamc = history / next token / EAMC hints)
``moe_cache_prefetch_used_total``          kind    prefetched experts used (acquired, joined by
                                                   a demand, or pinned by compute) before eviction
``moe_cache_prefetch_wasted_total``        kind    prefetched experts evicted unused (accuracy =
                                                   used / (used + wasted))
``moe_cache_prefetch_cancelled_total``     kind    queued prefetch reads cancelled to give their
                                                   slot to a demand
``moe_cache_prefetch_promoted_total``      kind    prefetch loads a demand joined and promoted to
                                                   demand priority
``moe_cache_signals_total``                kind    one-way prediction messages from compute
                                                   (route, layer_ahead, request_begin, request_end)
=========================================  ======  =============================================

Gauges (resident experts, pinned experts) are not counters: they are read from the tiers when
stats are taken, never kept twice.

Code counts on these objects (``metrics.hits.labels("device").inc(n)``) and ``GetStats`` reads
them (``expertcache.prom.value``). ``/metrics`` (``registry``) shows these very counters, with the
per-tier ones (hits, misses, bytes in, evictions) exactly as ``GetStats`` reports them (device hits
include the pins compute took through the shared slot table, which no counter sees), and adds
gauges read at scrape time (``moe_cache_capacity_slots``, ``moe_cache_resident_slots``, ``moe_cache_pinned_slots``,
``moe_cache_inflight_bytes``, ``moe_cache_reader_queued``, ``moe_cache_reader_in_flight``,
``moe_cache_hint_requests``) and the histograms ``moe_cache_acquire_wait_seconds`` (one
Acquire, arrival to AcquireDone) and ``moe_cache_acquire_experts`` (experts per Acquire).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, Metric

from expertcache.prom import Registry, ScrapeCollector, counter, gauge

if TYPE_CHECKING:
    from cache_daemon.daemon import CacheDaemon

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


def _scrape(daemon: CacheDaemon) -> Iterator[Metric]:
    """The per-tier counters and the gauges, from one ``stats()``."""
    stats = daemon.stats()
    for name, help_text, attr in _TIER_COUNTERS:
        family = CounterMetricFamily(name, help_text, labels=("tier",))
        for t in stats.tiers:
            family.add_metric([t.tier.value], getattr(t, attr))
        yield family
    yield gauge("moe_cache_pinned_slots", "Device slots pinned by compute now.", stats.pinned)
    slotted = [t for t in stats.tiers if t.tier.value != "store"]
    yield gauge(
        "moe_cache_capacity_slots",
        "Slots of each tier.",
        {t.tier.value: t.capacity_slots for t in slotted},
        "tier",
    )
    yield gauge(
        "moe_cache_resident_slots",
        "Experts resident in each tier now.",
        {t.tier.value: t.resident for t in slotted},
        "tier",
    )
    yield gauge(
        "moe_cache_inflight_bytes", "Bytes of every expert load in flight.", daemon.residency.inflight_bytes
    )
    reader = daemon.store.reader_stats()
    yield gauge("moe_cache_reader_queued", "Store read chunks queued.", reader.get("queued", 0))
    yield gauge("moe_cache_reader_in_flight", "Store read chunks in flight.", reader.get("in_flight", 0))
    if stats.hints is not None:
        yield gauge("moe_cache_hint_requests", "Requests on the hint board.", stats.hints.requests)


def registry(daemon: CacheDaemon) -> Registry:
    """The daemon's ``/metrics``: its counters (the ones GetStats reads), gauges, histograms."""
    reg = Registry()
    reg.add(daemon.metrics.registry.registry)  # a CollectorRegistry is a collector too
    reg.add(ScrapeCollector(lambda: _scrape(daemon)))
    return reg
