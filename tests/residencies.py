"""A real ``Residency`` over a synthetic store (``tests.stores.write_store``) in one process: its
store reader, shm arena, host tier, slot table and I/O threads under one directory, closed
together. The daemon's unit tests subclass ``ResidencyHarness`` with what they drive."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from cache_daemon.decisions.policy import make_policy
from cache_daemon.metrics import DaemonMetrics
from cache_daemon.residency import Residency, table_entries
from cache_daemon.tiers import HostTier, StoreReader
from cache_daemon.tiers.device import MemfdArena
from expertcache.keys import ExpertKey
from expertcache.native import SlotTable
from tests.stores import blob_of, write_store

H = TypeVar("H")


class ResidencyHarness:
    """LRU on both tiers; ``io_threads`` load threads (the Residency's executor)."""

    def __init__(
        self,
        tmp_path: Path,
        *,
        slots: int,
        host_slots: int = 0,
        io_threads: int = 4,
        acquire_timeout_s: float = 5.0,
        daemon_id: str = "unit",
    ) -> None:
        tmp_path.mkdir(parents=True, exist_ok=True)
        self.root = tmp_path / "store"
        self.manifest = write_store(self.root)
        self.metrics = DaemonMetrics()
        self.store = StoreReader(self.root, self.manifest, self.metrics)
        self.arena = MemfdArena(slots, self.manifest.blob_bytes, daemon_id=daemon_id)
        self.host = HostTier(host_slots, self.manifest.blob_bytes, make_policy("lru"), self.metrics)
        self.executor = ThreadPoolExecutor(io_threads)
        self.table = SlotTable.create(f"expertcache-{daemon_id}", table_entries(self.manifest), slots, 4)
        self.residency = Residency(
            self.manifest,
            self.arena,
            self.store,
            self.host,
            make_policy("lru"),
            self.metrics,
            table=self.table,
            acquire_timeout_s=acquire_timeout_s,
            executor=self.executor,
        )

    def blob(self, key: ExpertKey) -> bytes:
        return blob_of(self.root, self.manifest, key)

    def close(self) -> None:
        self.residency.shutdown()
        self.executor.shutdown(wait=True, cancel_futures=True)
        self.store.close()
        self.host.close()
        self.arena.close()


def harnesses(tmp_path: Path, make: Callable[..., H]) -> Iterator[Callable[..., H]]:
    """A fixture's body: yields a factory of harnesses (``make(path, **kwargs)``), each in its own
    directory under ``tmp_path``, and closes them all after the test."""
    made = []

    def factory(**kwargs) -> H:
        harness = make(tmp_path / f"h{len(made)}", **kwargs)
        made.append(harness)
        return harness

    yield factory
    for harness in made:
        harness.close()
