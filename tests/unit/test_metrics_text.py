"""The Prometheus text rendering (expertcache.counters) shared by the daemon's and the predictor's counters."""

from __future__ import annotations

import pytest

from cache_daemon.metrics import DaemonMetrics
from expertcache.counters import Counter, render_text
from predictor_svc.metrics import PredictorMetrics


def test_render_text_with_and_without_labels():
    plain = Counter("a_total", "Plain.")
    tiered = Counter("b_total", "By tier.", ("tier",))
    plain.inc(3)
    tiered.inc(2, tier="host")
    tiered.inc(0.5, tier="device")
    assert render_text([plain, tiered]) == (
        "# HELP a_total Plain.\n"
        "# TYPE a_total counter\n"
        "a_total 3\n"
        "# HELP b_total By tier.\n"
        "# TYPE b_total counter\n"
        'b_total{tier="device"} 0.5\n'
        'b_total{tier="host"} 2\n'
    )
    with pytest.raises(ValueError, match=r"b_total takes labels \('tier',\), got \(\)"):
        tiered.inc()


def test_services_render_every_counter():
    for metrics in (DaemonMetrics(), PredictorMetrics()):
        text = metrics.render_text()
        for counter in metrics.counters():
            assert f"# TYPE {counter.name} counter" in text
