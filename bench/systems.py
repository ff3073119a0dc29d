"""The systems served by real daemon + compute processes (ours, lru, resident and their
variants), as ``bench.e2e`` and ``bench.overhead`` run them: both processes started once and
kept up while the systems take turns request by request, each Generate's decode latencies kept,
and the daemon's GetStats and both processes' CPU read before and after the measured requests;
their peers (transformers, llama.cpp) and the turns they all take. Also what ``bench.serve``
shares with them: the daemon's tiers for a budget, its GetStats, and the host → arena link under
them."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
from moe.cache.v1 import cache_pb2, cache_pb2_grpc
from moe.inference.v1 import inference_pb2, inference_pb2_grpc

from bench import llama_cpp, profile
from bench.confine import Confinement
from bench.e2e_accelerate import drop_page_cache, page_cache_bytes
from bench.gpt_oss import PROMPT
from bench.plain_transformers import TransformersSystem
from bench.report import MIB, say
from bench.usage import cpu_seconds
from devtools.launch import checkout_python, start_compute, start_daemon
from expertcache.manifest import StoreManifest

# The systems that run in a process of their own beside the daemon's: every expert in memory,
# but llama.cpp-budget (held to the experts' budget, paging its GGUF).
PEERS = ("transformers", *llama_cpp.SYSTEMS)


def rotation(systems: list[str], repeat: int) -> list[str]:
    """The order the systems take turns in during ``repeat``: rotated by one each repeat, so
    that drift of the machine and the disk hits all alike."""
    return systems[repeat % len(systems) :] + systems[: repeat % len(systems)]


def check_baseline(parser: argparse.ArgumentParser, checkout: Path) -> None:
    """``--baseline DIR`` (bench.e2e, bench.overhead): another checkout of this project that can
    run beside this one (its own ``.venv``, and ``replay/forced_compute.py``); a usage error
    naming what is missing otherwise."""
    try:
        checkout_python(checkout)
    except ValueError as exc:
        parser.error(f"--baseline: {exc}")
    if not (checkout / "replay" / "forced_compute.py").is_file():
        parser.error(
            f"--baseline {checkout} has no replay/forced_compute.py: a checkout of an older revision "
            "cannot run as a baseline"
        )


def start_peer(
    system: str,
    checkpoint: Path,
    gguf: tuple | None,
    args: argparse.Namespace,
    budget_bytes: int | None = None,
) -> TransformersSystem | llama_cpp.LlamaCppSystem:
    """One of ``PEERS`` on ``checkpoint`` (llama.cpp on its ``gguf``), ``args.tokens`` per request
    on ``args.threads`` threads; in a memory cgroup of its own with ``args.cgroups``. The budgeted
    llama.cpp is held to ``budget_bytes`` of experts; its GGUF leaves the page cache first, so that
    the pages it maps are charged to its own group (a page cached by another is charged to that one);
    what of the GGUF the cache still held then is its ``cached_at_start``."""
    memory = Confinement(system, enabled=getattr(args, "cgroups", False))
    run = {"threads": args.threads, "tokens": args.tokens, "prompt": PROMPT, "memory": memory}
    if system == "transformers":
        return TransformersSystem(checkpoint, device=args.device, **run)
    if system == llama_cpp.BUDGETED:
        if budget_bytes is None:
            raise ValueError(f"{system} needs the experts' budget")
        drop_page_cache([gguf[0]])
        cached = page_cache_bytes(gguf[0])
        run["tokens"] = args.llama_budget_tokens
        proc = llama_cpp.LlamaCppSystem(*gguf, budget_bytes=budget_bytes, **run)
        proc.cached_at_start = cached
        return proc
    return llama_cpp.LlamaCppSystem(*gguf, **run)


@contextmanager
def all_stopped() -> Iterator[dict[str, ProcessSystem | TransformersSystem | llama_cpp.LlamaCppSystem]]:
    """A dict, label -> system, to start the systems into; each one in it is stopped on leaving."""
    running: dict[str, ProcessSystem | TransformersSystem | llama_cpp.LlamaCppSystem] = {}
    try:
        yield running
    finally:
        for proc in running.values():
            proc.stop()


def take_turns(labels: list[str], args: argparse.Namespace, measure: Callable[[str, int, int], None]) -> None:
    """``measure(label, repeat, r)`` of request r of every system before request r + 1 of any,
    ``args.requests`` of them per repeat, the order rotated each of ``args.repeats`` repeats."""
    for repeat in range(args.repeats):
        order = rotation(labels, repeat)
        say(f"repeat {repeat + 1}/{args.repeats}: order {', '.join(order)}")
        for r in range(args.requests):
            for label in order:
                measure(label, repeat, r)


def begin_paging(running: dict, last: list[str], start: Callable[[str], object]) -> dict[str, dict]:
    """Start (``start``) and begin ``last``, the systems that page their weights from the disk
    (llama.cpp-budget), once every other has had its turns. llama.cpp maps its GGUF with
    MAP_POPULATE at load, so its pages are charged to whichever process's group first read them:
    started beside llama.cpp's own process, the budgeted one would find the GGUF in memory charged
    to that one, and read nothing from the disk. So llama.cpp is finished and stopped first (its
    figures are returned: a page a live process maps stays cached whatever DONTNEED says), the
    GGUF leaves the page cache, and what of it the cache still holds is printed and kept."""
    done: dict[str, dict] = {}
    if last and llama_cpp.SYSTEM in running:
        proc = running.pop(llama_cpp.SYSTEM)
        done[llama_cpp.SYSTEM] = proc.finish()
        proc.stop()
    for system in last:
        running[system] = proc = start(system)  # it drops the GGUF from the page cache first
        cached = proc.cached_at_start
        size = proc.gguf.stat().st_size
        held = (
            "unknown (mincore failed)"
            if cached is None
            else f"{cached / MIB:.1f} MiB of its {size / MIB:.1f} MiB"
        )
        say(f"[{system}] its GGUF in the page cache as it started: {held}")
        proc.begin()
    return done


def finish_all(running: dict) -> tuple[dict[str, dict], dict | None]:
    """Each system's ``finish``, and transformers' greedy tokens where it ran (for llama.cpp's)."""
    answer = running["transformers"].reference if "transformers" in running else None
    return {label: proc.finish() for label, proc in running.items()}, answer


def add_check_tokens_argument(parser: argparse.ArgumentParser) -> None:
    """``--check-tokens``, what ``llama_cpp_figures`` checks."""
    parser.add_argument(
        "--check-tokens",
        type=int,
        default=llama_cpp.CHECK_TOKENS,
        help="llama.cpp's first greedy tokens checked against transformers' on the same checkpoint (0: not checked)",
    )


def llama_cpp_figures(
    results: dict, args: argparse.Namespace, checkpoint: Path, have: dict | None, precision: str
) -> dict:
    """``llama_cpp.check_and_report`` where llama.cpp ran (``have``: transformers' greedy tokens),
    else nothing."""
    if not set(llama_cpp.SYSTEMS) & set(results):
        return {}
    return llama_cpp.check_and_report(
        results,
        checkpoint=checkpoint,
        have=have,
        precision=precision,
        device=args.device,
        threads=args.threads,
        check_tokens=args.check_tokens,
        prompt=PROMPT,
    )


def add_tier_arguments(parser: argparse.ArgumentParser) -> None:
    """What ``tiers`` reads: ``--device``, the daemon's arena, and ``--host-share``."""
    parser.add_argument(
        "--device", default="cpu", help="the daemon's arena: cpu, or cuda[:n] on a GPU machine"
    )
    parser.add_argument(
        "--host-share",
        type=float,
        default=None,
        help="share of the budget in the host tier (default: none on the CPU; with --device cuda the "
        "arena gets the whole budget and a pinned host tier holds every expert, as on a GPU node)",
    )


def tiers(budget_bytes: int, manifest: StoreManifest, args: argparse.Namespace) -> tuple[int, int]:
    """(arena bytes, host tier bytes) of a daemon with ``budget_bytes`` of expert memory.

    ``--host-share`` moves that share of the budget to the host tier. Without it, on a GPU
    (``--device cuda``) the arena gets the whole budget and a pinned host tier holds every expert
    besides, as on a GPU node with ample RAM, so that a miss is a PCIe copy and the disk is read
    once per expert; on the CPU there is none (this machine's "device" arena is CPU memory: a
    host tier would hold a second copy of the same bytes)."""
    if args.host_share is not None:
        host = int(budget_bytes * args.host_share)
        return budget_bytes - host, host
    if str(args.device).startswith("cuda"):
        return budget_bytes, manifest.total_expert_bytes
    return budget_bytes, 0


def get_stats(address: str) -> cache_pb2.CacheStats:
    with grpc.insecure_channel(address) as channel:
        return cache_pb2_grpc.ExpertCacheStub(channel).GetStats(cache_pb2.GetStatsRequest(), timeout=30)


def device_tier(stats: cache_pb2.CacheStats) -> cache_pb2.TierStats:
    return next(t for t in stats.tiers if t.tier == cache_pb2.TIER_DEVICE)


def host_tier(stats: cache_pb2.CacheStats) -> cache_pb2.TierStats:
    return next(t for t in stats.tiers if t.tier == cache_pb2.TIER_HOST)


def ours_and_prefetch(system: str) -> tuple[bool, bool]:
    """Whether ``system`` runs ours' policy and signals, and whether it prefetches (ours-eviction:
    ours' policy on ours' signals (routes), without prefetch or lookahead)."""
    ours = system in ("ours", "ours-transitions", "ours-resident", "ours-eviction")
    return ours, ours and system != "ours-eviction"


def daemon_args(system: str, args: argparse.Namespace, *, baseline: bool = False) -> list[str]:
    """The daemon's options of ``system``: its policy, prefetch on (ours) or off, ours' learned
    next-visit model, and ours' prefetch bar (``--prefetch-min-probability``; a ``baseline``
    checkout runs under its own default, so that a bar is measured against it)."""
    ours, prefetch = ours_and_prefetch(system)
    out = [
        "--eviction-policy",
        "activation-aware" if ours else "lru",
        "--prefetch" if prefetch else "--no-prefetch",
    ]
    if system in ("ours", "ours-eviction") and args.next_visit_path is not None:
        out += ["--next-visit-model", str(args.next_visit_path)]
    bar = getattr(args, "prefetch_min_probability", None)
    if prefetch and not baseline and bar is not None:
        out += ["--prefetch-min-probability", str(bar)]
    return out


class ProcessSystem:
    """One system served by real daemon + compute processes (ours, lru, resident), started once
    and kept up while the systems take turns request by request; ``stop`` ends both."""

    def __init__(
        self,
        system: str,
        store: Path,
        manifest: StoreManifest,
        work: Path,
        args: argparse.Namespace,
        budget_bytes: int,
        *,
        device_bytes: int | None = None,
        host_bytes: int | None = None,
        compute_extra: tuple[str, ...] = (),
        checkout: Path | None = None,
        label: str = "",
    ) -> None:
        """``device_bytes`` / ``host_bytes`` override the tiers ``host_tier_bytes`` gives.
        ``checkout``: run another checkout's daemon and compute (its own ``.venv``), a baseline
        named ``label`` (default ``system``) in what is printed and in its request ids."""
        self.system, self.args = system, args
        self.label = label or system
        # Daemon and compute in one memory cgroup (bench.e2e --cgroups), held to the budget.
        self.memory = Confinement(self.label, enabled=getattr(args, "cgroups", False))
        ours, prefetch = ours_and_prefetch(system)
        # resident: an arena that holds every expert (ours-resident: with ours' policy and signals)
        self.resident = system in ("resident", "ours-resident")
        self.blob_bytes = manifest.blob_bytes
        if self.resident:
            self.device_bytes, self.host_bytes = manifest.total_expert_bytes, 0
        else:
            self.device_bytes, self.host_bytes = tiers(budget_bytes, manifest, args)
        if device_bytes is not None:
            self.device_bytes = device_bytes
        if host_bytes is not None:
            self.host_bytes = host_bytes
        daemon_extra = daemon_args(system, args, baseline=checkout is not None)
        compute_extra = [
            "--force-routing-path",
            str(args.trace),
            "--force-routing-request",
            str(args.request),
            "--force-routing-layer-ahead-accuracy",
            str(args.layer_ahead_accuracy),
            "--layer-ahead" if prefetch else "--no-layer-ahead",
            *(
                ["--layer-ahead-depth", str(args.layer_ahead_depth)]
                if prefetch and args.layer_ahead_depth
                else []
            ),
            "--max-new-tokens-limit",
            str(max(args.tokens, 1)),
            *compute_extra,
        ]
        work.mkdir(parents=True, exist_ok=True)
        say(
            f"[{self.label}] daemon: policy {daemon_extra[1]}, {'prefetch' if prefetch else 'no prefetch'}, arena "
            f"{self.device_bytes / MIB:.0f} MiB ({self.device_bytes // manifest.blob_bytes} slots) + host tier "
            f"{self.host_bytes / MIB:.0f} MiB; compute: layer-ahead {'on' if prefetch else 'off'}, routing forced "
            f"from the trace from request {args.request} on (each Generate takes the next)"
        )
        self.daemon = start_daemon(
            store,
            work,
            device=args.device,
            device_budget_bytes=self.device_bytes,
            host_budget_bytes=self.host_bytes,
            extra=daemon_extra,
            checkout=checkout,
            cgroup=self.memory.cgroup,
        )
        self.compute = None
        try:
            self.compute = start_compute(
                store,
                self.daemon,
                work,
                extra=compute_extra,
                module="replay.forced_compute",
                checkout=checkout,
                cgroup=self.memory.cgroup,
            )
            drop_page_cache([store / manifest.dense_file])  # read once by compute at start-up
            self.io_mode = get_stats(self.daemon.address).store_io_mode
            self.memory.limit(self.device_bytes + self.host_bytes)  # idle now: its baseline
        except BaseException:
            self.stop(dump_logs=True)
            raise
        self.channel = grpc.insecure_channel(self.compute.address)
        self.stub = inference_pb2_grpc.InferenceStub(self.channel)
        self.generated = 0
        # compute's wait for experts, and its experts not resident when asked for, over decode tokens
        self.decode_stall_s, self.decode_misses = 0.0, 0
        self.latencies: list[float] = []
        self.first_token: list[float] = []
        self.by_repeat: dict[int, list[float]] = {}
        self.recordings: list[profile.Recording] = []  # --profile: py-spy on both, from begin

    def generate(self, label: str) -> tuple[list[float], float]:
        """One Generate of ``--tokens`` tokens: (decode latencies, first-token latency)."""
        request = inference_pb2.GenerateRequest(
            token_ids=list(PROMPT), max_new_tokens=self.args.tokens, ignore_eos=True, request_id=label
        )
        started = time.perf_counter()
        decode, first = [], 0.0
        try:
            for event in self.stub.Generate(request, timeout=3600):
                if event.index == 0:
                    first = event.latency_s
                else:
                    decode.append(event.latency_s)
                    self.decode_stall_s += event.cache.stall_s
                    self.decode_misses += event.cache.misses
                if (event.index + 1) % self.args.progress_every == 0:
                    say(
                        f"  [{self.label}] {label}: {event.index + 1}/{self.args.tokens} tokens, "
                        f"{time.perf_counter() - started:.1f} s"
                    )
        except BaseException:
            self.stop(dump_logs=True)
            raise
        return decode, first

    def begin(self) -> None:
        """Start counting: what ``finish`` reports is what happened after this (and, with
        ``--profile``, start recording both processes)."""
        if self.resident:  # the warm-up request that loads every expert, not measured
            self.generate(f"{self.label}-warm-up")
        out = getattr(self.args, "profile", None)
        self.recordings = (
            []
            if out is None
            else [
                profile.start(f"{self.label}-{name}", proc.popen.pid, out)
                for name, proc in (("daemon", self.daemon), ("compute", self.compute))
            ]
        )
        self.before = get_stats(self.daemon.address)
        self.cpu_before = {
            "daemon": cpu_seconds(self.daemon.popen.pid),
            "compute": cpu_seconds(self.compute.popen.pid),
        }
        self.wall = 0.0
        self.decode_stall_s, self.decode_misses = 0.0, 0

    def measure(self, repeat: int, r: int) -> None:
        """One measured Generate (trace request taken in turn), kept under ``repeat``."""
        t0 = time.perf_counter()
        decode, first = self.generate(f"{self.label}-{repeat}-{r}")
        self.wall += time.perf_counter() - t0
        self.generated += self.args.tokens
        self.latencies += decode
        self.first_token.append(first)
        self.by_repeat.setdefault(repeat, []).extend(decode)

    def finish(self) -> dict:
        after = get_stats(self.daemon.address)
        for rec in self.recordings:
            rec.stop()
        cpu = {
            "daemon": cpu_seconds(self.daemon.popen.pid) - self.cpu_before["daemon"],
            "compute": cpu_seconds(self.compute.popen.pid) - self.cpu_before["compute"],
        }
        d0, d1 = device_tier(self.before), device_tier(after)
        hits, misses = d1.hits - d0.hits, d1.misses - d0.misses
        tokens = max(1, self.generated)
        h0, h1 = host_tier(self.before), host_tier(after)
        from_host = (h1.hits - h0.hits) * self.blob_bytes  # arena fills copied from the host tier
        prefetch = {
            cache_pb2.PrefetchClass.Name(p.prediction): {
                "started": p.started,
                "used": p.used,
                "wasted": p.wasted,
                "cancelled": p.cancelled,
                "promoted": p.promoted,
                "start_delay_s": p.start_delay_seconds,
            }
            for p in after.prefetch
        }
        return {
            "latencies_s": self.latencies,
            "latencies_by_repeat_s": [self.by_repeat[k] for k in sorted(self.by_repeat)],
            "first_token_s": self.first_token,
            "store_io_mode": self.io_mode,
            "hit_rate": hits / max(1, hits + misses),
            "hits": hits,
            "misses": misses,
            # Arena fills over the measured tokens (prefill included), per generated token: what the
            # policy moves (from the store, or from the host tier when there is one; on a GPU
            # every one of them crosses PCIe).
            "bytes_per_token": (d1.bytes_in - d0.bytes_in) / tokens,
            "host_bytes_per_token": from_host / tokens,  # of which copied from the host tier
            "store_bytes_per_token": (d1.bytes_in - d0.bytes_in - from_host) / tokens,  # read from the store
            # (0 from a daemon of an older release, whose GetStats has no arena_copy_seconds)
            "arena_copy_s": getattr(after, "arena_copy_seconds", 0.0)
            - getattr(self.before, "arena_copy_seconds", 0.0),
            "store_read_s": after.store_read_seconds - self.before.store_read_seconds,
            # CPU seconds per generated token of each process (2 cores shared by both, and any
            # peer: while the systems take turns, the others' processes are idle).
            "cpu_s_per_token": {name: value / tokens for name, value in cpu.items()},
            "generate_wall_s": self.wall,
            # compute's wait for experts per decode token (each MoE layer's acquire, summed)
            "stall_s_per_decode_token": self.decode_stall_s / max(1, len(self.latencies)),
            "misses_per_decode_token": self.decode_misses / max(1, len(self.latencies)),
            "prefetch": prefetch,
            "device_bytes": self.device_bytes,
            "host_bytes": self.host_bytes,
            "policy": after.config.eviction_policy,
            "prefetch_on": after.config.prefetch,
            "memory": self.memory.report(),
            **({"profile": self._profiles(tokens)} if self.recordings else {}),
        }

    def _profiles(self, tokens: int) -> dict[str, dict]:
        """The recordings ``begin`` started, summed up (``bench.profile``), by process."""
        out = {}
        for rec in self.recordings:
            process = rec.label.rsplit("-", 1)[1]
            if rec.error or not rec.path.is_file():
                out[process] = {"error": rec.error or f"no recording at {rec.path}"}
            else:
                out[process] = profile.summarize(rec.label, rec.path).as_dict(top=12, tokens=tokens)
        return out

    def stop(self, dump_logs: bool = False) -> None:
        for rec in self.recordings:
            rec.stop()
        if getattr(self, "channel", None) is not None:
            self.channel.close()
            self.channel = None
        for proc in (self.compute, self.daemon):
            if proc is not None and dump_logs:
                say(f"--- {proc.log_path} (tail) ---\n{proc.log()[-3000:]}")
        if self.compute is not None:
            self.compute.stop()
            self.compute = None
        if self.daemon is not None:
            self.daemon.stop()
            self.daemon = None
        self.memory.remove()


def measure_link(manifest: StoreManifest, device: str, copies: int = 64) -> dict:
    """The host → arena link under the systems: ``copies`` expert blobs copied from host memory
    (page-locked on a GPU, as the host tier is) into device memory, one at a time; GB/s. On the
    CPU the "device" arena is memory too: a memory copy."""
    import torch

    n = max(1, min(copies, (1 << 30) // max(1, manifest.blob_bytes)))
    cuda = str(device).startswith("cuda")
    src = torch.empty(n, manifest.blob_bytes, dtype=torch.uint8, pin_memory=cuda).fill_(1)
    dst = torch.empty(n, manifest.blob_bytes, dtype=torch.uint8, device=device if cuda else "cpu")
    for _ in range(2):
        started = time.perf_counter()
        for i in range(n):
            dst[i].copy_(src[i], non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize(dst.device)
        elapsed = time.perf_counter() - started
    gbps = n * manifest.blob_bytes / elapsed / 1e9
    say(
        f"host -> arena link ({'PCIe, page-locked host memory' if cuda else 'memory copy'}), expert blobs of "
        f"{manifest.blob_bytes / MIB:.2f} MiB one at a time: {gbps:.2f} GB/s"
    )
    return {"gb_per_s": gbps, "copies": n, "device": str(device)}
