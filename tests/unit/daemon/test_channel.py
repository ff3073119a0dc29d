"""The daemon's side of a client channel (cache_daemon/residency/channel.py) on a real Residency:
a demand is admitted into the client's ledger and answered, host-tier copies run on the channel's
thread, failures and refusals reach the client with their status, signals are applied or
rejected, and nothing is left pinned when the client goes."""

from __future__ import annotations

import mmap
import os
import struct
import threading
import time
from pathlib import Path

import pytest

from cache_daemon.decisions.policy import make_policy
from cache_daemon.residency import ClientLedger
from cache_daemon.residency.channel import MAX_OPS_PER_HOLD
from cache_daemon.residency.sessions import STRAY_CONFIRM_S
from expertcache import protocol as codes
from expertcache.keys import ExpertKey
from expertcache.native import SlotTable
from expertcache.prom import value
from tests.residencies import ResidencyHarness, harnesses
from tests.slot_tables import compute_handle
from tests.stores import corrupt
from tests.waiting import wait_for

L1, L3 = 1, 3  # the synthetic store's MoE layers, 6 experts each
CLIENT_HEADER_BYTES = 128  # a client region: header, then uint32 pins[num_entries] (slot_table.h)


class Client:
    """A compute process's view: the table read-only and its ledger's own region."""

    def __init__(self, daemon_table: SlotTable, ledger: ClientLedger, num_experts: int) -> None:
        self.table = compute_handle(daemon_table, ledger.index)
        self.channel = self.table.channel(ledger.index)
        self.num_experts = num_experts

    def demand(self, layer: int, experts: list[int], timeout_s: float = 5.0) -> tuple[int, str]:
        seen = self.channel.notify_seq
        seq = self.channel.post_demand(layer, experts)
        self.channel.ring_doorbell()
        deadline = time.monotonic() + timeout_s
        while self.channel.reply_seq != seq:
            assert time.monotonic() < deadline, "no reply"
            self.channel.wait_notify(seen, 0.5, 100e-6)
            seen = self.channel.notify_seq
        return self.channel.reply_status, self.channel.reply_message

    def wait_resident(self, layer: int, experts: list[int], timeout_s: float = 5.0) -> list[int]:
        entries = [layer * self.num_experts + e for e in experts]
        deadline = time.monotonic() + timeout_s
        while True:
            seen = self.channel.notify_seq
            slots = self.table.resident_slots(entries)
            if all(s >= 0 for s in slots):
                return slots
            assert time.monotonic() < deadline, f"not resident: {slots}"
            self.channel.wait_notify(seen, 0.5, 100e-6)

    def release(self, layer: int, experts: list[int]) -> None:
        self.table.unpin_many([layer * self.num_experts + e for e in experts])


class Harness(ResidencyHarness):
    """Two I/O threads and a 2 s acquire timeout; ``attach`` plays compute's side."""

    def __init__(self, tmp_path: Path, *, slots: int, host_slots: int = 0) -> None:
        super().__init__(
            tmp_path,
            slots=slots,
            host_slots=host_slots,
            io_threads=2,
            acquire_timeout_s=2.0,
            daemon_id="chan",
        )

    def attach(self) -> tuple[Client, object]:
        """Attach (a ledger and an emptied channel) and tie it to a session: the server starts."""
        ledger = self.residency.claim_client()
        session = self.residency.open_session("compute")
        client = Client(self.table, ledger, self.manifest.num_experts)
        self.residency.bind_client(session, ledger)
        return client, session


@pytest.fixture
def make(tmp_path):
    yield from harnesses(tmp_path, Harness)


