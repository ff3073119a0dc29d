"""Running one test body in several threads at once."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable


def run_in_threads(
    target: Callable, cases: Iterable, timeout_s: float | None = None
) -> list[threading.Thread]:
    """``target(case)`` in a thread per case, all started before any is joined (so they overlap);
    each join waits up to ``timeout_s``. The threads are returned for a test that checks that none
    is still alive (a hang), since a join that times out raises nothing."""
    threads = [threading.Thread(target=target, args=(case,)) for case in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    return threads
