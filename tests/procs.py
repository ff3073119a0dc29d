"""Process helpers for tests: the same launcher the demo uses."""

from devtools.launch import Proc, free_port, start, start_compute, start_daemon, wait_healthy

__all__ = ["Proc", "free_port", "start", "start_compute", "start_daemon", "wait_healthy"]
