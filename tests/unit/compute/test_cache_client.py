"""DaemonClient against a real gRPC server on a unix socket serving a scripted ExpertCache."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from concurrent import futures

import grpc
import pytest
from moe.cache.v1 import cache_pb2, cache_pb2_grpc

from compute_svc.daemon import client as daemon_client
from compute_svc.daemon.client import DaemonClient
from compute_svc.errors import (
    Cancelled,
    DaemonUnavailable,
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
)
from compute_svc.experts.arena import ArenaKind
from compute_svc.experts.layer_ahead import Prediction
from compute_svc.experts.moe import ReadyExpert, SpanSignals
from expertcache import memfd, native
from expertcache import protocol as codes
from expertcache.handoff import HANDOFF_TOKEN_BYTES, Grant, HandoffServer
from expertcache.native import SlotTable, TableState
from expertcache.protocol import Tier
from tests.slot_tables import ChannelServer
from tests.stores import two_layer_manifest

MANIFEST = two_layer_manifest(
    [("gate_up_proj", "float32", (8, 4)), ("down_proj", "float32", (4, 4))],
    model_id="test-model",
    checksums={0: (0, 0, 0, 0), 1: (0, 0, 0, 0)},
)
BLOB = MANIFEST.blob_bytes


class ChannelResponder(ChannelServer):
    """The daemon's side of a client channel, scripted like ``ScriptedCache``'s Acquires: signals
    are recorded as the stream's would be; a demand pins every expert into the client's ledger
    (RESIDENT ones as they are, the others loaded into a free slot), is answered, and then its
    loads land in reverse order (source STORE)."""

    def __init__(self, servicer: ScriptedCache, table: SlotTable, client: int) -> None:
        self.servicer = servicer
        self.requests: dict[int, str] = {}
        super().__init__(table, client)

    def records(self, records: list) -> None:
        for record in records:
            kind, handle = record[0], record[1]
            if kind == "begin":
                self.requests[handle] = record[2].decode()
                self.servicer.signals.append(("request_begin", self.requests[handle]))
            elif kind == "end":
                self.servicer.signals.append(("request_end", self.requests.pop(handle)))
            elif kind == "route":
                _, _, token, layer, experts = record
                self.servicer.signals.append(("route", self.requests[handle], token, layer, experts.tolist()))
            else:
                _, _, token, preds = record
                preds = [
                    (lay, dep, ex.tolist(), [round(float(x), 3) for x in sc]) for lay, dep, ex, sc in preds
                ]
                self.servicer.signals.append(("layer_ahead", self.requests[handle], token, preds))
            self.servicer.got_signal.set()

    def serve(self, seq: int, layer: int, experts: list[int], trace: bytes = b"") -> None:
        servicer, table, channel = self.servicer, self.table, self.channel
        servicer.acquired.append((layer, list(experts)))
        if servicer.fail_next is not None:
            code, message = servicer.fail_next
            servicer.fail_next = None
            channel.reply(seq, codes.status_of(code.name), message)
            return
        if servicer.hang_next:
            servicer.hang_next = False
            return  # never answered
        if servicer.hold is not None:
            servicer.hold.wait(10)
        epoch = table.client_epoch(self.client)
        loads = []
        for i, expert in enumerate(experts):
            entry = layer * MANIFEST.num_experts + expert
            if table.state(entry) != TableState.RESIDENT:
                used = {slot for slot in table.slots() if slot >= 0}
                table.begin_load(entry, min(set(range(table.num_slots)) - used))
                loads.append((i, entry))
            else:
                channel.set_source(i, codes.SOURCE_DEVICE)
            assert table.hold_for_client(self.client, epoch, entry)
        channel.reply(seq, codes.STATUS_OK, "")
        for i, entry in reversed(loads):
            if servicer.fail_load is not None:
                table.unhold_for_client(self.client, epoch, entry)
                channel.fail(codes.status_of("DATA_LOSS"), servicer.fail_load)
                table.abort_load(entry)
                servicer.fail_load = None
                continue
            table.finish_load(entry)
            channel.set_source(i, codes.SOURCE_STORE)
            channel.notify()


class ScriptedCache(cache_pb2_grpc.ExpertCacheServicer):
    """Answers each Acquire with its experts in reverse order (expert 3 is 'resident'); with a
    slot table offered, serves each client's channel (``ChannelResponder``) while its stream lives."""

    def __init__(self) -> None:
        self.released: list[tuple[int, int]] = []
        self.streams = 0
        self.fail_next: tuple[grpc.StatusCode, str] | None = None
        self.hang_next = False
        self.stream_closed = threading.Event()
        self.daemon_id = "d1"
        self.table: SlotTable | None = None  # a shared slot table offered at Attach (fast path), if set
        self.handoff: HandoffServer | None = None  # hands each client the arena, the table and its region
        self.tokens: dict[bytes, int] = {}  # handoff token -> client ledger (-1: the arena alone)
        # The arena: a sealed memfd, as the daemon's (never written here: compute only maps it).
        self.arena_fd = memfd.create("scripted-arena", 2 * BLOB)
        memfd.seal(self.arena_fd)
        self.attaches: list[bool] = []  # shm_fast_path of each Attach
        self.acquired: list[tuple[int, list[int]]] = []  # every Acquire received
        self.metadata: list[dict[str, str]] = []  # of each Demand call
        self.signals: list[tuple] = []  # one-way prediction messages, in arrival order
        self.got_signal = threading.Event()
        self.hold: threading.Event | None = None  # when set: answer acquires only once it is set
        self.fail_load: str | None = None  # the next load of a channel demand fails with this message
        self.responders: list[ChannelResponder] = []
        self.model_id = MANIFEST.model_id

    def Attach(self, request, context):  # noqa: N802
        self.attaches.append(request.shm_fast_path)
        offer = self.table is not None and request.shm_fast_path
        index, epoch = -1, 0
        if offer:
            index = len(self.attaches) - 1
            epoch = self.table.claim_channel(index)
        token = os.urandom(HANDOFF_TOKEN_BYTES)
        self.tokens[token] = index
        return cache_pb2.AttachResponse(
            client_index=index,
            client_epoch=epoch,
            handoff_socket=self.handoff.path if self.handoff is not None else "",
            handoff_token=token,
            arena=cache_pb2.ArenaHandle(kind=cache_pb2.ARENA_KIND_MEMFD, size_bytes=2 * BLOB),
            num_slots=2,
            slot_bytes=BLOB,
            manifest_json=dataclasses.replace(MANIFEST, model_id=self.model_id).to_json(),
            daemon_id=self.daemon_id,
        )

    def grant(self, token: bytes, peer_pid: int) -> Grant:
        """The handoff: the arena, and with a ledger the table (read-only for the client) and the
        ledger's region."""
        index = self.tokens.pop(token, None)
        if index is None:
            raise FailedPrecondition("unknown handoff token")
        if index < 0:
            return Grant(payload=json.dumps({"descriptors": ["arena"]}).encode(), fds=[os.dup(self.arena_fd)])
        payload = {
            "descriptors": ["arena", "table", "region"],
            "client_index": index,
            "client_epoch": self.table.client_epoch(index),
        }
        fds = [os.dup(self.arena_fd), self.table.table_fd(), self.table.client_fd(index)]
        return Grant(payload=json.dumps(payload).encode(), fds=fds)

    def Demand(self, request_iterator, context):  # noqa: N802
        self.streams += 1
        metadata = dict(context.invocation_metadata())
        self.metadata.append(metadata)
        context.add_callback(self.stream_closed.set)
        if self.table is not None and "expertcache-client-index" in metadata:
            responder = ChannelResponder(self, self.table, int(metadata["expertcache-client-index"]))
            self.responders.append(responder)
            context.add_callback(responder.stop)
        for req in request_iterator:
            kind = req.WhichOneof("kind")
            if kind == "release":
                self.released += [(r.decoder_layer, r.expert) for r in req.release.experts]
                continue
            if kind != "acquire":  # one-way: never answered
                msg = getattr(req, kind)
                if kind == "route":
                    self.signals.append(
                        (kind, msg.request_id, msg.token, msg.decoder_layer, list(msg.experts))
                    )
                elif kind == "layer_ahead":
                    preds = [
                        (p.decoder_layer, p.depth, list(p.experts), [round(x, 3) for x in p.scores])
                        for p in msg.predictions
                    ]
                    self.signals.append((kind, msg.request_id, msg.token, preds))
                else:
                    self.signals.append((kind, msg.request_id))
                self.got_signal.set()
                continue
            acq = req.acquire
            self.acquired.append((acq.decoder_layer, list(acq.experts)))
            if self.fail_next is not None:
                code, message = self.fail_next
                self.fail_next = None
                context.abort(code, message)
            if self.hang_next:
                self.hang_next = False
                time.sleep(1.0)
                return
            if self.hold is not None:
                self.hold.wait(10)
            for slot, expert in enumerate(reversed(acq.experts)):
                source = cache_pb2.TIER_DEVICE if expert == 3 else cache_pb2.TIER_STORE
                yield cache_pb2.DemandResponse(
                    ready=cache_pb2.ExpertReady(
                        ticket=acq.ticket,
                        expert=cache_pb2.ExpertRef(decoder_layer=acq.decoder_layer, expert=expert),
                        slot=slot,
                        source=source,
                    )
                )
            yield cache_pb2.DemandResponse(done=cache_pb2.AcquireDone(ticket=acq.ticket, elapsed_s=0.001))


