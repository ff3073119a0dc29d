"""Compute's handle on a daemon's slot table, made as the handoff gives it: the table's and the
ledger's region's descriptors, ``SlotTable.attach``, and the descriptors closed again."""

from __future__ import annotations

import os
import subprocess
import sys

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
