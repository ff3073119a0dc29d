"""Process helpers for tests: the same launcher the demo uses, and a module run to its end."""

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from devtools.launch import REPO, Proc, free_port, start, start_compute, start_daemon, wait_healthy

__all__ = [
    "Proc",
    "compute_over",
    "free_port",
    "run_module",
    "start",
    "start_compute",
    "start_daemon",
    "wait_healthy",
]


@contextmanager
def compute_over(daemon: Proc, store_dir: Path, work_dir: Path, **kwargs) -> Iterator[Proc]:
    """A compute process over ``daemon`` (``start_compute``'s arguments), started on entry; on exit
    compute is stopped, then the daemon, which is stopped also when compute did not start."""
    try:
        compute = start_compute(store_dir, daemon, work_dir, **kwargs)
        try:
            yield compute
        finally:
            compute.stop()
    finally:
        daemon.stop()


def run_module(module: str, *args: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """``python -m module args`` run to its end from the repository root, its output captured as
    text: for a command whose exit code and messages a test checks."""
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout_s
    )
