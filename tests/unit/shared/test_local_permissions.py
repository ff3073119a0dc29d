"""Local surfaces are owner-only whatever the umask, and never followed through a planted symlink:
the daemon's socket (0600) and its directory (0700), the arena and slot table files (0600)."""

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


def test_shm_arena_is_owner_only_and_refuses_a_planted_symlink(tmp_path, open_umask):
    arena = create_arena("cpu", 2, 4096, shm_dir=tmp_path, daemon_id="perm")
    try:
        assert mode(arena.path) == 0o600
    finally:
        arena.close()
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    (tmp_path / "expertcache-planted").symlink_to(victim)
    with pytest.raises(Exception, match="cannot create the arena file"):
        create_arena("cpu", 2, 4096, shm_dir=tmp_path, daemon_id="planted")
    assert victim.read_bytes() == b"precious"


def test_compute_refuses_a_symlinked_arena(tmp_path):
    import torch

    from compute_svc.arena import Arena
    from compute_svc.errors import ArenaMismatch
    from expertcache.arena_handle import ArenaHandle, ArenaKind

    target = tmp_path / "real"
    target.write_bytes(b"\0" * 8192)
    link = tmp_path / "expertcache-link"
    link.symlink_to(target)
    handle = ArenaHandle(kind=ArenaKind.POSIX_SHM, size_bytes=8192, shm_name=str(link))
    with pytest.raises(ArenaMismatch, match="cannot open the cache daemon's arena"):
        Arena.open(handle, 2, 4096, torch.device("cpu"))


def test_daemon_socket_and_directory_are_owner_only(tiny_store, tmp_path, open_umask):
    tiny = tiny_store("mixtral")
    work = tmp_path / "work"
    work.mkdir()
    run = tmp_path / "run" / "sub"
    args = [
        "--store-dir", str(tiny.store),
        "--socket-path", str(run / "daemon.sock"),
        "--shm-dir", str(tmp_path),
        "--device", "cpu",
        "--device-budget-bytes", str(4 * tiny.manifest.blob_bytes),
    ]  # fmt: skip
    daemon = start("cache_daemon", args, f"unix://{run / 'daemon.sock'}", work / "daemon.log")
    try:
        assert mode(run / "daemon.sock") == 0o600
        assert mode(run) == 0o700
        assert mode(run / "daemon.sock.handoff") == 0o600  # the handoff socket beside it
        assert not [p for p in tmp_path.iterdir() if p.name.endswith(".slots")]  # memfds now
        arenas = [p for p in tmp_path.iterdir() if p.name.startswith("expertcache-") and "." not in p.name]
        assert arenas and all(mode(p) == 0o600 for p in arenas)
    finally:
        daemon.stop()
