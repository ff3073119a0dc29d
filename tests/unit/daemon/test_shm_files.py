"""Shm-file ownership: a live daemon's files survive every sweep, a dead one's go at the next start.

The "daemons" here are real processes holding (or having held) the lock; the daemon process
itself, killed with SIGKILL, is in tests/integration/test_daemon_shm_sweep.py.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cache_daemon.errors import ArenaUnavailable
from cache_daemon.shm_files import claim_shm_files, daemon_files, lock_path, sweep_dead_daemons
from cache_daemon.tiers.device import create_arena

REPO = Path(__file__).resolve().parents[3]

# A stand-in daemon: claims its id, creates its files, says so, then lives until killed.
HOLDER = """
import sys, time
from cache_daemon.shm_files import claim_shm_files
shm_dir, daemon_id = sys.argv[1], sys.argv[2]
claim = claim_shm_files(shm_dir, daemon_id)
for suffix in ("", ".slots"):
    open(f"{shm_dir}/expertcache-{daemon_id}{suffix}", "wb").write(b"x" * 4096)
if len(sys.argv) > 3:  # start a long-lived child, as a daemon may (it must not inherit the lock)
    import subprocess
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    print(child.pid, flush=True)
print("ready", flush=True)
time.sleep(120)
"""


class Holder:
    def __init__(self, shm_dir: Path, daemon_id: str, *, spawn_child: bool = False) -> None:
        self.daemon_id = daemon_id
        self.popen = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(shm_dir), daemon_id, *(["spawn"] if spawn_child else [])],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.child_pid = int(self.popen.stdout.readline()) if spawn_child else None
        line = self.popen.stdout.readline()
        if line.strip() != "ready":
            self.popen.kill()
            raise AssertionError(f"holder did not start: {line!r} {self.popen.stderr.read()}")

    def sigkill(self) -> None:
        self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(10)
        self.popen.stdout.close()
        self.popen.stderr.close()


def names(shm_dir: Path) -> set[str]:
    return {p.name for p in shm_dir.iterdir()}


def test_a_killed_daemons_files_are_swept_and_a_live_ones_kept(tmp_path, caplog):
    dead, live = Holder(tmp_path, "dead01"), Holder(tmp_path, "live01")
    try:
        everything = {f"expertcache-{i}{s}" for i in ("dead01", "live01") for s in ("", ".slots", ".lock")}
        assert names(tmp_path) == everything
        assert sweep_dead_daemons(tmp_path) == []  # both alive: nothing goes
        assert names(tmp_path) == everything
        dead.sigkill()
        assert names(tmp_path) == everything  # SIGKILL: no clean-up ran, the files stay ...
        caplog.set_level(logging.INFO, logger="cache_daemon.shm_files")
        removed = sweep_dead_daemons(tmp_path)  # ... until the next sweep
        assert [p.name for p in removed] == [  # the lock goes last
            "expertcache-dead01",
            "expertcache-dead01.slots",
            "expertcache-dead01.lock",
        ]
        assert names(tmp_path) == {f"expertcache-live01{s}" for s in ("", ".slots", ".lock")}
        logged = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
        assert len(logged) == 3
        assert all("left by daemon dead01 which is no longer running" in m for m in logged)
        assert sweep_dead_daemons(tmp_path) == []  # idempotent
    finally:
        live.sigkill()
        if dead.popen.poll() is None:
            dead.sigkill()


def test_files_without_a_lock_are_never_touched(tmp_path):
    foreign = [
        "expertcache-test-123",
        "expertcache-bench-9.table",
        "expertcache-old",
        "expertcache-old.slots",
    ]
    for name in foreign:
        (tmp_path / name).write_bytes(b"keep")
    (tmp_path / "expertcache-a-dir").mkdir()
    (tmp_path / "expertcache-odd.id.lock").write_bytes(b"")  # not a name a daemon makes: skipped
    assert sweep_dead_daemons(tmp_path) == []
    assert names(tmp_path) == {*foreign, "expertcache-a-dir", "expertcache-odd.id.lock"}


def test_an_unheld_lock_takes_only_its_own_daemons_files(tmp_path):
    # "abc" died; "abcd" and "abc-2" merely share a prefix with it and have no lock of their own.
    for name in ("expertcache-abc", "expertcache-abc.slots", "expertcache-abcd", "expertcache-abc-2.slots"):
        (tmp_path / name).write_bytes(b"")
    lock_path(tmp_path, "abc").write_bytes(b"")  # left by a daemon that died (nobody holds it)
    (tmp_path / "expertcache-abc.extra").mkdir()  # a directory is reported, not removed
    assert daemon_files(tmp_path, "abc") == [
        tmp_path / "expertcache-abc",
        tmp_path / "expertcache-abc.extra",
        tmp_path / "expertcache-abc.slots",
    ]
    removed = sweep_dead_daemons(tmp_path)
    assert {p.name for p in removed} == {"expertcache-abc", "expertcache-abc.slots", "expertcache-abc.lock"}
    assert names(tmp_path) == {"expertcache-abcd", "expertcache-abc-2.slots", "expertcache-abc.extra"}


def test_claim_release_and_errors(tmp_path):
    claim = claim_shm_files(tmp_path, "d1")
    assert claim.held and names(tmp_path) == {"expertcache-d1.lock"}  # the temporary name is gone
    (tmp_path / "expertcache-d1").write_bytes(b"arena")
    assert sweep_dead_daemons(tmp_path) == []  # held, even from this very process
    with pytest.raises(ArenaUnavailable, match=r"daemon id 'd1' is in use in .*expertcache-d1.lock is held"):
        claim_shm_files(tmp_path, "d1")
    assert names(tmp_path) == {"expertcache-d1.lock", "expertcache-d1"}  # the failed claim left nothing
    claim.release()
    assert not claim.held and names(tmp_path) == {"expertcache-d1"}
    claim.release()  # idempotent
    with pytest.raises(ValueError, match=r"daemon id 'a\.b' must be non-empty and contain no"):
        claim_shm_files(tmp_path, "a.b")
    with pytest.raises(ValueError, match="daemon id '' must be non-empty"):
        claim_shm_files(tmp_path, "")
    with pytest.raises(ArenaUnavailable, match="cannot list the shared-memory directory .*missing"):
        claim_shm_files(tmp_path / "missing", "d2")


def test_create_arena_claims_sweeps_and_releases(tmp_path):
    (tmp_path / "expertcache-gone").write_bytes(b"old arena")
    (tmp_path / "expertcache-gone.slots").write_bytes(b"old table")
    lock_path(tmp_path, "gone").write_bytes(b"")  # its daemon was killed
    arena = create_arena("cpu", 2, 4096, shm_dir=tmp_path, daemon_id="new1")
    try:
        assert names(tmp_path) == {"expertcache-new1", "expertcache-new1.lock"}
        assert arena.shm_claim is not None and arena.shm_claim.held
        with pytest.raises(ArenaUnavailable, match="daemon id 'new1' is in use"):
            create_arena("cpu", 1, 4096, shm_dir=tmp_path, daemon_id="new1")
        assert names(tmp_path) == {"expertcache-new1", "expertcache-new1.lock"}
    finally:
        arena.close()
    assert names(tmp_path) == set()  # arena file and lock both removed by close
    # A failed arena creation releases the claim it took.
    with pytest.raises(ValueError, match="an arena needs at least one slot, got 0"):
        create_arena("cpu", 0, 4096, shm_dir=tmp_path, daemon_id="new2")
    assert names(tmp_path) == set()


def test_a_child_of_the_daemon_does_not_keep_its_files_alive(tmp_path):
    holder = Holder(tmp_path, "parent", spawn_child=True)
    try:
        holder.sigkill()  # the daemon dies; the child it started lives on
        os.kill(holder.child_pid, 0)  # still running
        assert {p.name for p in sweep_dead_daemons(tmp_path)} == {
            "expertcache-parent",
            "expertcache-parent.slots",
            "expertcache-parent.lock",
        }
        assert os.listdir(tmp_path) == []
    finally:
        if holder.popen.poll() is None:
            holder.sigkill()
        os.kill(holder.child_pid, signal.SIGKILL)
