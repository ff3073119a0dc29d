"""The CPU arena's pages are faulted in when it is made (``memfd.populate``) and mapped when
compute maps it (``map_readonly``): the first read into a slot while serving pays no page fault
and no page clear. Checked on real memfds through the kernel's own count of resident pages."""

from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np
import pytest

from cache_daemon.errors import ArenaUnavailable
from cache_daemon.tiers.device import MemfdArena
from expertcache import memfd

SLOT = 64 * 1024


def resident_bytes(address: int) -> int:
    """The Rss of this process's mapping that starts at ``address`` (/proc/self/smaps)."""
    found = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split(None, 1)[0]
            if "-" in head and ":" not in head:
                found = int(head.split("-")[0], 16) == address
            elif found and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping starts at {address:#x}")


def mapping_address(mapping: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(mapping))


def mapping_address_readonly(mapping: mmap.mmap) -> int:
    """A read-only mmap exports no writable buffer: its address through numpy's view."""
    return np.frombuffer(mapping, np.uint8).ctypes.data


def fresh(nbytes: int) -> tuple[int, mmap.mmap]:
    fd = memfd.create("populate-test", nbytes)
    return fd, mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def test_a_fresh_memfd_mapping_has_no_page_resident_until_populated():
    fd, mapping = fresh(32 * SLOT)
    try:
        address = mapping_address(mapping)
        assert resident_bytes(address) == 0  # fallocate reserves pages; it maps none
        memfd.populate(mapping, "the test mapping")
        assert resident_bytes(address) == len(mapping)
        assert mapping[:16] == bytes(16) and mapping[-16:] == bytes(16)  # still zeros
    finally:
        mapping.close()
        os.close(fd)


def test_the_daemon_arena_and_compute_mapping_are_resident_from_the_start():
    arena = MemfdArena(24, SLOT, daemon_id="populate")
    try:
        assert resident_bytes(arena.slots.data_ptr()) == arena.size_bytes
        fd = arena.arena_fd()
        try:
            seen = memfd.map_readonly(fd, arena.size_bytes, "the arena")
        finally:
            os.close(fd)
        try:
            assert resident_bytes(mapping_address_readonly(seen)) == arena.size_bytes
        finally:
            seen.close()
    finally:
        arena.close()


def test_without_madv_populate_write_every_page_is_touched_instead(monkeypatch):
    """A kernel before 5.14 refuses the advice (EINVAL): each page's first byte is written."""
    monkeypatch.setattr(memfd, "MADV_POPULATE_WRITE", 0x7FFF)  # an advice no kernel knows: EINVAL
    fd, mapping = fresh(16 * SLOT)
    try:
        memfd.populate(mapping, "the test mapping")
        assert resident_bytes(mapping_address(mapping)) == len(mapping)
    finally:
        mapping.close()
        os.close(fd)


def test_pages_that_cannot_be_faulted_in_are_a_clear_error():
    """Past the end of a memfd (shrunk under its mapping) a page would be SIGBUS: populate says
    so rather than crash later at the first read."""
    fd, mapping = fresh(8 * SLOT)
    try:
        os.ftruncate(fd, 4 * SLOT)
        with pytest.raises(
            memfd.MemfdError, match=rf"^cannot fault in the {8 * SLOT} bytes of the test mapping: "
        ):
            memfd.populate(mapping, "the test mapping")
    finally:
        mapping.close()
        os.close(fd)


def test_an_arena_that_cannot_be_faulted_in_is_arena_unavailable(monkeypatch):
    def refuse(mapping, what):
        raise memfd.MemfdError(f"cannot fault in the {len(mapping)} bytes of {what}: Cannot allocate memory")

    monkeypatch.setattr(memfd, "populate", refuse)
    with pytest.raises(
        ArenaUnavailable,
        match=r"^cannot fault in the \d+ bytes of the CPU arena: .*lower device_budget_bytes",
    ):
        MemfdArena(4, SLOT, daemon_id="refused")
