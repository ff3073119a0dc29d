"""One worker thread runs Generate requests one at a time; the others wait in a bounded queue.

::

    gRPC thread:  submit(request) ─ prepare (validate) ─▶ [ waiting ≤ max_queue ] ─▶ worker
                  iterate handle ◀── TokenEvent … ◀── engine.generate(prepared) ◀──┘
                  cancel() on client disconnect ──▶ worker stops before the next token

Requests arriving together are queued, never dropped; the queue's bound turns overload into an
immediate RESOURCE_EXHAUSTED instead of an unbounded wait. Validation errors are raised by
``submit`` in the caller's thread, before a request takes a place in the queue.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Iterator

from compute_svc.errors import Cancelled, ExpertCacheError, QueueFull, Unavailable
from compute_svc.generation import GenerationEngine, GenerationRequest, PreparedRequest, TokenEvent
from compute_svc.metrics import ComputeMetrics

logger = logging.getLogger(__name__)

_DONE = object()  # end of a request's event stream


class RequestHandle:
    """A submitted request: iterate it for its TokenEvents (raises the request's error)."""

    def __init__(self, prepared: PreparedRequest) -> None:
        self.prepared = prepared
        self._events: queue.Queue = queue.Queue()  # TokenEvent | Exception | _DONE
        self._cancelled = threading.Event()

    @property
    def request_id(self) -> str:
        return self.prepared.request.request_id

    def cancel(self) -> None:
        """Stop the request (the client went away); a finished one is unaffected."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def _put(self, item: object) -> None:
        self._events.put(item)

    def __iter__(self) -> Iterator[TokenEvent]:
        while True:
            item = self._events.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item


class Scheduler:
    """Bounded FIFO in front of a single worker that owns the engine (and the daemon stream)."""

    def __init__(
        self, engine: GenerationEngine, *, max_queue: int, metrics: ComputeMetrics | None = None
    ) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self.metrics = metrics or engine.metrics
        self._waiting: deque[RequestHandle] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._busy = False  # the worker is running a request (guarded by _cond)
        self._worker = threading.Thread(target=self._run, name="generate-worker", daemon=True)

    def start(self) -> None:
        self._worker.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Refuse new requests, fail the waiting ones, stop the running one, join the worker."""
        with self._cond:
            self._stopping = True
            waiting = list(self._waiting)
            self._waiting.clear()
            self._cond.notify_all()
        for handle in waiting:
            handle._put(Unavailable("the compute service is shutting down"))
            handle._put(_DONE)
        if self._worker.is_alive():
            self._worker.join(timeout_s)

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Validate and enqueue; ``InvalidArgument`` or ``QueueFull`` are raised here."""
        prepared = self.engine.prepare(request)
        handle = RequestHandle(prepared)
        with self._cond:
            if self._stopping:
                raise Unavailable("the compute service is shutting down")
            # Capacity is one running request plus max_queue waiting ones; while the worker is
            # idle, the head of the deque is the request it is about to run.
            if len(self._waiting) + int(self._busy) >= self.max_queue + 1:
                raise QueueFull(
                    f"{len(self._waiting) + int(self._busy) - 1} Generate requests already wait (max_queue {self.max_queue}): retry later"
                )
            self._waiting.append(handle)
            self.metrics.set_queue_depth(len(self._waiting))
            self._cond.notify()
        return handle

    def _run(self) -> None:
        while True:
            with self._cond:
                self._busy = False
                while not self._waiting and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                handle = self._waiting.popleft()
                self._busy = True
                self.metrics.set_queue_depth(len(self._waiting))
            self._execute(handle)

    def _execute(self, handle: RequestHandle) -> None:
        if handle.cancelled:
            self.metrics.record_finish("cancelled")
            handle._put(Cancelled(f"request {handle.request_id!r} was cancelled before it started"))
            handle._put(_DONE)
            return
        try:
            finished = False
            for event in self.engine.generate(
                handle.prepared, should_stop=lambda: handle.cancelled or self._stopping
            ):
                handle._put(event)
                finished = event.finish_reason is not None
            if not finished and handle.cancelled:
                self.metrics.record_finish("cancelled")
                handle._put(Cancelled(f"request {handle.request_id!r} was cancelled"))
            elif not finished:
                self.metrics.record_finish("error")
                handle._put(
                    Unavailable(
                        f"request {handle.request_id!r} was stopped: the compute service is shutting down"
                    )
                )
        except Exception as exc:  # noqa: BLE001 - the error travels to the request's caller
            self.metrics.record_finish("error")
            if isinstance(exc, ExpertCacheError):
                logger.warning("request %r failed: %s", handle.request_id, exc)
            else:
                logger.exception("request %r failed", handle.request_id)
            handle._put(exc)
        finally:
            handle._put(_DONE)
