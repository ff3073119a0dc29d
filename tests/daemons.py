"""The cache daemon as a real process in tests, driven over its unix socket like compute does: its
Attach, its arena mapped read-only, Demand streams, stats. Its store is ``tests.stores.write_store``'s
(4 KiB blobs)."""

from __future__ import annotations

import os
import queue
from pathlib import Path

import grpc
from moe.cache.v1 import cache_pb2, cache_pb2_grpc

from devtools.launch import Proc, start
from expertcache import handoff, memfd
from expertcache.keys import ExpertKey
from tests.stores import blob_of

BLOB = 4096  # write_store's blob size


class DemandStream:
    """One Demand call: requests go through a queue, responses are read in order."""

    def __init__(self, stub: cache_pb2_grpc.ExpertCacheStub) -> None:
        self._requests: queue.Queue = queue.Queue()
        self.call = stub.Demand(iter(self._requests.get, None), timeout=60)

    def acquire(self, ticket: int, layer: int, experts: list[int]) -> tuple[list, cache_pb2.AcquireDone]:
        self._requests.put(
            cache_pb2.DemandRequest(
                acquire=cache_pb2.Acquire(ticket=ticket, decoder_layer=layer, experts=experts)
            )
        )
        readies = []
        for response in self.call:
            if response.WhichOneof("kind") == "ready":
                assert response.ready.ticket == ticket
                readies.append(response.ready)
            else:
                assert response.done.ticket == ticket
                return readies, response.done
        raise AssertionError("the stream ended without AcquireDone")

    def release(self, layer: int, experts: list[int]) -> None:
        refs = [cache_pb2.ExpertRef(decoder_layer=layer, expert=e) for e in experts]
        self._requests.put(cache_pb2.DemandRequest(release=cache_pb2.Release(experts=refs)))

    def close(self) -> None:
        self._requests.put(None)


class Daemon:
    def __init__(self, proc: Proc, store: Path, manifest) -> None:
        self.proc, self.store, self.manifest = proc, store, manifest
        self.channel = grpc.insecure_channel(proc.address)
        self.stub = cache_pb2_grpc.ExpertCacheStub(self.channel)
        self.attach = self.stub.Attach(cache_pb2.AttachRequest(client_name="test"), timeout=10)
        # The arena is a memfd: Attach's one-time token buys its descriptor (read-only).
        _, fds = handoff.receive(self.attach.handoff_socket, self.attach.handoff_token)
        try:
            self.arena = memfd.map_readonly(fds[0], self.attach.arena.size_bytes, "the arena")
        finally:
            for fd in fds:
                os.close(fd)

    def slot_bytes(self, slot: int) -> bytes:
        return self.arena[slot * BLOB : (slot + 1) * BLOB]

    def blob(self, layer: int, expert: int) -> bytes:
        return blob_of(self.store, self.manifest, ExpertKey(layer, expert))

    def stats(self) -> cache_pb2.CacheStats:
        return self.stub.GetStats(cache_pb2.GetStatsRequest(), timeout=10)

    def close(self) -> None:
        self.arena.close()
        self.channel.close()


def tiers(stats: cache_pb2.CacheStats) -> dict[int, cache_pb2.TierStats]:
    return {t.tier: t for t in stats.tiers}


def start_live_daemon(
    store: Path, config_file: Path, work: Path, *flags: str, log: str = "daemon.log"
) -> Proc:
    """The daemon on CPU over ``store``, reading ``config_file`` live (a ConfigMap volume's file),
    ``flags`` after those; its socket and ``log`` in ``work`` (a restart reuses the socket)."""
    sock = work / "daemon.sock"
    args = ["--store-dir", str(store), "--socket-path", str(sock), "--device", "cpu"]
    args += ["--config-file", str(config_file), *flags]
    return start("cache_daemon", args, f"unix://{sock}", work / log)
