"""The daemon's side of a compute client's channel: its demands and signals, in shared memory.

While a client's ledger is tied to its Demand stream, a ``ChannelServer`` thread serves the
channel (``expertcache.native.ClientChannel``, csrc/include/expertcache/channel.h): a miss costs
compute no gRPC message, one futex wake each way. It reaches the residency only through its
``ChannelPort`` (docs/residency.md, "The client channel").
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from cache_daemon.client_messages import AcquireTrace, ClientMessages, Op
from cache_daemon.decisions.intake import SignalIntake
from cache_daemon.decisions.signals import LayerPrediction
from cache_daemon.errors import SessionClosed, ShuttingDown
from cache_daemon.metrics import DaemonMetrics
from cache_daemon.residency.clients import ClientLedger, Session
from cache_daemon.tiers.base import Tier
from expertcache.errors import ExpertCacheError, InvalidArgument
from expertcache.keys import ExpertKey
from expertcache.native import ClientChannel, SlotTable
from expertcache.protocol import CHANNEL_CODE, GATHER_BELOW_BYTES, STATUS_OK, decode_trace_context, status_of

if TYPE_CHECKING:
    from cache_daemon.residency.loader import Load

logger = logging.getLogger(__name__)

# Requests one client may have begun and not ended at once (compute's batch is far smaller): a
# begin beyond it is dropped and counted as a rejected signal.
MAX_LIVE_REQUESTS = 4096
# Signal records applied in one hold of the residency lock, at most.
MAX_OPS_PER_HOLD = 512
_EXPERT_OVERFLOW = 0xFFFFFFFF  # take_demand's mark of a count beyond the mailbox


@dataclass(frozen=True, slots=True)
class ChannelPort:
    """What a channel server uses of the residency, one per residency: the callables are its
    parts' bound methods (no hop through the residency on a demand)."""

    admit: Callable[[ChannelServer, int, list[int]], list[Load]]  # signals are the caller's to apply
    run_deferred: Callable[[list[Load]], None]  # host-tier copies in this thread, outside the lock
    copies_from_host: Callable[[list[Load]], bool]  # whether run_deferred would copy any (not only read)
    close_session: Callable[[Session], None]
    closing: Callable[[], bool]  # the daemon shuts down: the thread ends
    intake: SignalIntake
    metrics: DaemonMetrics
    table: SlotTable
    num_experts: int
    blob_bytes: int


