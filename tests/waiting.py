"""Waiting for a condition another thread or process brings about (no sleep-as-synchronisation)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(
    predicate: Callable[[], T], what: str = "condition", *, timeout_s: float = 5.0, poll_s: float = 0.01
) -> T:
    """Poll ``predicate`` until it returns something truthy and return that; AssertionError naming
    ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached after {timeout_s}s")
        time.sleep(poll_s)
