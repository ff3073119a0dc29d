"""Compute's handle on a daemon's slot table, made as the handoff gives it: the table's and the
ledger's region's descriptors, ``SlotTable.attach``, and the descriptors closed again."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

from expertcache.native import SlotTable


def compute_handle(table: SlotTable, client: int) -> SlotTable:
    """Compute's handle on claimed ledger ``client`` of the daemon's ``table``: the table
    read-only and the ledger's own region."""
    table_fd, region_fd = table.table_fd(), table.client_fd(client)
    try:
        return SlotTable.attach(table_fd, region_fd, client, table.client_epoch(client))
    finally:
        os.close(table_fd)
        os.close(region_fd)


def claim_and_attach(table: SlotTable, client: int) -> SlotTable:
    """A new region for ledger ``client`` (``claim_channel``), and compute's handle on it."""
    table.claim_channel(client)
    return compute_handle(table, client)


def spawn_holding(code: str, fds: tuple[int, ...], args: tuple, *, stdin: bool = False) -> subprocess.Popen:
    """``python -c code *args`` inheriting ``fds`` (closed here once it has them), its output
    piped: a compute process given its descriptors by the handoff."""
    try:
        return subprocess.Popen(
            [sys.executable, "-c", code, *map(str, args)],
            pass_fds=fds,
            stdin=subprocess.PIPE if stdin else None,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    finally:
        for fd in fds:
            os.close(fd)


class ChannelServer:
    """A thread serving a client channel as the daemon's does, scripted by the subclass: every
    signal record drained goes to ``records`` and every demand to ``serve(seq, layer, experts,
    trace)``, in order; ``stop`` ends it."""

    def __init__(self, table: SlotTable, client: int) -> None:
        self.table = table
        self.client = client
        self.channel = table.channel(client)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stopped.set()
        self.channel.ring_doorbell()
        self.thread.join(5)

    def run(self) -> None:
        taken = 0
        while not self.stopped.is_set():
            seen = self.channel.doorbell_seq
            records, corrupt = self.channel.drain()
            assert not corrupt
            self.records(records)
            demand = self.channel.take_demand(taken)
            if demand is not None:
                taken = demand[0]
                self.serve(*demand)
                continue
            self.channel.wait_doorbell(seen, 1.0)

    def records(self, records: list) -> None:
        """The signal records drained (``ClientChannel.drain``'s tuples); nothing by default."""

    def serve(self, seq: int, layer: int, experts: list[int], trace: bytes) -> None:
        raise NotImplementedError
