"""HF Accelerate disk offload on the same checkpoint and budget: per-token decode latency.

    python -m bench.e2e_accelerate CHECKPOINT --cpu-budget-bytes N --tokens T --offload-dir DIR --out result.json

Run by ``bench.e2e`` in its own process (so its memory and page-cache use are its own):
``run_accelerate`` is ``bench.e2e``'s side, a process per run.
``from_pretrained(device_map="auto", max_memory={"cpu": N}, offload_folder=DIR)``: what does not
fit in N bytes of CPU memory is offloaded to disk and streamed in, whole module by whole module,
at every forward — its cost does not depend on routing (it uses its own router; with random
weights that is noise, and it does not matter: every offloaded expert is read anyway).

Page cache: after loading and after every generated token (in the streamer's hook, outside the
timed interval), ``os.posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED)`` is called on every file
under the offload folder and the checkpoint, so no token finds offloaded weights cached in RAM
beyond the budget. Bytes read per token come from ``/proc/self/io`` (``read_bytes``: storage reads).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.confine import HEADROOM_BYTES, Confinement  # noqa: E402
from bench.gpt_oss import PROMPT  # noqa: E402
from bench.report import MIB, say  # noqa: E402


def drop_page_cache(roots: list[Path]) -> int:
    """fadvise(DONTNEED) every file under ``roots``; returns how many files. Each is synced first:
    the page cache keeps the dirty pages of a file just written (a GGUF just converted, an offload
    folder just saved) whatever DONTNEED says."""
    count = 0
    for root in roots:
        paths = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            count += 1
    return count


def page_cache_bytes(path: Path) -> int | None:
    """How many bytes of ``path`` the page cache holds now (mincore over a mapping of it), or None
    where it cannot be told (an empty file, or mincore failed)."""
    size = path.stat().st_size
    if size == 0:
        return None
    pages = -(-size // mmap.PAGESIZE)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    vec = np.zeros(pages, np.uint8)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as mapping:
        view = np.frombuffer(mapping, np.uint8)
        failed = libc.mincore(view.ctypes.data, size, vec.ctypes.data) != 0
        del view  # the mapping closes only once no view of it is left
    if failed:
        return None
    return min(int(np.count_nonzero(vec & 1)) * mmap.PAGESIZE, size)


def idle_baseline() -> int | None:
    """Before loading (imports done, no weight read yet): the anonymous memory of the benchmark's
    memory cgroup this process runs in, its own baseline; None outside one."""
    from devtools.memory_cgroup import MemoryCgroup

    group = MemoryCgroup.of_process()
    return None if group is None else group.anon_bytes


def hold_to_budget(baseline_bytes: int | None, budget_bytes: int, headroom_bytes: int) -> dict | None:
    """Once loaded (loading streams every weight through memory, beyond any budget): the memory
    cgroup this process runs in, if a benchmark's, limited to its idle baseline (``idle_baseline``)
    + ``budget_bytes`` + headroom, as every system is. Accelerate may keep less than its budget in
    memory (it places whole modules); its anonymous memory now + headroom is the floor of the
    limit, so that the weights it placed stay. Its offloaded weights are file pages: they must
    come from storage at each use, as they would on a machine with this much memory (the page
    cache is dropped after every token). What was set, or None."""
    from devtools.memory_cgroup import MemoryCgroup

    group = MemoryCgroup.of_process() if headroom_bytes and baseline_bytes is not None else None
    if group is None:
        return None
    anon = group.anon_bytes
    baseline = max(baseline_bytes, anon - budget_bytes)
    limit = baseline + budget_bytes + headroom_bytes
    group.set_limit(limit)
    group.reset_peak()  # the peak reported is the one under the limit
    return {"baseline_bytes": baseline, "anon_bytes": anon, "limit_bytes": limit}


def storage_read_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


class TimingStreamer:
    """``generate``'s streamer: timestamps each new token, then drops the page cache untimed."""

    def __init__(self, roots: list[Path], progress: bool) -> None:
        self.roots = roots
        self.progress = progress
        self.latencies_s: list[float] = []
        self.read_bytes: list[int] = []
        self.drop_s: list[float] = []
        self._prompt_seen = False
        self._since = 0.0
        self._bytes_since = 0

    def start(self) -> None:
        self._since = time.perf_counter()
        self._bytes_since = storage_read_bytes()

    def put(self, value) -> None:
        now = time.perf_counter()
        if not self._prompt_seen:  # the first call carries the prompt
            self._prompt_seen = True
            return
        self.latencies_s.append(now - self._since)
        self.read_bytes.append(storage_read_bytes() - self._bytes_since)
        dropped = time.perf_counter()
        drop_page_cache(self.roots)
        self.drop_s.append(time.perf_counter() - dropped)
        if self.progress:
            print(
                f"  accelerate token {len(self.latencies_s)}: {self.latencies_s[-1]:.2f}s",
                file=sys.stderr,
                flush=True,
            )
        self._since = time.perf_counter()  # the drop is not counted in the next token
        self._bytes_since = storage_read_bytes()

    def end(self) -> None:
        pass