@pytest.fixture
def daemon(tmp_path):
    servicer = ScriptedCache()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    cache_pb2_grpc.add_ExpertCacheServicer_to_server(servicer, server)
    address = f"unix://{tmp_path}/daemon.sock"
    server.add_insecure_port(address)
    servicer.handoff = HandoffServer(str(tmp_path / "daemon.sock.handoff"), servicer.grant)
    servicer.handoff.start()
    server.start()
    yield servicer, address
    server.stop(0)
    if servicer.handoff is not None:
        servicer.handoff.close()
    os.close(servicer.arena_fd)
    for responder in servicer.responders:  # none may be left inside a native wait at exit
        responder.stop()


def connect(address: str, **kwargs) -> DaemonClient:
    kwargs.setdefault("connect_timeout_s", 5.0)
    kwargs.setdefault("acquire_timeout_s", 5.0)
    return DaemonClient.connect(address, **kwargs)


def test_attach_converts_the_handle_and_manifest(daemon):
    _, address = daemon
    client = connect(address)
    att = client.attachment
    assert att.arena.kind is ArenaKind.MEMFD and len(att.arena_memory) == 2 * BLOB
    assert (att.num_slots, att.slot_bytes, att.daemon_id) == (2, BLOB, "d1")
    assert att.manifest == MANIFEST
    client.close()


