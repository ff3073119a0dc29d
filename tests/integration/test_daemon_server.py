"""The real daemon process on a synthetic store, driven over its unix socket like compute does."""

from __future__ import annotations

import functools
import json
import os
import queue
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from moe.cache.v1 import cache_pb2

from compute_svc.experts.layer_ahead import Prediction
from expertcache import handoff
from expertcache.errors import FailedPrecondition
from expertcache.keys import ExpertKey
from tests import waiting
from tests.daemons import BLOB, Daemon, DemandStream, tiers
from tests.procs import run_module, start_daemon
from tests.stores import corrupt, write_store

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]

SLOTS = 3


def launch(work: Path, *, extra: list[str] | None = None, corrupt_key: ExpertKey | None = None) -> Daemon:
    store = work / "store"
    manifest = write_store(store)
    if corrupt_key is not None:
        corrupt(store, manifest, corrupt_key)
    proc = start_daemon(
        store,
        work,
        device="cpu",
        device_budget_bytes=SLOTS * BLOB + 100,
        host_budget_bytes=4 * BLOB,
        extra=extra or [],
    )
    return Daemon(proc, store, manifest)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    # Short enough that the tests of a demand refused for pinned slots end soon, long enough
    # for a first read on a 2-core machine under the parallel suite (0.5 s timed out once in
    # three fresh-clone runs: "waiting for 3 expert(s) of layer 1 to load").
    d = launch(
        tmp_path_factory.mktemp("daemon"), extra=["--acquire-timeout-s", "2"], corrupt_key=ExpertKey(3, 5)
    )
    yield d
    d.close()
    assert d.proc.stop() == 0, d.proc.log()


wait_for = functools.partial(waiting.wait_for, poll_s=0.02)


def test_attach(daemon):
    reply = daemon.attach
    assert reply.arena.kind == cache_pb2.ARENA_KIND_MEMFD
    assert reply.num_slots == SLOTS and reply.slot_bytes == BLOB
    assert reply.arena.size_bytes == SLOTS * BLOB == len(daemon.arena)
    assert reply.manifest_json == (daemon.store / "manifest.json").read_text()
    assert reply.daemon_id
    # No ledger unless asked for; the token buys the arena alone, once.
    assert reply.client_index == -1 and reply.handoff_socket.endswith(".handoff")
    again = daemon.stub.Attach(cache_pb2.AttachRequest(client_name="test"), timeout=10)
    payload, fds = handoff.receive(again.handoff_socket, again.handoff_token)
    try:
        assert json.loads(payload) == {"descriptors": ["arena"]} and len(fds) == 1
        assert os.readlink(f"/proc/self/fd/{fds[0]}").startswith(
            f"/memfd:expertcache-arena-{reply.daemon_id}"
        )
    finally:
        for fd in fds:
            os.close(fd)
    with pytest.raises(FailedPrecondition, match="already used"):
        handoff.receive(again.handoff_socket, again.handoff_token)
    # The arena, the table and the regions are memfds: no file beside the sockets.
    sock = Path(daemon.proc.address.removeprefix("unix://"))
    assert sorted(p.name for p in sock.parent.iterdir() if p.name.startswith(sock.name)) == [
        sock.name,
        sock.name + ".handoff",
    ]


