"""Ownership of the daemon's shared-memory files, so a killed daemon leaves nothing behind for long.

A daemon keeps its arena as a file in ``shm_dir`` (a tmpfs: RAM). ``close``
removes them, but a daemon killed with SIGKILL (OOM killer, ``kubectl delete --force``) cannot,
and on a node that restarts the daemon container the leftovers would add up to whole arenas of
RAM. Every daemon therefore holds an ``flock`` on a lock file for as long as it lives, and the
next daemon to start removes the files of every daemon whose lock is free: the kernel drops an
flock when its holder dies, however it dies.

::

    <shm_dir>/expertcache-<daemon_id>.lock    flock(LOCK_EX) held by the live daemon
    <shm_dir>/expertcache-<daemon_id>         arena (CPU)                   removed by a later
                                                                            daemon's sweep once
                                                                            the lock is free
    (<shm_dir>/expertcache-<daemon_id>.slots  the slot table of releases before it became memfds,
                                              swept the same way)

Only ids that have a lock file are ever swept: other ``expertcache-*`` files in a shared
``/dev/shm`` (tests, benchmarks, a daemon of an older version) are left alone. A new lock file
is created under a hidden temporary name, locked, and only then hard-linked to its final name,
so a sweep can never see a lock file that is not yet held. A sweep that locks a lock file checks
that the name still refers to the file it locked before removing anything (another sweep may
have removed it and a new daemon reused the name).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
from pathlib import Path

from cache_daemon.errors import ArenaUnavailable

logger = logging.getLogger(__name__)

PREFIX = "expertcache-"
LOCK_SUFFIX = ".lock"


def lock_path(shm_dir: str | Path, daemon_id: str) -> Path:
    return Path(shm_dir) / f"{PREFIX}{daemon_id}{LOCK_SUFFIX}"


def daemon_files(shm_dir: str | Path, daemon_id: str) -> list[Path]:
    """The shm files of ``daemon_id`` other than its lock: ``expertcache-<id>`` and ``expertcache-<id>.*``."""
    shm_dir = Path(shm_dir)
    base = f"{PREFIX}{daemon_id}"
    lock_name = base + LOCK_SUFFIX
    found = []
    with os.scandir(shm_dir) as entries:
        for entry in entries:
            if entry.name != lock_name and (entry.name == base or entry.name.startswith(base + ".")):
                found.append(shm_dir / entry.name)
    return sorted(found)


def _check_daemon_id(daemon_id: str) -> None:
    # A dot would make "<id>.*" match another daemon's files ("a" vs "a.b"); a slash leaves shm_dir.
    if not daemon_id or "." in daemon_id or "/" in daemon_id or "\0" in daemon_id:
        raise ValueError(f"daemon id {daemon_id!r} must be non-empty and contain no '.', '/' or NUL")


class ShmClaim:
    """This daemon's hold on its shm files: an open, flock'ed lock file. ``release`` is idempotent."""

    def __init__(self, shm_dir: Path, daemon_id: str, fd: int) -> None:
        self.shm_dir = shm_dir
        self.daemon_id = daemon_id
        self.path = lock_path(shm_dir, daemon_id)
        self._fd: int | None = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Remove the lock file, then drop the lock (the daemon has removed its other files)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(fd)  # closing the last descriptor drops the flock


def claim_shm_files(shm_dir: str | Path, daemon_id: str) -> ShmClaim:
    """Sweep the files of dead daemons in ``shm_dir``, then lock ``daemon_id``'s files as live.

    Raises ``ArenaUnavailable`` when ``shm_dir`` is unusable or a live daemon holds ``daemon_id``.
    """
    _check_daemon_id(daemon_id)
    shm_dir = Path(shm_dir)
    try:
        sweep_dead_daemons(shm_dir)
    except OSError as exc:
        raise ArenaUnavailable(f"cannot list the shared-memory directory {shm_dir}: {exc.strerror}") from exc
    final = lock_path(shm_dir, daemon_id)
    tmp = shm_dir / f".{final.name}.{os.getpid()}.tmp"  # hidden: no sweep looks at it
    try:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise ArenaUnavailable(f"cannot create the lock file {tmp}: {exc.strerror}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: nobody else can hold it
        try:
            os.link(tmp, final)  # unlike rename, never replaces a live daemon's lock file
        except FileExistsError as exc:
            raise ArenaUnavailable(
                f"daemon id {daemon_id!r} is in use in {shm_dir}: {final} is held by a live daemon"
            ) from exc
        except OSError as exc:
            raise ArenaUnavailable(f"cannot create the lock file {final}: {exc.strerror}") from exc
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    tmp.unlink()
    logger.debug("holding %s", final)
    return ShmClaim(shm_dir, daemon_id, fd)


def sweep_dead_daemons(shm_dir: str | Path) -> list[Path]:
    """Remove the shm files of every daemon in ``shm_dir`` whose lock is not held; returns them.

    A live daemon's files are never touched: its lock cannot be taken. Each removal is logged
    at INFO.
    """
    shm_dir = Path(shm_dir)
    removed: list[Path] = []
    with os.scandir(shm_dir) as entries:
        locks = sorted(e.name for e in entries if e.name.startswith(PREFIX) and e.name.endswith(LOCK_SUFFIX))
    for name in locks:
        daemon_id = name[len(PREFIX) : -len(LOCK_SUFFIX)]
        if not daemon_id or "." in daemon_id:
            continue  # not a name claim_shm_files makes
        removed += _sweep_one(shm_dir, daemon_id)
    return removed


def _sweep_one(shm_dir: Path, daemon_id: str) -> list[Path]:
    path = lock_path(shm_dir, daemon_id)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return []  # released or swept meanwhile
    except OSError as exc:
        logger.warning("cannot check %s for a dead daemon: %s", path, exc.strerror)
        return []
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return []  # its daemon is alive
            raise
        try:
            current = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            return []  # its daemon released it, or another sweep removed it, before we locked
        mine = os.fstat(fd)
        if (current.st_dev, current.st_ino) != (mine.st_dev, mine.st_ino):
            return []  # the name now belongs to a new daemon
        removed = []
        for leftover in daemon_files(shm_dir, daemon_id):
            if leftover.is_dir() and not leftover.is_symlink():
                logger.warning("not removing %s left by dead daemon %s: a directory", leftover, daemon_id)
                continue
            try:
                leftover.unlink()
            except FileNotFoundError:
                continue
            except OSError as exc:
                logger.warning(
                    "cannot remove %s left by dead daemon %s: %s", leftover, daemon_id, exc.strerror
                )
                continue
            logger.info("removed %s, left by daemon %s which is no longer running", leftover, daemon_id)
            removed.append(leftover)
        path.unlink(missing_ok=True)
        logger.info("removed %s, left by daemon %s which is no longer running", path, daemon_id)
        removed.append(path)
        return removed
    finally:
        os.close(fd)