def test_acquire_yields_in_readiness_order_and_release_unpins(daemon):
    servicer, address = daemon
    client = connect(address)
    got = list(client.acquire(1, [2, 3]))
    assert got == [ReadyExpert(3, 0, Tier.DEVICE), ReadyExpert(2, 1, Tier.STORE)]
    client.release(1, [2, 3])
    assert list(client.acquire(0, [1])) == [ReadyExpert(1, 0, Tier.STORE)]
    deadline = time.monotonic() + 5
    while len(servicer.released) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert servicer.released == [(1, 2), (1, 3)]
    assert servicer.streams == 1  # one long-lived stream
    client.close()


@pytest.mark.parametrize(
    ("code", "error"),
    [(grpc.StatusCode.DATA_LOSS, DataLoss), (grpc.StatusCode.INVALID_ARGUMENT, InvalidArgument)],
)
def test_stream_errors_become_domain_errors_and_the_stream_reopens(daemon, code, error):
    servicer, address = daemon
    client = connect(address)
    servicer.fail_next = (code, "checksum mismatch for L1E2 in experts/layer_0001.bin")
    with pytest.raises(error, match="checksum mismatch for L1E2"):
        list(client.acquire(1, [2]))
    assert list(client.acquire(1, [2])) == [ReadyExpert(2, 0, Tier.STORE)]
    assert servicer.streams == 2
    client.close()


def test_acquire_timeout_is_deadline_exceeded(daemon):
    servicer, address = daemon
    client = connect(address, acquire_timeout_s=0.2)
    servicer.hang_next = True
    with pytest.raises(DeadlineExceeded, match=r"experts \[1\] of layer 0 within 0.2s"):
        list(client.acquire(0, [1]))
    client.close()


def test_closing_an_unfinished_acquire_drops_the_stream(daemon):
    servicer, address = daemon
    client = connect(address)
    it = client.acquire(1, [0, 1])
    next(it)
    it.close()  # e.g. compute failed mid-wave: the daemon must drop this stream's pins
    assert servicer.stream_closed.wait(5)
    assert list(client.acquire(1, [0])) == [ReadyExpert(0, 0, Tier.STORE)]
    client.close()


def test_unreachable_daemon_names_the_address(tmp_path):
    address = f"unix://{tmp_path}/nobody.sock"
    started = time.monotonic()
    with pytest.raises(DaemonUnavailable, match=f"cache daemon at {address} is not reachable after 0.5s"):
        connect(address, connect_timeout_s=0.5)
    assert time.monotonic() - started < 3


