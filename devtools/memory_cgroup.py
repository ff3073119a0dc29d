"""Memory cgroups for benchmarked processes: a process started in one (its command wrapped by
``command``) is charged for every page it touches from its first instruction on, the page
cache it reads included, and is held to the group's limit. cgroup v1 (``memory`` controller
mounted at /sys/fs/cgroup/memory) and v2 (the unified hierarchy) are both handled; where neither
can be written (not root, no such mount) ``MemoryCgroup.make`` says why and returns None.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

V1_ROOT = Path("/sys/fs/cgroup/memory")
V2_ROOT = Path("/sys/fs/cgroup")
PARENT = "expertcache-bench"

# The files of each version: what the group uses now, its peak, its limit, and where OOM kills
# are counted.
_FILES = {
    1: {
        "usage": "memory.usage_in_bytes",
        "peak": "memory.max_usage_in_bytes",
        "limit": "memory.limit_in_bytes",
        "events": "memory.oom_control",
    },
    2: {"usage": "memory.current", "peak": "memory.peak", "limit": "memory.max", "events": "memory.events"},
}
# ``memory.stat`` figures are named as v1 names them; v2 calls some of them otherwise.
_V2_STAT = {"rss": "anon", "mapped_file": "file_mapped", "cache": "file"}


def _version(v1_root: Path, v2_root: Path) -> int | None:
    if (v1_root / "memory.limit_in_bytes").is_file():
        return 1
    controllers = v2_root / "cgroup.controllers"
    if controllers.is_file() and "memory" in controllers.read_text().split():
        return 2
    return None


@dataclass
class MemoryCgroup:
    """One memory cgroup, made for one benchmarked system and removed after it."""

    path: Path
    version: int

    @classmethod
    def make(
        cls, name: str, *, v1_root: Path = V1_ROOT, v2_root: Path = V2_ROOT
    ) -> tuple[MemoryCgroup | None, str]:
        """A new, empty group ``PARENT/name-<pid>`` (no limit yet), and a line saying where; or
        None and why none can be made here."""
        version = _version(v1_root, v2_root)
        if version is None:
            return None, f"no memory cgroup: neither {v1_root} (v1) nor a v2 memory controller at {v2_root}"
        root = v1_root if version == 1 else v2_root
        try:
            parent = root / PARENT
            parent.mkdir(exist_ok=True)
            if version == 2:  # a v2 group gets the memory controller from its parent's subtree_control
                for level in (root, parent):
                    control = level / "cgroup.subtree_control"
                    if "memory" not in control.read_text().split():
                        control.write_text("+memory")
            path = parent / f"{name}-{os.getpid()}"
            path.mkdir()
        except OSError as exc:
            return None, f"no memory cgroup: cannot make one under {root} ({exc.strerror or exc})"
        return cls(path, version), f"cgroup v{version} {path}"

    def _file(self, what: str) -> Path:
        return self.path / _FILES[self.version][what]

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside the group from its first instruction on (``confined_command``)."""
        return confined_command(argv, cgroup=self)

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def pids(self) -> list[int]:
        return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]

    @property
    def usage_bytes(self) -> int:
        return int(self._file("usage").read_text())

    @property
    def peak_bytes(self) -> int | None:
        """The most the group has used (None where the kernel keeps no peak: v2 before 5.19)."""
        peak = self._file("peak")
        return int(peak.read_text()) if peak.is_file() else None

    def stat(self, key: str) -> int:
        """One figure of the group's ``memory.stat`` (bytes), named as v1 names it (``rss``,
        ``mapped_file``, ``shmem``, ...): a v2 group answers with its own name for it."""
        if self.version == 2:
            key = _V2_STAT.get(key, key)
        for line in (self.path / "memory.stat").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
        raise ValueError(f"{self.path / 'memory.stat'} has no {key!r}")

    @property
    def anon_bytes(self) -> int:
        """Anonymous memory charged to the group (the processes' own, without page cache)."""
        return self.stat("rss")

    @classmethod
    def of_process(cls, pid: int | str = "self") -> MemoryCgroup | None:
        """The memory cgroup ``pid`` runs in, if it is one of ``PARENT``'s (a benchmark's)."""
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
            _, controllers, rel = line.split(":", 2)
            if controllers == "memory" and f"/{PARENT}/" in rel:
                return cls(V1_ROOT / rel.lstrip("/"), 1)
            if (
                controllers == ""
                and f"/{PARENT}/" in rel
                and (V2_ROOT / rel.lstrip("/") / "memory.max").exists()
            ):
                return cls(V2_ROOT / rel.lstrip("/"), 2)
        return None

    def reset_peak(self) -> None:
        """Start the peak anew (v1, and v2 from Linux 6.12; elsewhere it keeps counting)."""
        try:
            self._file("peak").write_text("0")
        except OSError:
            pass

    def set_limit(self, limit_bytes: int) -> None:
        """Hold the group to ``limit_bytes`` (its page cache is reclaimed first, then its
        processes are OOM-killed)."""
        self._file("limit").write_text(str(int(limit_bytes)))

    @property
    def limit_bytes(self) -> int | None:
        text = self._file("limit").read_text().strip()
        return None if text == "max" else int(text)

    @property
    def oom_kills(self) -> int:
        for line in self._file("events").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def remove(self, timeout_s: float = 5.0) -> None:
        """Remove the group once its processes are gone (they are waited for ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.05)


def confined_command(
    argv: Sequence[str], *, cgroup: MemoryCgroup | None = None, open_files: int | None = None
) -> list[str]:
    """``argv`` as it is with neither, else run by a shell that sets the soft limit of
    ``open_files`` descriptors, writes its own pid into ``cgroup`` and ``exec``s ``argv`` under
    that pid: charged to the group from its first instruction on. The spawning process then runs
    no code of its own between fork and exec. A ``preexec_fn`` does, and in a process with
    threads that child can wait forever on a lock another thread held at the fork (a benchmark
    hung so, spawning a daemon)."""
    steps = []
    if open_files is not None:
        steps.append(f"ulimit -Sn {int(open_files)}")
    if cgroup is not None:
        steps.append('echo $$ > "$0"')
    if not steps:
        return list(argv)
    procs = str(cgroup.path / "cgroup.procs") if cgroup is not None else "sh"
    return ["/bin/sh", "-c", " && ".join([*steps, 'exec "$@"']), procs, *argv]


__all__ = ["PARENT", "MemoryCgroup", "confined_command"]
