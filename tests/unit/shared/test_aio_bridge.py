"""Synchronous servicers on the asyncio edge (``expertcache.aio_bridge``), on a real socket: the
``grpc.ServicerContext`` they were written for keeps its meaning (callbacks at the call's end,
``is_active``, errors as statuses, request streams), and a call waiting for its request holds no
handler thread."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref

import grpc
import pytest

from bench.hostile import Attack
from expertcache.errors import InvalidArgument, NotFound
from expertcache.grpc_server import build_server, set_serving
from expertcache.transport import TransportLimits
from tests.waiting import wait_for

SERVICE = "test.Bridge"


def _identity(b: bytes) -> bytes:
    return b


class Held:
    """Something a handler holds while it runs (as Generate holds its request)."""


class Servicer:
    def __init__(self) -> None:
        self.ended = threading.Event()
        self.active_after_end: list[bool] = []
        self.started = threading.Event()
        self.held: list[weakref.ref] = []

    def refuse(self, request: bytes, context) -> bytes:
        held = Held()
        self.held.append(weakref.ref(held))
        raise InvalidArgument(f"refused {len(request)} bytes")

    def refuse_stream(self, request: bytes, context):
        yield from ()
        self.refuse(request, context)

    def echo(self, request: bytes, context) -> bytes:
        if request == b"missing":
            raise NotFound("no such thing as 'missing'")
        return request.upper()

    def count(self, request: bytes, context):
        def on_end():
            self.ended.set()

        context.add_callback(on_end)
        self.started.set()
        for i in range(int(request)):
            yield str(i).encode()
        if not self.ended.wait(30):  # a stream that lasts until the client goes
            return
        self.active_after_end.append(context.is_active())

    def total(self, requests, context) -> bytes:
        return str(sum(int(r) for r in requests)).encode()


@pytest.fixture
def server():
    servicer = Servicer()
    handlers = {
        "Echo": grpc.unary_unary_rpc_method_handler(servicer.echo, _identity, _identity),
        "Count": grpc.unary_stream_rpc_method_handler(servicer.count, _identity, _identity),
        "Total": grpc.stream_unary_rpc_method_handler(servicer.total, _identity, _identity),
        "Refuse": grpc.unary_unary_rpc_method_handler(servicer.refuse, _identity, _identity),
        "RefuseStream": grpc.unary_stream_rpc_method_handler(servicer.refuse_stream, _identity, _identity),
    }
    limits = TransportLimits.from_config(None, request_timeout_s=0.5, max_streams_per_address=40)
    srv, port = serve(handlers, limits)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield servicer, channel, port, srv
    channel.close()
    srv.stop(0).wait(10)


def serve(handlers: dict, limits: TransportLimits):
    """A started bridge server of ``handlers`` (SERVICE's methods) on a free port: (server, port)."""
    srv, health = build_server(
        "127.0.0.1:0",
        [lambda s: s.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))],
        [SERVICE],
        max_workers=2,
        limits=limits,
    )
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    set_serving(health, [SERVICE])
    return srv, port


def call(channel, method: str, kind: str = "unary_unary"):
    return getattr(channel, kind)(
        f"/{SERVICE}/{method}", request_serializer=_identity, response_deserializer=_identity
    )


def test_unary_calls_and_domain_errors_as_statuses(server):
    _servicer, channel, _port, _srv = server
    assert call(channel, "Echo")(b"abc", timeout=5) == b"ABC"
    with pytest.raises(grpc.RpcError) as info:
        call(channel, "Echo")(b"missing", timeout=5)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "'missing'" in info.value.details()


