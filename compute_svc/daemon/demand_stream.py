"""One open ``ExpertCache.Demand`` call: requests go through a queue that the call's request
iterator drains; a reader thread moves responses into a queue, so that each wait for one can
have a deadline (``acquire_timeout_s``). Closing it (half-close and cancel) makes the daemon
release every pin the stream holds; ``compute_svc.daemon.client`` opens the next one.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator

import grpc
from moe.cache.v1 import cache_pb2, cache_pb2_grpc

END = object()  # in ``responses``: the response stream ended without an error
INTERRUPT = object()  # in ``responses``: the step waiting for experts lost all its requests


class DemandStream:
    """One open Demand call: a request queue feeding gRPC, a reader thread draining responses."""

    def __init__(
        self,
        stub: cache_pb2_grpc.ExpertCacheStub,
        metadata: tuple[tuple[str, str], ...] = (),
        on_end: Callable[[str], None] | None = None,
        wake: Callable[[], None] | None = None,
    ) -> None:
        self._requests: queue.Queue = queue.Queue()
        self._wake = wake  # wakes a wait on the client channel when the stream ends
        self.responses: queue.Queue = queue.Queue()
        self.ended = False  # the response stream is over (the daemon ended it, or it broke)
        self._closing = False  # we closed it (then its end is no news)
        self._on_end = on_end
        self._call = stub.Demand(self._request_iter(), metadata=metadata or None)
        self._reader = threading.Thread(target=self._read, name="demand-reader", daemon=True)
        self._reader.start()

    def _request_iter(self) -> Iterator[cache_pb2.DemandRequest]:
        while True:
            item = self._requests.get()
            if item is None:
                return
            yield item

    def _read(self) -> None:
        try:
            for response in self._call:
                self.responses.put(response)
            self.ended = True
            self.responses.put(END)
            reason = "the cache daemon closed the Demand stream"
        except grpc.RpcError as exc:
            self.ended = True
            self.responses.put(exc)
            reason = f"the Demand stream to the cache daemon broke: {exc.code().name if exc.code() else exc}"
        if self._wake is not None:
            self._wake()
        if not self._closing and self._on_end is not None:
            self._on_end(reason)

    def send(self, request: cache_pb2.DemandRequest) -> None:
        self._requests.put(request)

    def interrupt(self) -> None:
        """Wake the wait for the next response: it finds ``INTERRUPT`` (thread-safe)."""
        self.responses.put(INTERRUPT)

    def close(self) -> None:
        """Half-close and cancel: the daemon releases every pin this stream holds."""
        self._closing = True
        self._requests.put(None)
        self._call.cancel()
