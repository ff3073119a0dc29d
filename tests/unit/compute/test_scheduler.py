"""Continuous batching on the real engine (tiny models, in-process experts): requests batched
together each get exactly what they would get alone, join and leave mid-way, and the limits, the
cancellations, the deadlines and the daemon's loss behave as the scheduler promises."""

from __future__ import annotations

import threading
import time

import pytest

from compute_svc.engine.requests import GenerationRequest
from compute_svc.engine.sampling import SamplingParams
from compute_svc.engine.scheduler import BatchLimits, Scheduler
from compute_svc.errors import Cancelled, DaemonUnavailable, DeadlineExceeded, QueueFull, Unavailable
from devtools.tiny import SUPPORTED_ARCHS
from tests.threads import run_in_threads

PROMPTS = [tuple(range(5, 5 + n)) for n in (3, 17, 9, 26)]


def request(i: int, n: int = 6, **kw) -> GenerationRequest:
    return GenerationRequest(
        token_ids=PROMPTS[i % len(PROMPTS)], max_new_tokens=n, ignore_eos=True, request_id=f"r{i}", **kw
    )


def alone(engine, req: GenerationRequest) -> list[int]:
    return [e.token_id for e in engine.generate(engine.requests.prepare(req))]


class StepLog:
    """Wraps ``engine.step`` to record every plan (request ids and tokens fed) it runs."""

    def __init__(self, engine) -> None:
        self.plans: list[list[tuple[str, int]]] = []
        self._step = engine.step
        self.gate: threading.Event | None = None  # when set: each step waits for it
        self.pace_s = 0.0  # each step takes at least this long (a tiny model's step is a few ms)
        engine.step = self

    def __call__(self, plan, **kwargs):
        self.plans.append([(seq.prepared.request_id, n) for seq, n in plan])
        if self.gate is not None:
            self.gate.wait(10)
        if self.pace_s:
            time.sleep(self.pace_s)
        return self._step(plan, **kwargs)


@pytest.fixture
def batching(local_engine):
    started = []

    def make(arch="mixtral", limits=None, **kw):
        engine, provider, tiny = local_engine(arch)
        log = StepLog(engine)
        scheduler = Scheduler(
            engine, limits=limits or BatchLimits(max_batch_size=4, max_batched_tokens=16), **kw
        )
        scheduler.start()
        started.append((scheduler, engine, log))
        return scheduler, engine, provider, log

    yield make
    for scheduler, engine, log in started:
        scheduler.stop()
        engine.step = log._step  # the engine is shared by the session: unwrap it


def collect(handles) -> dict[str, list[int]]:
    out = {}
    threads = []

    def drain(h):
        out[h.request_id] = [e.token_id for e in h]

    for h in handles:
        t = threading.Thread(target=drain, args=(h,))
        t.start()
        threads.append(t)
    for t in threads:
        t.join(60)
    return out


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
def test_batched_requests_equal_each_request_alone(arch, batching):
    scheduler, engine, provider, log = batching(arch)
    reqs = [request(i, n=4 + i) for i in range(4)]
    want = {r.request_id: alone(engine, r) for r in reqs}
    log.plans.clear()
    log.gate = threading.Event()
    handles = [scheduler.submit(reqs[0]), scheduler.submit(reqs[1])]
    log.gate.set()
    # The others join while the first ones run; they all leave at different steps.
    while len(log.plans) < 3:
        time.sleep(0.01)
    handles += [scheduler.submit(reqs[2]), scheduler.submit(reqs[3])]
    got = collect(handles)
    assert got == want
    sizes = [len(p) for p in log.plans]
    assert max(sizes) > 1, "requests were never batched"
    assert all(sum(n for _, n in p) <= 16 for p in log.plans)  # max_batched_tokens
    assert all(len(p) <= 4 for p in log.plans)  # max_batch_size
    assert any(n > 1 for p in log.plans for _, n in p) and any(
        n < len(PROMPTS[3]) for p in log.plans for rid, n in p if rid == "r3"
    ), "the 26-token prompt should be fed in chunks"
    assert all(not n for n in provider.pins.values())


