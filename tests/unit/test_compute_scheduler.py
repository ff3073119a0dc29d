"""The scheduler: one request at a time, a bounded queue, cancellation, errors reach the caller."""

from __future__ import annotations

import threading
import time

import pytest

from compute_svc.errors import Cancelled, DataLoss, InvalidArgument, QueueFull, Unavailable
from compute_svc.generation import FinishReason, GenerationRequest, PreparedRequest, TokenEvent, TokenStats
from compute_svc.metrics import ComputeMetrics
from compute_svc.scheduler import Scheduler


class ScriptedEngine:
    """Generates ``max_new_tokens`` events; blocks on ``gate`` before each one when given."""

    def __init__(self) -> None:
        self.metrics = ComputeMetrics()
        self.gate: threading.Event | None = None
        self.running = 0
        self.max_running = 0
        self.order: list[str] = []
        self.fail_with: Exception | None = None

    def prepare(self, request: GenerationRequest) -> PreparedRequest:
        if not request.token_ids:
            raise InvalidArgument("prompt is empty: set text or token_ids")
        return PreparedRequest(request=request, prompt_ids=request.token_ids, top_p=1.0)

    def generate(self, prepared, should_stop=lambda: False):
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        self.order.append(prepared.request.request_id)
        try:
            for i in range(prepared.request.max_new_tokens):
                if self.gate is not None:
                    self.gate.wait(5)
                if should_stop():
                    return
                if self.fail_with is not None:
                    raise self.fail_with
                last = i == prepared.request.max_new_tokens - 1
                yield TokenEvent(
                    index=i,
                    token_id=i,
                    text="",
                    latency_s=0.0,
                    cache=TokenStats(),
                    finish_reason=FinishReason.LENGTH if last else None,
                )
        finally:
            self.running -= 1


def request(rid: str, n: int = 3) -> GenerationRequest:
    return GenerationRequest(token_ids=(1, 2), max_new_tokens=n, request_id=rid)


@pytest.fixture
def engine():
    return ScriptedEngine()


@pytest.fixture
def scheduler(engine):
    s = Scheduler(engine, max_queue=2)
    s.start()
    yield s
    if engine.gate is not None:
        engine.gate.set()
    s.stop()


def test_requests_run_one_at_a_time_in_arrival_order(engine, scheduler):
    handles = [scheduler.submit(request(f"r{i}")) for i in range(3)]
    results = [[e.token_id for e in h] for h in handles]
    assert results == [[0, 1, 2]] * 3
    assert engine.order == ["r0", "r1", "r2"]
    assert engine.max_running == 1


def test_concurrent_submitters_are_all_served(engine):
    scheduler = Scheduler(engine, max_queue=8)
    scheduler.start()
    out: dict[int, list[int]] = {}

    def client(i: int) -> None:
        out[i] = [e.token_id for e in scheduler.submit(request(f"c{i}", n=4))]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    scheduler.stop()
    assert out == {i: [0, 1, 2, 3] for i in range(6)}
    assert engine.max_running == 1


def test_a_full_queue_refuses_with_resource_exhausted(engine, scheduler):
    engine.gate = threading.Event()
    running = scheduler.submit(request("running"))
    deadline = time.monotonic() + 5
    while engine.running == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    waiting = [scheduler.submit(request(f"w{i}")) for i in range(2)]
    with pytest.raises(QueueFull, match=r"2 Generate requests already wait \(max_queue 2\)"):
        scheduler.submit(request("one too many"))
    engine.gate.set()
    assert [len(list(h)) for h in (running, *waiting)] == [3, 3, 3]


def test_validation_errors_are_raised_by_submit(scheduler):
    with pytest.raises(InvalidArgument, match="prompt is empty"):
        scheduler.submit(GenerationRequest(max_new_tokens=3))


def test_engine_errors_reach_the_caller(engine, scheduler):
    engine.fail_with = DataLoss("checksum mismatch in L1E3")
    with pytest.raises(DataLoss, match="L1E3"):
        list(scheduler.submit(request("bad")))
    engine.fail_with = None
    assert len(list(scheduler.submit(request("next")))) == 3  # the worker survived


def test_cancel_stops_a_running_request_and_skips_a_waiting_one(engine, scheduler):
    engine.gate = threading.Event()
    running = scheduler.submit(request("running", n=100))
    waiting = scheduler.submit(request("waiting"))
    deadline = time.monotonic() + 5
    while engine.running == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    waiting.cancel()
    running.cancel()
    engine.gate.set()
    with pytest.raises(Cancelled, match="'running' was cancelled"):
        list(running)
    with pytest.raises(Cancelled, match="'waiting' was cancelled before it started"):
        list(waiting)
    assert "waiting" not in engine.order


def test_stop_fails_waiting_and_running_requests_with_unavailable(engine):
    scheduler = Scheduler(engine, max_queue=2)
    scheduler.start()
    engine.gate = threading.Event()
    running = scheduler.submit(request("running", n=100))
    deadline = time.monotonic() + 5
    while engine.running == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    waiting = scheduler.submit(request("waiting"))
    stopper = threading.Thread(target=scheduler.stop)
    stopper.start()
    with pytest.raises(Unavailable, match="shutting down"):
        list(waiting)
    engine.gate.set()
    with pytest.raises(Unavailable, match="'running' was stopped"):
        list(running)
    stopper.join(5)
    with pytest.raises(Unavailable):
        scheduler.submit(request("late"))
