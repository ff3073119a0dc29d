"""A compute client that does not keep the shared-memory protocol: ``RegionFuzz``.

It attaches to a cache daemon as compute does (``Attach`` with the shm fast path, the handoff
socket for the table and its own region, a Demand stream that ties the ledger to it), and then
writes random bytes into every byte of shared memory it can write: its region's pins and access
stamps, its channel's demand mailbox, words and signal ring. It rings the daemon's doorbell after
each write, so that the daemon's thread for it reads what it wrote, and attaches again every
``reattach_s`` (a new ledger and region each time; the old one is reclaimed). The table and the
CPU arena map read-only: it cannot write there, and it checks that (``writable`` stays empty).

``bench.hostile`` runs it as the ``shm-fuzz`` phase beside a real compute process;
``tests/integration/test_shm_fuzz.py`` checks that the other client's output still equals
transformers' while it runs.
"""

from __future__ import annotations

import json
import mmap
import os
import random
import threading
import time

import grpc
from moe.cache.v1 import cache_pb2, cache_pb2_grpc

from expertcache import handoff, native
from expertcache.protocol import CLIENT_EPOCH_KEY, CLIENT_INDEX_KEY


class RegionFuzz:
    """Attaches to the daemon at ``socket_path`` and scribbles over its own region until stopped."""

    def __init__(
        self, socket_path: str, *, reattach_s: float = 2.0, pause_s: float = 0.001, seed: int = 0
    ) -> None:
        self.socket_path = socket_path
        self.reattach_s = reattach_s
        self.pause_s = pause_s
        self.attaches = 0
        self.bytes_written = 0
        self.errors: dict[str, int] = {}  # what went wrong on our side, by kind (refusals included)
        self.writable: set[str] = set()  # handed descriptors it could map writable (none, or a bug)
        self._rng = random.Random(seed)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shm-fuzz", daemon=True)

    def start(self) -> RegionFuzz:
        self._thread.start()
        return self

    def held(self) -> int:
        return self.attaches

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        channel = grpc.insecure_channel(f"unix://{self.socket_path}")
        stub = cache_pb2_grpc.ExpertCacheStub(channel)
        try:
            while not self._stop.is_set():
                try:
                    self._round(stub)
                except Exception as exc:  # noqa: BLE001 - counted; the attacker goes on
                    kind = type(exc).__name__
                    self.errors[kind] = self.errors.get(kind, 0) + 1
                    self._stop.wait(0.1)
        finally:
            channel.close()

    def _round(self, stub: cache_pb2_grpc.ExpertCacheStub) -> None:
        reply = stub.Attach(cache_pb2.AttachRequest(client_name="shm-fuzz", shm_fast_path=True), timeout=10)
        if reply.client_index < 0 or not reply.handoff_socket:
            raise RuntimeError("the daemon offered no client ledger")
        payload, fds = handoff.receive(reply.handoff_socket, reply.handoff_token)
        try:
            handed = dict(zip(json.loads(payload)["descriptors"], fds, strict=True))
            table_fd, region_fd = handed["table"], handed["region"]
            for name in ("table", "arena"):
                if name in handed:
                    try:
                        writable = mmap.mmap(
                            handed[name], 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE
                        )
                    except PermissionError:
                        continue
                    writable.close()
                    self.writable.add(name)
            handle = native.SlotTable.attach(table_fd, region_fd, reply.client_index, reply.client_epoch)
            size = os.fstat(region_fd).st_size
            region = mmap.mmap(region_fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            for fd in fds:
                os.close(fd)
        doorbell = handle.channel(reply.client_index)
        ended = threading.Event()

        def requests():  # nothing to send: the stream only ties the ledger to us
            ended.wait()
            return
            yield

        metadata = ((CLIENT_INDEX_KEY, str(reply.client_index)), (CLIENT_EPOCH_KEY, str(reply.client_epoch)))
        call = stub.Demand(requests(), metadata=metadata)
        self.attaches += 1
        rng = self._rng
        try:
            region[:] = rng.randbytes(size)  # every byte once, then at random
            self.bytes_written += size
            until = time.monotonic() + self.reattach_s
            while not self._stop.is_set() and time.monotonic() < until:
                at = rng.randrange(size)
                n = min(rng.randrange(1, 4096), size - at)
                region[at : at + n] = rng.randbytes(n)
                self.bytes_written += n
                doorbell.ring_doorbell()
                time.sleep(self.pause_s)
        finally:
            ended.set()
            call.cancel()
            region.close()


__all__ = ["RegionFuzz"]
