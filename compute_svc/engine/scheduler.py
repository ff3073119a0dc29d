"""Continuous batching: every step runs one forward over the requests that can advance.

A new request joins at the next step, a long prompt is fed in chunks, overload is refused at
``submit``, and a lost daemon is re-attached without a restart. Design: docs/compute.md."""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from compute_svc.engine.generation import GenerationEngine, RunningRequest, TokenEvent
from compute_svc.engine.requests import GenerationRequest, PreparedRequest
from compute_svc.errors import (
    Cancelled,
    DaemonUnavailable,
    DeadlineExceeded,
    ExpertCacheError,
    QueueFull,
    Unavailable,
)
from compute_svc.metrics import ComputeMetrics

logger = logging.getLogger(__name__)

_DONE = object()  # end of a request's event stream
RECOVERY_INITIAL_S = 0.1
RECOVERY_MAX_S = 2.0
# stop() interrupts the step in flight this often until the worker ends: an interrupt that lands
# before the step begins is forgotten by it (the daemon client forgets an earlier step's).
STOP_INTERRUPT_EVERY_S = 0.05
# The retry hint of every request a shutdown ends or refuses (the pod is going away).
RETRY_ELSEWHERE = "retry on another replica"


@dataclass(frozen=True)
class BatchLimits:
    """How much the engine takes on at once (the service's configuration)."""

    max_batch_size: int = 16  # requests in one step
    max_batched_tokens: int = 256  # tokens in one step (decode tokens + prompt chunks); 0 = no limit
    max_waiting_requests: int = 64  # admitted requests waiting for a place in the batch
    max_cache_tokens: int = 0  # prompt + max_new_tokens of the running requests together; 0 = no limit
    # The most of the batch and of the queue that one client address may hold (1.0: no bound).
    max_client_share: float = 1.0

    def client_places(self) -> tuple[int, int]:
        """(running, waiting) places one client address may hold: its share of each, at least
        one running place."""
        share = self.max_client_share
        return (
            max(1, math.ceil(share * self.max_batch_size - 1e-9)),
            math.ceil(share * self.max_waiting_requests - 1e-9),
        )


class RequestHandle:
    """A submitted request: iterate it for its TokenEvents (raises the request's error)."""

    def __init__(
        self, prepared: PreparedRequest, wake: Callable[[], None], client: str | None = None
    ) -> None:
        self.prepared = prepared
        self.client = client  # the caller's address, for the per-client share (None: not counted)
        self._events: queue.Queue = queue.Queue()  # TokenEvent | Exception | _DONE
        self._cancelled = threading.Event()
        self._wake = wake
        self.seq: RunningRequest | None = None  # set by the worker once admitted
        self._unsent: object | None = None  # a token event the worker holds back (``hold``)

    @property
    def request_id(self) -> str:
        return self.prepared.request.request_id

    @property
    def deadline(self) -> float | None:
        return self.prepared.request.deadline

    def cancel(self) -> None:
        """Stop the request (the client went away); a finished one is unaffected."""
        if not self._cancelled.is_set():
            self._cancelled.set()
            self._wake()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline

    def _put(self, item: object) -> None:
        self.send()
        self._events.put(item)

    def hold(self, event: TokenEvent) -> None:
        """Keep ``event`` until ``send`` (the worker's thread only): see ``Scheduler._step``."""
        self.send()
        self._unsent = event

    def send(self) -> None:
        """Hand the event held back, if any, to the reader."""
        event, self._unsent = self._unsent, None
        if event is not None:
            self._events.put(event)

    def __iter__(self) -> Iterator[TokenEvent]:
        while True:
            item = self._events.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item


