"""The daemon's counters: plain, thread-safe, Prometheus-named.

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
"""

from __future__ import annotations

from expertcache.counters import Counter, render_text

TIERS = ("device", "host", "store")

__all__ = ["TIERS", "Counter", "DaemonMetrics", "render_text"]


class DaemonMetrics:
    """Every counter the daemon keeps; one instance per daemon, shared by its components."""

    def __init__(self) -> None:
        self.hits = Counter("moe_cache_hits_total", "Experts served from each tier.", ("tier",))
        self.misses = Counter(
            "moe_cache_misses_total", "Experts looked up in a tier and not found.", ("tier",)
        )
        self.bytes_in = Counter("moe_cache_bytes_in_total", "Bytes copied into each tier.", ("tier",))
        self.evictions = Counter("moe_cache_evictions_total", "Experts evicted from each tier.", ("tier",))
        self.demands = Counter("moe_cache_demands_total", "Acquire requests handled.")
        self.checksum_failures = Counter(
            "moe_cache_checksum_failures_total", "Store reads that failed their CRC-32 check."
        )
        self.store_read_seconds = Counter(
            "moe_cache_store_read_seconds_total", "Seconds spent reading and checking store blobs."
        )
        self.store_read_bytes = Counter("moe_cache_store_read_bytes_total", "Bytes read from the store.")
        self.prefetch_started = Counter(
            "moe_cache_prefetch_started_total", "Prefetch loads started, per prediction kind.", ("kind",)
        )
        self.prefetch_used = Counter(
            "moe_cache_prefetch_used_total", "Prefetched experts used before eviction.", ("kind",)
        )
        self.prefetch_wasted = Counter(
            "moe_cache_prefetch_wasted_total", "Prefetched experts evicted without being used.", ("kind",)
        )
        self.prefetch_cancelled = Counter(
            "moe_cache_prefetch_cancelled_total",
            "Queued prefetch reads cancelled to give their slot to a demand.",
            ("kind",),
        )
        self.prefetch_promoted = Counter(
            "moe_cache_prefetch_promoted_total",
            "Prefetch loads joined by a demand and promoted to demand priority.",
            ("kind",),
        )
        self.signals = Counter(
            "moe_cache_signals_total", "One-way prediction messages received from compute.", ("kind",)
        )

    def counters(self) -> list[Counter]:
        return [
            self.hits,
            self.misses,
            self.bytes_in,
            self.evictions,
            self.demands,
            self.checksum_failures,
            self.store_read_seconds,
            self.store_read_bytes,
            self.prefetch_started,
            self.prefetch_used,
            self.prefetch_wasted,
            self.prefetch_cancelled,
            self.prefetch_promoted,
            self.signals,
        ]

    def render_text(self) -> str:
        """The counters in the Prometheus text exposition format."""
        return render_text(self.counters())