def test_seeded_sampling_is_the_same_batched_or_alone(batching):
    scheduler, engine, _, _ = batching()
    reqs = [
        request(i, n=8, sampling=SamplingParams(temperature=1.3, top_k=50, seed=100 + i)) for i in range(3)
    ]
    want = {r.request_id: alone(engine, r) for r in reqs}
    assert collect([scheduler.submit(r) for r in reqs]) == want


def test_a_long_prompt_is_chunked_and_does_not_hold_back_the_others(batching):
    scheduler, engine, _, log = batching(limits=BatchLimits(max_batch_size=4, max_batched_tokens=8))
    short = scheduler.submit(
        GenerationRequest(token_ids=PROMPTS[0], max_new_tokens=60, ignore_eos=True, request_id="r0")
    )
    stream = iter(short)
    next(stream)  # the short one decodes
    log.plans.clear()
    long_req = GenerationRequest(
        token_ids=tuple(range(3, 60)), max_new_tokens=2, ignore_eos=True, request_id="long"
    )
    assert len(collect([scheduler.submit(long_req)])["long"]) == 2
    short.cancel()
    # The 57-token prompt was fed 7 tokens at a time (8 minus the short request's decode token),
    # and the short request decoded a token in every one of those steps.
    prefill = [p for p in log.plans if any(rid == "long" for rid, _ in p)][:9]  # ceil(57 / 7) steps
    assert [n for p in prefill for rid, n in p if rid == "long"] == [7] * 8 + [1]
    assert all(("r0", 1) in p and sum(n for _, n in p) <= 8 for p in prefill)


def test_a_token_reaches_its_reader_when_the_next_step_reaches_its_layers(batching):
    """The worker holds a step's tokens back until the next step's layers begin (where it lets go
    of the GIL for long), and hands a request's last token over at once."""
    scheduler, engine, _, log = batching()
    timeline: list[str] = []
    real = log._step

    def step(plan, *, before_layers=None, **kwargs):
        def layers():
            timeline.append(f"layers {len(log.plans) - 1}")
            before_layers()

        return real(plan, before_layers=layers if before_layers is not None else None, **kwargs)

    log._step = step
    log.gate = threading.Event()  # no step runs before the reader's queue is watched
    handle = scheduler.submit(request(0, n=4))
    put = handle._events.put
    handle._events.put = lambda item: (
        timeline.append(f"token {item.index}" if hasattr(item, "index") else "end"),
        put(item),
    )
    log.gate.set()
    assert [e.index for e in handle] == [0, 1, 2, 3]
    assert timeline == [
        "layers 0",
        "layers 1",
        "token 0",
        "layers 2",
        "token 1",
        "layers 3",
        "token 2",
        "token 3",
        "end",
    ], timeline


def test_cancelling_one_request_leaves_the_others_untouched(batching):
    scheduler, engine, provider, log = batching()
    reqs = [request(i, n=10) for i in range(3)]
    want = {r.request_id: alone(engine, r) for r in reqs}
    log.gate = threading.Event()
    handles = [scheduler.submit(r) for r in reqs]
    log.gate.set()
    victim = handles[1]
    it = iter(victim)
    next(it)
    victim.cancel()
    with pytest.raises(Cancelled, match="'r1' was cancelled"):
        list(it)
    got = collect([handles[0], handles[2]])
    assert got == {"r0": want["r0"], "r2": want["r2"]}
    assert all(not n for n in provider.pins.values())


def test_a_deadline_stops_a_request_within_a_step(batching):
    scheduler, engine, _, log = batching(limits=BatchLimits(max_batch_size=4, max_batched_tokens=4))
    keeps = scheduler.submit(request(0, n=6))
    log.gate = threading.Event()
    # ~50 steps of prefill at 4 tokens a step: paced at 20 ms they take ~1 s, well past the
    # deadline however fast the machine (unpaced, a quiet one finished them within it).
    log.pace_s = 0.02
    late = scheduler.submit(
        GenerationRequest(
            token_ids=tuple(range(3, 200)),
            max_new_tokens=4,
            request_id="late",
            deadline=time.monotonic() + 0.3,
        )
    )
    log.gate.set()
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="'late' passed its deadline"):
        list(late)
    assert time.monotonic() - started < 5  # not the ~50 steps its prefill would take
    assert len(list(keeps)) == 6
    expired = scheduler.submit(
        GenerationRequest(token_ids=(1, 2), max_new_tokens=2, deadline=time.monotonic() - 1)
    )
    with pytest.raises(DeadlineExceeded, match="before it started"):
        list(expired)