# -- bench.e2e's side ---------------------------------------------------------------------------
def run_accelerate(checkpoint: Path, work: Path, args: argparse.Namespace, cpu_bytes: int) -> dict:
    offload = work / "offload"
    out = work / "accelerate.json"
    tokens = args.accelerate_tokens
    say(
        f"[accelerate] from_pretrained(device_map='auto', max_memory={{'cpu': {cpu_bytes / MIB:.0f} MiB}}, "
        f"offload_folder={offload}); generate {tokens} tokens x {args.accelerate_requests} request(s); "
        "posix_fadvise(DONTNEED) on the offload folder and the checkpoint after load and after every token"
    )
    latencies: list[float] = []
    read_bytes: list[int] = []
    runs = []
    memory: list[dict] = []
    cgroups = getattr(args, "cgroups", False)
    for r in range(args.accelerate_requests):
        cmd = [
            sys.executable,
            "-m",
            "bench.e2e_accelerate",
            str(checkpoint),
            "--cpu-budget-bytes",
            str(cpu_bytes),
            "--tokens",
            str(tokens),
            "--prompt",
            ",".join(map(str, PROMPT)),
            "--offload-dir",
            str(offload),
            "--out",
            str(out),
            "--progress",
            "--threads",
            str(args.threads),
        ]
        # Its own memory cgroup, which it limits itself once loaded (``hold_to_budget``).
        confined = Confinement("accelerate", enabled=cgroups)
        if confined.cgroup is not None:
            cmd += ["--memory-headroom-bytes", str(HEADROOM_BYTES)]
        try:
            proc = subprocess.run(
                confined.command(cmd), cwd=REPO, stderr=subprocess.PIPE, text=True, timeout=3600
            )
            if confined.cgroup is not None and proc.returncode == 0:
                held = json.loads(out.read_text())["memory_after_load"]
                confined.held(held["baseline_bytes"], cpu_bytes)
            memory.append(confined.report())
        finally:
            confined.remove()
        progress = [line for line in proc.stderr.splitlines() if line.startswith("  accelerate token")]
        for line in progress[-3:]:
            say(f"  [accelerate] request {r + 1}: {line.strip()}")
        if proc.returncode != 0:
            raise RuntimeError(f"bench.e2e_accelerate failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        run = json.loads(out.read_text())
        runs.append(run)
        latencies += run["latencies_s"][1:]  # the first includes prefill
        read_bytes += run["read_bytes"][1:]
    return {
        "latencies_s": latencies,
        "first_token_s": [run["latencies_s"][0] for run in runs],
        "bytes_per_token": statistics.fmean(read_bytes) if read_bytes else None,
        "load_s": [run["load_s"] for run in runs],
        "device_map_modules": runs[0]["device_map_modules"],
        "page_cache_files_dropped": runs[0]["page_cache_files"],
        "page_cache_drop_s_mean": statistics.fmean(run["drop_s_mean"] for run in runs),
        "cpu_budget_bytes": cpu_bytes,
        "memory": peak_of(memory),
    }


def peak_of(reports: list[dict]) -> dict:
    """One memory report for several runs of one system: the first's limit, the highest peak,
    every OOM kill."""
    if not reports or reports[0].get("cgroup") is None:
        return reports[0] if reports else {"cgroup": None, "note": "no runs"}
    peaks = [r["peak_bytes"] for r in reports if r.get("peak_bytes") is not None]
    return {
        **reports[0],
        "peak_bytes": max(peaks) if peaks else None,
        "oom_kills": sum(r["oom_kills"] for r in reports),
    }


def merge_accelerate(runs: list[dict]) -> dict:
    """One result of several ``run_accelerate`` calls (one per repeat)."""
    out = dict(runs[0])
    out["latencies_s"] = [x for run in runs for x in run["latencies_s"]]
    out["latencies_by_repeat_s"] = [run["latencies_s"] for run in runs]
    out["first_token_s"] = [x for run in runs for x in run["first_token_s"]]
    out["load_s"] = [x for run in runs for x in run["load_s"]]
    per_token = [run["bytes_per_token"] for run in runs if run["bytes_per_token"] is not None]
    out["bytes_per_token"] = statistics.fmean(per_token) if per_token else None
    out["memory"] = peak_of([run["memory"] for run in runs])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--cpu-budget-bytes", type=int, required=True)
    parser.add_argument("--tokens", type=int, required=True)
    parser.add_argument("--prompt", default="5,9,17,33,2,8,1,12")
    parser.add_argument("--offload-dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--progress", action="store_true")
    parser.add_argument(
        "--memory-headroom-bytes",
        type=int,
        default=0,
        help="in a benchmark's memory cgroup: once loaded, limit it to this process's idle baseline "
        "(measured before loading) + --cpu-budget-bytes + this",
    )
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    if args.threads:
        torch.set_num_threads(args.threads)
    checkpoint = Path(args.checkpoint)
    offload = Path(args.offload_dir)
    offload.mkdir(parents=True, exist_ok=True)
    roots = [offload, checkpoint]
    baseline = idle_baseline()
    drop_page_cache(roots)
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        checkpoint,
        device_map="auto",
        max_memory={"cpu": args.cpu_budget_bytes},
        offload_folder=str(offload),
        dtype="auto",
    ).eval()
    load_s = time.perf_counter() - started
    placement: dict[str, int] = {}
    for device in getattr(model, "hf_device_map", {}).values():
        placement[str(device)] = placement.get(str(device), 0) + 1
    files = drop_page_cache(roots)
    memory = hold_to_budget(baseline, args.cpu_budget_bytes, args.memory_headroom_bytes)
    prompt = torch.tensor([[int(t) for t in args.prompt.split(",")]])
    streamer = TimingStreamer(roots, args.progress)
    streamer.start()
    with torch.inference_mode():
        model.generate(
            prompt,
            max_new_tokens=args.tokens,
            min_new_tokens=args.tokens,
            do_sample=False,
            streamer=streamer,
            pad_token_id=0,
        )
    result = {
        "load_s": load_s,
        "device_map_modules": placement,
        "page_cache_files": files,
        "latencies_s": streamer.latencies_s,
        "read_bytes": streamer.read_bytes,
        "drop_s_mean": sum(streamer.drop_s) / max(1, len(streamer.drop_s)),
        "torch_threads": torch.get_num_threads(),
        "memory_after_load": memory,
    }
    Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