def test_a_demand_pins_into_the_ledger_and_reports_each_source(make):
    h = make(slots=4, host_slots=8)
    client, session = h.attach()
    assert client.demand(L1, [0, 1]) == (codes.STATUS_OK, "")
    slots = client.wait_resident(L1, [0, 1])
    for expert, slot in zip((0, 1), slots, strict=True):
        assert bytes(h.arena.slots[slot].numpy()) == h.blob(ExpertKey(L1, expert))
        assert h.table.client_pins(session.ledger, L1 * 6 + expert) == 1
    assert [client.channel.source(i) for i in (0, 1)] == [codes.SOURCE_STORE] * 2
    client.release(L1, [0, 1])
    assert h.residency.stats().pinned == 0
    # Evicted from the arena (4 slots, 4 others wanted) but kept by the host tier: a copy, no read.
    assert client.demand(L3, [0, 1, 2, 3]) == (codes.STATUS_OK, "")
    client.wait_resident(L3, [0, 1, 2, 3])
    client.release(L3, [0, 1, 2, 3])
    assert client.demand(L1, [1, 0]) == (codes.STATUS_OK, "")
    client.wait_resident(L1, [1, 0])
    assert [client.channel.source(i) for i in (0, 1)] == [codes.SOURCE_HOST] * 2
    client.release(L1, [0, 1])
    assert client.demand(L1, [0]) == (codes.STATUS_OK, "")  # resident: known at once
    assert client.channel.source(0) == codes.SOURCE_DEVICE
    client.release(L1, [0])
    stats = h.residency.stats()
    assert stats.pinned == 0 and value(h.metrics.demands) == 4


def test_the_channel_says_copying_while_its_thread_copies_from_the_host_tier(make, monkeypatch):
    """Compute polls for landings only while this is raised (a store read it sleeps through)."""
    h = make(slots=4, host_slots=8)
    client, _ = h.attach()
    seen_while_copying: list[bool] = []
    copy_in = h.arena.copy_in

    def watched(slot, src):
        seen_while_copying.append(client.channel.copying)
        return copy_in(slot, src)

    monkeypatch.setattr(h.arena, "copy_in", watched)
    for layer in (L1, L3, L1):  # L1 from the store, evicted by L3, then copied from the host tier
        assert client.demand(layer, [0, 1, 2, 3]) == (codes.STATUS_OK, "")
        client.wait_resident(layer, [0, 1, 2, 3])
        client.release(layer, [0, 1, 2, 3])
    assert [client.channel.source(i) for i in range(4)] == [codes.SOURCE_HOST] * 4
    copies_from_host = seen_while_copying[-4:]
    assert copies_from_host == [True] * 4
    wait_for(lambda: not client.channel.copying, "copying lowered once the copies are done")


def test_the_channel_does_not_say_copying_while_misses_it_answered_are_read_from_the_store(make, monkeypatch):
    """A store read takes milliseconds: compute sleeps through it rather than poll a CPU away.
    (Large experts: the answer goes first; the reads were submitted by the admission.)"""
    from cache_daemon.residency import channel as channel_module

    monkeypatch.setattr(channel_module, "GATHER_BELOW_BYTES", 0)  # every expert is "large"
    h = make(slots=4)  # no host tier: every miss is a store read
    client, _ = h.attach()
    h.store.pause()  # the reads stay queued in the reader until resumed
    try:
        assert client.demand(L1, [0, 1, 2]) == (codes.STATUS_OK, "")
        assert h.store.reader_stats()["queued"] == 3  # submitted before the answer
        # lowered just after the answer, the reads still pending: compute may sleep
        wait_for(lambda: not client.channel.copying, "copying lowered while the reads are pending")
        assert h.store.reader_stats()["queued"] == 3
    finally:
        h.store.resume()
    client.wait_resident(L1, [0, 1, 2])
    client.release(L1, [0, 1, 2])
    assert [client.channel.source(i) for i in range(3)] == [codes.SOURCE_STORE] * 3
    assert not client.channel.copying


def test_the_channel_says_copying_while_admitting_but_not_after_a_flood_of_signals(make, monkeypatch):
    """An admission answers in microseconds, the signals that came with it waiting until it has
    (compute polls for the answer); a flood of records applied first takes far longer (compute
    sleeps). Both lower it after."""
    from cache_daemon.residency.admission import Admission

    h = make(slots=4)
    client, _ = h.attach()
    seen_while_admitting: list[bool] = []
    admit = Admission._admit

    def watched(self, *args, **kwargs):
        seen_while_admitting.append(client.channel.copying)
        return admit(self, *args, **kwargs)

    monkeypatch.setattr(Admission, "_admit", watched)
    assert client.demand(L1, [0]) == (codes.STATUS_OK, "")  # nothing in the ring before it
    client.wait_resident(L1, [0])
    client.release(L1, [0])
    client.channel.signal_begin(1, "req-a")
    client.channel.signal_route(1, 0, L3, [1])  # applied once the demand is answered
    assert client.demand(L3, [1]) == (codes.STATUS_OK, "")
    client.wait_resident(L3, [1])
    client.release(L3, [1])
    floods = MAX_OPS_PER_HOLD + 1
    for token in range(floods):
        assert client.channel.signal_route(1, token + 1, L1, [token % 6])
    assert client.demand(L3, [2]) == (codes.STATUS_OK, "")
    client.wait_resident(L3, [2])
    client.release(L3, [2])
    assert seen_while_admitting == [True, True, False]
    wait_for(lambda: value(h.metrics.signals, "route") == 1 + floods, "every route applied")
    wait_for(lambda: not client.channel.copying, "copying lowered once the demands were served")