def test_more_clients_than_the_limits_complete_or_are_refused(batching):
    limits = BatchLimits(max_batch_size=2, max_batched_tokens=8, max_waiting_requests=3, max_cache_tokens=40)
    scheduler, engine, provider, log = batching(limits=limits)
    outcomes: dict[int, str] = {}

    def client(i):
        try:
            n = len(list(scheduler.submit(request(i, n=3))))
            outcomes[i] = "ok" if n == 3 else f"short {n}"
        except QueueFull as exc:
            assert "retry later" in str(exc)
            outcomes[i] = "refused"

    threads = run_in_threads(client, range(24), timeout_s=60)
    assert not any(t.is_alive() for t in threads), "deadlock"
    assert set(outcomes.values()) <= {"ok", "refused"} and len(outcomes) == 24
    assert "ok" in outcomes.values()
    assert all(not n for n in provider.pins.values())
    assert all(len(p) <= 2 for p in log.plans)
    # The KV budget (prompt + new tokens of running requests <= 40) held: r3's 26 + 3 never ran with r1's 17 + 3.
    assert not any({"r1", "r3"} <= {rid for rid, _ in p} for p in log.plans)
    assert scheduler._running == [] and not scheduler._waiting  # every request's state is gone


def test_one_client_holds_its_share_and_another_passes_its_waiting_requests(batching):
    """max_client_share 0.5 of a batch of 4 and a queue of 4: client A holds 2 running + 2
    waiting, its fifth request is refused naming the share, and client B's request, behind A's
    waiting ones, runs at once in the places A may not take."""
    limits = BatchLimits(
        max_batch_size=4, max_batched_tokens=16, max_waiting_requests=4, max_client_share=0.5
    )
    assert limits.client_places() == (2, 2)
    scheduler, engine, provider, log = batching(limits=limits)
    log.gate = threading.Event()  # steps wait: nothing finishes while the test looks
    a = [scheduler.submit(request(i, n=3), client="10.0.0.1") for i in range(4)]
    with pytest.raises(QueueFull, match="max_client_share 0.5: 2 running \\+ 2 waiting"):
        scheduler.submit(request(9, n=3), client="10.0.0.1")
    b = scheduler.submit(request(5, n=3), client="10.0.0.2")
    in_process = scheduler.submit(request(6, n=3))  # not counted: no client
    deadline = time.monotonic() + 10
    while len(scheduler._running) < 4 and time.monotonic() < deadline:
        log.gate.set()
        log.gate.clear()
        time.sleep(0.01)
    running = {h.request_id for h in scheduler._running}
    assert running == {"r0", "r1", "r5", "r6"}, running  # B and the in-process one passed r2, r3
    log.gate.set()
    log.gate = None
    results = collect([*a, b, in_process])
    assert all(len(tokens) == 3 for tokens in results.values()), results
    assert scheduler._held == {}  # every request gave its place back
    # A's places are free again: it may submit as much as before.
    assert len(list(scheduler.submit(request(7, n=2), client="10.0.0.1"))) == 2


def test_a_client_share_of_1_bounds_nothing_beyond_the_batch_and_queue():
    assert BatchLimits(max_batch_size=16, max_waiting_requests=64, max_client_share=1.0).client_places() == (
        16,
        64,
    )
    assert BatchLimits(max_batch_size=1, max_waiting_requests=0, max_client_share=0.01).client_places() == (
        1,
        0,
    )


def test_validation_errors_are_raised_by_submit(batching):
    scheduler, *_ = batching()
    from compute_svc.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="prompt is empty"):
        scheduler.submit(GenerationRequest(max_new_tokens=3))


