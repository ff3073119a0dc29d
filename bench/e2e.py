"""End-to-end decode latency: ours vs plain LRU on-demand vs HF Accelerate, same memory budget.

    python -m bench.e2e [--precision mxfp4] [--tokens 96] [--requests 3] [--repeats 1] ...
                        [--budget-share 0.25] [--systems ours,lru,resident,accelerate]
                        [--compare-with bench/results/e2e-bf16.json]
    make bench-e2e [BENCH_E2E_ARGS="--tokens 96"]   # a bf16 run, then an mxfp4 run printed beside it

One run, side by side, on one random-weight checkpoint of gpt-oss shape written by transformers'
own ``save_pretrained`` (24 layers x 32 experts, top-4, bf16 dense; hidden and expert sizes
printed), converted once with the real converter (``cache_daemon.convert``) into an expert store;
both cached under bench/.data/. ``--precision`` is the experts' precision in the checkpoint and
so in the store and every tier: ``mxfp4`` (the default: gpt-oss ships its experts in MXFP4;
``expertcache.tiny`` quantises the random experts and writes the published ``*_blocks`` /
``*_scales`` layout), ``bf16``, or ``fp8`` (e4m3 with 128 x 128 blocks, transformers' own
quantiser; gpt-oss does not ship in FP8, and transformers' loader ignores stacked FP8 scales, so
accelerate then runs unscaled weights at the same cost). The budget is ``--budget-share`` of the
expert total in encoded bytes (25%: the same share of experts at every precision; ``--budget-mib``
overrides), and the expert total is several times the budget (printed, checked >= 4x).
``--compare-with`` prints a previous run's figures (the bf16 run) beside this one's, with ours'
MiB per token as a fraction of that run's (goal <= 0.3 at mxfp4).

1. ours: real daemon + compute processes (``expertcache.launch``); eviction policy
   ``activation-aware``, prefetch on, layer-ahead on;
2. lru: the same processes, eviction policy ``lru``, prefetch off, layer-ahead off (plain LRU
   on-demand fetch);
3. accelerate: ``from_pretrained(device_map="auto", max_memory={"cpu": budget + dense},
   offload_folder=...)`` on the same checkpoint, ``generate`` of the same number of tokens, in
   its own process (``bench.e2e_accelerate``).
4. resident: the same processes as lru with an arena that holds every expert, warmed up by one
   unmeasured request (an expert it did not route to loads on first use, counted in its bytes):
   the compute-bound floor. Each system's share of the gap between lru and resident,
   (lru - system) / (lru - resident) in per-token p50, is printed: lru 0, resident 1.

Interleaved: every system's daemon and compute are up at once, and they take turns request by
request (ours, lru, resident, ours, ...; accelerate, a process per run, once per repeat), the
order rotated each repeat, so that the machine's and the disk's drift hits all alike.
``--repeats N`` runs N such rounds, each on the next trace requests; every ratio is printed with
its spread over the rounds (median, min, max of the per-round p50 ratios), and
bench/results/e2e.png plots the p50s with their spread and the shares of the gap.

Routing: ours and lru are forced from the real gpt-oss-20b trace (``--force-routing``, a
benchmark feature of compute: ``compute_svc.forced_routing``), trace requests ``--request`` ..
``--request + --requests - 1``, one Generate each; layer-ahead under forced routing is modelled
at ``--layer-ahead-accuracy`` (printed). Accelerate routes with its own (random) routers, which
does not change its cost: it streams whole offloaded modules, every expert of them, per forward.
Ours' daemon runs the learned next-visit model (``--next-visit-model``), fitted on the 64 trace
requests after the measured ones (held out, as a served model's is fitted on earlier traffic).
On an MXFP4 checkpoint transformers dequantises the experts to bf16 when it loads (no Triton or
kernels on CPU), so Accelerate holds and offloads bf16 experts within the same byte budget.

Budget: ours/lru get it all as the daemon's arena (this machine has no GPU: the "device" arena
is CPU shared memory, so a host tier below it would only hold a second copy; ``--host-share``
moves a share of it to the host tier). The store is read with O_DIRECT (checked: the daemon's
GetStats ``store_io_mode``), so the page cache holds none of it. Accelerate's offload folder and
the checkpoint are dropped from the page cache with ``posix_fadvise(POSIX_FADV_DONTNEED)`` after
loading and after every token; compute's dense file after start-up.

Per-token latency: decode tokens only — the first token of each request (prefill) is left out
for every system; ours/lru use the server's per-token ``latency_s``, accelerate the time between
tokens in ``generate``'s streamer. Bytes per token: ours/lru the daemon's store → arena bytes
(GetStats, prefill included) over generated tokens; accelerate ``/proc/self/io`` storage reads.
Where the time goes, ours/lru: compute's wait for experts per decode token (each MoE layer's
acquire wait, summed; the server's per-token ``cache.stall_s``) and its experts not resident when
asked for (``cache.misses``: loads it waited for, a prefetch still in flight included).
The disk under them: before the systems start, ``--store-reads`` random experts are read the
daemon's way (``bench.io_bench.random_expert_reads``: the native reader, O_DIRECT, CRC-checked),
one at a time (what a lone demand miss waits) and then 4 in flight; the MiB per token of ours,
lru and resident over that throughput is their disk time per token, printed beside the p50 and
marked on the plot (not accelerate's: it reads its offload files buffered and in order).
Where that time is most of the p50, the disk bounds the token and only fewer bytes make it faster.
Belady's reference: MIN needs the future, so it runs in the replay's simulator instead, on the very
routing ours and lru were forced to and the same slots (``bench.e2e_reference``): the simulated
LRU's bytes printed beside the measured ones (they agree), Belady's bytes and, with the ``cpu-e2e``
timing model where it is calibrated (bf16 experts of the default shape), its speed-up over LRU;
then ours' share of Belady's gain, (ours - 1) / (belady - 1), in speed (ours measured) and in
bytes saved against LRU. The replay's prediction for ours is printed beside it.
Every process runs ``--threads`` torch threads (default 1: see ``main``). Default sizes (3 x 96
tokens for ours and lru, 16 for accelerate) take about 4 minutes here on 2 cores once the model is
built (about 1.5 minutes, once); the first ~50 tokens of a request are its cold start (the trace's
requests average 306). Writes bench/results/e2e.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import grpc  # noqa: E402
import numpy as np  # noqa: E402
from moe.cache.v1 import cache_pb2, cache_pb2_grpc  # noqa: E402
from moe.inference.v1 import inference_pb2, inference_pb2_grpc  # noqa: E402

from bench.e2e_accelerate import drop_page_cache  # noqa: E402
from bench.e2e_reference import forced_routes, is_calibrated, simulate  # noqa: E402
from bench.e2e_reference import shares as belady_shares  # noqa: E402
from bench.io_bench import random_expert_reads  # noqa: E402
from bench.plain_transformers import TransformersSystem  # noqa: E402
from cache_daemon.decisions.next_visit import NextVisitModelError  # noqa: E402
from cache_daemon.decisions.next_visit import read as read_next_visit  # noqa: E402
from compute_svc.config import ComputeConfig  # noqa: E402
from compute_svc.forced_routing import modelled_accuracy  # noqa: E402
from expertcache.launch import start_compute, start_daemon  # noqa: E402
from expertcache.manifest import MANIFEST_NAME, StoreManifest, read_manifest  # noqa: E402
from expertcache.trace import read_trace  # noqa: E402
from replay.learn_next_visit import fit_trace  # noqa: E402
from replay.learn_next_visit import write as write_next_visit  # noqa: E402

MIB = 1 << 20
GIB = 1 << 30
DATA_DIR = REPO / "bench" / ".data"
RESULTS = REPO / "bench" / "results" / "e2e.json"
DEFAULT_TRACE = REPO.parent / "shared" / "traces" / "gpt-oss-20b_decode_703req.npz"
GOAL_VS_ACCELERATE = 10.0
GOAL_VS_ACCELERATE_BY_PRECISION = {"mxfp4": 15.0}  # experts at the checkpoint's precision
GOAL_VS_LRU = 1.3
GOAL_BYTES_VS_LRU = 0.8  # ours' MiB read per token / LRU's
GOAL_BYTES_VS_BF16 = 0.3  # ours' MiB read per token, mxfp4 run / bf16 run
# --precision → expertcache.tiny's quantization of the checkpoint (bf16: none).
PRECISIONS = {"bf16": None, "mxfp4": "mxfp4", "fp8": "fp8"}
FP8_BLOCK = (128, 128)  # DeepSeek-V3's and Qwen3-FP8's blocks
# resident: every expert fits (the compute-bound floor of this machine); a warm-up request, not
# measured, loads them first.
SYSTEMS = ("ours", "lru", "resident", "transformers", "accelerate")
# ours with the routing transitions in place of the learned next-visit model (the daemon without
# a next_visit_model file): what the model is worth, side by side in one run.
EXTRA_SYSTEMS: tuple[str, ...] = ("ours-transitions",)
PROMPT = (5, 9, 17, 33, 2, 8, 1, 12)


def say(msg: str) -> None:
    print(msg, flush=True)


# -- the checkpoint and its store ------------------------------------------------------------------
def build(
    data_dir: Path,
    *,
    hidden: int,
    intermediate: int,
    layers: int,
    experts: int,
    top_k: int,
    precision: str = "bf16",
) -> tuple[Path, Path, StoreManifest]:
    """A gpt-oss-shaped checkpoint (save_pretrained; experts at ``precision``) and its store,
    built once and reused."""
    import torch

    from cache_daemon.convert import run_conversion
    from cache_daemon.convert.__main__ import expert_bytes_line
    from expertcache.errors import DataLoss
    from expertcache.tiny import make_checkpoint

    suffix = "" if precision == "bf16" else f"-{precision}"
    root = data_dir / f"e2e-gpt_oss-h{hidden}-i{intermediate}-e{experts}-k{top_k}-l{layers}{suffix}"
    checkpoint, store = root / "checkpoint", root / "store"
    if (store / MANIFEST_NAME).exists() and (checkpoint / "config.json").exists():
        try:
            manifest = read_manifest(store)
        except DataLoss as exc:  # e.g. a store of an older format: build it again
            say(f"model: {exc}; rebuilding the store")
        else:
            say(f"model: reusing {root}")
            return checkpoint, store, manifest
    if not (checkpoint / "config.json").exists():
        shutil.rmtree(root, ignore_errors=True)
        say(
            f"model: writing a random gpt_oss checkpoint ({layers} layers x {experts} experts, top-{top_k}, "
            f"hidden {hidden}, expert intermediate {intermediate}, bf16, experts {precision}) to {checkpoint}"
        )
    started = time.perf_counter()
    if not (checkpoint / "config.json").exists():
        make_checkpoint(
            "gpt_oss",
            checkpoint,
            hidden_size=hidden,
            num_layers=layers,
            num_experts=experts,
            top_k=top_k,
            dtype=torch.bfloat16,
            intermediate_size=intermediate,
            max_shard_size="1GB",
            quantization=PRECISIONS[precision],
            fp8_block_size=FP8_BLOCK,
        )
    say(f"model: converting with cache_daemon.convert into {store}")
    result = run_conversion(checkpoint, store, progress=False, force=True)
    say(f"model: {expert_bytes_line(result)}")
    say(f"model: built in {time.perf_counter() - started:.0f} s")
    return checkpoint, store, result.manifest


# -- ours / lru: real processes ------------------------------------------------------------------
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


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and its threads so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def get_stats(address: str) -> cache_pb2.CacheStats:
    with grpc.insecure_channel(address) as channel:
        return cache_pb2_grpc.ExpertCacheStub(channel).GetStats(cache_pb2.GetStatsRequest(), timeout=30)


def device_tier(stats: cache_pb2.CacheStats) -> cache_pb2.TierStats:
    return next(t for t in stats.tiers if t.tier == cache_pb2.TIER_DEVICE)


def host_tier(stats: cache_pb2.CacheStats) -> cache_pb2.TierStats:
    return next(t for t in stats.tiers if t.tier == cache_pb2.TIER_HOST)


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
    ) -> None:
        """``device_bytes`` / ``host_bytes`` override the tiers ``host_tier_bytes`` gives."""
        self.system, self.args = system, args
        ours = system in ("ours", "ours-transitions", "ours-resident")
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
        daemon_extra = [
            "--eviction-policy",
            "activation-aware" if ours else "lru",
            "--prefetch" if ours else "--no-prefetch",
        ]
        if system == "ours" and args.next_visit_path is not None:
            daemon_extra += ["--next-visit-model", str(args.next_visit_path)]
        compute_extra = [
            "--force-routing-path",
            str(args.trace),
            "--force-routing-request",
            str(args.request),
            "--force-routing-layer-ahead-accuracy",
            str(args.layer_ahead_accuracy),
            "--layer-ahead" if ours else "--no-layer-ahead",
            *(
                ["--layer-ahead-depth", str(args.layer_ahead_depth)]
                if ours and args.layer_ahead_depth
                else []
            ),
            "--max-new-tokens-limit",
            str(max(args.tokens, 1)),
            *compute_extra,
        ]
        work.mkdir(parents=True, exist_ok=True)
        say(
            f"[{system}] daemon: policy {daemon_extra[1]}, {'prefetch' if ours else 'no prefetch'}, arena "
            f"{self.device_bytes / MIB:.0f} MiB ({self.device_bytes // manifest.blob_bytes} slots) + host tier "
            f"{self.host_bytes / MIB:.0f} MiB; compute: layer-ahead {'on' if ours else 'off'}, routing forced "
            f"from the trace from request {args.request} on (each Generate takes the next)"
        )
        self.daemon = start_daemon(
            store,
            work,
            device=args.device,
            device_budget_bytes=self.device_bytes,
            host_budget_bytes=self.host_bytes,
            extra=[*daemon_extra, "--shm-dir", str(args.shm_dir)] if args.shm_dir else daemon_extra,
        )
        self.compute = None
        try:
            self.compute = start_compute(store, self.daemon, work, extra=compute_extra)
            drop_page_cache([store / manifest.dense_file])  # read once by compute at start-up
            self.io_mode = get_stats(self.daemon.address).store_io_mode
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
                        f"  [{self.system}] {label}: {event.index + 1}/{self.args.tokens} tokens, "
                        f"{time.perf_counter() - started:.1f} s"
                    )
        except BaseException:
            self.stop(dump_logs=True)
            raise
        return decode, first

    def begin(self) -> None:
        """Start counting: what ``finish`` reports is what happened after this."""
        if self.resident:  # the warm-up request that loads every expert, not measured
            self.generate(f"{self.system}-warm-up")
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
        decode, first = self.generate(f"{self.system}-{repeat}-{r}")
        self.wall += time.perf_counter() - t0
        self.generated += self.args.tokens
        self.latencies += decode
        self.first_token.append(first)
        self.by_repeat.setdefault(repeat, []).extend(decode)

    def finish(self) -> dict:
        after = get_stats(self.daemon.address)
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
        }

    def stop(self, dump_logs: bool = False) -> None:
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


# -- tracing costs ---------------------------------------------------------------------------------
# Tracing off; on with the default trace_layer_ratio (ComputeConfig); on with every layer traced.
TRACING_MODES = (("off", None), ("on-default-ratio", None), ("on-full", "1.0"))


class _SpanSink:
    """An in-process OTLP trace receiver (a real gRPC server) that counts the spans it is sent."""

    def __init__(self) -> None:
        from concurrent import futures

        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        sink = self

        class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):  # noqa: N802 - gRPC method name
                sink.spans += sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
                return trace_service_pb2.ExportTraceServiceResponse()

        self.spans = 0
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), self.server)
        self.endpoint = f"http://127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()


def tracing_costs(store: Path, manifest: StoreManifest, args: argparse.Namespace, budget: int) -> int:
    """``ours`` three times side by side (tracing off, on at the default layer ratio, on at full
    sampling), started together and taking turns request by request, so that the machine's other
    load falls on all three alike."""
    sink = _SpanSink()
    keys = ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL",
            "EXPERTCACHE_COMPUTE_TRACE_LAYER_RATIO")  # fmt: skip
    saved = {k: os.environ.get(k) for k in keys}
    systems: dict[str, ProcessSystem] = {}
    results = {}
    try:
        with tempfile.TemporaryDirectory(prefix="e2e-tracing-", dir=args.data_dir) as tmp:
            try:
                for mode, ratio in TRACING_MODES:  # the environment at start decides a process's tracing
                    for key in keys:
                        os.environ.pop(key, None)
                    if mode != "off":
                        os.environ.update(
                            OTEL_TRACES_EXPORTER="otlp",
                            OTEL_EXPORTER_OTLP_ENDPOINT=sink.endpoint,
                            OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
                        )
                    if ratio is not None:
                        os.environ["EXPERTCACHE_COMPUTE_TRACE_LAYER_RATIO"] = ratio
                    systems[mode] = ProcessSystem("ours", store, manifest, Path(tmp) / mode, args, budget)
                for proc in systems.values():
                    proc.begin()
                before = sink.spans
                spans = dict.fromkeys(systems, 0)
                for r in range(args.requests):
                    for mode, proc in systems.items():
                        before = sink.spans
                        proc.measure(0, r)
                        spans[mode] += sink.spans - before  # exports lag a little: approximate
                for mode, proc in systems.items():
                    result = proc.finish()
                    result.update(summarise(result))
                    result["spans_exported"] = spans[mode]
                    results[mode] = result
                    say(f"[tracing {mode}] p50 {fmt(result['p50_s'] and result['p50_s'] * 1e3, '.1f')} ms")
            finally:
                for proc in systems.values():
                    proc.stop()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        sink.server.stop(0)
    off = results["off"]["p50_s"]
    say("")
    say(f"{'tracing':<18}{'p50 ms':>10}{'p99 ms':>10}{'vs off':>8}{'spans':>8}")
    for mode, _ in TRACING_MODES:
        r = results[mode]
        rel = r["p50_s"] / off if off and r["p50_s"] else None
        say(f"{mode:<18}{fmt(r['p50_s'] and r['p50_s'] * 1e3, '>10.2f'):>10}{fmt(r['p99_s'] and r['p99_s'] * 1e3, '>10.2f'):>10}"
            f"{fmt(rel, '>8.3f'):>8}{r['spans_exported']:>8}")  # fmt: skip
    out = args.out.with_name(args.out.stem + "-tracing.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"tokens": args.tokens, "requests": args.requests, "modes": results}, indent=1))
    say(f"wrote {out}")
    return 0


# -- accelerate ------------------------------------------------------------------------------------
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
        proc = subprocess.run(cmd, cwd=REPO, stderr=subprocess.PIPE, text=True, timeout=3600)
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
    return out


# -- report -------------------------------------------------------------------------------------------
def summarise(result: dict) -> dict:
    lat = np.asarray(result["latencies_s"], dtype=np.float64)
    if not len(lat):
        return {"p50_s": None, "p99_s": None, "tokens_per_s": None, "tokens": 0}
    return {
        "p50_s": float(np.percentile(lat, 50)),
        "p99_s": float(np.percentile(lat, 99)),
        "tokens_per_s": float(len(lat) / lat.sum()),
        "tokens": int(len(lat)),
    }


def repeat_p50s(result: dict) -> list[float]:
    """The per-token p50 of each repeat, seconds."""
    return [float(np.percentile(lat, 50)) for lat in result.get("latencies_by_repeat_s", []) if len(lat)]


def repeat_ratios(numerator: dict, denominator: dict) -> list[float]:
    """numerator's p50 over denominator's, repeat by repeat (both ran in the same rounds)."""
    return [a / b for a, b in zip(repeat_p50s(numerator), repeat_p50s(denominator), strict=False) if b > 0]


def spread_text(values: list[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.2f} (one repeat: no spread)"
    return (
        f"median {statistics.median(values):.2f}, min {min(values):.2f}, max {max(values):.2f} "
        f"over {len(values)} repeats"
    )


def gap_shares(results: dict) -> dict:
    """Each system's share of the p50 gap between lru (0) and resident (1), overall and per
    repeat; empty unless both ran and resident is the faster."""
    if "lru" not in results or "resident" not in results:
        return {}
    lru, resident = results["lru"]["p50_s"], results["resident"]["p50_s"]
    if not lru or not resident or lru <= resident:
        return {}
    lru_r, res_r = repeat_p50s(results["lru"]), repeat_p50s(results["resident"])
    out = {}
    for system, r in results.items():
        if not r.get("p50_s") or system == "transformers":  # no cache: it has no place on that scale
            continue
        per = [
            (a - x) / (a - b)
            for a, b, x in zip(lru_r, res_r, repeat_p50s(r), strict=False)
            if a > b  # a repeat where resident was not the faster has no gap to share
        ]
        out[system] = {"share": (lru - r["p50_s"]) / (lru - resident), "per_repeat": per}
    return out


def next_visit_model(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[Path | None, str]:
    """The file of ours' learned next-visit model as ``--next-visit-model`` asks, and a line saying
    what it is. Fitted on trace requests after the measured ones (held out from them, as a served
    model's is fitted on earlier traffic), once per range: cached under ``--data-dir``."""
    choice = args.next_visit_model
    if choice == "none":
        return None, "the routing transitions (--next-visit-model none)"
    if choice != "fit":
        try:
            model = read_next_visit(choice)
        except NextVisitModelError as exc:
            parser.error(f"--next-visit-model: {exc}")
        return Path(
            choice
        ), f"the learned model of {choice} ({model.trained_on or 'its training data unrecorded'})"
    trace = read_trace(args.trace).decode_only()
    first = args.request + args.repeats * args.requests
    if not 1 <= args.next_visit_requests <= trace.num_requests - first:
        parser.error(
            f"--next-visit-requests must be in [1, {trace.num_requests - first}] (trace requests after the "
            f"measured ones), got {args.next_visit_requests}"
        )
    learn = range(first, first + args.next_visit_requests)
    path = args.data_dir / f"next_visit-{args.trace.stem}-{learn.start}-{learn.stop}.safetensors"
    note = f"the learned model, fitted on trace requests {learn.start}..{learn.stop - 1} (after the measured ones)"
    try:
        read_next_visit(path)
        return path, f"{note}, cached in {path}"
    except NextVisitModelError:
        pass
    started = time.perf_counter()
    say(f"fitting the next-visit model on trace requests {learn.start}..{learn.stop - 1} ...")
    model = fit_trace(trace, learn)
    args.data_dir.mkdir(parents=True, exist_ok=True)
    write_next_visit(model, path)
    return path, f"{note} in {time.perf_counter() - started:.0f} s, written to {path}"


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


def print_tiers_and_ceilings(results: dict, store_reads: dict | None, link: dict) -> None:
    """Each daemon-backed system's MiB per token per tier (arena fills, of which from the host
    tier and from the store) and the two ceilings on its speed: every arena fill over the link
    (PCIe on a GPU), and the store's bytes over the disk."""
    disk = store_reads["four_in_flight"]["gb_per_s"] * 1e9 if store_reads else None
    say(
        "MiB per token per tier (arena fills = from the host tier + from the store), and the time per token "
        f"the link ({link['gb_per_s']:.2f} GB/s) and the disk ("
        + (f"{disk / 1e9:.2f} GB/s" if disk else "not measured")
        + ") need for them, whatever overlaps:"
    )
    for system, r in results.items():
        if "store_bytes_per_token" not in r:
            continue
        arena, host, store = r["bytes_per_token"], r["host_bytes_per_token"], r["store_bytes_per_token"]
        link_ms = arena / (link["gb_per_s"] * 1e9) * 1e3
        disk_ms = store / disk * 1e3 if disk else None
        r["link_s_per_token"] = link_ms / 1e3
        say(
            f"  {system:<18}{arena / MIB:>8.1f} = {host / MIB:.1f} host + {store / MIB:.1f} store; link-bound "
            f"{link_ms:.2f} ms, disk-bound {fmt(disk_ms, '.2f')} ms per token (p50 {r['p50_s'] * 1e3:.1f} ms)"
        )


def measure_store_reads(store: Path, manifest: StoreManifest, reads: int) -> dict | None:
    """The disk under the systems, before they run: ``reads`` random experts read the daemon's
    way one at a time (what a lone demand miss waits), then twice as many 4 in flight (the
    throughput that bounds a token's reads); None when ``reads`` is 0."""
    if reads <= 0:
        return None
    alone = random_expert_reads(store, manifest, reads=reads, in_flight=1, seed=1)
    four = random_expert_reads(store, manifest, reads=2 * reads, in_flight=4, seed=2)
    say(
        f"store reads (O_DIRECT, the daemon's reader, random experts of {manifest.blob_bytes / MIB:.2f} MiB): "
        f"one at a time p50 {alone['latency_ms_p50']:.2f} ms each ({alone['gb_per_s']:.2f} GB/s); "
        f"4 in flight {four['gb_per_s']:.2f} GB/s"
    )
    return {"alone": alone, "four_in_flight": four}


def simulated_reference(
    args: argparse.Namespace, manifest: StoreManifest, budget: int, results: dict
) -> dict | None:
    """Belady's MIN and the replay's prediction on the routing ours and lru were forced to
    (``bench.e2e_reference``), printed beside the measurement; None unless lru ran. Ours' share
    of Belady's gain: (ours - 1) / (belady - 1) in speed-up over lru (ours measured, Belady
    simulated), and in bytes saved against lru."""
    if "lru" not in results:
        return None
    routes = forced_routes(args.trace, manifest, args.request, args.repeats * args.requests, args.tokens)
    ours = {}
    if "ours" in results:
        ours["ours"] = args.next_visit_path
    if "ours-transitions" in results:
        ours["ours-transitions"] = None
    calibrated = is_calibrated(manifest)
    depth = args.layer_ahead_depth or ComputeConfig().layer_ahead_depth
    drop = ComputeConfig().force_routing_accuracy_drop_per_depth
    accuracy = tuple(modelled_accuracy(args.layer_ahead_accuracy, drop, d) for d in range(1, depth + 1))
    slots = budget // manifest.blob_bytes
    started = time.perf_counter()
    simulated = simulate(
        routes, manifest, slots, ours=ours, lookahead_accuracy=accuracy, calibrated=calibrated
    )
    say("")
    say(
        f"simulated on the same routing (trace requests {routes.requests[0]}..{routes.requests[-1]}, {args.tokens} "
        f"tokens each, {slots} slots; cache_daemon.decisions.simulator, "
        + (
            "timing model cpu-e2e"
            if calibrated
            else "bytes only: the cpu-e2e timing model is calibrated for bf16 experts of the default shape"
        )
        + f"; {time.perf_counter() - started:.1f} s):"
    )
    say(f"  {'system':<18}{'MiB/tok':>9}{'measured':>10}{'x lru':>8}{'ms/tok':>9}{'x lru':>7}")
    sim_lru = simulated["lru"]
    for system, sim in simulated.items():
        measured = results.get(system, {}).get("bytes_per_token")
        lat = sim["latency_ms_per_token"]
        speedup = sim_lru["latency_ms_per_token"] / lat if lat else None
        say(
            f"  {system:<18}{sim['bytes_per_token'] / MIB:>9.1f}{fmt(measured and measured / MIB, '>10.1f'):>10}"
            f"{sim['bytes_per_token'] / sim_lru['bytes_per_token']:>8.3f}"
            f"{fmt(lat, '>9.1f'):>9}{fmt(speedup, '>7.2f'):>7}"
            + {
                "belady": "   (demand fetching with the future known: the fewest bytes)",
                "oracle-next-token": "   (ours' eviction told the next token's routing, demand fetching)",
            }.get(system, "")
        )
    share = belady_shares(results, simulated)
    if share:
        if share.get("speed_share") is not None:
            say(
                f"ours' share of Belady's gain in speed, (ours - 1) / (belady - 1): {share['speed_share']:.2f} "
                f"(ours {share['speedup']:.2f}x lru measured, belady {share['belady_speedup']:.2f}x lru simulated)"
            )
        if share.get("bytes_share") is not None:
            say(
                f"ours' share of Belady's byte saving, (1 - ours / lru) / (1 - belady / lru): "
                f"{share['bytes_share']:.2f} (ours {share['bytes_ratio']:.3f}x lru's bytes measured, belady "
                f"{share['belady_bytes_ratio']:.3f}x simulated)"
            )
    return {
        "requests": list(routes.requests),
        "slots": slots,
        "calibrated": calibrated,
        "lookahead_accuracy": list(accuracy),
        "systems": simulated,
        "shares": share,
    }


def add_disk_time(results: dict, store_reads: dict) -> None:
    """Each daemon-backed system's ``disk_s_per_token``: its bytes read per token at the disk's
    measured throughput with 4 reads in flight (None without a byte count). Accelerate gets none:
    it reads its offload files buffered and in order, not random experts with O_DIRECT, so that
    throughput is not its own."""
    rate = store_reads["four_in_flight"]["gb_per_s"] * 1e9
    for r in results.values():
        if "store_io_mode" not in r:
            continue
        bpt = r.get("store_bytes_per_token", r.get("bytes_per_token"))
        r["disk_s_per_token"] = bpt / rate if bpt is not None and rate > 0 else None


def write_e2e_png(
    results: dict, shares: dict, precision: str, path: Path, reference: dict | None = None
) -> None:
    """Per-token p50 per system (bars; whiskers: the lowest and highest repeat), each system's
    share of the lru-resident gap, and with a simulated ``reference`` each system's MiB read per
    token measured beside the simulation's, with Belady's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = [s for s in results if results[s].get("p50_s")]
    panels = 1 + bool(shares) + bool(reference)
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4.2), squeeze=False)
    ax = axes[0][0]
    p50 = np.array([results[s]["p50_s"] * 1e3 for s in systems])
    lo = np.array([min(repeat_p50s(results[s]) or [results[s]["p50_s"]]) * 1e3 for s in systems])
    hi = np.array([max(repeat_p50s(results[s]) or [results[s]["p50_s"]]) * 1e3 for s in systems])
    bars = ax.bar(systems, p50, yerr=[np.maximum(p50 - lo, 0), np.maximum(hi - p50, 0)], capsize=4)
    ax.bar_label(bars, fmt="%.0f", fontsize=8)
    disk = [
        (i, results[s]["disk_s_per_token"] * 1e3)
        for i, s in enumerate(systems)
        if results[s].get("disk_s_per_token")
    ]
    if disk:
        ax.plot([i for i, _ in disk], [d for _, d in disk], "r_", ms=28, mew=2, label="disk time per token")
        ax.legend(fontsize=8, loc="upper left")
    ax.set_yscale("log")
    ax.set_title("per-token p50, ms (log; whiskers: lowest / highest repeat)")
    if shares:
        ax = axes[0][1]
        names = [s for s in systems if s in shares]
        vals = [shares[s]["share"] for s in names]
        bars = ax.bar(names, vals, color="tab:green")
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
        for i, s in enumerate(names):
            if shares[s]["per_repeat"]:
                ax.plot([i] * len(shares[s]["per_repeat"]), shares[s]["per_repeat"], "k.", ms=5)
        ax.axhline(0, color="grey", lw=0.8)
        ax.axhline(1, color="grey", lw=0.8, ls="--")
        ax.set_title("share of the lru -> resident gap closed (dots: repeats)")
    if reference:
        ax = axes[0][panels - 1]
        sim = reference["systems"]
        names = [s for s in sim if s not in results or results[s].get("bytes_per_token") is not None]
        x = np.arange(len(names))
        measured = [(results.get(s, {}).get("bytes_per_token") or np.nan) / MIB for s in names]
        simulated = [sim[s]["bytes_per_token"] / MIB for s in names]
        bars = ax.bar(x - 0.2, measured, 0.4, label="measured")
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
        bars = ax.bar(x + 0.2, simulated, 0.4, label="simulated", hatch="//", color="tab:orange")
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
        ax.set_xticks(x, [n.replace("oracle-next-token", "oracle\nnext token") for n in names], fontsize=8)
        ax.legend(fontsize=8)
        ax.set_title("MiB read per token (belady, oracle: simulated only)")
    fig.suptitle(f"bench.e2e: gpt-oss shape, experts {precision}, interleaved systems, 2-core CPU")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def write_comparison_png(results: dict, baseline: dict, precision: str, other: str, path: Path) -> None:
    """Bars of MiB read per token and p50 per token, per system, this run beside the baseline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = [s for s in results if s in baseline]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, scale, label in (
        (axes[0], "bytes_per_token", 1 / MIB, "MiB read per token (log)"),
        (axes[1], "p50_s", 1e3, "per-token p50, ms (log)"),
    ):
        x = np.arange(len(systems))
        for i, (runs, name) in enumerate(((baseline, other), (results, precision))):
            vals = [(runs[s].get(key) or np.nan) * scale for s in systems]
            bars = ax.bar(x + (i - 0.5) * 0.38, vals, 0.38, label=f"experts {name}")
            ax.bar_label(bars, fmt="%.0f", fontsize=8)
        ax.set_xticks(x, systems)
        ax.set_yscale("log")
        ax.set_title(label)
        ax.legend()
    fig.suptitle("bench.e2e: gpt-oss shape, budget 25% of the encoded experts, 2-core CPU")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def compare_runs(results: dict, precision: str, baseline: dict, path: Path, out: Path) -> dict:
    """Print this run's MiB read per token and p50 beside ``baseline``'s (a previous run's JSON,
    e.g. the bf16 run), per system; returns the verdict on ours' bytes per token."""
    other = baseline.get("precision") or baseline.get("model", {}).get("precision", "bf16")
    say("")
    say(f"beside the {other} run ({path}, budget {baseline['budget_bytes'] / MIB:.0f} MiB):")
    say(
        f"{'system':<18}{'MiB/tok ' + precision:>16}{'MiB/tok ' + other:>16}{'ratio':>8}"
        f"{'p50 ms ' + precision:>16}{'p50 ms ' + other:>16}"
    )
    rows = {}
    for system, r in results.items():
        b = baseline["systems"].get(system)
        if b is None:
            continue
        mine, theirs = r.get("bytes_per_token"), b.get("bytes_per_token")
        share = mine / theirs if mine and theirs else None
        rows[system] = {"bytes_per_token_ratio": share, "p50_s": (r["p50_s"], b["p50_s"])}
        say(
            f"{system:<18}{fmt(mine and mine / MIB, '>16.1f'):>16}{fmt(theirs and theirs / MIB, '>16.1f'):>16}"
            f"{fmt(share, '>8.3f'):>8}{fmt(r['p50_s'] and r['p50_s'] * 1e3, '>16.1f'):>16}"
            f"{fmt(b['p50_s'] and b['p50_s'] * 1e3, '>16.1f'):>16}"
        )
    png = out.with_name(f"{out.stem}-{precision}-vs-{other}.png")  # next to the JSON results
    write_comparison_png(results, baseline["systems"], precision, other, png)
    say(f"wrote {png}")
    share = rows.get("ours", {}).get("bytes_per_token_ratio")
    if share is None:
        return {"compared": rows}
    verdict = "PASS" if share <= GOAL_BYTES_VS_BF16 else "FAIL"
    say(
        f"ours reads {share:.3f}x the MiB per token of the {other} run (goal <= {GOAL_BYTES_VS_BF16:g}x) {verdict}"
    )
    return {
        "compared": rows,
        f"ours_bytes_vs_{other}": {"ratio": share, "goal": GOAL_BYTES_VS_BF16, "verdict": verdict},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tokens",
        type=int,
        default=96,
        help="tokens per Generate for ours and lru (96: past the cold start of each request; the trace's "
        "requests average 306 decode tokens)",
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=3,
        help="Generates (trace requests) per repeat for ours, lru and resident",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds of --requests Generates per system, interleaved; each ratio is printed with its spread "
        "over the rounds (each round takes the next trace requests)",
    )
    parser.add_argument(
        "--accelerate-tokens", type=int, default=16, help="tokens per generate for accelerate"
    )
    parser.add_argument("--accelerate-requests", type=int, default=1)
    parser.add_argument(
        "--precision",
        choices=tuple(PRECISIONS),
        default="mxfp4",
        help="the experts' precision in the checkpoint, the store and every tier (gpt-oss ships mxfp4)",
    )
    parser.add_argument(
        "--budget-share",
        type=float,
        default=0.25,
        help="expert memory budget of every system, as a share of the expert total in encoded bytes",
    )
    parser.add_argument(
        "--budget-mib",
        type=float,
        default=None,
        help="expert memory budget in MiB (overrides --budget-share)",
    )
    parser.add_argument(
        "--compare-with",
        type=Path,
        default=None,
        help="a previous run's JSON (e.g. the bf16 run) whose figures are printed beside this run's",
    )
    parser.add_argument(
        "--host-share",
        type=float,
        default=None,
        help="share of the budget in the host tier (default: none on the CPU; with --device cuda the "
        "arena gets the whole budget and a pinned host tier holds every expert, as on a GPU node)",
    )
    parser.add_argument(
        "--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {SYSTEMS + EXTRA_SYSTEMS}"
    )
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--request", type=int, default=0, help="first trace request")
    parser.add_argument(
        "--layer-ahead-accuracy", type=float, default=0.85, help="modelled under forced routing"
    )
    parser.add_argument(
        "--layer-ahead-depth",
        type=int,
        default=0,
        help="ours' lookahead depth in MoE layers (default: compute's own default)",
    )
    parser.add_argument(
        "--next-visit-model",
        default="fit",
        help="ours' learned next-visit model (the daemon's next_visit_model): 'fit' (default: fitted on the "
        "--next-visit-requests trace requests after the measured ones, cached under --data-dir), a model file, "
        "or 'none' (the routing transitions)",
    )
    parser.add_argument(
        "--next-visit-requests",
        type=int,
        default=64,
        help="with --next-visit-model fit: requests it learns from",
    )
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1280, help="expert intermediate size")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--data-dir", type=Path, default=DATA_DIR)
    parser.add_argument("--shm-dir", default="", help="daemon's shm directory (default: the daemon's)")
    parser.add_argument(
        "--device", default="cpu", help="the daemon's arena: cpu, or cuda[:n] on a GPU machine"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--progress-every", type=int, default=8)
    parser.add_argument(
        "--store-reads",
        type=int,
        default=128,
        help="random expert reads that measure the disk before the systems run, one at a time and "
        "then 4 in flight (the disk time per token is printed from them); 0 = skip",
    )
    parser.add_argument("--min-ratio", type=float, default=4.0, help="required expert total / budget")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of compute and of accelerate")
    parser.add_argument(
        "--tracing-costs",
        action="store_true",
        help="instead of the systems: ours with tracing off, on at the default layer ratio, on at full "
        "sampling (OTLP/gRPC to an in-process receiver); prints the per-token p50 of each",
    )
    args = parser.parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(systems) - set(SYSTEMS) - set(EXTRA_SYSTEMS))
    if unknown or not systems:
        parser.error(f"--systems {args.systems!r}: choose from {', '.join(SYSTEMS + EXTRA_SYSTEMS)}")
    if not 0 <= args.store_reads <= 100_000:
        parser.error(f"--store-reads must be in [0, 100000], got {args.store_reads}")
    if not 0 <= args.layer_ahead_depth <= 64:
        parser.error(
            f"--layer-ahead-depth must be in [1, 64] (0: compute's default), got {args.layer_ahead_depth}"
        )
    if args.repeats < 1 or args.requests < 1:
        parser.error(f"--repeats and --requests must be >= 1, got {args.repeats} and {args.requests}")
    if args.host_share is not None and not 0.0 <= args.host_share < 1.0:
        parser.error(f"--host-share {args.host_share} is out of range [0, 1)")
    if not args.trace.is_file():
        parser.error(f"--trace {args.trace} does not exist")
    if not 0.0 < args.budget_share <= 1.0:
        parser.error(f"--budget-share {args.budget_share} is out of range (0, 1]")
    baseline = None
    if args.compare_with is not None:
        try:
            baseline = json.loads(args.compare_with.read_text())
        except (OSError, ValueError) as exc:
            parser.error(f"--compare-with {args.compare_with}: {exc}")

    # Every process gets the same torch threads. On a 2-core machine shared with the daemon's I/O,
    # more than one OpenMP thread per process makes each small matmul wait for a descheduled
    # thread (measured: 14x slower decode with 2 threads under load than with 1).
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ["MKL_NUM_THREADS"] = str(args.threads)
    started = time.perf_counter()
    checkpoint, store, manifest = build(
        args.data_dir,
        hidden=args.hidden,
        intermediate=args.intermediate,
        layers=args.layers,
        experts=args.experts,
        top_k=args.top_k,
        precision=args.precision,
    )
    total = manifest.total_expert_bytes
    budget = int(args.budget_mib * MIB) if args.budget_mib is not None else int(args.budget_share * total)
    ratio = total / budget
    say(
        f"model: gpt_oss, {len(manifest.moe_layers)} layers x {manifest.num_experts} experts, top-{manifest.top_k}, "
        f"hidden {args.hidden}, expert intermediate {args.intermediate}, bf16 dense, experts {args.precision} "
        f"({', '.join(manifest.encodings)}); expert blob {manifest.blob_bytes / MIB:.2f} MiB encoded "
        f"({manifest.decoded_blob_bytes / MIB:.2f} MiB decoded), experts {total / GIB:.2f} GiB, "
        f"dense {manifest.dense_bytes / MIB:.1f} MiB"
    )
    say(
        f"budget: {budget / MIB:.0f} MiB of expert memory (encoded bytes) for every system = "
        f"{budget // manifest.blob_bytes} experts of {manifest.num_blobs} ({100 / ratio:.1f}%); experts are "
        f"{ratio:.1f}x the budget"
    )
    if ratio < args.min_ratio:
        parser.error(
            f"experts ({total / MIB:.0f} MiB) are only {ratio:.1f}x the budget; need >= {args.min_ratio}x"
        )
    say(
        f"routing: ours/lru forced from {args.trace.name}, requests {args.request}.."
        f"{args.request + args.repeats * args.requests - 1} ({args.requests} per repeat), {args.tokens} tokens each (prompt {len(PROMPT)} tokens, prefill rows = the trace's first decode row); "
        f"layer-ahead accuracy modelled at {args.layer_ahead_accuracy:.2f}, ours' lookahead depth "
        f"{args.layer_ahead_depth or ComputeConfig().layer_ahead_depth} MoE layers"
    )
    say(
        f"threads: torch/OpenMP threads = {args.threads} in compute and in accelerate ({os.cpu_count()} CPUs)"
    )
    say(
        "page cache: store read with O_DIRECT (checked below); accelerate's offload folder + checkpoint "
        "posix_fadvise(DONTNEED) after load and after every token; compute's dense file after start-up"
    )

    args.next_visit_path, next_visit_note = next_visit_model(args, parser)
    say(f"ours' next-visit estimate: {next_visit_note}")
    if args.tracing_costs:
        return tracing_costs(store, manifest, args, budget)
    store_reads = measure_store_reads(store, manifest, args.store_reads)
    link = measure_link(manifest, args.device)

    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="e2e-", dir=args.data_dir) as tmp:
        started_systems: dict[str, ProcessSystem | TransformersSystem] = {}
        accelerate_runs: list[dict] = []
        try:
            for system in systems:  # all up at once: they take turns below
                if system == "transformers":
                    say(
                        f"[transformers] {checkpoint} loaded by transformers on {args.device}, every expert in memory"
                    )
                    started_systems[system] = TransformersSystem(
                        checkpoint,
                        device=args.device,
                        threads=args.threads,
                        tokens=args.tokens,
                        prompt=PROMPT,
                    )
                elif system != "accelerate":
                    proc = ProcessSystem(system, store, manifest, Path(tmp) / system, args, budget)
                    started_systems[system] = proc
                    if not proc.io_mode.lower().startswith("o_direct"):
                        say(f"  WARNING: the daemon reads the store as {proc.io_mode!r}, not O_DIRECT")
            for proc in started_systems.values():
                proc.begin()
            # Interleaved: request r of every system before request r + 1 of any, the order of the
            # systems rotated each repeat, so that drift of the machine and the disk hits all alike.
            for repeat in range(args.repeats):
                order = systems[repeat % len(systems) :] + systems[: repeat % len(systems)]
                say(f"repeat {repeat + 1}/{args.repeats}: order {', '.join(order)}")
                for r in range(args.requests):
                    for system in order:
                        if system == "accelerate":
                            if r == 0:  # its own process per run: one run (of its requests) per repeat
                                run = run_accelerate(
                                    checkpoint, Path(tmp) / system, args, budget + manifest.dense_bytes
                                )
                                run["repeat"] = repeat
                                accelerate_runs.append(run)
                        else:
                            started_systems[system].measure(repeat, r)
            for system, proc in started_systems.items():
                results[system] = proc.finish()
        finally:
            for proc in started_systems.values():
                proc.stop()
        if accelerate_runs:
            results["accelerate"] = merge_accelerate(accelerate_runs)
        results = {system: results[system] for system in systems}
        for r in results.values():
            r.update(summarise(r))

    say("")
    say(
        f"{'system':<18}{'p50 ms':>10}{'p99 ms':>10}{'tok/s':>8}{'MiB in/tok':>14}{'hit rate':>10}{'tokens':>8}  io"
    )
    for system in systems:
        r = results[system]
        bpt = r.get("bytes_per_token")
        io = r.get("store_io_mode", "buffered+fadvise(DONTNEED) per token" if system == "accelerate" else "-")
        say(
            f"{system:<18}{fmt(r['p50_s'] and r['p50_s'] * 1e3, '>10.1f'):>10}{fmt(r['p99_s'] and r['p99_s'] * 1e3, '>10.1f'):>10}"
            f"{fmt(r['tokens_per_s'], '>8.2f'):>8}{fmt(bpt and bpt / MIB, '>14.1f'):>14}"
            f"{fmt(r.get('hit_rate'), '>10.3f'):>10}{r['tokens']:>8}  {io}"
        )
    if "transformers" in results:
        cpu = results["transformers"]["cpu_s_per_token"]["transformers"]
        say(
            f"transformers: CPU per token {cpu * 1e3:.0f} ms; experts implementation "
            f"{results['transformers'].get('experts_implementation')}"
        )
    for system in ("ours", "ours-transitions", "lru", "resident"):
        if system in results:
            r = results[system]
            cpu = ", ".join(f"{name} {value * 1e3:.0f} ms" for name, value in r["cpu_s_per_token"].items())
            say(
                f"{system}: CPU per token: {cpu}; compute waits for experts "
                f"{r['stall_s_per_decode_token'] * 1e3:.1f} ms per decode token, "
                f"{r['misses_per_decode_token']:.1f} experts not resident when asked for; store read time "
                f"{r['store_read_s']:.1f} s in all"
            )
            say(f"{system} prefetch: {r['prefetch']}")
    if store_reads:
        add_disk_time(results, store_reads)
        gbs = store_reads["four_in_flight"]["gb_per_s"]
        say(
            f"disk time per token: MiB read per token / the {gbs:.2f} GB/s measured with 4 reads in flight "
            "(the disk is busy that long per token, whatever overlaps it):"
        )
        for system, r in results.items():
            if r.get("disk_s_per_token") is not None and r["p50_s"]:
                say(
                    f"  {system:<18}{r['disk_s_per_token'] * 1e3:>7.1f} ms = {r['disk_s_per_token'] / r['p50_s']:.2f} "
                    f"of its p50"
                )
    print_tiers_and_ceilings(results, store_reads, link)
    verdicts = {}
    if "resident" in results and "transformers" in results:
        vs_plain = results["resident"]["p50_s"] / results["transformers"]["p50_s"]
        per_repeat = repeat_ratios(results["resident"], results["transformers"])
        verdicts["resident_vs_transformers"] = {"p50_ratio": vs_plain, "per_repeat": per_repeat}
        say(
            f"resident vs transformers (every expert in memory; what serving through the cache costs): "
            f"{vs_plain:.3f}x the per-token p50, per repeat {spread_text(per_repeat)}"
        )
    if "ours" in results:
        goal_accelerate = GOAL_VS_ACCELERATE_BY_PRECISION.get(args.precision, GOAL_VS_ACCELERATE)
        for other, goal in (("accelerate", goal_accelerate), ("lru", GOAL_VS_LRU)):
            if other in results and results[other]["p50_s"] and results["ours"]["p50_s"]:
                speedup = results[other]["p50_s"] / results["ours"]["p50_s"]
                verdict = "PASS" if speedup >= goal else "FAIL"
                per_repeat = repeat_ratios(results[other], results["ours"])
                verdicts[f"ours_vs_{other}"] = {
                    "p50_speedup": speedup,
                    "per_repeat": per_repeat,
                    "goal": goal,
                    "verdict": verdict,
                }
                say(
                    f"ours vs {other}: {speedup:.2f}x faster per token (p50; goal >= {goal:g}x) {verdict}; "
                    f"per repeat {spread_text(per_repeat)}"
                )
        plain = results.get("ours-transitions")
        if plain is not None and plain["p50_s"] and results["ours"]["p50_s"]:
            speedup = plain["p50_s"] / results["ours"]["p50_s"]
            per_repeat = repeat_ratios(plain, results["ours"])
            bytes_ratio = results["ours"]["bytes_per_token"] / plain["bytes_per_token"]
            verdicts["ours_vs_ours_transitions"] = {
                "p50_speedup": speedup,
                "per_repeat": per_repeat,
                "bytes_ratio": bytes_ratio,
            }
            say(
                f"ours vs ours-transitions (the learned next-visit model against the routing transitions): "
                f"{speedup:.2f}x faster per token (p50), per repeat {spread_text(per_repeat)}; {bytes_ratio:.3f}x "
                "the MiB per token"
            )
        lru_bytes = results.get("lru", {}).get("bytes_per_token")
        if lru_bytes:
            share = results["ours"]["bytes_per_token"] / lru_bytes
            verdict = "PASS" if share <= GOAL_BYTES_VS_LRU else "FAIL"
            verdicts["ours_bytes_vs_lru"] = {"ratio": share, "goal": GOAL_BYTES_VS_LRU, "verdict": verdict}
            say(f"ours reads {share:.3f}x lru's MiB per token (goal <= {GOAL_BYTES_VS_LRU:g}x) {verdict}")
    reference = simulated_reference(args, manifest, budget, results)
    if reference is not None:
        verdicts["belady_share"] = reference["shares"]
    shares = gap_shares(results)
    if shares:
        verdicts["share_of_lru_resident_gap"] = shares
        lru_ms, res_ms = results["lru"]["p50_s"] * 1e3, results["resident"]["p50_s"] * 1e3
        say(
            f"share of the gap between lru ({lru_ms:.1f} ms) and resident ({res_ms:.1f} ms, every expert in "
            "memory: the compute-bound floor) that each system closes, (lru - system) / (lru - resident), p50:"
        )
        for system, share in shares.items():
            say(f"  {system:<18}{share['share']:>7.2f}   per repeat {spread_text(share['per_repeat'])}")
    png = args.out.with_suffix(".png")
    write_e2e_png(results, shares, args.precision, png, reference)
    say(f"wrote {png}")
    if baseline is not None:
        verdicts.update(compare_runs(results, args.precision, baseline, args.compare_with, args.out))
    report = {
        "model": {
            "arch": "gpt_oss",
            "layers": len(manifest.moe_layers),
            "experts": manifest.num_experts,
            "top_k": manifest.top_k,
            "hidden": args.hidden,
            "intermediate": args.intermediate,
            "dtype": "bfloat16",
            "precision": args.precision,
            "expert_encodings": list(manifest.encodings),
            "blob_bytes": manifest.blob_bytes,
            "decoded_blob_bytes": manifest.decoded_blob_bytes,
            "total_expert_bytes": total,
            "dense_bytes": manifest.dense_bytes,
            "checkpoint": str(checkpoint),
            "store": str(store),
        },
        "precision": args.precision,
        "budget_bytes": budget,
        "budget_share": budget / total,
        "experts_over_budget": ratio,
        "compared_with": str(args.compare_with) if args.compare_with else None,
        "trace": str(args.trace),
        "first_request": args.request,
        "next_visit_model": next_visit_note,
        "requests": args.requests,
        "repeats": args.repeats,
        "interleaved": True,
        "tokens": args.tokens,
        "accelerate_tokens": args.accelerate_tokens,
        "layer_ahead_accuracy_modelled": args.layer_ahead_accuracy,
        "layer_ahead_depth": args.layer_ahead_depth or ComputeConfig().layer_ahead_depth,
        "page_cache": "store: O_DIRECT; accelerate: posix_fadvise(POSIX_FADV_DONTNEED) on offload folder and "
        "checkpoint after load and after every token; compute dense file after start-up",
        "store_reads": store_reads,
        "link": link,
        "cpu_count": os.cpu_count(),
        "torch_threads": args.threads,
        "systems": results,
        "simulated_reference": reference,
        "verdicts": verdicts,
        "wall_s": time.perf_counter() - started,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    say(f"wrote {args.out} ({report['wall_s']:.0f} s in all)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
