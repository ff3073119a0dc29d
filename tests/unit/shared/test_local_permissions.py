"""Local surfaces are owner-only whatever the umask, and never followed through a planted symlink:
the daemon's socket (0600) and its directory (0700); the arena and the slot table have no file."""

from __future__ import annotations

import mmap
import os
import stat
from pathlib import Path

import pytest

from cache_daemon.tiers.device import create_arena
from devtools.launch import start
from expertcache.native import SlotTable


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def open_umask():
    old = os.umask(0)
    yield
    os.umask(old)


def test_slot_table_has_no_file_and_maps_read_only_outside_the_daemon(tmp_path, open_umask):
    """The table is a sealed memfd: nothing appears in any directory (no file to open, plant or
    leave behind), and a process it is handed to can only map it read-only."""
    before = set(os.listdir(tmp_path))
    table = SlotTable.create("expertcache-x", 8, 2)
    assert set(os.listdir(tmp_path)) == before
    fd = table.table_fd()
    try:
        with pytest.raises(PermissionError):
            mmap.mmap(
                fd, SlotTable.table_bytes(8), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE
            )
        mmap.mmap(fd, SlotTable.table_bytes(8), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ).close()
    finally:
        os.close(fd)


def test_cpu_arena_has_no_file_and_maps_read_only_outside_the_daemon(tmp_path, open_umask):
    """The CPU arena is a sealed memfd too: no name to open or plant, nothing left behind, and a
    process it is handed to cannot write it by any route."""
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        arena = create_arena("cpu", 2, 4096, daemon_id="perm")
    finally:
        os.chdir(cwd)
    assert list(tmp_path.iterdir()) == []
    try:
        fd = arena.arena_fd()
        try:
            with pytest.raises(PermissionError):
                mmap.mmap(fd, 8192, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            with pytest.raises(PermissionError):
                os.pwrite(fd, b"x", 0)
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 0)  # a shrink would SIGBUS the daemon's reads
            # Re-opening it writable through /proc gives no way around the seals.
            again = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
            try:
                with pytest.raises(PermissionError):
                    os.write(again, b"x")
                with pytest.raises(PermissionError):
                    mmap.mmap(again, 4096, flags=mmap.MAP_SHARED, prot=mmap.PROT_WRITE)
            finally:
                os.close(again)
            mmap.mmap(fd, 8192, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ).close()
            # A private writable mapping copies on write: the arena is untouched.
            private = mmap.mmap(fd, 4096, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            private[:1] = b"x"
            private.close()
            assert bytes(arena.slots[0, :1].numpy()) == b"\0"
        finally:
            os.close(fd)
    finally:
        arena.close()


def test_daemon_socket_and_directory_are_owner_only(tiny_store, tmp_path, open_umask):
    tiny = tiny_store("mixtral")
    work = tmp_path / "work"
    work.mkdir()
    run = tmp_path / "run" / "sub"
    args = [
        "--store-dir", str(tiny.store),
        "--socket-path", str(run / "daemon.sock"),
        "--device", "cpu",
        "--device-budget-bytes", str(4 * tiny.manifest.blob_bytes),
    ]  # fmt: skip
    daemon = start("cache_daemon", args, f"unix://{run / 'daemon.sock'}", work / "daemon.log")
    try:
        assert mode(run / "daemon.sock") == 0o600
        assert mode(run) == 0o700
        assert mode(run / "daemon.sock.handoff") == 0o600  # the handoff socket beside it
        # The arena and the slot table are memfds: the sockets are the daemon's only files.
        assert sorted(p.name for p in run.iterdir()) == ["daemon.sock", "daemon.sock.handoff"]
    finally:
        daemon.stop()