def test_a_bad_demand_is_refused_with_its_status_and_nothing_pinned(make):
    h = make(slots=2)
    client, _ = h.attach()
    status, message = client.demand(L1, [0, 1, 2])
    assert codes.STATUS_NAMES[status] == "INVALID_ARGUMENT"
    assert "names 3 experts but the arena has 2 slots" in message
    status, message = client.demand(2, [0])
    assert codes.STATUS_NAMES[status] in ("INVALID_ARGUMENT", "NOT_FOUND") and "layer 2" in message
    status, message = client.demand(L1, [4, 4])
    assert "names expert 4 more than once" in message
    assert h.residency.stats().pinned == 0
    assert client.demand(L1, [5]) == (codes.STATUS_OK, "")  # the channel goes on
    client.wait_resident(L1, [5])
    client.release(L1, [5])


def test_a_failed_load_unpins_and_tells_the_client_why(make):
    h = make(slots=4)
    corrupt(h.root, h.manifest, ExpertKey(L1, 3))
    client, session = h.attach()
    fail_seen = client.channel.fail_seq
    assert client.demand(L1, [2, 3]) == (codes.STATUS_OK, "")
    deadline = time.monotonic() + 5
    while client.channel.fail_seq == fail_seen:
        assert time.monotonic() < deadline
        client.channel.wait_notify(client.channel.notify_seq, 0.2)
    assert codes.STATUS_NAMES[client.channel.fail_status] == "DATA_LOSS"
    assert "L1E3" in client.channel.fail_message and "checksum mismatch" in client.channel.fail_message
    assert h.table.client_pins(session.ledger, L1 * 6 + 3) == 0  # the daemon took its pin back
    client.wait_resident(L1, [2])
    client.release(L1, [2])
    assert h.residency.stats().pinned == 0


def test_a_demand_waits_for_slots_the_client_itself_frees(make):
    h = make(slots=2)
    client, _ = h.attach()
    assert client.demand(L1, [0, 1]) == (codes.STATUS_OK, "")
    client.wait_resident(L1, [0, 1])
    # Both slots pinned by this client: the next demand waits until it releases them.
    seq = client.channel.post_demand(L3, [0, 1])
    client.channel.ring_doorbell()
    time.sleep(0.2)
    assert client.channel.reply_seq != seq
    client.release(L1, [0, 1])  # an unpin through the table wakes the waiting admission
    deadline = time.monotonic() + 5
    while client.channel.reply_seq != seq:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert client.channel.reply_status == codes.STATUS_OK
    client.wait_resident(L3, [0, 1])
    client.release(L3, [0, 1])


def test_a_demand_that_never_fits_times_out_with_deadline_exceeded(make):
    h = make(slots=2)
    client, _ = h.attach()
    assert client.demand(L1, [0, 1]) == (codes.STATUS_OK, "")
    client.wait_resident(L1, [0, 1])
    client.channel.signal_begin(1, "req-a")
    client.channel.signal_route(1, 0, L3, [0])  # comes with the demand: applied all the same
    status, message = client.demand(L3, [0], timeout_s=10)  # its own pins hold every slot
    assert codes.STATUS_NAMES[status] == "DEADLINE_EXCEEDED" and "acquire_timeout_s" in message
    assert value(h.metrics.signals, "route") == 1
    client.release(L1, [0, 1])


