"""Prometheus exposition (expertcache.prom): the services' own counters, read at scrape time,
parsed back with prometheus_client's parser; the HTTP endpoint on a real port."""

from __future__ import annotations

import socket
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cache_daemon.metrics import DaemonMetrics
from compute_svc.metrics import ComputeMetrics
from compute_svc.moe import CacheCounters, ExpertSource
from expertcache.counters import Counter
from expertcache.errors import InvalidArgument
from expertcache.prom import CountersCollector, Gauge, Registry, counter_family, serve
from predictor_svc.metrics import PredictorMetrics


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_counters_and_gauges_render_and_parse_back():
    plain = Counter("moe_a_total", "Plain.")
    tiered = Counter("moe_b_total", "By tier.", ("tier",))
    plain.inc(3)
    tiered.inc(2, tier="host")
    tiered.inc(0.5, tier="device")
    reg = Registry()
    reg.add(
        CountersCollector(
            lambda: [plain, tiered], lambda: [Gauge("moe_slots", "Slots.", 7, {"tier": "device"})]
        )
    )
    got = samples(reg.render())
    assert got[("moe_a_total", ())] == 3
    assert got[("moe_b_total", (("tier", "device"),))] == 0.5
    assert got[("moe_b_total", (("tier", "host"),))] == 2
    assert got[("moe_slots", (("tier", "device"),))] == 7
    plain.inc()  # read at scrape time: never a stale copy
    assert samples(reg.render())[("moe_a_total", ())] == 4


def test_counter_without_total_suffix_is_refused():
    with pytest.raises(InvalidArgument, match="'moe_bad' must be named with a _total suffix"):
        counter_family(Counter("moe_bad", "Bad."))


def test_histogram_without_unit_is_refused():
    with pytest.raises(InvalidArgument, match="histogram 'moe_wait' must end with its unit"):
        Registry().histogram("moe_wait", "No unit.")


@pytest.mark.parametrize("metrics", [DaemonMetrics(), PredictorMetrics()], ids=["daemon", "predictor"])
def test_every_service_counter_is_exposed(metrics):
    reg = Registry()
    reg.add(CountersCollector(metrics.counters))
    names = {f.name for f in text_string_to_metric_families(reg.render())}
    for counter in metrics.counters():
        assert counter.name.removesuffix("_total") in names


def test_compute_metrics_record_and_render():
    m = ComputeMetrics()
    counters = CacheCounters(
        hits=3, misses=1, stall_s=0.25, by_tier={ExpertSource.DEVICE: 3, ExpertSource.STORE: 1}
    )
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
    c = Counter("moe_served_total", "Served.")
    c.inc(5)
    reg = Registry()
    reg.add(CountersCollector(lambda: [c]))
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