def test_losing_the_daemon_fails_the_step_then_recovers(batching):
    recovered = threading.Event()
    serving: list[bool] = []
    attempts = []

    def recover():
        attempts.append(time.monotonic())
        if len(attempts) < 3:
            raise DaemonUnavailable("not back yet")
        recovered.set()

    scheduler, engine, provider, log = batching(
        recover=recover, on_serving=lambda ok, why: serving.append(ok)
    )
    original = provider.acquire_batches
    broken = {"on": True}

    def acquire_batches(layer, experts, deadline=None, trace_context=None):
        if broken.pop("on", False):
            raise DaemonUnavailable("cache daemon at unix:///x: the Demand stream broke")
        return original(layer, experts, deadline, trace_context)

    provider.acquire_batches = acquire_batches
    try:
        with pytest.raises(Unavailable, match="the Demand stream broke"):
            list(scheduler.submit(request(0)))
        assert recovered.wait(10) and len(attempts) == 3
        while not scheduler.serving:
            time.sleep(0.01)
        assert serving == [False, True]
        assert len(list(scheduler.submit(request(1, n=3)))) == 3  # serving again, no restart
    finally:
        provider.acquire_batches = original


def test_stop_fails_waiting_and_running_requests_with_unavailable(batching):
    scheduler, engine, _, log = batching(limits=BatchLimits(max_batch_size=1, max_batched_tokens=8))
    log.gate = threading.Event()
    running = scheduler.submit(request(0, n=50))
    waiting = scheduler.submit(request(1))
    stopper = threading.Thread(target=scheduler.stop)
    stopper.start()
    time.sleep(0.1)
    log.gate.set()
    stopper.join(30)
    for handle in (running, waiting):
        with pytest.raises(Unavailable, match="shutting down"):
            list(handle)
    with pytest.raises(Unavailable, match="shutting down"):
        scheduler.submit(request(2))


def test_drain_refuses_new_requests_and_lets_running_and_waiting_ones_finish(batching):
    scheduler, engine, _, log = batching(limits=BatchLimits(max_batch_size=1, max_batched_tokens=8))
    log.gate = threading.Event()  # holds the first step until the drain has begun
    running = scheduler.submit(request(0, n=8))
    waiting = scheduler.submit(request(1, n=4))
    result: list[bool] = []
    drainer = threading.Thread(target=lambda: result.append(scheduler.drain(60)))
    drainer.start()
    with scheduler._cond:  # the drain has begun once new requests are refused
        scheduler._cond.wait_for(lambda: scheduler._draining, timeout=10)
    assert not scheduler.serving
    with pytest.raises(Unavailable, match="shutting down: retry on another replica"):
        scheduler.submit(request(2))
    log.gate.set()
    drainer.join(60)
    assert result == [True]
    assert [e.token_id for e in running] == alone(engine, request(0, n=8))
    assert [e.token_id for e in waiting] == alone(engine, request(1, n=4))
    scheduler.stop()


def test_drain_gives_up_after_its_timeout_and_stop_ends_the_rest(batching):
    scheduler, _, _, log = batching(limits=BatchLimits(max_batch_size=1, max_batched_tokens=8))
    log.gate = threading.Event()  # never set: the running request cannot finish
    running = scheduler.submit(request(0, n=50))
    started = time.monotonic()
    assert scheduler.drain(0.3) is False
    assert 0.3 <= time.monotonic() - started < 5
    stopper = threading.Thread(target=scheduler.stop)
    stopper.start()
    log.gate.set()
    stopper.join(30)
    with pytest.raises(Unavailable, match="shutting down"):
        list(running)


@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss"])
def test_bf16_batched_logprobs_stay_within_tolerance_of_alone(arch, local_engine):
    # bf16: batching changes the shapes of the dense and expert GEMMs, so results may differ in the
    # last bits; the chosen tokens' log-probabilities stay within 0.05 (stated tolerance).
    import torch

    engine, _, _ = local_engine(arch, dtype=torch.bfloat16)
    reqs = [request(i, n=6, logprobs=True) for i in range(3)]
    alone_events = {r.request_id: list(engine.generate(engine.requests.prepare(r))) for r in reqs}
    seqs = [engine.start(engine.requests.prepare(r)) for r in reqs]
    batched: dict[str, list] = {s.routing_id: [] for s in seqs}
    while any(not s.done for s in seqs):
        plan = [(s, len(s.pending)) for s in seqs if not s.done]
        for seq, event in engine.step(plan):
            batched[seq.routing_id].append(event)
    for s in seqs:
        engine.finish(s, "length")
    for rid, events in alone_events.items():
        ours = batched[rid]
        n = next(
            (i for i, (a, b) in enumerate(zip(events, ours, strict=True)) if a.token_id != b.token_id),
            len(events),
        )
        assert n >= 1, f"{rid}: the first token already differs"
        for a, b in zip(events[:n], ours[:n], strict=True):
            assert abs(a.logprob - b.logprob) <= 0.05, (rid, a.logprob, b.logprob)