def test_a_restarted_daemon_is_detected_and_reattached(daemon):
    servicer, address = daemon
    client = connect(address)
    ended: list[str] = []
    client.on_stream_end = ended.append
    servicer.fail_next = (grpc.StatusCode.UNAVAILABLE, "daemon going away")
    with pytest.raises(DaemonUnavailable, match="daemon going away"):
        list(client.acquire(0, [1]))
    assert ended and "Demand stream" in ended[0]  # told without waiting for the next request
    servicer.daemon_id = "d2"  # the daemon came back with a new arena
    # Its slots index an arena this process has not mapped: refused until re-attached.
    with pytest.raises(DaemonUnavailable, match=r"restarted \(id d1 -> d2\): re-attaching to its new arena"):
        list(client.acquire(0, [1]))
    attachment = client.reattach()
    assert attachment.daemon_id == "d2" and client.attachment is attachment
    assert list(client.acquire(0, [1])) == [ReadyExpert(1, 0, Tier.STORE)]
    client.close()


def test_reattach_refuses_a_daemon_serving_another_model(daemon):
    servicer, address = daemon
    client = connect(address)
    servicer.model_id = "other-model"
    with pytest.raises(FailedPrecondition, match=r"now serves model other-model, not .*: restart compute"):
        client.reattach()
    client.close()


def assert_interrupt_cancels_the_wait(client: DaemonClient, layer: int, experts: list[int]) -> None:
    """In a new step, an acquire the daemon does not answer is ended by ``interrupt`` (0.2 s later)
    with Cancelled, well before any deadline."""
    client.begin_step()
    waiting = client.acquire(layer, experts)
    threading.Timer(0.2, client.interrupt).start()
    started = time.monotonic()
    with pytest.raises(Cancelled, match=f"all cancelled while it waited for experts of layer {layer}"):
        next(waiting)
    assert time.monotonic() - started < 5


def test_interrupt_wakes_a_wait_for_experts_with_cancelled(daemon):
    servicer, address = daemon
    client = connect(address, fast_path=False)
    servicer.hold = threading.Event()  # the daemon does not answer until released
    assert_interrupt_cancels_the_wait(client, 0, [2])
    servicer.hold.set()
    client.begin_step()  # a later step: the old interrupt no longer applies
    assert list(client.acquire(0, [1])) == [ReadyExpert(1, 0, Tier.STORE)]
    client.close()


def test_a_step_deadline_bounds_the_wait_for_experts(daemon):
    servicer, address = daemon
    client = connect(address, fast_path=False)
    servicer.hold = threading.Event()
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="passed their deadlines while waiting for experts"):
        list(client.acquire(0, [2], deadline=time.monotonic() + 0.3))
    assert time.monotonic() - started < 5
    servicer.hold.set()
    client.close()


# -- fast path: hits pinned in the shared slot table, misses through Demand ----------------------
def offer_table(servicer: ScriptedCache, tmp_path, *, entries: int = 8, resident=((1, 3, 1),)) -> SlotTable:
    """A table like the daemon's (layer * 4 + expert), with ``(layer, expert, slot)`` resident."""
    table = SlotTable.create("test-slots", entries, 2, 4)
    for layer, expert, slot in resident:
        table.begin_load(layer * 4 + expert, slot)
        table.finish_load(layer * 4 + expert)
    servicer.table = table
    return table


def test_fast_path_pins_hits_in_shm_and_demands_only_misses(daemon, tmp_path):
    servicer, address = daemon
    table = offer_table(servicer, tmp_path)
    client = connect(address)
    assert servicer.attaches == [True] and client.attachment.client_index == 0
    batches = list(client.acquire_batches(1, [2, 3]))
    assert servicer.metadata[0]["expertcache-client-index"] == "0"
    # The hit comes first, as a batch of its own, without a round trip; the miss went as a demand
    # on the client channel (no Acquire message) and was pinned into our ledger by the daemon.
    assert batches == [[ReadyExpert(3, 1, Tier.DEVICE)], [ReadyExpert(2, 0, Tier.STORE)]]
    assert servicer.acquired == [(1, [2])]
    assert table.pins(7) == 1 and table.client_pins(0, 7) == 1
    assert table.pins(6) == 1 and table.client_pins(0, 6) == 1
    client.release(1, [2, 3])
    assert table.pins(7) == table.pins(6) == 0  # both unpinned locally, no Release message
    assert list(client.acquire(1, [3])) == [ReadyExpert(3, 1, Tier.DEVICE)]
    assert list(client.acquire(1, [2])) == [ReadyExpert(2, 0, Tier.DEVICE)]  # resident now: a hit
    client.release(1, [3])
    client.release(1, [2])
    assert servicer.released == []
    assert servicer.acquired == [(1, [2])] and table.hits == 3
    client.close()


