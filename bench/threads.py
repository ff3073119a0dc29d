"""Threads a benchmark runs at once, timed."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


def run_threads(threads: list[threading.Thread], meanwhile: Callable[[], None] | None = None) -> float:
    """Seconds from starting ``threads`` until all have ended; ``meanwhile`` runs once all are
    started (e.g. what tells them to stop)."""
    started = time.perf_counter()
    for t in threads:
        t.start()
    if meanwhile is not None:
        meanwhile()
    for t in threads:
        t.join()
    return time.perf_counter() - started