class Scheduler:
    """The continuous-batching loop on one worker thread, which alone drives the engine."""

    def __init__(
        self,
        engine: GenerationEngine,
        *,
        limits: BatchLimits | None = None,
        metrics: ComputeMetrics | None = None,
        recover: Callable[[], None] | None = None,
        on_serving: Callable[[bool, str], None] | None = None,
        interrupt: Callable[[], None] | None = None,
    ) -> None:
        """``recover``: re-attach to a restarted cache daemon (raises while it is not back);
        ``on_serving(serving, reason)``: told when serving stops and resumes; ``interrupt``: wakes
        a step waiting for experts (the daemon client's), when all its requests are gone."""
        self.engine = engine
        self.limits = limits or BatchLimits()
        if self.limits.max_batched_tokens and self.limits.max_batched_tokens < self.limits.max_batch_size:
            raise ValueError(
                f"max_batched_tokens {self.limits.max_batched_tokens} must be at least max_batch_size "
                f"{self.limits.max_batch_size} (every request of a full batch feeds one token)"
            )
        self.metrics = metrics or engine.metrics
        self._recover = recover
        self._on_serving = on_serving
        self._interrupt = interrupt
        self._waiting: deque[RequestHandle] = deque()
        self._running: list[RequestHandle] = []
        # Waiting + running requests of each client address (under _cond; ``_release_locked`` ends them).
        self._held: dict[str, int] = {}
        self._stepping: tuple[RequestHandle, ...] = ()  # the requests of the step in flight
        self._cond = threading.Condition()
        self._stopping = False
        self._draining = False  # drain(): new requests refused, those admitted go on
        self._down: str | None = None  # why the daemon is unusable (recovering), else None
        self._worker = threading.Thread(target=self._run, name="generate-worker", daemon=True)

    # -- the API of the gRPC threads ---------------------------------------------------------------
    def start(self) -> None:
        self._worker.start()

    def drain(self, timeout_s: float) -> bool:
        """Refuse new requests and wait up to ``timeout_s`` for the running and waiting ones to
        finish; True when none is left. ``stop`` then ends whatever remains."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._draining = True
            self._cond.notify_all()
            while self._waiting or self._running:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)  # notified by every request that leaves
            left = len(self._waiting) + len(self._running)
        if left:
            logger.warning("drain: %d requests still in progress after %.1fs; stopping them", left, timeout_s)
        return left == 0

    def stop(self, timeout_s: float = 10.0) -> None:
        """Refuse new requests, fail the waiting ones, stop the running ones (a step waiting for
        experts is interrupted), join the worker; each ends with UNAVAILABLE and a retry hint."""
        with self._cond:
            self._stopping = True
            waiting = self._take_waiting_locked()
        for handle in waiting:
            self._fail(handle, Unavailable(f"the compute service is shutting down: {RETRY_ELSEWHERE}"))
        deadline = time.monotonic() + timeout_s
        while self._worker.is_alive():
            if self._interrupt is not None:
                self._interrupt()  # the step in flight, if it waits for experts, ends now
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self._worker.join(min(STOP_INTERRUPT_EVERY_S, remaining))

    def submit(self, request: GenerationRequest, client: str | None = None) -> RequestHandle:
        """Validate and enqueue; ``InvalidArgument``, ``QueueFull`` or ``Unavailable`` are raised here.

        ``client``: the caller's address (gRPC peer or HTTP client host). One address holds at
        most ``max_client_share`` of the batch and of the queue: its requests beyond are refused,
        and those it has waiting let other addresses' requests pass them, so a client that opens
        streams and never reads them cannot keep everyone else out. None: an in-process caller,
        not counted."""
        prepared = self.engine.requests.prepare(request)
        handle = RequestHandle(prepared, self._wake, client)
        with self._cond:
            if self._stopping or self._draining:
                raise Unavailable(f"the compute service is shutting down: {RETRY_ELSEWHERE}")
            if self._down is not None:
                raise Unavailable(f"{self._down}; retry shortly")
            # Room: the free places of the batch (the worker admits them at its next step) plus
            # max_waiting_requests.
            room = max(0, self.limits.max_batch_size - len(self._running)) + self.limits.max_waiting_requests
            if len(self._waiting) >= room:
                raise QueueFull(
                    f"{len(self._waiting)} Generate requests already wait for a place in the batch "
                    f"(max_waiting_requests {self.limits.max_waiting_requests}, {len(self._running)} running): "
                    "retry later, with backoff"
                )
            if client is not None:
                held = self._held.get(client, 0)
                running, waiting = self.limits.client_places()
                if held >= running + waiting:
                    raise QueueFull(
                        f"the client {client} already holds {held} Generate requests, its share of the "
                        f"batch and queue (max_client_share {self.limits.max_client_share:g}: {running} "
                        f"running + {waiting} waiting): retry later, with backoff"
                    )
                self._held[client] = held + 1
            self._waiting.append(handle)
            self.metrics.set_queue_depth(len(self._waiting))
            self._cond.notify_all()
        return handle

    @property
    def serving(self) -> bool:
        return self._down is None and not self._stopping and not self._draining

    def _wake(self) -> None:
        """A request was cancelled: the worker looks at once; a step waiting for experts whose
        requests are all gone is interrupted."""
        with self._cond:
            self._cond.notify_all()
            stepping = self._stepping
        if stepping and self._interrupt is not None and all(h.cancelled for h in stepping):
            self._interrupt()

    # -- the worker -------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and self._down is None and not (self._waiting or self._running):
                    self._cond.wait()
                if self._stopping:
                    break
                if self._down is None:
                    self._admit_locked()
            if self._down is not None:
                self._recover_daemon()
                continue
            self._drop_finished(time.monotonic())
            plan = self._plan()
            if plan:
                self._step(plan)
            else:
                self._send_held()
        for handle in list(self._running):
            self._leave(handle, "error", self._stopped_error(handle))

    def _admit_locked(self) -> None:
        """Move waiting requests into the batch, in arrival order, while it has room. A request
        whose client already runs its share of the batch stays waiting; those behind it pass."""
        now = time.monotonic()
        budget = self.limits.max_cache_tokens
        used = sum(self._footprint(h) for h in self._running)
        share, _ = self.limits.client_places()
        running_of: dict[str, int] = {}
        for h in self._running:
            if h.client is not None:
                running_of[h.client] = running_of.get(h.client, 0) + 1
        passed: list[RequestHandle] = []  # kept waiting, in their order, ahead of the rest
        while self._waiting and len(self._running) < self.limits.max_batch_size:
            head = self._waiting.popleft()
            if head.cancelled or head.expired(now):
                self._release_locked(head)
                self._fail(head, self._gone_error(head, now, started=False))
                continue
            if head.client is not None and running_of.get(head.client, 0) >= share:
                passed.append(head)
                continue
            if budget and self._running and used + self._footprint(head) > budget:
                self._waiting.appendleft(head)
                break  # the KV budget is full: it waits for a running request to finish
            try:
                head.seq = self.engine.start(head.prepared)
            except ExpertCacheError as exc:
                self._release_locked(head)
                self._fail(head, exc)
                continue
            self._running.append(head)
            if head.client is not None:
                running_of[head.client] = running_of.get(head.client, 0) + 1
            used += self._footprint(head)
        self._waiting.extendleft(reversed(passed))
        self.metrics.set_queue_depth(len(self._waiting))
        if not self._waiting and not self._running:
            self._cond.notify_all()  # a drain waiting for the last request

    def _release_locked(self, handle: RequestHandle) -> None:
        """``handle`` no longer counts against its client's share (under ``_cond``, when it leaves
        the queue or the batch; a second call changes nothing)."""
        client = handle.client
        if client is None:
            return
        handle.client = None
        left = self._held.get(client, 0) - 1
        if left > 0:
            self._held[client] = left
        else:
            self._held.pop(client, None)

    @staticmethod
    def _footprint(handle: RequestHandle) -> int:
        return len(handle.prepared.prompt_ids) + handle.prepared.request.max_new_tokens

    def _drop_finished(self, now: float) -> None:
        for handle in list(self._running):
            if handle.cancelled or handle.expired(now):
                self._leave(
                    handle,
                    "cancelled" if handle.cancelled else "expired",
                    self._gone_error(handle, now, started=True),
                )

    def _plan(self) -> list[tuple[RunningRequest, int]]:
        """Decode tokens first (one per decoding request), then prompt chunks, the prompts with
        the fewest tokens left first, within ``max_batched_tokens``: a short prompt arriving
        behind a long one gets its first token at the next step instead of after the long
        prompt's whole prefill, and the long one still advances by what the others leave."""
        budget = self.limits.max_batched_tokens or None
        plan: list[tuple[RunningRequest, int]] = []
        taken = 0
        for handle in self._running:
            if not handle.seq.in_prefill:
                plan.append((handle.seq, 1))
                taken += 1
        prefilling = sorted(
            (h.seq for h in self._running if h.seq.in_prefill), key=lambda seq: len(seq.pending)
        )
        for seq in prefilling:
            n = len(seq.pending) if budget is None else min(len(seq.pending), budget - taken)
            if n <= 0:
                break
            plan.append((seq, n))
            taken += n
        return plan

    def _step(self, plan: list[tuple[RunningRequest, int]]) -> None:
        by_seq = {id(h.seq): h for h in self._running}
        stepping = tuple(by_seq[id(seq)] for seq, _ in plan)
        deadlines = [h.deadline for h in stepping]
        # The step may wait for experts until its last request's deadline, not beyond.
        step_deadline = None if any(d is None for d in deadlines) else max(deadlines)
        with self._cond:
            self._stepping = stepping
        try:
            events = self.engine.step(plan, deadline=step_deadline, before_layers=self._send_held)
        except DaemonUnavailable as exc:
            logger.warning("cache daemon lost during a step of %d requests: %s", len(stepping), exc)
            # While draining, the request will not be taken up again here: it is to be retried elsewhere.
            hint = f"; {RETRY_ELSEWHERE}" if (self._draining or self._stopping) else ""
            for handle in list(self._running):  # every request's pins went with the stream
                self._leave(
                    handle, "error", Unavailable(f"request {handle.request_id!r} failed: {exc}{hint}")
                )
            self._set_down(str(exc))
            return
        except ExpertCacheError as exc:
            now = time.monotonic()
            for handle in stepping:
                if handle.cancelled or handle.expired(now):
                    self._leave(
                        handle,
                        "cancelled" if handle.cancelled else "expired",
                        self._gone_error(handle, now, started=True),
                    )
                elif self._stopping:
                    # stop() interrupted the step (its wait for experts raises Cancelled): the
                    # service ended it, not the client.
                    self._leave(handle, "error", self._stopped_error(handle))
                else:
                    logger.warning("request %r failed: %s", handle.request_id, exc)
                    self._leave(handle, "error", type(exc)(str(exc)))
            return
        except Exception as exc:  # noqa: BLE001 - a bug in one step fails its requests, not the service
            logger.exception("a step of %d requests failed", len(stepping))
            for handle in stepping:
                self._leave(handle, "error", exc)
            return
        finally:
            with self._cond:
                self._stepping = ()
        # A token that is not its request's last is held back until the next step reaches its
        # layers (``before_layers``), where the worker lets go of the GIL for long: handing it over
        # now would wake the stream's threads while the worker runs the next step's Python, and
        # each torch op there would wait for them to let go of the GIL (the step, about a third
        # longer). The reader gets it when those threads would have got the GIL anyway.
        for seq, event in events:
            handle = by_seq[id(seq)]
            if event.finish_reason is None:
                handle.hold(event)
            else:
                handle._put(event)
                self._leave(handle, event.finish_reason.value, None)

    def _send_held(self) -> None:
        """Every running request's held-back token to its reader (``_step``)."""
        for handle in self._running:
            handle.send()

    def _leave(self, handle: RequestHandle, outcome: str, error: BaseException | None) -> None:
        """``handle`` leaves the batch: the engine forgets it, its caller gets ``error`` or the end."""
        if outcome in ("cancelled", "expired"):
            generated = handle.seq.generated if handle.seq is not None else 0
            logger.info(
                "request %r stopped (%s) after %d generated tokens", handle.request_id, outcome, generated
            )
        if handle in self._running:
            self._running.remove(handle)
        if handle.seq is not None:
            self.engine.finish(handle.seq, outcome)
            handle.seq = None
        if error is not None:
            handle._put(error)
        handle._put(_DONE)
        with self._cond:
            self._release_locked(handle)
            self._cond.notify_all()  # room for a waiting request

    def _fail(self, handle: RequestHandle, error: BaseException) -> None:
        self.metrics.record_finish("cancelled" if isinstance(error, Cancelled) else "error")
        handle._put(error)
        handle._put(_DONE)

    @staticmethod
    def _stopped_error(handle: RequestHandle) -> Unavailable:
        """What a request still running at ``stop`` ends with: UNAVAILABLE, to be retried elsewhere."""
        done = handle.seq.generated if handle.seq is not None else 0
        return Unavailable(
            f"request {handle.request_id!r} was stopped after {done} generated tokens: the compute "
            f"service is shutting down and could not finish it in time; {RETRY_ELSEWHERE}"
        )

    @staticmethod
    def _gone_error(handle: RequestHandle, now: float, *, started: bool) -> ExpertCacheError:
        if handle.cancelled:
            return Cancelled(
                f"request {handle.request_id!r} was cancelled{'' if started else ' before it started'}"
            )
        done = handle.seq.generated if handle.seq is not None else 0
        return DeadlineExceeded(
            f"request {handle.request_id!r} passed its deadline after {done} generated tokens"
            f"{'' if started else ', before it started'}: it was stopped"
        )

    def _take_waiting_locked(self) -> list[RequestHandle]:
        """Every waiting request, taken out (none may wait any more: the caller has just said
        why, under ``_cond``); the worker wakes to see why."""
        waiting = list(self._waiting)
        self._waiting.clear()
        for handle in waiting:
            self._release_locked(handle)
        self._cond.notify_all()
        return waiting

    # -- the daemon's loss and return ---------------------------------------------------------------
    def _set_down(self, reason: str) -> None:
        with self._cond:
            self._down = reason
            waiting = self._take_waiting_locked()
        for handle in waiting:
            self._fail(handle, Unavailable(f"{reason}; retry shortly"))
        if self._on_serving is not None:
            self._on_serving(False, reason)

    def _recover_daemon(self) -> None:
        """Re-attach with backoff until the daemon is back or the service stops."""
        started = time.monotonic()
        backoff = RECOVERY_INITIAL_S
        while True:
            with self._cond:
                if self._stopping:
                    return
            try:
                if self._recover is None:
                    raise DaemonUnavailable("no way to re-attach to the cache daemon")
                self._recover()
            except ExpertCacheError as exc:
                logger.debug("cache daemon not back yet: %s", exc)
                with self._cond:
                    self._cond.wait(backoff)  # woken early only by stop()
                backoff = min(backoff * 2, RECOVERY_MAX_S)
                continue
            break
        with self._cond:
            self._down = None
            self._cond.notify_all()
        logger.info("cache daemon re-attached after %.2fs: serving again", time.monotonic() - started)
        if self._on_serving is not None:
            self._on_serving(True, "")

    def daemon_lost(self, reason: str) -> None:
        """Called when the daemon's stream ends while idle: stop serving now, recover in the worker."""
        with self._cond:
            if self._down is not None or self._stopping:
                return
            if self._running or self._stepping:
                return  # the step in flight sees it and handles it
        self._set_down(reason)
        with self._cond:
            self._cond.notify_all()