@pytest.mark.parametrize(
    ("code", "error"),
    [(grpc.StatusCode.DATA_LOSS, DataLoss), (grpc.StatusCode.INVALID_ARGUMENT, InvalidArgument)],
)
def test_a_refused_channel_demand_is_the_daemons_error_and_the_stream_reopens(daemon, tmp_path, code, error):
    servicer, address = daemon
    table = offer_table(servicer, tmp_path)
    client = connect(address)
    servicer.fail_next = (code, "checksum mismatch for L1E2 in experts/layer_0001.bin")
    with pytest.raises(error, match="checksum mismatch for L1E2"):
        list(client.acquire(1, [2]))
    assert servicer.stream_closed.wait(5)  # the failed acquire dropped its stream (and pins)
    assert list(client.acquire(1, [2])) == [ReadyExpert(2, 0, Tier.STORE)]
    assert servicer.streams == 2 and table.client_pins(1, 6) == 1  # a new ledger
    client.release(1, [2])
    client.close()


def test_a_failed_load_on_the_channel_raises_its_message(daemon, tmp_path):
    servicer, address = daemon
    table = offer_table(servicer, tmp_path)
    client = connect(address)
    servicer.fail_load = "loading expert L1E2 failed: checksum mismatch"
    with pytest.raises(DataLoss, match="loading expert L1E2 failed: checksum mismatch"):
        list(client.acquire(1, [2]))
    assert table.client_pins(0, 6) == 0 and table.state(6) == TableState.ABSENT
    client.close()


def test_channel_waits_end_at_the_timeout_the_deadline_and_an_interrupt(daemon, tmp_path):
    servicer, address = daemon
    offer_table(servicer, tmp_path)
    client = connect(address, acquire_timeout_s=0.3)
    servicer.hang_next = True  # the demand is never answered
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded, match=r"experts \[2\] of layer 1 within 0.3s"):
        list(client.acquire(1, [2]))
    assert time.monotonic() - started < 3
    client.close()
    client = connect(address)
    servicer.hang_next = True
    with pytest.raises(DeadlineExceeded, match="passed their deadlines while waiting for experts"):
        list(client.acquire(1, [0], deadline=time.monotonic() + 0.3))
    client.close()
    client = connect(address)
    servicer.hang_next = True
    assert_interrupt_cancels_the_wait(client, 1, [1])
    client.close()


def test_an_interrupt_just_after_the_checks_is_not_slept_through(daemon, tmp_path, monkeypatch):
    """Finding C4: the wait for the daemon's answer read the notify word after the interrupt and
    stream checks, so an interrupt (or a daemon death) landing between the two was slept through
    for the whole acquire timeout (120 s by default). Here it lands exactly there."""
    servicer, address = daemon
    offer_table(servicer, tmp_path)
    client = connect(address, acquire_timeout_s=30.0)
    servicer.hang_next = True  # the demand is never answered
    real = daemon_client._Wait.remaining
    calls = []

    def remaining_then_interrupted(wait, *args):
        left = real(wait, *args)  # the checks pass ...
        if not calls:
            calls.append(left)
            client.interrupt()  # ... and the interrupt arrives before the wait starts
        return left

    monkeypatch.setattr(daemon_client._Wait, "remaining", remaining_then_interrupted)
    client.begin_step()
    started = time.monotonic()
    with pytest.raises(Cancelled):
        list(client.acquire(1, [2]))
    assert time.monotonic() - started < calls[0] / 3  # not the 30 s it would have slept
    client.close()


def test_fast_path_off_sends_every_acquire(daemon, tmp_path):
    servicer, address = daemon
    table = offer_table(servicer, tmp_path)
    client = connect(address, fast_path=False)
    assert servicer.attaches == [False] and client.attachment.client_index == -1
    assert list(client.acquire(1, [3])) == [ReadyExpert(3, 0, Tier.DEVICE)]
    assert servicer.acquired == [(1, [3])] and table.hits == 0
    client.close()


