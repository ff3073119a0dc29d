"""The daemon's side of a compute client's channel: its demands and signals, in shared memory.

A compute process that attaches with the shared-memory fast path gets a client ledger of the
slot table, and with it a channel (``expertcache.native.ClientChannel``; layout and protocol in
csrc/include/expertcache/channel.h). When the ledger is tied to the client's Demand stream
(``Residency.bind_client``), a ``ChannelServer`` thread starts for it and serves, until that
stream ends::

    compute                                        ChannelServer thread (this module)
    signal_route / signal_ahead / begin / end ──▶  drain → checked → applied to the signals
    post_demand(layer, misses), doorbell      ──▶  admission (Residency.admit_for_client):
                                                   every expert pinned *in the client's ledger*
                                                   (resident: source DEVICE at once; missing: a
                                                   load started, the client told when it lands)
    wait on notify                            ◀──  reply(seq, 0) — or the refusal's status and
                                                   message; then host-tier copies run here
    wait until the entries are RESIDENT       ◀──  each load's end: source set, notify
    unpin_many(its entries) — locally, no message

So a miss costs compute no gRPC message and no thread hop of the daemon's: one futex wake each
way, the admission, and (from the host tier) the copy, done by this thread. The pins live in the
client's ledger, so a killed compute leaks none: its stream ends, the ledger is reclaimed (which
also wakes this thread, which then ends). A demand traced by OpenTelemetry still goes through the
Demand stream (the daemon's spans join its trace there).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import numpy as np

from cache_daemon.decisions.signals import LayerPrediction
from cache_daemon.errors import SessionClosed, ShuttingDown
from cache_daemon.residency.clients import ClientLedger, Session
from cache_daemon.tiers.base import Tier
from expertcache.channel import GATHER_BELOW_BYTES, SOURCE_OF_TIER, STATUS_OK, status_of
from expertcache.errors import ExpertCacheError, InvalidArgument
from expertcache.keys import ExpertKey
from expertcache.native import ClientChannel

if TYPE_CHECKING:
    from cache_daemon.residency.core import Residency

logger = logging.getLogger(__name__)

# Requests one client may have begun and not ended at once (compute's batch is far smaller): a
# begin beyond it is dropped and counted as a rejected signal.
MAX_LIVE_REQUESTS = 4096
# Signal records applied in one hold of the residency lock, at most.
MAX_OPS_PER_HOLD = 512
_EXPERT_OVERFLOW = 0xFFFFFFFF  # take_demand's mark of a count beyond the mailbox


class ChannelServer:
    """Serves one client's channel on a thread of its own while ``session`` lives."""

    def __init__(
        self, residency: Residency, session: Session, ledger: ClientLedger, channel: ClientChannel
    ) -> None:
        self.residency = residency
        self.session = session
        self.ledger = ledger
        self.channel = channel
        self._requests: dict[int, str] = {}  # the client's request handles -> request ids
        self._taken = 0  # the last demand sequence number served
        self._serving: int | None = None  # the demand taken up and not yet answered
        self._warned: set[str] = set()
        self.gather = residency.blob_bytes < GATHER_BELOW_BYTES
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
        entry = key.entry(self.residency.num_experts)
        if not self.residency.table.hold_for_client(self.ledger.index, self.ledger.epoch, entry):
            raise SessionClosed(f"client ledger {self.ledger.index} was reclaimed: its stream ended")

    def set_source(self, position: int, tier: Tier) -> None:
        self.channel.set_source(position, SOURCE_OF_TIER[tier.value])

    def loaded(self, position: int, tier: Tier) -> None:
        """A load the client waits for landed: record where it came from and wake the client."""
        self.channel.set_source(position, SOURCE_OF_TIER[tier.value])
        self.channel.notify()

    def failed(self, key: ExpertKey, error: BaseException) -> None:
        """A load the client waits for failed: take its pin back and tell the client why."""
        entry = key.entry(self.residency.num_experts)
        self.residency.table.unhold_for_client(self.ledger.index, self.ledger.epoch, entry)
        code = error.grpc_code if isinstance(error, ExpertCacheError) else "INTERNAL"
        self.channel.fail(status_of(code), f"loading expert {key} failed: {error}")

    # -- the thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        channel = self.channel
        try:
            while not self.session.closed and not self.residency.closing:
                seen = channel.doorbell_seq
                ops = self._drain_signals()
                demand = channel.take_demand(self._taken)
                # A flood of records is applied in bounded holds of the lock: one client's ring
                # never keeps the others' admissions waiting for long.
                while len(ops) > MAX_OPS_PER_HOLD:
                    self.residency.intake.apply_ops(ops[:MAX_OPS_PER_HOLD])
                    ops = ops[MAX_OPS_PER_HOLD:]
                if demand is not None:
                    # The layer's signals go in the admission's hold of the lock, just before it:
                    # its demand loads are started before any prefetch they trigger.
                    self._serve(*demand, ops)
                    continue
                if ops:
                    self.residency.intake.apply_ops(ops)
                channel.wait_doorbell(seen)  # no timeout: a post, a reclaim or shutdown rings it
        except (SessionClosed, ShuttingDown):
            pass
        except Exception as exc:  # noqa: BLE001 - a bug here must not take the daemon down silently
            self._fail(exc)

    def _fail(self, exc: Exception) -> None:
        """Any other error ends the channel: the demand in progress is answered INTERNAL (compute
        fails that layer at once instead of waiting out its deadline) and the session is closed,
        which reclaims the client's pins; compute attaches again for the next request."""
        self.residency.metrics.channel_failures.inc()
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
        self.residency.close_session(self.session)  # this thread: close skips joining itself

    def _serve(self, seq: int, layer: int, experts: list[int], ops: list[tuple[str, object]]) -> None:
        self._taken = seq
        self._serving = seq
        started = time.monotonic()
        try:
            if experts and experts[-1] == _EXPERT_OVERFLOW:
                raise InvalidArgument(
                    f"a demand on the channel names more than {self.channel.max_demand} experts"
                )
            deferred = self.residency.admit_for_client(self, layer, experts, ops)
        except (SessionClosed, ShuttingDown):
            raise
        except ExpertCacheError as exc:
            self.channel.reply(seq, status_of(exc.grpc_code), str(exc))
            self._serving = None
            return
        metrics = self.residency.metrics
        metrics.acquire_experts.observe(len(experts))
        # Host-tier copies of the missing experts run here, in order; store reads go to the I/O
        # pool. Small experts: copied before the answer, so that the client wakes once to find
        # them all. Large ones: answered first, each announced as it lands.
        # (Never answered once the client is gone: its channel may soon be another client's.)
        if self.gather:
            self.residency.run_deferred(deferred)
            if not self.session.closed:
                self.channel.reply(seq, STATUS_OK, "")
            self._serving = None
        else:
            if not self.session.closed:
                self.channel.reply(seq, STATUS_OK, "")
            self._serving = None
            self.residency.run_deferred(deferred)
        metrics.acquire_wait.observe(time.monotonic() - started)

    def _drain_signals(self) -> list[tuple[str, object]]:
        """The ring's records since the last drain, checked: ops for ``SignalIntake.apply_ops``."""
        records, corrupt = self.channel.drain()
        if corrupt:
            self._reject("corrupt", "a malformed record in the signal ring (the rest of it was skipped)")
        if not records:
            return []
        intake = self.residency.intake
        ops: list[tuple[str, object]] = []
        for record in records:
            kind, handle = record[0], record[1]
            try:
                if kind == "begin":
                    if handle not in self._requests and len(self._requests) >= MAX_LIVE_REQUESTS:
                        raise InvalidArgument(f"more than {MAX_LIVE_REQUESTS} live requests on one channel")
                    request_id = record[2].decode("utf-8", "replace")
                    self._requests[handle] = request_id
                    ops.append(("begin", request_id))
                elif kind == "end":
                    request_id = self._requests.pop(handle, None)
                    if request_id is not None:
                        ops.append(("end", request_id))
                elif kind == "route":
                    _, _, token, layer, experts = record
                    ops.append(("signal", intake.check_route(self._request(handle), token, layer, experts)))
                else:
                    _, _, token, predictions = record
                    checked = intake.check_layer_ahead(
                        token,
                        [
                            LayerPrediction(int(lay), int(dep), ex, np.asarray(sc))
                            for lay, dep, ex, sc in predictions
                        ],
                        self._request(handle),
                    )
                    ops.append(("signal", checked))
            except InvalidArgument as exc:
                self._reject(kind, str(exc))
        return ops

    def _request(self, handle: int) -> str:
        request_id = self._requests.get(handle)
        if request_id is None:
            raise InvalidArgument(f"request handle {handle} was never begun on this channel")
        return request_id

    def _reject(self, kind: str, why: str) -> None:
        self.residency.metrics.signals.labels("rejected").inc()
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning(
                "dropping malformed %s signals of client ledger %d (counted in signals_rejected): %s",
                kind,
                self.ledger.index,
                why,
            )


__all__ = ["MAX_LIVE_REQUESTS", "MAX_OPS_PER_HOLD", "ChannelServer"]
