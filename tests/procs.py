"""Process helpers for tests: the same launcher the demo uses, and a module run to its end."""

import subprocess
import sys

from devtools.launch import REPO, Proc, free_port, start, start_compute, start_daemon, wait_healthy

__all__ = ["Proc", "free_port", "run_module", "start", "start_compute", "start_daemon", "wait_healthy"]


def run_module(module: str, *args: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """``python -m module args`` run to its end from the repository root, its output captured as
    text: for a command whose exit code and messages a test checks."""
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout_s
    )