class ChannelServer:
    """Serves one client's channel on a thread of its own while ``session`` lives."""

    def __init__(
        self, port: ChannelPort, session: Session, ledger: ClientLedger, channel: ClientChannel
    ) -> None:
        self._port = port
        self.session = session
        self.ledger = ledger
        self.channel = channel
        self._requests: dict[int, str] = {}  # the client's request handles -> request ids
        self._taken = 0  # the last demand sequence number served
        self._serving: int | None = None  # the demand taken up and not yet answered
        self._messages = ClientMessages(
            port.intake, port.metrics.signals.labels("rejected"), f"client ledger {ledger.index}"
        )
        self._trace = _DemandTrace()
        self.gather = port.blob_bytes < GATHER_BELOW_BYTES
        self._thread = threading.Thread(
            target=self._run, name=f"expertcache-channel-{ledger.index}", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        """Wake the thread (it then sees its session closed, or the daemon closing)."""
        self.channel.ring_doorbell()

    def join(self, timeout_s: float) -> None:
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    # -- under the residency lock (admission and load results) -------------------------------------
    def hold(self, key: ExpertKey) -> None:
        """Pin ``key`` (LOADING or RESIDENT) into the client's ledger."""
        entry = key.entry(self._port.num_experts)
        if not self._port.table.hold_for_client(self.ledger.index, self.ledger.epoch, entry):
            raise SessionClosed(f"client ledger {self.ledger.index} was reclaimed: its stream ended")

    def set_source(self, position: int, tier: Tier, prefetch: str = "") -> None:
        """Demand position ``position`` was found in ``tier`` (brought by ``prefetch``, if any)."""
        self.channel.set_source(position, CHANNEL_CODE[tier])
        self._trace.ready(position, tier, prefetch)

    def loaded(self, position: int, tier: Tier) -> None:
        """A load the client waits for landed: record where it came from and wake the client."""
        self.channel.set_source(position, CHANNEL_CODE[tier])
        self._trace.ready(position, tier)
        self.channel.notify()

    def failed(self, key: ExpertKey, error: BaseException) -> None:
        """A load the client waits for failed: take its pin back and tell the client why."""
        entry = key.entry(self._port.num_experts)
        self._port.table.unhold_for_client(self.ledger.index, self.ledger.epoch, entry)
        code = error.grpc_code if isinstance(error, ExpertCacheError) else "INTERNAL"
        self.channel.fail(status_of(code), f"loading expert {key} failed: {error}")
        self._trace.end()

    # -- the thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        channel, port = self.channel, self._port
        try:
            while not self.session.closed and not port.closing():
                seen = channel.doorbell_seq
                ops = self._drain_signals()
                # The admission answers within microseconds: the take raises the channel's
                # ``copying`` at once, so that compute polls for it (unless a flood of records is
                # applied first).
                demand = channel.take_demand(self._taken, copying=len(ops) <= MAX_OPS_PER_HOLD)
                # A flood of records is applied in bounded holds of the lock: one client's ring
                # never keeps the others' admissions waiting for long.
                while len(ops) > MAX_OPS_PER_HOLD:
                    port.intake.apply_ops(ops[:MAX_OPS_PER_HOLD])
                    ops = ops[MAX_OPS_PER_HOLD:]
                # The layer's signals are applied once its demand is answered (admitted, its
                # reads submitted, the hits' sources set): they cost a hundred microseconds of
                # Python that compute would otherwise wait out, and the prefetch decision they
                # steer follows them either way.
                try:
                    if demand is not None:
                        self._serve(*demand)
                finally:
                    if ops:
                        port.intake.apply_ops(ops)
                if demand is None:
                    channel.wait_doorbell(seen)  # no timeout: a post, a reclaim or shutdown rings it
        except (SessionClosed, ShuttingDown):
            pass
        except Exception as exc:  # noqa: BLE001 - a bug here must not take the daemon down silently
            self._fail(exc)
        finally:
            self._trace.end()

    def _fail(self, exc: Exception) -> None:
        """Any other error ends the channel: the demand in progress is answered INTERNAL (compute
        fails that layer at once instead of waiting out its deadline) and the session is closed,
        which reclaims the client's pins; compute attaches again for the next request."""
        self._port.metrics.channel_failures.inc()
        logger.error(
            "the channel of client ledger %d failed; ending its session: %s: %s",
            self.ledger.index,
            type(exc).__name__,
            exc,
            exc_info=logger.isEnabledFor(logging.DEBUG),
        )
        if self._serving is not None and not self.session.closed:
            self.channel.reply(
                self._serving,
                status_of("INTERNAL"),
                f"the cache daemon's channel failed: {type(exc).__name__}",
            )
        self._port.close_session(self.session)  # this thread: close skips joining itself

    def _serve(self, seq: int, layer: int, experts: list[int], trace: bytes = b"") -> None:
        self._taken = seq
        self._serving = seq
        self._trace.end()  # the previous demand's, if some of it never landed
        # The channel's ``copying`` tells the client that an answer or a landing is microseconds
        # away, so that it polls rather than sleep: up while a demand is admitted (raised by the
        # take, unless a flood of signals went first), and while host-tier experts are copied;
        # down while a layer's signals are applied, or store reads are waited for (hundreds of
        # microseconds, or milliseconds, that polling would take from the daemon's threads).
        try:
            self._admit_and_answer(seq, layer, experts, trace)
        finally:
            self.channel.copying = False

    def _admit_and_answer(self, seq: int, layer: int, experts: list[int], trace: bytes) -> None:
        started = time.monotonic()
        try:
            if experts and experts[-1] == _EXPERT_OVERFLOW:
                raise InvalidArgument(
                    f"a demand on the channel names more than {self.channel.max_demand} experts"
                )
            if trace:
                self._trace.start(
                    AcquireTrace.start(decode_trace_context(trace), layer, experts, self._port.blob_bytes),
                    layer,
                    experts,
                )
            deferred = self._port.admit(self, layer, experts)
        except (SessionClosed, ShuttingDown):
            raise
        except ExpertCacheError as exc:
            self.channel.reply(seq, status_of(exc.grpc_code), str(exc))
            self._serving = None
            self._trace.end()
            return
        metrics = self._port.metrics
        metrics.acquire_experts.observe(len(experts))
        # Host-tier copies of the missing experts run here, in order; store reads go to the I/O
        # pool. Small experts: copied before the answer, so that the client wakes once to find
        # them all. Large ones: answered first, each announced as it lands.
        # (Never answered once the client is gone: its channel may soon be another client's.)
        copying = bool(deferred) and self._port.copies_from_host(deferred)
        if copying:
            self.channel.copying = True  # the client polls for the copies (and the answer)
        if self.gather:
            if deferred:
                self._port.run_deferred(deferred)
            if not self.session.closed:
                self.channel.reply(seq, STATUS_OK, "")
            self._serving = None
        else:
            if not self.session.closed:
                self.channel.reply(seq, STATUS_OK, "")
            self._serving = None
            # Lowered after the answer (polled for while it is up), unless copies follow it.
            self.channel.copying = copying
            if deferred:
                self._port.run_deferred(deferred)
        metrics.acquire_wait.observe(time.monotonic() - started)

    def _drain_signals(self) -> list[Op]:
        """The ring's records since the last drain, checked: ops for ``SignalIntake.apply_ops``."""
        records, corrupt = self.channel.drain()
        messages = self._messages
        if corrupt:
            messages.reject("corrupt", "a malformed record in the signal ring (the rest of it was skipped)")
        ops: list[Op | None] = []
        for record in records:
            kind, handle = record[0], record[1]
            if kind == "begin":
                if handle not in self._requests and len(self._requests) >= MAX_LIVE_REQUESTS:
                    messages.reject(kind, f"more than {MAX_LIVE_REQUESTS} live requests on one channel")
                    continue
                request_id = record[2].decode("utf-8", "replace")
                self._requests[handle] = request_id
                ops.append(messages.begin(request_id))
                continue
            if kind == "end":
                request_id = self._requests.pop(handle, None)
                if request_id is not None:
                    ops.append(messages.end(request_id))
                continue
            request_id = self._requests.get(handle)
            if request_id is None:
                messages.reject(kind, f"request handle {handle} was never begun on this channel")
            elif kind == "route":
                _, _, token, layer, experts = record
                ops.append(messages.route(request_id, token, layer, experts))
            else:
                _, _, token, predictions = record
                ops.append(
                    messages.layer_ahead(
                        request_id,
                        token,
                        [
                            LayerPrediction(int(lay), int(dep), ex, np.asarray(sc))
                            for lay, dep, ex, sc in predictions
                        ],
                    )
                )
        return [op for op in ops if op is not None]


class _DemandTrace:
    """The spans of the traced demand in progress, if any: ended when its last expert is ready,
    when one fails, or when the next demand is taken up. Its calls come from the channel thread
    and, under the residency lock, from the threads that land loads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._trace: AcquireTrace | None = None
        self._keys: list[ExpertKey] = []
        self._left = 0

    def start(self, trace: AcquireTrace | None, layer: int, experts: list[int]) -> None:
        if trace is None:
            return
        with self._lock:
            self._trace, self._keys, self._left = trace, [ExpertKey(layer, e) for e in experts], len(experts)

    def ready(self, position: int, tier: Tier, prefetch: str = "") -> None:
        if self._trace is None:  # not traced: no lock taken
            return
        with self._lock:
            trace = self._trace
            if trace is None or not 0 <= position < len(self._keys):
                return
            trace.ready(self._keys[position], tier, prefetch)
            self._left -= 1
            if self._left <= 0:
                self._trace = None
                trace.end()

    def end(self) -> None:
        if self._trace is None:
            return
        with self._lock:
            trace, self._trace = self._trace, None
        if trace is not None:
            trace.end()


__all__ = ["MAX_LIVE_REQUESTS", "MAX_OPS_PER_HOLD", "ChannelPort", "ChannelServer"]
