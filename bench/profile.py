"""Where a system's processes spend their CPU: py-spy samples of the daemon and of compute over
the measured requests (``bench.e2e --profile DIR``), summed into the functions and threads that
hold the most samples.

py-spy (the ``bench`` extra) attaches to a running process by ptrace and records its Python
stacks, one per thread, without stopping it (``--nonblocking``). A sample is kept only while its
thread runs or waits to run (py-spy's idle filter). A thread woken from a wait is seen on the
line of the wait until it runs again, so those lines (the channel's doorbell, the worker's poll,
the residency lock) are the cost of thread hand-offs on a busy node, not Python: the summary
counts them apart ("hand-offs") and ranks the functions over the other samples ("working").
Where py-spy is missing or cannot attach (no ptrace permission), the run says why in one line and
goes on without profiling.
"""

from __future__ import annotations

import collections
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from bench.report import say

# Sample rate (per second and thread): a few percent of one core in py-spy itself.
RATE_HZ = 100
# The lines where a thread of ours sleeps: a sample there is a thread woken and not yet running.
HANDOFF_LINES = (
    ("cache_daemon/residency/channel.py", "wait_doorbell"),
    ("cache_daemon/residency/prefetcher.py", "waker.poll"),
    ("cache_daemon/residency/admission.py", "wait_unpin"),
    ("threading.py", "Condition.__enter__"),
    ("threading.py", "Condition.__exit__"),
    ("threading.py", "Condition.wait"),
)
_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^():]*?)(?::(?P<line>\d+))?\)$")


def py_spy() -> str | None:
    """The py-spy executable beside this interpreter or on PATH; None if there is none."""
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.is_file() else shutil.which("py-spy")


@dataclass
class Recording:
    """One process's py-spy recording, from ``start`` until ``stop``."""

    label: str
    path: Path
    proc: subprocess.Popen | None = None
    error: str = ""

    def stop(self) -> None:
        """End the recording (py-spy writes its file on SIGINT)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            _, err = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        if not self.path.is_file():
            said = (err or b"").decode(errors="replace").strip().splitlines()
            self.error = f"py-spy wrote nothing for {self.label}: {said[-1] if said else 'no output'}"
        self.proc = None


def start(label: str, pid: int, out_dir: Path) -> Recording:
    """Record process ``pid`` into ``out_dir/<label>.txt`` (py-spy's raw, collapsed stacks with
    a frame per thread). Never raises: a recording that could not start carries its ``error``."""
    path = out_dir / f"{label}.txt"
    exe = py_spy()
    if exe is None:
        return Recording(
            label, path, error="py-spy is not installed (pip install py-spy, or the bench extra)"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    cmd = [exe, "record", "--pid", str(pid), "--rate", str(RATE_HZ), "--nonblocking", "--threads"]
    cmd += ["--format", "raw", "--output", str(path)]
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    except OSError as exc:
        return Recording(label, path, error=f"py-spy could not start for {label}: {exc}")
    return Recording(label, path, proc)


@dataclass
class Profile:
    """A recording summed up: samples in all, by thread, hand-offs apart, and by function."""

    label: str
    samples: int = 0
    handoffs: int = 0
    threads: collections.Counter = field(default_factory=collections.Counter)
    # over the working samples: a function's samples with it anywhere on the stack / at its top
    inclusive: collections.Counter = field(default_factory=collections.Counter)
    own: collections.Counter = field(default_factory=collections.Counter)

    @property
    def working(self) -> int:
        return self.samples - self.handoffs

    def as_dict(self, top: int, tokens: int) -> dict:
        """For the run's JSON (and ``print_profiles``): the ``top`` threads and functions, and the
        ``tokens`` the recording spans."""
        return {
            "tokens": tokens,
            "samples": self.samples,
            "rate_hz": RATE_HZ,
            "handoffs": self.handoffs,
            "threads": dict(self.threads.most_common(top)),
            "inclusive": dict(
                self.inclusive.most_common(top + 20)
            ),  # threading's frames are left out when shown
            "own": dict(self.own.most_common(top)),
        }


def _frame(text: str) -> tuple[str, str, str]:
    """(function, file, line) of one py-spy frame ``func (file:line)``."""
    m = _FRAME.match(text)
    if m is None:
        return text, "", ""
    return m["func"], m["file"], m["line"] or ""


def _is_handoff(func: str, file: str, source: str) -> bool:
    return any(file.endswith(f) and (what in func or what in source) for f, what in HANDOFF_LINES)


def summarize(label: str, path: Path) -> Profile:
    """Sum ``path`` (py-spy raw output: ``thread (tid): name;frame;...;frame count`` per line).
    The main thread's samples (start-up, gRPC's idle loop) are left out."""
    prof = Profile(label)
    sources: dict[tuple[str, str], str] = {}
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        thread = re.sub(r"^thread \((?:0x)?[0-9a-f]+\):? ?", "", frames[0]).strip() or frames[0]
        if thread == "MainThread":
            continue
        calls = [_frame(f) for f in frames[1:]]
        prof.samples += n
        prof.threads[thread] += n
        if calls:
            func, file, lineno = calls[-1]
            key = (file, lineno)
            if key not in sources:
                sources[key] = _source_line(file, lineno)
            if _is_handoff(func, file, sources[key]):
                prof.handoffs += n
                continue
        names = [f"{func} ({file})" for func, file, _ in calls]
        for name in set(names):
            prof.inclusive[name] += n
        if names:
            prof.own[names[-1]] += n
    return prof


def _source_line(file: str, lineno: str) -> str:
    """The text of ``file``'s line ``lineno`` (repository-relative or a module's), or ''."""
    if not lineno:
        return ""
    for root in (Path(__file__).resolve().parent.parent, *map(Path, sys.path)):
        candidate = root / file
        if candidate.is_file():
            lines = candidate.read_text(errors="replace").splitlines()
            i = int(lineno) - 1
            return lines[i] if 0 <= i < len(lines) else ""
    return ""


def print_profiles(results: dict[str, dict], top: int = 12) -> None:
    """Print the profile of each system that has one (``ProcessSystem.finish``: ``profile`` holds
    ``Profile.as_dict`` per process, with ``tokens``): its samples per token, the hand-offs'
    share, its threads, and the ``top`` functions by samples on the stack, as shares of the
    working samples."""
    for system, result in results.items():
        for process, prof in (result.get("profile") or {}).items():
            label = f"{system} {process}"
            if prof.get("error"):
                say(f"profile {label}: {prof['error']}")
                continue
            samples, handoffs = prof["samples"], prof["handoffs"]
            if not samples:
                say(f"profile {label}: no samples")
                continue
            working = samples - handoffs
            per_token = samples / prof["rate_hz"] * 1000 / max(1, prof["tokens"])
            say(
                f"profile {label}: {samples} samples, {per_token:.1f} ms of samples a token; hand-offs "
                f"(a woken thread still on its wait line) {handoffs / samples:.0%}, working {working / samples:.0%}"
            )
            threads = prof["threads"]
            say(
                "  threads: "
                + ", ".join(f"{name} {n / samples:.0%}" for name, n in list(threads.items())[:6])
            )
            if not working:
                continue
            shown = [
                (name, n)
                for name, n in prof["inclusive"].items()
                if "(threading.py)" not in name and "<frozen" not in name
            ][:top]
            for name, n in shown:
                own = prof["own"].get(name, 0)
                say(f"  {n / working:6.1%} on the stack, {own / working:6.1%} at the top  {name}")


__all__ = ["Profile", "Recording", "print_profiles", "py_spy", "start", "summarize"]
