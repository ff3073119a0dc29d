"""Local surfaces are owner-only whatever the umask, and never followed through a planted symlink:
the daemon's socket (0600) and its directory (0700), the arena and slot table files (0600)."""

from __future__ import annotations

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


def test_slot_table_is_owner_only_and_refuses_symlinks(tmp_path, open_umask):
    path = tmp_path / "expertcache-x.slots"
    table = SlotTable.create(str(path), 8, 2)
    assert mode(path) == 0o600
    del table
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    link = tmp_path / "expertcache-y.slots"
    link.symlink_to(victim)
    with pytest.raises(RuntimeError, match="cannot open: Too many levels of symbolic links"):
        SlotTable.open(str(link))
    # A symlink planted at the temporary name is removed, not written through.
    planted = tmp_path / f"expertcache-z.slots.tmp.{os.getpid()}"
    planted.symlink_to(victim)
    SlotTable.create(str(tmp_path / "expertcache-z.slots"), 8, 2)
    assert victim.read_bytes() == b"precious"
    assert mode(tmp_path / "expertcache-z.slots") == 0o600


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
        slots = [p for p in tmp_path.iterdir() if p.name.endswith(".slots")]
        assert slots and all(mode(p) == 0o600 for p in slots)
        arenas = [p for p in tmp_path.iterdir() if p.name.startswith("expertcache-") and "." not in p.name]
        assert arenas and all(mode(p) == 0o600 for p in arenas)
    finally:
        daemon.stop()