def test_demand_release_and_stats(daemon):
    before = daemon.stats()
    stream = DemandStream(daemon.stub)
    try:
        readies, done = stream.acquire(1, 1, [0, 1, 2])
        assert sorted(r.expert.expert for r in readies) == [0, 1, 2] and done.elapsed_s > 0
        assert {r.source for r in readies} == {cache_pb2.TIER_STORE}
        assert len({r.slot for r in readies}) == SLOTS
        for r in readies:
            assert daemon.slot_bytes(r.slot) == daemon.blob(1, r.expert.expert)
        assert daemon.stats().pinned == before.pinned + 3
        stream.release(1, [0, 1, 2])
        # The next wave: L1E2 is resident and comes first; L1E3 evicts L1E0 or L1E1 (whichever
        # finished loading first, so is least recently used).
        readies, _ = stream.acquire(2, 1, [3, 2])
        assert [(r.expert.expert, r.source) for r in readies] == [
            (2, cache_pb2.TIER_DEVICE),
            (3, cache_pb2.TIER_STORE),
        ]
        for r in readies:
            assert daemon.slot_bytes(r.slot) == daemon.blob(1, r.expert.expert)
        stream.release(1, [2, 3])
        # The survivor is served from the device, first; the evicted one from the host tier.
        readies, _ = stream.acquire(3, 1, [0, 1])
        assert [r.source for r in readies] == [cache_pb2.TIER_DEVICE, cache_pb2.TIER_HOST]
        for r in readies:
            assert daemon.slot_bytes(r.slot) == daemon.blob(1, r.expert.expert)
        stream.release(1, [0, 1])
        wait_for(lambda: daemon.stats().pinned == before.pinned)
    finally:
        stream.close()
    after, was = tiers(daemon.stats()), tiers(before)
    device, host, store = cache_pb2.TIER_DEVICE, cache_pb2.TIER_HOST, cache_pb2.TIER_STORE
    assert after[device].hits - was[device].hits == 2
    assert after[device].misses - was[device].misses == 5
    assert after[device].bytes_in - was[device].bytes_in == 5 * BLOB
    assert after[device].evictions - was[device].evictions == 2
    assert after[device].capacity_slots == SLOTS and after[device].resident == SLOTS
    assert after[host].hits - was[host].hits == 1 and after[host].capacity_slots == 4
    assert after[store].hits - was[store].hits == 4
    assert after[store].capacity_slots == daemon.manifest.num_blobs
    stats = daemon.stats()
    assert stats.demands - before.demands == 3
    # The mode names belong to the store reader (cache_daemon.tiers.store); any is fine here.
    assert stats.store_io_mode and stats.store_read_seconds > 0