def test_a_short_prompt_behind_a_long_one_is_not_held_for_its_whole_prefill(batching):
    scheduler, engine, _, log = batching(limits=BatchLimits(max_batch_size=4, max_batched_tokens=8))
    log.gate = threading.Event()
    long_handle = scheduler.submit(
        GenerationRequest(token_ids=tuple(range(3, 60)), max_new_tokens=2, ignore_eos=True, request_id="long")
    )
    log.gate.set()
    while not log.plans:
        time.sleep(0.005)
    short = scheduler.submit(GenerationRequest(token_ids=(1, 2, 3), max_new_tokens=1, request_id="short"))
    assert len(list(short)) == 1
    collect([long_handle])
    steps_with_long = [i for i, p in enumerate(log.plans) if any(rid == "long" for rid, _ in p)]
    short_step = next(i for i, p in enumerate(log.plans) if ("short", 3) in p)
    # The short prompt went in whole at its first step, ahead of the long prompt's remaining chunks.
    assert short_step < steps_with_long[7]
    assert [rid for rid, _ in log.plans[short_step]][0] == "short"


class StuckDaemon:
    """Stands in for the daemon client waiting on a daemon that delivers nothing: each acquire
    waits until ``interrupt`` (up to 30 s), then raises the client's ``Cancelled``. As the client
    does, a step's first acquire forgets interrupts that came before it (``begin_step``);
    ``hold_begin`` keeps that moment back until it is set."""

    def __init__(self, provider) -> None:
        self.provider, self.original = provider, provider.acquire_batches
        self.interrupted = False
        self.interrupts = 0
        self.entered = threading.Event()
        self.hold_begin = threading.Event()
        self.hold_begin.set()
        provider.acquire_batches = self.acquire_batches

    def interrupt(self) -> None:
        self.interrupts += 1
        self.interrupted = True

    def acquire_batches(self, layer, experts, deadline=None, trace_context=None):
        self.entered.set()
        self.hold_begin.wait(10)
        self.interrupted = False
        give_up = time.monotonic() + 30
        while not self.interrupted:
            if time.monotonic() > give_up:
                raise DeadlineExceeded(f"no interrupt came while waiting for experts of layer {layer}")
            time.sleep(0.002)
        raise Cancelled(
            f"the requests of this step were all cancelled while it waited for experts of layer {layer}"
        )

    def restore(self) -> None:
        self.provider.acquire_batches = self.original


def test_a_drain_cut_off_inside_a_wait_for_experts_ends_unavailable_with_a_retry_hint(batching):
    daemon = None
    scheduler, _, provider, _ = batching(
        limits=BatchLimits(max_batch_size=2, max_batched_tokens=8), interrupt=lambda: daemon.interrupt()
    )
    daemon = StuckDaemon(provider)
    try:
        handles = [scheduler.submit(request(0, n=50)), scheduler.submit(request(1, n=50))]
        assert daemon.entered.wait(10)
        assert scheduler.drain(0.2) is False  # the step never gets its experts
        scheduler.stop()
        for handle in handles:
            # Not CANCELLED: the client did not go away, the service stopped it.
            with pytest.raises(Unavailable, match="shutting down .*; retry on another replica"):
                list(handle)
    finally:
        daemon.restore()


def test_stop_interrupts_a_step_that_began_after_its_first_interrupt(batching):
    daemon = None
    scheduler, _, provider, _ = batching(interrupt=lambda: daemon.interrupt())
    daemon = StuckDaemon(provider)
    daemon.hold_begin.clear()
    try:
        handle = scheduler.submit(request(0, n=50))
        assert daemon.entered.wait(10)
        stopper = threading.Thread(target=scheduler.stop)
        stopper.start()
        while not daemon.interrupts:  # stop's first interrupt comes before the step's wait begins
            time.sleep(0.001)
        daemon.hold_begin.set()
        stopper.join(5)
        assert not stopper.is_alive(), "stop waited for a step that forgot its interrupt"
        with pytest.raises(Unavailable, match="retry on another replica"):
            list(handle)
    finally:
        daemon.restore()
