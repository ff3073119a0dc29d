"""The benchmark's page-cache hygiene on real files: a file just written leaves the page cache
when dropped (its dirty pages are synced first), ``page_cache_bytes`` tells what stays, and the
budgeted llama.cpp starts only once llama.cpp's own process, which maps the same GGUF, is gone
and the GGUF has left the cache: otherwise it would find the GGUF in memory no group of its own
is charged for, and read nothing from the disk (bf16 once measured 20 ms a token that way)."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest

from bench import llama_cpp
from bench.e2e_accelerate import drop_page_cache, page_cache_bytes
from bench.systems import begin_paging

SIZE = 4 << 20


def fs_type(path: Path) -> str:
    best, kind = "", ""
    with open("/proc/self/mounts") as mounts:
        for line in mounts:
            _, point, fs = line.split()[:3]
            if str(path).startswith(point) and len(point) > len(best):
                best, kind = point, fs
    return kind


@pytest.fixture
def written(tmp_path) -> Path:
    if fs_type(tmp_path) in ("tmpfs", "ramfs"):
        pytest.skip(f"{tmp_path} is on {fs_type(tmp_path)}: its files are memory, no page cache to leave")
    path = tmp_path / "model.gguf"
    path.write_bytes(os.urandom(SIZE))  # dirty pages, not yet written back
    return path


def test_a_file_just_written_leaves_the_page_cache(written):
    assert page_cache_bytes(written) == SIZE
    assert drop_page_cache([written]) == 1
    assert page_cache_bytes(written) == 0
    written.read_bytes()
    assert page_cache_bytes(written) == SIZE


def test_an_empty_file_has_no_answer(tmp_path):
    empty = tmp_path / "empty"
    empty.touch()
    assert page_cache_bytes(empty) is None


class Mapper:
    """llama.cpp's own system: its process maps the GGUF and has touched every page of it."""

    def __init__(self, gguf: Path, calls: list[str]) -> None:
        self.calls = calls
        self._file = open(gguf, "rb")  # noqa: SIM115 - closed by stop
        self._map = mmap.mmap(self._file.fileno(), 0, prot=mmap.PROT_READ)
        assert sum(self._map[i] for i in range(0, len(self._map), mmap.PAGESIZE)) >= 0

    def finish(self) -> dict:
        self.calls.append("llama.cpp finish")
        return {"latencies_s": [0.02]}

    def stop(self) -> None:
        self.calls.append("llama.cpp stop")
        self._map.close()
        self._file.close()


class Budgeted:
    """The budgeted llama.cpp as ``start_peer`` starts it: the GGUF dropped, then what stays."""

    def __init__(self, gguf: Path, calls: list[str]) -> None:
        drop_page_cache([gguf])
        self.gguf, self.calls, self.cached_at_start = gguf, calls, page_cache_bytes(gguf)
        calls.append(f"budgeted started, {self.cached_at_start} bytes cached")

    def begin(self) -> None:
        self.calls.append("budgeted begin")


def test_the_budgeted_llama_cpp_starts_after_llama_cpp_is_gone_and_the_gguf_dropped(written):
    calls: list[str] = []
    running: dict = {llama_cpp.SYSTEM: Mapper(written, calls)}
    # While llama.cpp's process maps it, DONTNEED leaves the GGUF where it is.
    drop_page_cache([written])
    assert page_cache_bytes(written) == SIZE
    done = begin_paging(running, [llama_cpp.BUDGETED], lambda system: Budgeted(written, calls))
    assert calls == [
        "llama.cpp finish",
        "llama.cpp stop",
        "budgeted started, 0 bytes cached",
        "budgeted begin",
    ]
    assert done == {llama_cpp.SYSTEM: {"latencies_s": [0.02]}}
    assert list(running) == [llama_cpp.BUDGETED]
    assert running[llama_cpp.BUDGETED].cached_at_start == 0


def test_without_a_budgeted_system_nothing_is_stopped(written):
    calls: list[str] = []
    running = {llama_cpp.SYSTEM: Mapper(written, calls)}
    try:
        assert begin_paging(running, [], lambda system: pytest.fail(f"{system} started")) == {}
        assert calls == [] and list(running) == [llama_cpp.SYSTEM]
    finally:
        running[llama_cpp.SYSTEM].stop()
