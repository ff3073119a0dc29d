"""The daemon's ``/metrics`` (``cache_daemon.metrics.registry``): the per-tier counters and the gauges
come from one ``CacheDaemon.scrape_stats``, the same values ``GetStats`` reports."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from cache_daemon.config import DaemonConfig
from cache_daemon.daemon import CacheDaemon
from cache_daemon.metrics import registry
from tests.stores import write_store

BLOB = 4096  # write_store's blob size


def samples(text: str) -> dict[tuple[str, str], float]:
    """(sample name, its tier label or "") -> value of every sample of a /metrics text."""
    return {
        (s.name, s.labels.get("tier", "")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_show_the_tiers_as_get_stats_reports_them(tmp_path):
    store = tmp_path / "store"
    write_store(store)
    config = DaemonConfig(
        store_dir=str(store),
        socket_path=str(tmp_path / "d.sock"),
        device_budget_bytes=2 * BLOB,
        host_budget_bytes=3 * BLOB,
        device="cpu",
    )
    daemon = CacheDaemon.start(config)
    try:
        daemon.metrics.tier["device"].hits.inc(3)
        daemon.metrics.tier["host"].misses.inc(2)
        daemon.metrics.tier["store"].bytes_in.inc(5)  # never counted by the daemon; shown all the same
        got = samples(registry(daemon.metrics, daemon.scrape_stats).render())
        stats = daemon.stats()
        for t in stats.tiers:
            tier = t.tier.value
            assert got["moe_cache_hits_total", tier] == t.hits
            assert got["moe_cache_misses_total", tier] == t.misses
            assert got["moe_cache_bytes_in_total", tier] == t.bytes_in
            assert got["moe_cache_evictions_total", tier] == t.evictions
        assert (got["moe_cache_hits_total", "device"], got["moe_cache_misses_total", "host"]) == (3, 2)
        assert {k: v for k, v in got.items() if k[0] == "moe_cache_capacity_slots"} == {
            ("moe_cache_capacity_slots", "device"): 2,
            ("moe_cache_capacity_slots", "host"): 3,
        }
        assert got["moe_cache_resident_slots", "device"] == got["moe_cache_resident_slots", "host"] == 0
        for gauge in (
            "moe_cache_pinned_slots",
            "moe_cache_inflight_bytes",
            "moe_cache_reader_queued",
            "moe_cache_reader_in_flight",
            "moe_cache_hint_requests",
        ):
            assert got[gauge, ""] == 0
        assert ("moe_cache_demands_total", "") in got and ("moe_cache_acquire_wait_seconds_count", "") in got
    finally:
        daemon.close()