def expect_error(stream: DemandStream, layer: int, experts: list[int]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        stream.acquire(9, layer, experts)
    stream.close()
    return info.value


def test_bad_layer_is_invalid_argument(daemon):
    err = expect_error(DemandStream(daemon.stub), 7, [0])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "layer 7 is not a MoE layer" in err.details()


def test_too_many_experts_is_invalid_argument(daemon):
    err = expect_error(DemandStream(daemon.stub), 1, [0, 1, 2, 3])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "names 4 experts but the arena has 3 slots" in err.details()


def test_corrupted_blob_is_data_loss(daemon):
    failures = daemon.stats().checksum_failures
    err = expect_error(DemandStream(daemon.stub), 3, [4, 5])
    assert err.code() == grpc.StatusCode.DATA_LOSS
    assert "checksum mismatch for expert L3E5 in experts/layer_0003.bin" in err.details()
    assert daemon.stats().checksum_failures == failures + 1
    wait_for(lambda: daemon.stats().pinned == 0)  # the broken stream's pins were dropped


def test_all_slots_pinned_is_deadline_exceeded_and_cancel_releases(daemon):
    holder = DemandStream(daemon.stub)
    readies, _ = holder.acquire(1, 3, [0, 1, 2])
    assert len(readies) == SLOTS
    err = expect_error(DemandStream(daemon.stub), 3, [3])
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "3 of 3 slots are pinned" in err.details()
    assert daemon.stats().pinned == 3
    holder.call.cancel()  # a compute process that goes away releases everything it pinned
    wait_for(lambda: daemon.stats().pinned == 0)
    stream = DemandStream(daemon.stub)
    readies, _ = stream.acquire(1, 3, [3])
    assert daemon.slot_bytes(readies[0].slot) == daemon.blob(3, 3)
    stream.close()


def test_sigterm_removes_the_sockets(tmp_path):
    d = launch(tmp_path)
    stream = DemandStream(d.stub)
    stream.acquire(1, 1, [0])  # an open stream holding a pin does not block the stop
    sock = Path(d.proc.address.removeprefix("unix://"))
    handoff = Path(str(sock) + ".handoff")
    assert sock.exists() and handoff.exists()
    d.close()
    d.proc.popen.send_signal(signal.SIGTERM)
    assert d.proc.popen.wait(15) == 0, d.proc.log()
    assert not sock.exists() and not handoff.exists()
    stream.close()


def test_budget_below_one_blob_exits_2(tmp_path):
    store = tmp_path / "store"
    write_store(store)
    result = run_module(
        "cache_daemon",
        "--store-dir",
        str(store),
        "--socket-path",
        str(tmp_path / "d.sock"),
        "--device-budget-bytes",
        "4095",
        "--device",
        "cpu",
        timeout_s=60,
    )
    assert result.returncode == 2
    assert "'device_budget_bytes' = 4095 is smaller than one expert blob (blob_bytes=4096)" in result.stderr


# -- the compute fast path: hits through the shared slot table, no RPC ------------------------------
def fast_client(daemon: Daemon, **kwargs):
    from compute_svc.daemon.client import DaemonClient

    return DaemonClient.connect(daemon.proc.address, connect_timeout_s=10, acquire_timeout_s=10, **kwargs)


def test_second_pass_over_resident_experts_sends_no_demand(daemon):
    from expertcache.protocol import Tier

    client = fast_client(daemon)
    try:
        assert client.attachment.client_index >= 0
        first = list(client.acquire(1, [0, 1, 2]))
        client.release(1, [0, 1, 2])
        # These pins were taken through Demand: their release is a message on the stream, which the
        # daemon handles on its own time (nothing orders it before a GetStats).
        wait_for(lambda: daemon.stats().pinned == 0, "the daemon handled the Release of the Demand pins")
        before = daemon.stats()
        for _ in range(3):
            again = list(client.acquire(1, [2, 0, 1]))
            assert [(r.expert, r.source) for r in again] == [
                (2, Tier.DEVICE),
                (0, Tier.DEVICE),
                (1, Tier.DEVICE),
            ]
            assert {r.expert: r.slot for r in again} == {r.expert: r.slot for r in first}
            for r in again:
                assert daemon.slot_bytes(r.slot) == daemon.blob(1, r.expert)
            assert daemon.stats().pinned == 3
            client.release(1, [2, 0, 1])
        after = daemon.stats()
        assert after.demands == before.demands  # zero new Demand acquires
        was, now = tiers(before), tiers(after)
        device = cache_pb2.TIER_DEVICE
        assert now[device].misses == was[device].misses  # zero misses
        assert now[device].hits - was[device].hits == 9  # shm hits count as device hits
        assert after.pinned == 0  # shm pins are released in the slot table itself, at once
    finally:
        client.close()


def test_experts_compute_waited_for_in_flight_count_as_device_misses(daemon):
    # A native span that waits for a layer's experts in flight pins them itself, with no demand
    # (ExpertFfn.run_layers): it counts them in its ledger, and GetStats counts them as device
    # misses, as if demanded.
    client = fast_client(daemon)
    try:
        table = client._link.table  # this client's handle of the shared slot table
        was = tiers(daemon.stats())
        table.count_waited(3)
        now = tiers(daemon.stats())
        device = cache_pb2.TIER_DEVICE
        assert (now[device].misses - was[device].misses, now[device].hits - was[device].hits) == (3, 0)
        assert table.waited == 3
    finally:
        client.close()


def test_slow_path_client_demands_every_acquire(daemon):
    from expertcache.protocol import Tier

    client = fast_client(daemon, fast_path=False)
    try:
        assert client.attachment.client_index == -1
        list(client.acquire(1, [0]))
        client.release(1, [0])
        before = daemon.stats().demands
        got = list(client.acquire(1, [0]))
        assert [r.source for r in got] == [Tier.DEVICE]
        client.release(1, [0])
        assert daemon.stats().demands == before + 1
    finally:
        client.close()


def assert_pins_reclaimed(daemon: Daemon) -> None:
    """Once the killed holders' pins are reclaimed, a demand for 3 experts (the whole arena) is
    served with the right bytes."""
    wait_for(lambda: daemon.stats().pinned == 0)
    stream = DemandStream(daemon.stub)
    readies, _ = stream.acquire(1, 1, [4, 5, 0])
    assert len(readies) == 3
    for r in readies:
        assert daemon.slot_bytes(r.slot) == daemon.blob(1, r.expert.expert)
    stream.close()


HOLDER = """
import sys, time
sys.path.insert(0, sys.argv[2])
from compute_svc.daemon.client import DaemonClient
c = DaemonClient.connect(sys.argv[1], connect_timeout_s=10, acquire_timeout_s=10)
list(c.acquire(3, [0, 1, 2]))
c.release(3, [0, 1, 2])
got = list(c.acquire(3, [0, 1, 2]))  # all hits: shm pins, not Demand pins
assert all(r.source.value == "device" for r in got), got
print("pinned", flush=True)
time.sleep(120)
"""


def test_shm_pins_block_eviction_until_the_holder_dies(daemon):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, daemon.proc.address, str(REPO)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert holder.stdout.readline().strip() == "pinned", holder.stderr.read()
        assert daemon.stats().pinned == 3
        demands = daemon.stats().demands
        # Every slot is shm-pinned by the other process: the demand waits, then times out.
        err = expect_error(DemandStream(daemon.stub), 1, [4])
        assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "waiting for 1 free slot(s) for layer 1: 3 of 3 slots are pinned" in err.details()
        assert daemon.stats().demands == demands + 1
        for expert in (0, 1, 2):  # never evicted, never overwritten
            slot = next(i for i in range(SLOTS) if daemon.slot_bytes(i) == daemon.blob(3, expert))
            assert slot >= 0
    finally:
        holder.kill()  # SIGKILL while holding the pins: its stream ends, the daemon reclaims them
        holder.wait(10)
    assert_pins_reclaimed(daemon)


CHANNEL_HOLDER = """
import sys, time
sys.path.insert(0, sys.argv[2])
from compute_svc.daemon.client import DaemonClient
c = DaemonClient.connect(sys.argv[1], connect_timeout_s=10, acquire_timeout_s=60)
got = list(c.acquire(int(sys.argv[3]), [int(e) for e in sys.argv[4].split(",")]))
print("pinned", sorted(r.source.value for r in got), flush=True)
time.sleep(120)
"""


def channel_holder(daemon: Daemon, layer: int, experts: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", CHANNEL_HOLDER, daemon.proc.address, str(REPO), str(layer), experts],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )


def test_a_killed_client_leaks_no_pin_the_daemon_gave_it_on_its_channel(daemon):
    # Misses are pinned by the daemon into the client's ledger: killing the client while it holds
    # them, or while its own demand waits for slots, leaves nothing pinned.
    holder = channel_holder(daemon, 3, "0,1,2")
    waiter = None
    try:
        line = holder.stdout.readline().split()
        assert line and line[0] == "pinned", holder.stderr.read()
        assert daemon.stats().pinned == 3  # every slot, pinned by the daemon for the client
        waiter = channel_holder(daemon, 1, "4")  # no slot can free: its demand waits
        wait_for(lambda: daemon.stats().demands >= 2)
        waiter.kill()  # killed while its demand waits in the daemon's admission
        waiter.wait(10)
        assert daemon.stats().pinned == 3
    finally:
        for proc in (holder, waiter):
            if proc is not None:
                proc.kill()
                proc.wait(10)
    assert_pins_reclaimed(daemon)


def test_demand_metadata_errors(daemon):
    bad = DemandStream.__new__(DemandStream)
    bad._requests = queue.Queue()
    bad.call = daemon.stub.Demand(
        iter(bad._requests.get, None), timeout=10, metadata=(("expertcache-client-index", "x"),)
    )
    err = expect_error(bad, 1, [0])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'expertcache-client-index' and 'expertcache-client-epoch' as decimal integers" in err.details()
    unclaimed = DemandStream.__new__(DemandStream)
    unclaimed._requests = queue.Queue()
    unclaimed.call = daemon.stub.Demand(
        iter(unclaimed._requests.get, None),
        timeout=10,
        metadata=(("expertcache-client-index", "31"), ("expertcache-client-epoch", "0")),
    )
    err = expect_error(unclaimed, 1, [0])
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "client ledger 31 (epoch 0) is not an unused ledger claimed at Attach" in err.details()


# -- live config (UpdateConfig, SIGHUP reload) and compute's prediction messages -------------------
@pytest.fixture
def lone(tmp_path):
    """A daemon of its own (tests below change its config), starting on plain LRU."""
    d = launch(tmp_path, extra=["--eviction-policy", "lru"])
    yield d
    d.close()
    assert d.proc.stop() == 0, d.proc.log()


def update(daemon: Daemon, **fields) -> cache_pb2.UpdateConfigResponse:
    return daemon.stub.UpdateConfig(cache_pb2.UpdateConfigRequest(**fields), timeout=10)


def test_policy_switch_at_runtime_loses_nothing(lone):
    holder, other = DemandStream(lone.stub), DemandStream(lone.stub)
    try:
        held, _ = holder.acquire(1, 1, [0, 1])  # pinned through the switch
        loaded, _ = other.acquire(2, 3, [4])
        other.release(3, [4])
        slots = {(r.expert.expert, r.slot) for r in held} | {(4, loaded[0].slot)}
        # Release is one-way: wait until the daemon has applied it before reading the counts.
        before = waiting.wait_for(lambda: (s := lone.stats()).pinned == 2 and s, "the release of expert 4")
        assert before.config.eviction_policy == "lru" and before.config.prefetch

        reply = update(lone, eviction_policy="activation-aware", prefetch=False)
        assert list(reply.changed) == ["eviction_policy", "prefetch"]
        assert reply.config.eviction_policy == "activation-aware" and not reply.config.prefetch
        after = lone.stats()
        assert after.config.eviction_policy == "activation-aware"
        assert (
            tiers(after)[cache_pb2.TIER_DEVICE].resident == tiers(before)[cache_pb2.TIER_DEVICE].resident == 3
        )
        assert after.pinned == before.pinned == 2
        for r in held:  # the pinned slots were never touched
            assert lone.slot_bytes(r.slot) == lone.blob(1, r.expert.expert)
        # Later acquires of the residents are hits in the same slots, under the new policy.
        again, _ = other.acquire(3, 3, [4])
        assert [(r.expert.expert, r.slot, r.source) for r in again] == [
            (4, loaded[0].slot, cache_pb2.TIER_DEVICE)
        ]
        other.release(3, [4])
        holder.release(1, [0, 1])
        hits, _ = holder.acquire(4, 1, [1, 0])
        assert {(r.expert.expert, r.slot) for r in hits} | {(4, loaded[0].slot)} == slots
        assert {r.source for r in hits} == {cache_pb2.TIER_DEVICE}
        holder.release(1, [0, 1])
        # And the new policy evicts when it must: a fourth expert still loads.
        fresh, _ = other.acquire(5, 3, [5])
        assert lone.slot_bytes(fresh[0].slot) == lone.blob(3, 5)
        other.release(3, [5])
        assert list(update(lone, eviction_policy="activation-aware").changed) == []  # no-op
    finally:
        holder.close()
        other.close()


@pytest.mark.parametrize(
    "fields, message",
    [
        (
            dict(eviction_policy="belady"),
            r"'eviction_policy' = 'belady' is not one of activation-aware, lfu, lru, moe-infinity",
        ),
        (
            dict(eviction_policy="fifo"),
            r"'eviction_policy' = 'fifo' is not one of activation-aware, lfu, lru",
        ),
        (
            dict(device_budget_bytes=1 << 20),
            r"config field 'device_budget_bytes' = 1048576 is above its ceiling device_budget_max_bytes = 12388",
        ),
        (
            dict(host_budget_bytes=1 << 20),
            r"config field 'host_budget_bytes' = 1048576 is above its ceiling host_budget_max_bytes = 16384",
        ),
        (
            dict(device_budget_bytes=100),
            r"config field 'device_budget_bytes' = 100 is smaller than one expert blob \(blob_bytes=4096\)",
        ),
        (dict(hint_stale_s=0.0), r"config field 'hint_stale_s' = 0.0 is below its minimum 0.001"),
        (dict(hint_stale_s=float("nan")), r"'hint_stale_s' = nan from UpdateConfig is not a finite number"),
        (dict(hint_stale_s=float("inf")), r"'hint_stale_s' = inf from UpdateConfig is not a finite number"),
        (
            dict(prefetch_horizon_layers=0),
            r"config field 'prefetch_horizon_layers' = 0 is below its minimum 1",
        ),
        (
            dict(prefetch_min_probability=1.5),
            r"config field 'prefetch_min_probability' = 1.5 is above its maximum 1.0",
        ),
        (
            dict(prefetch_min_probability=-0.1),
            r"config field 'prefetch_min_probability' = -0.1 is below its minimum 0.0",
        ),
        (
            dict(prefetch_min_probability=float("nan")),
            r"'prefetch_min_probability' = nan from UpdateConfig is not a finite number",
        ),
        # One bad field refuses the whole update: the good one is not applied either.
        (
            dict(prefetch=False, hint_ttl_tokens=8, hint_stale_s=-1.0),
            r"'hint_stale_s' = -1.0 is below",
        ),
    ],
)
def test_invalid_update_config_is_invalid_argument_and_keeps_the_config(daemon, fields, message):
    before = daemon.stats().config
    with pytest.raises(grpc.RpcError) as info:
        update(daemon, **fields)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.search(message, info.value.details()), info.value.details()
    assert daemon.stats().config == before


def begin_routed(stream: DemandStream):
    """Begin request ``req-1`` on ``stream`` with token 0 routed to experts 0 and 1 at layer 1;
    the stream's one-way send."""
    send = stream._requests.put
    send(cache_pb2.DemandRequest(request_begin=cache_pb2.RequestBegin(request_id="req-1")))
    send(
        cache_pb2.DemandRequest(
            route=cache_pb2.Route(request_id="req-1", token=0, decoder_layer=1, experts=[0, 1])
        )
    )
    return send


def test_prediction_messages_drive_prefetch_without_replies(lone):
    stream = DemandStream(lone.stub)
    try:
        send = begin_routed(stream)
        send(
            cache_pb2.DemandRequest(
                layer_ahead=cache_pb2.LayerAhead(
                    token=0,
                    predictions=[
                        cache_pb2.LayerPrediction(decoder_layer=3, depth=1, experts=[2, 3], scores=[0.9, 0.6])
                    ],
                )
            )
        )

        def prefetched() -> int:
            stats = lone.stats()
            return next(
                p.started for p in stats.prefetch if p.prediction == cache_pb2.PREFETCH_CLASS_LAYER_AHEAD
            )

        wait_for(lambda: prefetched() == 2 and lone.stats().tiers[0].resident == 2)
        # Each start's lag behind the signal it follows, summed (GetStats carries it).
        (layer_ahead,) = (
            p for p in lone.stats().prefetch if p.prediction == cache_pb2.PREFETCH_CLASS_LAYER_AHEAD
        )
        assert layer_ahead.start_delay_seconds > 0
        # No reply was sent for any of them: the next answer on the stream is this acquire's.
        readies, _ = stream.acquire(7, 3, [3, 2])
        assert {r.source for r in readies} == {cache_pb2.TIER_DEVICE}
        for r in readies:
            assert lone.slot_bytes(r.slot) == lone.blob(3, r.expert.expert)
        stream.release(3, [2, 3])
        stats = lone.stats()
        (ahead,) = [p for p in stats.prefetch if p.prediction == cache_pb2.PREFETCH_CLASS_LAYER_AHEAD]
        assert (ahead.started, ahead.used, ahead.wasted, ahead.cancelled) == (2, 2, 0, 0)
        send(cache_pb2.DemandRequest(request_end=cache_pb2.RequestEnd(request_id="req-1")))
        # A malformed prediction is advice gone wrong: dropped and counted; the stream goes on.
        assert lone.stats().signals_rejected == 0
        send(
            cache_pb2.DemandRequest(
                route=cache_pb2.Route(request_id="req-1", token=1, decoder_layer=2, experts=[0])
            )
        )
        bad = cache_pb2.LayerPrediction(decoder_layer=3, depth=1, experts=[99])
        send(cache_pb2.DemandRequest(layer_ahead=cache_pb2.LayerAhead(token=1, predictions=[bad])))
        readies, _ = stream.acquire(8, 3, [3])
        assert [r.expert.expert for r in readies] == [3]
        stream.release(3, [3])
        assert lone.stats().signals_rejected == 2
        log = lone.proc.log()
        assert "dropping malformed route messages" in log
        assert "Route names layer 2, which is not a MoE layer of the store (MoE layers: [1, 3])" in log
    finally:
        stream.close()


def test_the_prefetch_bar_is_live(lone):
    """``prefetch_min_probability`` holds a prediction back while it is above the prediction's
    estimated confidence (a new depth's prior precision, 0.8), and lowered again lets it start,
    without a restart."""
    assert lone.stats().config.prefetch_min_probability == pytest.approx(0.7)
    reply = update(lone, prefetch_min_probability=0.9)
    assert list(reply.changed) == ["prefetch_min_probability"]
    assert reply.config.prefetch_min_probability == pytest.approx(0.9)
    stream = DemandStream(lone.stub)
    try:
        send = begin_routed(stream)
        prediction = cache_pb2.LayerPrediction(decoder_layer=3, depth=1, experts=[2, 3], scores=[0.9, 0.6])
        send(cache_pb2.DemandRequest(layer_ahead=cache_pb2.LayerAhead(token=0, predictions=[prediction])))

        def prefetched() -> int:
            return sum(p.started for p in lone.stats().prefetch)

        # A demand on the same stream is served after the signals before it were applied.
        readies, _ = stream.acquire(7, 1, [4])
        stream.release(1, [4])
        time.sleep(0.5)  # the prefetch worker's pass after those signals
        assert prefetched() == 0
        assert lone.stats().tiers[0].resident == 1  # expert 4 of layer 1 alone
        update(lone, prefetch_min_probability=0.7)  # the change itself wakes the worker
        wait_for(lambda: prefetched() == 2 and lone.stats().tiers[0].resident == 3)
        readies, _ = stream.acquire(8, 3, [3, 2])
        assert {r.source for r in readies} == {cache_pb2.TIER_DEVICE}
        for r in readies:
            assert lone.slot_bytes(r.slot) == lone.blob(3, r.expert.expert)
        stream.release(3, [2, 3])
    finally:
        stream.close()


def test_an_acquire_carries_its_layers_signals(lone):
    """Route and LayerAhead ride in an Acquire: applied with it (the lookahead starts its
    prefetches), a malformed one dropped and counted while the Acquire is served, and an
    Acquire carrying more than MAX_CARRIED_SIGNALS of a kind refused by name."""
    from cache_daemon.client_messages import MAX_CARRIED_SIGNALS

    stream = DemandStream(lone.stub)
    try:
        stream._requests.put(cache_pb2.DemandRequest(request_begin=cache_pb2.RequestBegin(request_id="r")))
        acquire = cache_pb2.Acquire(
            ticket=1,
            decoder_layer=1,
            experts=[0],
            routes=[
                cache_pb2.Route(request_id="r", token=0, decoder_layer=1, experts=[0, 1]),
                cache_pb2.Route(request_id="r", token=0, decoder_layer=2, experts=[0]),  # not MoE
            ],
            layer_aheads=[
                cache_pb2.LayerAhead(
                    request_id="r",
                    token=0,
                    predictions=[
                        cache_pb2.LayerPrediction(decoder_layer=3, depth=1, experts=[2, 3], scores=[0.9, 0.6])
                    ],
                ),
                cache_pb2.LayerAhead(
                    token=0, predictions=[cache_pb2.LayerPrediction(decoder_layer=3, depth=1, experts=[99])]
                ),
            ],
        )
        stream._requests.put(cache_pb2.DemandRequest(acquire=acquire))
        readies = []
        for response in stream.call:
            if response.WhichOneof("kind") == "done":
                break
            readies.append(response.ready)
        assert [r.expert.expert for r in readies] == [0]
        assert lone.slot_bytes(readies[0].slot) == lone.blob(1, 0)
        stream.release(1, [0])

        def prefetched() -> int:
            return next(
                p.started
                for p in lone.stats().prefetch
                if p.prediction == cache_pb2.PREFETCH_CLASS_LAYER_AHEAD
            )

        wait_for(lambda: prefetched() == 2)
        assert lone.stats().signals_rejected == 2
        log = lone.proc.log()
        assert "Route names layer 2, which is not a MoE layer of the store" in log
        # The stream goes on.
        readies, _ = stream.acquire(2, 3, [2])
        assert lone.slot_bytes(readies[0].slot) == lone.blob(3, 2)
        stream.release(3, [2])
    finally:
        stream.close()

    stream = DemandStream(lone.stub)
    try:
        route = cache_pb2.Route(request_id="r", token=0, decoder_layer=1, experts=[0])
        flood = cache_pb2.Acquire(
            ticket=3, decoder_layer=1, experts=[0], routes=[route] * (MAX_CARRIED_SIGNALS + 1)
        )
        stream._requests.put(cache_pb2.DemandRequest(acquire=flood))
        with pytest.raises(grpc.RpcError) as err:
            list(stream.call)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (
            f"Acquire for layer 1 carries {MAX_CARRIED_SIGNALS + 1} routes; at most {MAX_CARRIED_SIGNALS}"
            in err.value.details()
        )
    finally:
        stream.close()


def test_the_client_writes_signals_to_its_channel_and_rings_once_per_layer(lone):
    # The fast path's signals go into the client channel's ring at once; with_acquire only holds
    # back the doorbell, which the layer's acquire rings (with its demand, or alone for hits).
    client = fast_client(lone)
    try:
        channel = client._link.shm_channel
        client.begin_request("req-3")
        rung = channel.doorbell_seq
        client.routed("req-3", 0, 1, [4], with_acquire=True)
        client.layer_ahead("req-3", 0, [Prediction(3, (5,), (0.8,))], with_acquire=True)
        assert client.signals_sent == 3  # begin, route, lookahead: written, nothing held back
        assert channel.doorbell_seq == rung  # the daemon is not woken before the acquire
        got = list(client.acquire(1, [4]))  # a miss: its demand rings the doorbell once
        assert [(r.expert, r.source.value) for r in got] == [(4, "store")]
        assert channel.doorbell_seq == rung + 1
        wait_for(lambda: lone.stats().tiers[0].resident >= 2)  # the lookahead's prefetch of L3E5
        client.release(1, [4])
        client.routed("req-3", 1, 3, [5], with_acquire=True)
        got = list(client.acquire(3, [5]))  # a hit through the slot table: the doorbell still rings
        assert [(r.expert, r.source.value) for r in got] == [(5, "device")]
        assert channel.doorbell_seq == rung + 2
        client.release(3, [5])
        client.routed("req-3", 2, 1, [4], with_acquire=True)
        client.end_request("req-3")  # rings for both
        assert channel.doorbell_seq == rung + 3
        assert (client.signals_sent, client.signals_dropped) == (6, 0)
        assert lone.stats().signals_rejected == 0
    finally:
        client.close()


def test_client_prediction_methods_never_wait_and_count_drops(lone):
    client = fast_client(lone)
    try:
        client.begin_request("req-2")
        client.routed("req-2", 0, 1, [4, 5])
        client.layer_ahead("req-2", 0, [Prediction(3, (1,), (0.8,))])
        wait_for(lambda: lone.stats().tiers[0].resident >= 1)
        got = list(client.acquire(3, [1]))  # prefetched: a hit through shared memory, no Demand
        assert [(r.expert, r.source.value) for r in got] == [(1, "device")]
        client.release(3, [1])
        client.end_request("req-2")
        assert (client.signals_sent, client.signals_dropped) == (4, 0)
        with pytest.raises(Exception, match=r"layer_ahead for layer 3 at depth 1: 2 experts but 1 scores"):
            client.layer_ahead("req-2", 0, [Prediction(3, (1, 2), (0.5,))])
    finally:
        client.close()
    client.routed("req-2", 1, 1, [0])  # no stream any more: dropped and counted, never raised or waited for
    assert client.signals_dropped == 1


def replace_text(path: Path, text: str) -> None:
    """``path`` holds ``text`` from one instant to the next (a rename, as a ConfigMap volume swaps
    its files): the daemon watches the file, and an in-place write could be read empty in between,
    i.e. as all defaults (a SIGHUP test once failed so, its reload by the watcher reading it so)."""
    staged = path.with_name(path.name + ".new")
    staged.write_text(text)
    os.replace(staged, path)


def test_sighup_reloads_live_fields_and_refuses_the_rest(tmp_path):
    config = tmp_path / "daemon.yaml"
    config.write_text("eviction_policy: lru\n")
    d = launch(tmp_path, extra=["--config-file", str(config)])
    try:
        assert d.stats().config.eviction_policy == "lru"
        replace_text(config, "eviction_policy: lfu\nprefetch: false\n")
        d.proc.popen.send_signal(signal.SIGHUP)
        wait_for(lambda: d.stats().config.eviction_policy == "lfu")
        assert not d.stats().config.prefetch
        replace_text(config, "eviction_policy: moe-infinity\nio_threads: 2\n")  # io_threads is not live
        d.proc.popen.send_signal(signal.SIGHUP)
        wait_for(lambda: d.stats().config.eviction_policy == "moe-infinity")
        assert "config field 'io_threads' changed in file" in d.proc.log()
        assert "applies only at start: not applied until the service restarts" in d.proc.log()
        replace_text(config, "eviction_policy: fifo\n")  # invalid: refused whole
        d.proc.popen.send_signal(signal.SIGHUP)
        wait_for(lambda: "refused, the running config stays" in d.proc.log())
        assert "'eviction_policy' = 'fifo' is not one of" in d.proc.log()
        assert d.stats().config.eviction_policy == "moe-infinity"
        # A ConfigMap volume changes the file with no signal: the daemon notices by itself.
        replace_text(config, "eviction_policy: activation-aware\nprefetch: true\nhint_ttl_tokens: 9\n")
        wait_for(lambda: d.stats().config.hint_ttl_tokens == 9)
        assert d.stats().config.eviction_policy == "activation-aware" and d.stats().config.prefetch
    finally:
        d.close()
        assert d.proc.stop() == 0, d.proc.log()
