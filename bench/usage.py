"""What the benchmarks read of the processes they run: CPU seconds and memory from ``/proc``,
and Redis's own memory figures."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

MIB = 1 << 20


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and its threads so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def memory_status(pid: int) -> dict[str, int]:
    """VmRSS / VmHWM of ``pid`` in bytes (a process that has exited has neither)."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def rss_mib(pid: int) -> float:
    """The resident set of ``pid`` now, MiB; NaN when ``/proc`` has none."""
    rss = memory_status(pid).get("VmRSS")
    return float("nan") if rss is None else rss / MIB


def redis_memory(url: str) -> dict[str, int]:
    """Redis INFO ``used_memory``, ``used_memory_rss`` and ``used_memory_peak``, bytes."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        info = client.info("memory")
    finally:
        client.close()
    return {k: int(info[k]) for k in ("used_memory", "used_memory_rss", "used_memory_peak")}


def ask_line_process(proc: subprocess.Popen, request: str | None, what: str) -> dict:
    """Send one request line (None: none, only read) to a process that answers one JSON line per
    request (a benchmark's driver) and read its answer; RuntimeError naming ``what`` when it has
    exited instead."""
    if request is not None:
        proc.stdin.write(request + "\n")
        proc.stdin.flush()
    line = proc.stdout.readline()
    if not line:
        code = proc.wait(timeout=30)
        raise RuntimeError(f"{what} exited with {code} (its stderr is above)")
    return json.loads(line)


def end_line_process(proc: subprocess.Popen) -> None:
    """End a process that answers one request per stdin line (a benchmark's driver): close its
    stdin, which ends it, and kill it when it has not ended 30 s later."""
    if proc.poll() is None:
        proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def record_answer(system, got: dict, repeat: int) -> None:
    """Keep a driver's answer to one measured request on ``system`` (its ``latencies``,
    ``first_token``, ``by_repeat``, ``cpu_s`` and ``generated`` of ``system.tokens`` tokens)."""
    system.latencies += got["latencies_s"]
    system.first_token.append(got["first_s"])
    system.by_repeat.setdefault(repeat, []).extend(got["latencies_s"])
    system.cpu_s += got["cpu_s"]
    system.generated += system.tokens