def test_a_demand_is_answered_before_the_signals_that_came_with_it_are_applied(make, monkeypatch):
    """The admission comes first: its victims are chosen on the estimates the last decision
    computed, its reads are in the reader and the client has its answer before the signals
    (which change those estimates, in hundreds of microseconds) are applied; they are applied all
    the same, after a refused demand too."""
    from cache_daemon.decisions.intake import SignalIntake

    h = make(slots=4)
    client, _ = h.attach()
    when_applied: list[tuple[int, int]] = []  # (reads submitted, the channel's last answer)
    apply = SignalIntake.apply_ops_locked

    def watched(self, ops):
        ops = list(ops)
        if ops:
            when_applied.append((h.store.reader_stats()["submitted"], client.channel.reply_seq))
        return apply(self, ops)

    monkeypatch.setattr(SignalIntake, "apply_ops_locked", watched)
    client.channel.signal_begin(1, "req-a")
    client.channel.signal_route(1, 0, L1, [0, 1])
    assert client.demand(L1, [0, 1]) == (codes.STATUS_OK, "")
    answered = client.channel.reply_seq
    client.wait_resident(L1, [0, 1])
    client.release(L1, [0, 1])
    wait_for(lambda: value(h.metrics.signals, "route") == 1, "the route applied")
    assert when_applied == [(2, answered)]
    assert h.residency.signals.live_requests == ("req-a",)

    client.channel.signal_route(1, 1, L3, [0])
    status, message = client.demand(L3, [0, 0])  # refused: named twice
    assert codes.STATUS_NAMES[status] == "INVALID_ARGUMENT" and "more than once" in message
    wait_for(lambda: value(h.metrics.signals, "route") == 2, "the refused demand's route applied")
    assert when_applied[-1] == (2, client.channel.reply_seq)


def test_signals_are_applied_in_order_and_malformed_ones_rejected(make):
    h = make(slots=4)
    client, _ = h.attach()
    ch = client.channel
    ch.signal_begin(1, "req-a")
    ch.signal_route(1, 0, L1, [0, 2])
    ch.signal_ahead(1, 0, [L3], [1], [[4]], [[0.9]])
    ch.signal_route(1, 0, 2, [0])  # layer 2 is not a MoE layer
    ch.signal_route(9, 0, L1, [0])  # a handle never begun
    ch.ring_doorbell()
    signals = h.residency.signals
    deadline = time.monotonic() + 5
    while value(h.metrics.signals, "rejected") < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert "req-a" in signals.live_requests
    assert value(h.metrics.signals, "route") == 1
    assert value(h.metrics.signals, "layer_ahead") == 1
    ch.signal_end(1)
    ch.ring_doorbell()
    while "req-a" in signals.live_requests:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_flood_of_signal_records_is_applied_in_bounded_holds_of_the_lock(make, monkeypatch):
    """Finding C7: one client's ring flood was applied in one hold of the daemon's lock (up to the
    ring's 16,000 records), keeping every other client's admission waiting meanwhile."""
    h = make(slots=4)
    client, _ = h.attach()
    intake = h.residency.intake
    holds: list[int] = []
    real = intake.apply_ops

    def counted(ops):
        holds.append(len(ops))
        real(ops)

    monkeypatch.setattr(intake, "apply_ops", counted)
    ch = client.channel
    ch.signal_begin(1, "req-flood")
    floods = 2000
    for token in range(floods):
        assert ch.signal_route(1, token, L1, [token % 6])
    ch.ring_doorbell()  # the channel's thread finds them all at once
    wait_for(lambda: value(h.metrics.signals, "route") == floods, "every route applied")
    assert sum(holds) == floods + 1 and max(holds) <= MAX_OPS_PER_HOLD, holds


def test_signals_wanted_follows_the_policy_and_prefetch(make):
    h = make(slots=4)
    assert not h.table.signals_wanted  # lru, prefetch off: nothing reads them
    h.residency.configure_prefetch(enabled=True, max_inflight_bytes=0)
    assert h.table.signals_wanted
    h.residency.configure_prefetch(enabled=False, max_inflight_bytes=0)
    h.residency.set_policy(make_policy("activation-aware", signals=h.residency.signals))
    assert h.table.signals_wanted


def test_closing_the_session_reclaims_the_pins_and_ends_the_thread(make):
    h = make(slots=4)
    client, session = h.attach()
    assert client.demand(L1, [0, 1]) == (codes.STATUS_OK, "")
    client.wait_resident(L1, [0, 1])
    assert h.residency.stats().pinned == 2
    name = f"expertcache-channel-{session.ledger}"
    (thread,) = [t for t in threading.enumerate() if t.name == name]
    h.residency.close_session(session)  # compute died: its stream ended
    thread.join(5)
    assert not thread.is_alive()
    assert h.residency.stats().pinned == 0


