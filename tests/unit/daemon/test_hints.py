"""HintBoard semantics, and HintSubscriber against a real gRPC Predictor servicer on a real socket."""

from __future__ import annotations

import functools
import queue
import threading
import time
from concurrent import futures

import grpc
import pytest
from moe.predictor.v1 import predictor_pb2, predictor_pb2_grpc

from cache_daemon.hints import Hint, HintBatch, HintBoard, HintSubscriber
from devtools.launch import free_port
from tests import waiting


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def batch(request_id: str, *hints: tuple[int, int, float], done: bool = False) -> HintBatch:
    return HintBatch(request_id, tuple(Hint(*h) for h in hints), request_done=done)


def test_a_newer_batch_replaces_only_the_layers_it_names():
    # The worked example of the module docstring.
    board = HintBoard()
    board.apply(batch("r1", (0, 5, 0.9), (1, 2, 0.8)))
    board.apply(batch("r1", (1, 7, 0.6), (1, 3, 0.7)))
    assert board.snapshot() == {"r1": {0: ((5, 0.9),), 1: ((3, 0.7), (7, 0.6))}}
    stats = board.stats()
    assert (stats.batches, stats.hints, stats.replaced, stats.dropped, stats.requests) == (2, 4, 1, 0, 1)


def test_quiet_requests_go_stale_and_done_ones_are_forgotten():
    clock = Clock()
    board = HintBoard(stale_after_s=10.0, clock=clock)
    board.apply(batch("old", (0, 1, 0.5)))
    clock.now += 6
    board.apply(batch("new", (0, 2, 0.5)))
    clock.now += 5  # "old" quiet for 11 s, "new" for 5 s
    assert set(board.snapshot()) == {"new"}
    assert board.stats().dropped == 1
    board.apply(batch("new", done=True))
    assert board.snapshot() == {}
    assert board.stats().dropped == 1  # a finished request is not a drop


def test_the_board_is_bounded_least_recently_updated_first():
    board = HintBoard(max_requests=2)
    board.apply(batch("a", (0, 1, 0.1)))
    board.apply(batch("b", (0, 2, 0.2)))
    board.apply(batch("a", (1, 1, 0.1)))  # "a" is now the most recently updated
    board.apply(batch("c", (0, 3, 0.3)))
    assert set(board.snapshot()) == {"a", "c"}
    assert board.stats().dropped == 1


def test_every_batch_is_pushed_to_the_consumer_after_it_is_applied():
    got = []
    board = HintBoard(
        on_batch=lambda b: got.append((b.request_id, dict(board.snapshot().get(b.request_id, {}))))
    )
    board.apply(batch("a", (0, 1, 0.4)))
    board.apply(batch("a", done=True))
    assert got == [("a", {0: ((1, 0.4),)}), ("a", {})]  # the board was up to date at each push

    def broken(_batch):
        raise RuntimeError("consumer bug")

    resilient = HintBoard(on_batch=broken)
    resilient.apply(batch("b", (0, 2, 0.5)))  # logged, the board keeps working
    assert resilient.stats().batches == 1


def test_bad_bound_is_named():
    with pytest.raises(ValueError, match="max_requests must be >= 1, got 0"):
        HintBoard(max_requests=0)


class HintSource(predictor_pb2_grpc.PredictorServicer):
    """Streams the batches put on ``outbox`` to each subscriber; records subscriptions."""

    def __init__(self) -> None:
        self.outbox: queue.Queue = queue.Queue()
        self.subscriptions: list[tuple[str, str]] = []

    def SubscribeHints(self, request, context):  # noqa: N802 - gRPC method name
        self.subscriptions.append((request.model_id, request.pod))
        while context.is_active():
            try:
                item = self.outbox.get(timeout=0.1)
            except queue.Empty:
                continue
            yield item


def serve(servicer, port: int) -> grpc.Server:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    predictor_pb2_grpc.add_PredictorServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server


wait_for = functools.partial(waiting.wait_for, timeout_s=15.0, poll_s=0.02)


def pb_batch(request_id: str, *hints: tuple[int, int, float], done: bool = False) -> predictor_pb2.HintBatch:
    return predictor_pb2.HintBatch(
        request_id=request_id,
        hints=[predictor_pb2.Hint(moe_layer=la, expert=e, score=s) for la, e, s in hints],
        request_done=done,
    )


def test_subscriber_fills_the_board_and_reconnects_after_a_restart():
    port = free_port()
    source = HintSource()
    server = serve(source, port)
    board = HintBoard()
    subscriber = HintSubscriber(f"127.0.0.1:{port}", "model-x", "pod-a", board)
    try:
        source.outbox.put(pb_batch("r1", (0, 3, 0.75), (2, 1, 0.5)))
        wait_for(lambda: board.stats().batches == 1)
        assert source.subscriptions == [("model-x", "pod-a")]
        assert board.snapshot() == {"r1": {0: ((3, 0.75),), 2: ((1, 0.5),)}}
        assert board.stats().subscribed
        server.stop(0).wait()
        wait_for(lambda: not board.stats().subscribed)
        assert subscriber.outages == 1

        restarted = HintSource()
        server = serve(restarted, port)
        restarted.outbox.put(pb_batch("r1", (0, 4, 0.25)))
        wait_for(lambda: board.stats().batches == 2)
        assert board.snapshot()["r1"][0] == ((4, 0.25),)  # the newer batch replaced layer 0
        restarted.outbox.put(pb_batch("r1", done=True))
        wait_for(lambda: board.stats().requests == 0)
        assert subscriber.outages == 1
    finally:
        subscriber.close()
        server.stop(0)


def test_an_absent_predictor_leaves_the_board_empty_and_close_is_prompt():
    board = HintBoard()
    subscriber = HintSubscriber(f"127.0.0.1:{free_port()}", "m", "p", board)
    time.sleep(0.3)
    assert board.stats().batches == 0 and not board.stats().subscribed
    started = time.monotonic()
    closer = threading.Thread(target=subscriber.close)
    closer.start()
    closer.join(10)
    assert not closer.is_alive()
    assert time.monotonic() - started < 5
