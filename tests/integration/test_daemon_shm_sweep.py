"""No shared-memory leftovers: a daemon killed with SIGKILL leaves its shm files, the next daemon
to start in that directory removes them, and no daemon ever removes a live daemon's files."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.procs import Proc, start_daemon
from tests.stores import write_store

pytestmark = pytest.mark.integration

BLOB = 4096


def launch(work: Path, store: Path, shm_dir: Path) -> Proc:
    work.mkdir()
    return start_daemon(
        store, work, device="cpu", device_budget_bytes=2 * BLOB, extra=["--shm-dir", str(shm_dir)]
    )


def daemon_ids(shm_dir: Path) -> set[str]:
    """Ids of the daemons whose lock file is in ``shm_dir``."""
    return {
        p.name.removeprefix("expertcache-").removesuffix(".lock") for p in shm_dir.glob("expertcache-*.lock")
    }


def files_of(shm_dir: Path, daemon_id: str) -> set[str]:
    return {p.name for p in shm_dir.iterdir() if p.name.split(".")[0] == f"expertcache-{daemon_id}"}


def test_sigkilled_daemons_files_are_removed_by_the_next_start(tmp_path):
    store = tmp_path / "store"
    write_store(store)
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    first = launch(tmp_path / "d1", store, shm_dir)
    second = third = None
    try:
        (killed,) = daemon_ids(shm_dir)
        expected = {f"expertcache-{killed}{s}" for s in ("", ".lock")}
        assert files_of(shm_dir, killed) == expected
        first.popen.send_signal(signal.SIGKILL)
        assert first.popen.wait(15) == -signal.SIGKILL
        assert files_of(shm_dir, killed) == expected  # nothing cleaned up after a SIGKILL

        second = launch(tmp_path / "d2", store, shm_dir)
        assert files_of(shm_dir, killed) == set()  # swept at the second daemon's start
        (alive,) = daemon_ids(shm_dir)
        assert files_of(shm_dir, alive) == {f"expertcache-{alive}{s}" for s in ("", ".lock")}
        assert f"removed {shm_dir}/expertcache-{killed}, left by daemon {killed}" in second.log()

        third = launch(tmp_path / "d3", store, shm_dir)  # sweeps too, but the second is alive
        assert files_of(shm_dir, alive) == {f"expertcache-{alive}{s}" for s in ("", ".lock")}
        assert len(daemon_ids(shm_dir)) == 2
        assert "no longer running" not in third.log()
        assert third.stop() == 0, third.log()
        assert second.stop() == 0, second.log()
        assert list(shm_dir.iterdir()) == []  # clean stops leave nothing either
    finally:
        for proc in (first, second, third):
            if proc is not None and proc.popen.poll() is None:
                proc.popen.kill()
                proc.popen.wait()