def test_unmappable_slot_table_is_failed_precondition(daemon, tmp_path):
    servicer, address = daemon
    offer_table(servicer, tmp_path)
    servicer.handoff.close()  # the handoff socket is gone
    with pytest.raises(
        FailedPrecondition,
        match=r"cannot get the arena and slot table from the cache daemon's handoff socket .*mounted",
    ):
        connect(address)
    servicer.handoff = None
    with pytest.raises(FailedPrecondition, match="has a CPU arena but offered no handoff socket"):
        connect(address)
    servicer.handoff = HandoffServer(str(tmp_path / "daemon.sock.handoff"), servicer.grant)
    servicer.handoff.start()
    offer_table(servicer, tmp_path, entries=9)
    with pytest.raises(FailedPrecondition, match="has 9 entries, expected 2 layers x 4 experts"):
        connect(address)


def test_pins_reclaimed_while_in_use_fail_the_release(daemon, tmp_path):
    servicer, address = daemon
    table = offer_table(servicer, tmp_path)
    client = connect(address)
    assert list(client.acquire(1, [3])) == [ReadyExpert(3, 1, Tier.DEVICE)]
    table.reclaim_client(0)  # as the daemon does when the stream ends under us
    assert table.pins(7) == 0
    with pytest.raises(
        DaemonUnavailable, match=r"took back the pins of experts \[3\] of layer 1 while they were in use"
    ):
        client.release(1, [3])
    # The next acquire notices the stale ledger, re-attaches for a new one and pins again.
    assert list(client.acquire(1, [3])) == [ReadyExpert(3, 1, Tier.DEVICE)]
    assert servicer.attaches == [True, True] and table.client_pins(1, 7) == 1
    client.release(1, [3])
    client.close()


def test_a_release_after_the_ledger_went_with_its_stream_sends_nothing(daemon, tmp_path):
    """Pins taken in a ledger the daemon took back (its stream ended) went with it: releasing
    them later, on a new stream, neither raises nor sends a Release the daemon would refuse."""
    servicer, address = daemon
    offer_table(servicer, tmp_path)
    client = connect(address)
    assert list(client.acquire(1, [3])) == [ReadyExpert(3, 1, Tier.DEVICE)]
    client._link.drop(client._link.stream)  # the stream ends: the ledger and its pins go with it
    assert list(client.acquire(1, [2])) == [ReadyExpert(2, 0, Tier.STORE)]  # a new stream and ledger
    client.release(1, [3])
    client.release(1, [2])
    assert servicer.released == []
    client.close()


def test_a_layer_runs_in_one_call_only_while_the_daemon_wants_no_signals(daemon, tmp_path):
    """run_layer hands the slot table and the experts per layer to the layer's one call while the
    daemon wants no routes (the call finds the experts itself, so none would be sent); else, or
    without a slot table, it does nothing and says 0."""
    servicer, address = daemon
    table = offer_table(servicer, tmp_path)
    client = connect(address)
    calls = []

    def run(returns):
        def call(handle, num_experts, layer_signals):
            calls.append(num_experts)
            given.append(layer_signals)
            if isinstance(returns, Exception):
                raise returns
            return returns

        return call

    given = []
    table.signals_wanted = True
    assert client.run_layer(1, run(2)) == 0 and calls == []  # its signals go with run_resident
    # With the step's rows and lookahead, the call gets the LayerSignals it writes them with, and
    # what that wrote is counted as sent.
    spec = SpanSignals(("a", "b"), (3, 9), 2, 2, 1, (1, -1))
    sent = client.signals_sent
    assert client.run_layer(1, run(2), spec) == 2 and calls == [4]
    assert isinstance(given[-1], native.LayerSignals) and client.signals_sent == sent + 2  # begins
    calls.clear()
    table.signals_wanted = False
    assert client.run_layer(1, run(2), spec) == 2 and calls == [4] and given[-1] is None
    calls.clear()
    assert client.run_layer(1, run(2)) == 2 and calls == [4]
    assert client.run_layer(1, run(0)) == 0  # a miss: the acquire serves the layer
    with pytest.raises(
        DaemonUnavailable, match="took back the pins of layer 1's experts while they were in use"
    ):
        client.run_layer(1, run(-1))
    # The ledger went with a stream that ended before we read so: the stream is dropped, 0.
    stream = client._link.stream
    assert client.run_layer(1, run(daemon_client.StaleClient("stale"))) == 0
    assert stream is not None and client._link.stream is None
    client.close()
    plain = connect(address, fast_path=False)  # no slot table
    assert plain.run_layer(1, run(2)) == 0 and calls == [4, 4, 4, 4]
    plain.close()