def test_many_clients_are_served_at_once(make):
    h = make(slots=6, host_slots=12)
    clients = [h.attach()[0] for _ in range(3)]
    errors = []

    def work(client: Client, layer: int) -> None:
        try:
            for i in range(30):
                experts = [i % 6, (i + 1) % 6]
                assert client.demand(layer, experts, timeout_s=10)[0] == codes.STATUS_OK
                client.wait_resident(layer, experts)
                client.release(layer, experts)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(c, L1 if i % 2 else L3)) for i, c in enumerate(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert h.residency.stats().pinned == 0


def test_an_internal_error_answers_internal_and_ends_the_session(make, monkeypatch):
    """Finding C5: the channel's thread died on any exception other than ExpertCacheError; the
    demand was never answered and compute stalled for its whole deadline (120 s)."""
    h = make(slots=4)
    client, session = h.attach()
    index = session.ledger
    epoch = h.table.client_epoch(index)

    def broken(*args, **kwargs):
        raise KeyError("a bug in admission")

    # The demand's admission, under the lock (the server's port is bound to the admission's
    # method at start, so it is patched one call down).
    monkeypatch.setattr(h.residency._admission, "_try_admit", broken)
    status, message = client.demand(L1, [0])
    assert codes.STATUS_NAMES[status] == "INTERNAL" and "KeyError" in message
    wait_for(lambda: h.table.client_epoch(index) != epoch, "the failed channel's ledger reclaimed")
    assert value(h.metrics.channel_failures) == 1
    # Its ledger went with it: the client's next call learns it must attach again.
    with pytest.raises(RuntimeError, match="reclaimed by the cache daemon"):
        client.table.try_pin_many([0])


def stray_pins(table: SlotTable, ledger: int, entries: list[int], count: int = 1) -> None:
    """What a hostile compute can do in its own region: write pin counts at will."""
    fd = table.client_fd(ledger)
    try:
        region = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    with region:
        for e in entries:
            struct.pack_into("<I", region, CLIENT_HEADER_BYTES + 4 * e, count)


def test_a_client_pinning_at_will_loses_its_session_and_the_others_go_on(make):
    """Finding C3 (and S2): a client's pins lived in counts every client could write, so one
    compute could hold every slot, or unpin another's experts. Now each client pins in its own
    region; one whose region pins experts that are not even resident (no real pin stays there)
    has its session ended by the next admission that lacks slots, and its pins go with it."""
    h = make(slots=2)
    good, _ = h.attach()
    hostile, hostile_session = h.attach()
    assert good.demand(L1, [0, 1]) == (codes.STATUS_OK, "")
    good.wait_resident(L1, [0, 1])
    good.release(L1, [0, 1])
    everything = list(range(h.table.num_entries))
    stray_pins(h.table, hostile_session.ledger, everything)  # both resident slots "pinned" too
    # Admitted, not DEADLINE_EXCEEDED: within the harness's 2 s acquire timeout.
    assert good.demand(L1, [2, 3]) == (codes.STATUS_OK, "")
    good.wait_resident(L1, [2, 3])
    assert hostile_session.closed and value(h.metrics.clients_revoked) == 1
    good.release(L1, [2, 3])
    assert h.residency.stats().pinned == 0


def test_a_revoked_client_is_counted_once_while_its_session_closes(make, monkeypatch):
    """The session of a revoked client closes in a thread; audits meanwhile do not revoke (and
    count) it again."""
    h = make(slots=2)
    _, session = h.attach()
    stray_pins(h.table, session.ledger, list(range(h.table.num_entries)))
    slow_close = threading.Event()
    # The audit closes a revoked client's session in a thread of its own (``Sessions``).
    monkeypatch.setattr(h.residency._sessions, "close_session", lambda s: slow_close.wait(30))

    def audit() -> float:
        with h.residency._cond:  # audit_clients runs under the residency's lock
            h.residency.audit_clients()
        return value(h.metrics.clients_revoked)

    wait_for(lambda: audit() == 1, "the client revoked")
    assert session.revoked and not session.closed
    later = time.monotonic() + 3 * STRAY_CONFIRM_S
    wait_for(lambda: audit() > 1 or time.monotonic() > later, "three confirmation periods of audits")
    assert value(h.metrics.clients_revoked) == 1
    slow_close.set()