@pytest.mark.parametrize(("method", "kind"), [("Refuse", "unary_unary"), ("RefuseStream", "unary_stream")])
def test_a_refused_call_is_freed_as_it_ends_not_by_the_cyclic_collector(server, method, kind):
    """What a refused call held (its request, the handler's frames) goes when the call ends: no
    reference cycle (grpc's AbortError, a traceback through the frames holding the call) keeps it
    until the cyclic garbage collector runs. Refused 1 MB prompts stayed in compute's memory so."""
    servicer, channel, _port, _srv = server
    gc.collect()
    gc.disable()  # what a cycle keeps now stays
    try:
        rpc = call(channel, method, kind)
        with pytest.raises(grpc.RpcError) as info:
            if kind == "unary_stream":
                list(rpc(b"x" * 1000, timeout=30))
            else:
                rpc(b"x" * 1000, timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details() == "refused 1000 bytes"
        (held,) = servicer.held
        wait_for(
            lambda: held() is None, "the call's objects freed without the cyclic collector", timeout_s=30
        )
    finally:
        gc.enable()


class HeldRequest:
    """A request message that can be watched (bytes cannot be weakly referenced)."""

    made: list[weakref.ref] = []

    def __init__(self, data: bytes) -> None:
        self.data = data
        HeldRequest.made.append(weakref.ref(self))


def flood(request: HeldRequest, context):
    for _ in range(1000):  # far more than the client's flow-control window: the writes stall
        yield b"y" * (1 << 20)


def test_a_stalled_stream_cut_by_the_loop_is_freed_as_it_ends(caplog):
    """The loop's own refusals (here a client that reads nothing, cut after
    stream_stall_timeout_s) end the call without grpc's abort, whose error keeps a cycle through
    the call: once the client has read what was sent before the cut and the status, the call has
    ended and its request is gone, with no cyclic collection."""
    handlers = {"Flood": grpc.unary_stream_rpc_method_handler(flood, HeldRequest, _identity)}
    limits = TransportLimits.from_config(None, request_timeout_s=5.0, stream_stall_timeout_s=0.5)
    srv, port = serve(handlers, limits)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    HeldRequest.made.clear()
    gc.collect()
    gc.disable()  # what a cycle keeps now stays
    try:
        responses = call(channel, "Flood", "unary_stream")(b"x" * 1000, timeout=60)
        wait_for(lambda: len(HeldRequest.made) == 1, "the request reached the server", timeout_s=30)
        (held,) = HeldRequest.made
        wait_for(
            lambda: any("stream_stall_timeout_s" in r.getMessage() for r in caplog.records),
            "the stalled stream cut",
            timeout_s=30,
        )
        with pytest.raises(grpc.RpcError) as info:
            for _ in responses:  # what was sent before the cut, then the status
                pass
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "stream_stall_timeout_s" in info.value.details()
        wait_for(
            lambda: held() is None, "the cut call's request freed without the cyclic collector", timeout_s=30
        )
    finally:
        gc.enable()
        channel.close()
        srv.stop(0).wait(10)


def test_request_streams_reach_the_handler_whole(server):
    _servicer, channel, _port, _srv = server
    assert call(channel, "Total", "stream_unary")(iter([b"1", b"2", b"39"]), timeout=5) == b"42"


def test_a_client_cancel_runs_the_callbacks_and_ends_the_handler(server):
    servicer, channel, _port, _srv = server
    responses = call(channel, "Count", "unary_stream")(b"3", timeout=30)
    assert [next(responses) for _ in range(3)] == [b"0", b"1", b"2"]
    responses.cancel()
    assert servicer.ended.wait(5)
    deadline = time.monotonic() + 5
    while not servicer.active_after_end and time.monotonic() < deadline:
        time.sleep(0.01)
    assert servicer.active_after_end == [False]


def test_calls_waiting_for_their_request_hold_no_handler_thread(server):
    _servicer, channel, port, _srv = server
    # 30 header-only calls against 2 handler threads: the unary call still runs at once, and
    # each of them ends with DEADLINE_EXCEEDED after the 0.5 s request timeout.
    attack = Attack("127.0.0.1", port, f"/{SERVICE}/Echo", connections=3, streams=10).start()
    try:
        assert attack.wait_held(30) == 30
        start = time.monotonic()
        assert call(channel, "Echo")(b"x", timeout=5) == b"X"
        assert time.monotonic() - start < 1.0
        deadline = time.monotonic() + 10
        while attack.tally().statuses.get("4", 0) < 30 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert attack.tally().statuses.get("4", 0) >= 30
    finally:
        attack.stop()


def test_stopping_the_server_ends_open_streams(server):
    servicer, channel, _port, srv = server
    responses = call(channel, "Count", "unary_stream")(b"1", timeout=30)
    assert next(responses) == b"0"
    assert srv.stop(0.1).wait(10)
    assert servicer.ended.wait(5)
    with pytest.raises(grpc.RpcError):
        next(responses)


def test_the_stall_bound_is_per_write_with_one_timer_for_the_stream():
    # _WriteWatch: writes each shorter than the bound never stall, however long the stream; a
    # write longer than it calls on_stall once, at the bound, and is reported when it ends.
    from expertcache.aio_bridge import _WriteWatch

    async def scenario():
        loop = asyncio.get_running_loop()
        stalls = []
        watch = _WriteWatch(loop, 0.05, lambda: stalls.append(loop.time()))
        for _ in range(8):  # 8 x 20 ms of writing, 160 ms in all: no stall
            watch.writing()
            await asyncio.sleep(0.02)
            assert not watch.written()
        await asyncio.sleep(0.08)  # idle past the bound: no stall either
        assert stalls == []
        watch.writing()
        began = loop.time()
        await asyncio.sleep(0.12)
        assert watch.written() and len(stalls) == 1 and stalls[0] - began >= 0.05
        watch.close()

    asyncio.run(scenario())