def hand_back(client: DaemonClient, layer: int, hits: list[int], misses: list[int], elapsed_s: float = 0.0):
    """What a native span leaves when it hands a layer back (``native.SpanDemand.handed_back``): its
    resident experts pinned in the ledger, a demand posted for the others, recorded on the link."""
    link = client._link
    with link.lock:
        stream = link.open_locked()
        slots = link.table.try_pin_many([layer * 4 + e for e in hits])
        channel = link.shm_channel
        fail_seen = channel.fail_seq
        seq = channel.post_demand(layer, misses)
        channel.ring_doorbell()
        link.spans.handed_back = daemon_client.HandedBack(
            stream, layer, seq, fail_seen, hits, slots, misses, elapsed_s
        )
    return stream


def test_a_layer_a_span_handed_back_is_adopted_by_its_acquire(daemon, tmp_path):
    """The layer's acquire takes over the span's pins and its posted demand (no second demand, no
    second pin): the hits first, then the misses as they land, released as its own; an acquire of
    another layer, or a new step, drops the stream instead (its pins and demand go with it)."""
    servicer, address = daemon
    table = offer_table(servicer, tmp_path)
    client = connect(address, acquire_timeout_s=1.0)
    hand_back(client, 1, [3], [2])
    assert list(client.acquire_batches(1, [2, 3])) == [
        [ReadyExpert(3, 1, Tier.DEVICE)],
        [ReadyExpert(2, 0, Tier.STORE)],
    ]
    assert servicer.acquired == [(1, [2])] and client._link.spans.handed_back is None
    assert table.client_pins(0, 7) == table.client_pins(0, 6) == 1
    client.release(1, [2, 3])
    assert table.pins(7) == table.pins(6) == 0
    # Handed back after waiting: the acquire's time limit counts that wait.
    servicer.hang_next = True
    hand_back(client, 0, [], [1], elapsed_s=0.9)
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded, match=r"experts \[1\] of layer 0 within 1s"):
        list(client.acquire(0, [1]))
    assert time.monotonic() - started < 0.6  # 0.1 s left of its 1 s
    # Not this acquire's (other experts): dropped with its stream; the acquire serves itself on a
    # new one. A hand back no acquire took is dropped by the next step the same way.
    dropped = []
    drop_locked = client._link.drop_locked
    client._link.drop_locked = lambda stream: dropped.append(stream) or drop_locked(stream)
    stream = hand_back(client, 1, [3], [2])
    assert list(client.acquire(1, [2])) == [ReadyExpert(2, 0, Tier.DEVICE)]
    assert dropped == [stream] and client._link.stream not in (None, stream)
    client.release(1, [2])
    stream = hand_back(client, 1, [3], [2])
    client.begin_step()
    assert dropped[1:] == [stream] and client._link.spans.handed_back is None and client._link.stream is None
    client.close()


def test_a_spans_demands_are_stopped_by_an_interrupt_and_by_the_streams_end(daemon, tmp_path):
    """run_layer with ``demand`` hands the span a SpanDemand bound to this client's channel; an
    interrupt (before the span or during it) and the stream's end stop it, so that a wait of the
    span hands its layer back to the acquire, whose checks raise what ended it."""
    servicer, address = daemon
    table = offer_table(servicer, tmp_path)
    table.signals_wanted = False
    client = connect(address)
    seen = []

    def run(then=None):
        def call(handle, num_experts, layer_signals, demand):
            seen.append((isinstance(demand, native.SpanDemand), demand.stopped))
            if then is not None:
                then()
                seen.append(demand.stopped)
            return 2

        return call

    assert client.run_layer(1, run(), demand=True) == 2 and seen == [(True, False)]
    assert client._link.spans.running is None  # only while the span runs
    seen.clear()
    assert client.run_layer(1, run(client.interrupt), demand=True) == 2 and seen == [(True, False), True]
    seen.clear()
    assert client.run_layer(1, run(), demand=True) == 2 and seen == [(True, True)]  # interrupted before it
    client.begin_step()
    seen.clear()
    assert client.run_layer(1, run(client._link.wake_channel), demand=True) == 2 and seen == [
        (True, False),
        True,
    ]
    # Without ``demand`` the call takes three arguments, as before.
    assert client.run_layer(1, lambda handle, num_experts, layer_signals: 1) == 1
    client.close()


# -- one-way prediction messages: queued on the Demand stream, never answered, never waited for ---
def wait_signals(servicer: ScriptedCache, n: int) -> list[tuple]:
    deadline = time.monotonic() + 5
    while len(servicer.signals) < n and time.monotonic() < deadline:
        time.sleep(0.005)
    return servicer.signals


