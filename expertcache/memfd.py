"""Sealed memfds: shared memory with no name, writable by its maker alone.

The cache daemon makes its CPU arena here (``create``, map it read-write, then ``seal``) and hands
the descriptor to compute over the handoff socket (``expertcache.handoff``); compute maps it with
``map_readonly``. After ``seal``:
- nobody can map it writable again, write(2) to it or re-open it writable and write
  (``F_SEAL_FUTURE_WRITE``); the maker's own mapping stays writable;
- nobody can shrink it under a reader, which would turn its reads into SIGBUS, or grow it
  (``F_SEAL_SHRINK|F_SEAL_GROW``);
- the seals cannot be changed (``F_SEAL_SEAL``).
The slot table (``csrc/src/slot_table.cc``) is sealed the same way.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os

F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)  # Linux 5.1; not in Python 3.11
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14; not in Python 3.11
PAGE = mmap.PAGESIZE


class MemfdError(Exception):
    """A memfd could not be made, sealed or mapped; the message says which and why."""


def create(name: str, nbytes: int) -> int:
    """A new memfd of ``nbytes`` (its pages reserved, so a full memory cgroup or tmpfs limit fails
    here with ENOSPC/ENOMEM and not with SIGBUS at the first write), close-on-exec, sealable."""
    if nbytes <= 0:
        raise ValueError(f"a memfd needs at least one byte, got {nbytes}")
    try:
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError as exc:
        raise MemfdError(f"memfd_create({name!r}) failed: {exc.strerror}") from None
    try:
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise MemfdError(f"cannot reserve {nbytes} bytes of shared memory: {exc.strerror}") from None
            os.ftruncate(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise
    return fd


def populate(mapping: mmap.mmap, what: str) -> None:
    """Fault in every page of a writable shared ``mapping`` now. ``create``'s fallocate reserves
    a memfd's pages but leaves them to be zeroed at their first touch: without this, the first
    read into each arena slot pays that (a fault and a page clear per 4 KiB, in the read's
    submission) while it serves a request. ``MADV_POPULATE_WRITE`` where the kernel has it, else
    a write of each page's first byte (the memory is fresh: its bytes are zero either way)."""
    try:
        mapping.madvise(MADV_POPULATE_WRITE)
        return
    except OSError as exc:
        if exc.errno != errno.EINVAL:  # EINVAL: a kernel before 5.14
            raise MemfdError(f"cannot fault in the {len(mapping)} bytes of {what}: {exc.strerror}") from None
    view = memoryview(mapping)
    try:
        for offset in range(0, len(mapping), PAGE):
            view[offset] = 0
    finally:
        view.release()


def seal(fd: int) -> None:
    """Add ``SEALS`` to ``fd``: map it writable before this; nobody can after."""
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except OSError as exc:
        raise MemfdError(f"cannot seal the memfd (Linux 5.1 or newer needed): {exc.strerror}") from None


def map_readonly(fd: int, nbytes: int, what: str) -> mmap.mmap:
    """Map the first ``nbytes`` of a sealed memfd read-only, its pages mapped now (``MemfdError``
    naming ``what`` if it is not a memfd sealed with ``SEALS`` or is shorter). ``fd`` stays the
    caller's to close."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        size = os.fstat(fd).st_size
    except OSError as exc:
        raise MemfdError(f"{what} is not a sealed memfd: {exc.strerror}") from None
    if seals & SEALS != SEALS:
        raise MemfdError(f"{what} is not sealed (seals {seals:#x}, expected {SEALS:#x})")
    if size < nbytes:
        raise MemfdError(f"{what} has {size} bytes, expected at least {nbytes}")
    try:
        # MAP_POPULATE: its page tables are filled now, not at each page's first read.
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
    except OSError as exc:
        raise MemfdError(f"cannot map {what}: {exc.strerror}") from None


__all__ = ["SEALS", "MemfdError", "create", "map_readonly", "populate", "seal"]
