"""Prometheus exposition (expertcache.prom): the services' prometheus_client counters (the objects
GetStats reads) and gauges read at scrape time, parsed back with prometheus_client's parser; the
HTTP endpoint on a real port."""

from __future__ import annotations

import socket
import urllib.request

import pytest
from prometheus_client import Counter
from prometheus_client.parser import text_string_to_metric_families

from cache_daemon.metrics import DaemonMetrics
from compute_svc.experts.moe import CacheCounters
from compute_svc.metrics import ComputeMetrics
from expertcache.errors import InvalidArgument
from expertcache.prom import Registry, ScrapeCollector, counter, gauge, serve, value, values
from expertcache.protocol import Tier
from predictor_svc.metrics import PredictorMetrics


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_counters_and_gauges_render_and_parse_back():
    reg = Registry()
    plain = reg.counter("moe_a_total", "Plain.")
    tiered = reg.counter("moe_b_total", "By tier.", ("tier",))
    plain.inc(3)
    tiered.labels("host").inc(2)
    tiered.labels("device").inc(0.5)
    slots = {"device": 7}
    reg.add(ScrapeCollector(lambda: [gauge("moe_slots", "Slots.", slots, "tier")]))
    got = samples(reg.render())
    assert got[("moe_a_total", ())] == 3
    assert got[("moe_b_total", (("tier", "device"),))] == 0.5
    assert got[("moe_b_total", (("tier", "host"),))] == 2
    assert got[("moe_slots", (("tier", "device"),))] == 7
    plain.inc()  # the same objects: never a stale copy
    slots["device"] = 6  # gauges read at scrape time
    got = samples(reg.render())
    assert got[("moe_a_total", ())] == 4 and got[("moe_slots", (("tier", "device"),))] == 6
    # What GetStats reads is what /metrics shows.
    assert value(plain) == 4 and value(tiered, "host") == 2 and value(tiered, "store") == 0
    assert values(tiered) == {("host",): 2, ("device",): 0.5}


def test_counter_without_total_suffix_is_refused():
    with pytest.raises(InvalidArgument, match="'moe_bad' must be named with a _total suffix"):
        counter("moe_bad", "Bad.")


def test_histogram_without_unit_is_refused():
    with pytest.raises(InvalidArgument, match="histogram 'moe_wait' must end with its unit"):
        Registry().histogram("moe_wait", "No unit.")


@pytest.mark.parametrize("metrics", [DaemonMetrics(), PredictorMetrics()], ids=["daemon", "predictor"])
def test_every_service_counter_is_exposed(metrics):
    """Every counter the service keeps is in its registry, except the daemon's per-tier ones,
    which its /metrics takes from the stats (cache_daemon.metrics.registry)."""
    names = {f.name for f in text_string_to_metric_families(metrics.registry.render())}
    kept = {n for n, v in vars(metrics).items() if isinstance(v, Counter)}
    per_tier = {"hits", "misses", "bytes_in", "evictions"} if isinstance(metrics, DaemonMetrics) else set()
    assert kept > per_tier
    for attr in kept - per_tier:
        assert getattr(metrics, attr).describe()[0].name in names


def test_compute_metrics_record_and_render():
    m = ComputeMetrics()
    counters = CacheCounters(hits=3, misses=1, stall_s=0.25, by_tier={Tier.DEVICE: 3, Tier.STORE: 1})
    counters.acquire_waits.extend([0.001, 0.2])
    m.record_step(counters, batch_requests=2)
    m.record_token(0.5, first=True)
    m.record_token(0.1)
    m.record_finish("length", 0.6)
    m.record_finish("error")
    m.set_queue_depth(4)
    got = samples(m.render())
    assert got[("moe_compute_tokens_total", ())] == 2
    assert got[("moe_compute_time_to_first_token_seconds_count", ())] == 1
    assert got[("moe_compute_token_latency_seconds_count", ())] == 2
    assert got[("moe_compute_acquire_wait_seconds_count", ())] == 2
    assert got[("moe_compute_acquire_wait_seconds_bucket", (("le", "0.001"),))] == 1
    assert got[("moe_compute_expert_acquires_total", (("tier", "store"),))] == 1
    assert got[("moe_compute_stall_seconds_total", ())] == 0.25
    assert got[("moe_compute_requests_total", (("finish_reason", "length"),))] == 1
    assert got[("moe_compute_request_duration_seconds_count", ())] == 1  # errors without tokens: not timed
    assert got[("moe_compute_queue_depth", ())] == 4
    assert got[("moe_compute_step_batch_requests_sum", ())] == 2


def test_serve_over_http_and_off_at_port_zero():
    assert serve(Registry(), "127.0.0.1", 0, "test") is None
    reg = Registry()
    reg.counter("moe_served_total", "Served.").inc(5)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = serve(reg, "127.0.0.1", port, "test")
    try:
        assert server.port == port
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            body = response.read().decode()
        assert samples(body)[("moe_served_total", ())] == 5
    finally:
        server.close()


def test_serve_on_a_taken_port_names_it():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=rf"cannot serve test metrics on 127.0.0.1:{port} \(metrics_port\)"):
            serve(Registry(), "127.0.0.1", port, "test")
