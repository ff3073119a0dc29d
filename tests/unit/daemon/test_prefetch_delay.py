"""The prefetcher's start delay (``moe_cache_prefetch_start_delay_seconds_total``, GetStats'
``PrefetchStats.start_delay_seconds``): each prefetch start counts the time since the change that
asked for its decision, not since the worker happened to run, and a decision nothing asked for
(``run_prefetch``) counts from its own start."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from cache_daemon.decisions import intake as intake_module
from cache_daemon.decisions.intake import SignalIntake
from cache_daemon.decisions.scheduler import PrefetchClass, PrefetchStart
from cache_daemon.decisions.signals import ActivationSignals, LayerPrediction
from cache_daemon.metrics import DaemonMetrics
from cache_daemon.residency import prefetcher as prefetcher_module
from cache_daemon.residency.prefetcher import Prefetcher
from expertcache.keys import ExpertKey
from expertcache.layers import LayerMap
from expertcache.prom import value


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Tier:
    demand_waiting = 0


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(prefetcher_module.time, "monotonic", c)
    monkeypatch.setattr(intake_module.time, "monotonic", c)
    return c


def make_prefetcher() -> tuple[Prefetcher, DaemonMetrics]:
    metrics = DaemonMetrics()
    p = Prefetcher(threading.Condition(), scheduler=None, metrics=metrics)  # type: ignore[arg-type]
    p.enabled = True
    return p, metrics


def start(expert: int, cls: PrefetchClass = PrefetchClass.LAYER_AHEAD) -> PrefetchStart:
    return PrefetchStart(ExpertKey(1, expert), cls, 0.5, None, 1 if cls is PrefetchClass.LAYER_AHEAD else 0)


def test_a_start_is_delayed_from_the_first_change_its_decision_answers(clock):
    p, metrics = make_prefetcher()
    with p._cond:
        assert p.take_work(Tier())  # the change at construction (t = 100)
        clock.now = 101.0
        p.started(start(0))  # 1 s after the change it answers
        assert value(metrics.prefetch_start_delay_seconds, "layer_ahead") == pytest.approx(1.0)
        clock.now = 110.0
        p.kick()  # a layer's signals: the next decision answers this one
        clock.now = 112.0
        p.kick()  # more signals before the worker ran: still the first change counts
        clock.now = 115.0
        assert p.take_work(Tier())
        clock.now = 116.0
        p.started(start(1))
        p.started(start(2, PrefetchClass.EAMC))
    assert value(metrics.prefetch_start_delay_seconds, "layer_ahead") == pytest.approx(1.0 + 6.0)
    assert value(metrics.prefetch_start_delay_seconds, "eamc") == pytest.approx(6.0)
    assert value(metrics.prefetch_started, "layer_ahead") == 2


def test_a_landed_load_that_asks_nothing_does_not_restart_the_clock(clock):
    p, _metrics = make_prefetcher()
    with p._cond:
        assert p.take_work(Tier())
        p.settled = True  # the last decision went through every candidate
        clock.now = 105.0
        p.kick(landed=True)  # frees room only: no decision is asked for
        assert not p.take_work(Tier())
        clock.now = 107.0
        p.kick()
        clock.now = 109.0
        p.kick(landed=True)
        assert p.take_work(Tier())
        assert p._deciding_since == 107.0


def test_a_decision_nothing_asked_for_counts_from_its_own_start(clock):
    p, metrics = make_prefetcher()
    with p._cond:
        assert p.take_work(Tier())
        clock.now = 150.0  # long after the last change: run_prefetch decides now
        p.begin_decision()
        clock.now = 150.5
        p.started(start(3))
    assert value(metrics.prefetch_start_delay_seconds, "layer_ahead") == pytest.approx(0.5)


def test_a_start_counts_from_when_the_daemon_read_the_signals_it_follows(clock):
    p, metrics = make_prefetcher()
    with p._cond:
        assert p.take_work(Tier())
        clock.now = 120.0
        p.kick(asked_at=117.5)  # the signals were read at 117.5 and applied now
        clock.now = 121.0
        p.kick(asked_at=120.5)  # a later batch before the worker ran: the first counts
        assert p.take_work(Tier())
        clock.now = 122.0
        p.started(start(4))
    assert value(metrics.prefetch_start_delay_seconds, "layer_ahead") == pytest.approx(4.5)


def test_the_intake_tells_the_prefetcher_when_a_batchs_first_signal_arrived(clock):
    calls = []
    signals = ActivationSignals(4, 6)
    intake = SignalIntake(
        signals,
        LayerMap.dense(4),
        threading.Condition(),
        lambda **kw: calls.append(kw),
        DaemonMetrics().signals,
    )
    clock.now = 200.0
    route = intake.check_route("r", 0, 1, [0, 2])  # read at 200
    clock.now = 203.0
    ahead = intake.check_layer_ahead(0, [LayerPrediction(2, 1, np.array([1, 3]), np.array([0.9, 0.5]))], "r")
    clock.now = 205.0
    intake.apply_ops_locked([("begin", "r"), ("signal", route), ("signal", ahead)])
    assert calls == [{"asked_at": 200.0}]
    intake.apply_locked([ahead])  # an Acquire's carried signals
    assert calls[-1] == {"asked_at": 203.0}
    intake.apply_ops_locked([("end", "r")])  # no signal: the change is now
    assert calls[-1] == {"asked_at": None}