def test_prediction_messages_travel_one_way_on_the_client_channel(daemon, tmp_path):
    servicer, address = daemon
    offer_table(servicer, tmp_path)  # fast path: records in the client channel's ring
    client = connect(address)
    client.begin_request("req-1")
    client.routed("req-1", 4, 1, [3, 0])
    client.layer_ahead("req-1", 4, [Prediction(1, (2, 1), (0.7, 0.2)), Prediction(2, (5,), (0.5,), depth=2)])
    # Interleaved with an acquire (a channel demand), whose answers are still its own.
    assert list(client.acquire(0, [1])) == [ReadyExpert(1, 0, Tier.STORE)]
    client.release(0, [1])
    client.end_request("req-1")
    assert wait_signals(servicer, 4) == [
        ("request_begin", "req-1"),
        ("route", "req-1", 4, 1, [3, 0]),
        ("layer_ahead", "req-1", 4, [(1, 1, [2, 1], [0.7, 0.2]), (2, 2, [5], [0.5])]),
        ("request_end", "req-1"),
    ]
    assert (client.signals_sent, client.signals_dropped) == (4, 0)
    assert servicer.streams == 1
    with pytest.raises(InvalidArgument, match=r"layer_ahead for layer 1 at depth 1: 2 experts but 1 scores"):
        client.layer_ahead("req-1", 5, [Prediction(1, (2, 1), (0.7,))])
    client.close()


def test_prediction_messages_without_a_stream_are_dropped_and_counted(daemon):
    servicer, address = daemon
    client = connect(address, fast_path=False)  # no stream until the first acquire
    started = time.monotonic()
    client.begin_request("req-9")
    client.routed("req-9", 0, 0, [1])
    client.layer_ahead("req-9", 0, [Prediction(1, (2,), (0.5,))])
    assert time.monotonic() - started < 2.5  # nothing waited for a stream or a reply (5 s here)
    assert (client.signals_sent, client.signals_dropped) == (0, 3)
    assert servicer.streams == 0
    # The first acquire opens a stream, which is told the running request before anything else.
    assert list(client.acquire(0, [1])) == [ReadyExpert(1, 0, Tier.STORE)]
    client.routed("req-9", 1, 0, [1])
    assert wait_signals(servicer, 2) == [("request_begin", "req-9"), ("route", "req-9", 1, 0, [1])]
    client.end_request("req-9")
    client.close()
    client.routed("req-9", 2, 0, [1])  # after close: dropped, never raised
    assert client.signals_dropped == 4


class _FailingLoadChannel:
    """A channel whose demand was admitted and whose one miss then failed to load: the daemon
    posts the failure (``fail_seq``) before the slot goes absent, and the failure lands between
    the wait's check of ``fail_seq`` and its read of the slots (``fail_seq`` reads 0, then 1)."""

    reply_seq = 7
    notify_seq = 0
    reply_status = codes.STATUS_OK
    fail_status = codes.status_of("DATA_LOSS")
    fail_message = "loading expert L0E3 failed: checksum mismatch"

    def __init__(self) -> None:
        self.fail_reads = 0

    @property
    def fail_seq(self) -> int:
        self.fail_reads += 1
        return 0 if self.fail_reads == 1 else 1

    def wait_notify(self, *_args) -> None:
        raise AssertionError("nothing to wait for: the slot is absent")


def test_a_miss_whose_load_failed_is_the_loads_error_even_when_its_slot_is_seen_absent_first():
    """The slot reads absent (-2, as after an ended stream) just after the failure was posted: the
    wait raises the load's error (DATA_LOSS naming the expert), not DaemonUnavailable."""
    from types import SimpleNamespace

    from compute_svc.daemon.transport import ChannelTransport, SignalCounts

    table = SimpleNamespace(resident_slots=lambda entries: [-2] * len(entries))
    attachment = SimpleNamespace(manifest=SimpleNamespace(num_experts=8), slot_bytes=1 << 20)
    link = SimpleNamespace(
        address="unix:///d.sock", lock=threading.Lock(), held={}, attachment=attachment, table=table
    )
    transport = ChannelTransport(link, SignalCounts())
    channel = _FailingLoadChannel()
    with pytest.raises(DataLoss, match="L0E3"):
        next(transport._wait(None, None, channel, 7, 0, 0, [3]))
    assert channel.fail_reads == 2
