"""End-to-end decode latency: ours vs plain LRU on-demand vs HF Accelerate, same memory budget.

    python -m bench.e2e [--precision mxfp4] [--tokens 96] [--requests 3] [--repeats 1] ...
                        [--budget-share 0.25] [--systems ours,lru,resident,accelerate,llama.cpp,...]
                        [--compare-with bench/results/e2e-bf16.json]
    make bench-e2e [BENCH_E2E_ARGS="--tokens 96"]   # a bf16 run, then an mxfp4 run printed beside it

One run, side by side, on one random-weight checkpoint of gpt-oss shape written by transformers'
own ``save_pretrained`` (24 layers x 32 experts, top-4, bf16 dense; hidden and expert sizes
printed), converted once with the real converter (``cache_daemon.convert``) into an expert store;
both cached under bench/.data/. ``--precision`` is the experts' precision in the checkpoint and
so in the store and every tier: ``mxfp4`` (the default: gpt-oss ships its experts in MXFP4;
``devtools.tiny`` quantises the random experts and writes the published ``*_blocks`` /
``*_scales`` layout), ``bf16``, or ``fp8`` (e4m3 with 128 x 128 blocks, transformers' own
quantiser; gpt-oss does not ship in FP8, and transformers' loader ignores stacked FP8 scales, so
accelerate then runs unscaled weights at the same cost). The budget is ``--budget-share`` of the
expert total in encoded bytes (25%: the same share of experts at every precision; ``--budget-mib``
overrides), and the expert total is several times the budget (printed, checked >= 4x).
``--compare-with`` prints a previous run's figures (the bf16 run) beside this one's, with ours'
MiB per token as a fraction of that run's (goal <= 0.3 at mxfp4).

1. ours: real daemon + compute processes (``devtools.launch``); eviction policy
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
5. transformers: the checkpoint run by transformers itself, every expert in memory
   (``bench.plain_transformers``).
6. llama.cpp: the checkpoint converted to GGUF by the converter of the llama-cpp-python sdist
   (bf16 experts to BF16, MXFP4 kept MXFP4) and run by llama.cpp built from that sdist, every
   expert in memory (``bench.llama_cpp``; ``make llama-cpp`` builds it). Where it is not built,
   or cannot convert the checkpoint, one line says why and the rest run. Printed: its per-token
   p50 and p99, its GGUF's bytes beside the store's, resident / llama.cpp in per-token p50, and
   its first ``--check-tokens`` greedy tokens against transformers' on the same checkpoint (or
   why they cannot agree).
7. llama.cpp-budget: the same GGUF and build held to the experts' budget of the others, as a
   user without the memory for the model runs it: its weights used where the GGUF is mapped (no
   repacked copy in anonymous memory), in a memory cgroup of the GGUF's dense bytes + the budget
   (+ its idle baseline and the headroom), so that experts beyond the budget are paged in from the
   file as its own router picks them (random weights: no skew in its routing, unlike the trace
   ours and lru are forced to). Its GGUF leaves the page cache before it starts, and its warm-up
   and its requests come after every other system's (at hundreds of MiB a token it would slow the
   disk for the systems after it), ``--llama-budget-tokens`` a request. Printed: its
   p50 and p99, the MiB read from storage per token (/proc/PID/io), and ours against it (goal
   ours >= 2x).

Interleaved: every system's daemon and compute are up at once, and they take turns request by
request (ours, lru, resident, ours, ...; accelerate, a process per run, once per repeat), the
order rotated each repeat, so that the machine's and the disk's drift hits all alike.
A spare (``--spare``, the default) is started before them all and kept up, idle, to the end:
an lru system that is never measured. The first daemon and compute started measured 5-12% slower
per token than identical twins started after them, in every repeat, more CPU for the same work
(A/A runs of three identical ours, 2026-11-30, cause not found). The spare takes the worst of
it, not all: with ``--baseline`` at an identical checkout, this checkout's ours (started before
the baseline's) measured 0.912-0.947x the baseline's, in either checkout, and 1.077x with
``--baseline-first`` (2026-12-03). So an A/B is read as the geometric mean of a run in each
start order.
``--repeats N`` runs N such rounds, each on the next trace requests; every ratio is printed with
its spread over the rounds (median, min, max of the per-round p50 ratios), and
bench/results/e2e.png plots the p50s with their spread and the shares of the gap.

Routing: ours and lru are forced from the real gpt-oss-20b trace (``--force-routing``, a
benchmark mode of compute: ``python -m replay.forced_compute``, ``replay.forced_routing``), trace requests ``--request`` ..
``--request + --requests - 1``, one Generate each; layer-ahead under forced routing is modelled
at ``--layer-ahead-accuracy`` (printed). Accelerate routes with its own (random) routers, which
does not change its cost: it streams whole offloaded modules, every expert of them, per forward.
Ours' daemon runs the learned next-visit model (``--next-visit-model``), fitted on the 64 trace
requests after the measured ones (held out, as a served model's is fitted on earlier traffic).
On an MXFP4 checkpoint transformers dequantises the experts to bf16 when it loads (no Triton or
kernels on CPU), so Accelerate holds and offloads bf16 experts within the same byte budget. On
the block-FP8 checkpoint its GPT-OSS loader does not: it drops the ``*_scale_inv`` tensors and
reads the e4m3 values as the weights, so transformers' and Accelerate's figures there are timings
of a model whose output is not the checkpoint's (tests/integration/test_generate_equivalence.py
dequantises those experts itself for its reference).

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
The disk under them: before the systems start, every blob of the store is read once
(``--store-pass``: on a virtual machine the disk's host cache lies beneath O_DIRECT, and the first
system to read a cold store ran its first tokens up to 15x slower than the second), then
``--store-reads`` random experts are read the daemon's way (``bench.io_bench.random_expert_reads``:
the native reader, O_DIRECT, CRC-checked), one at a time (what a lone demand miss waits) and then 4 in flight; the MiB per token of ours,
lru and resident over that throughput is their disk time per token, printed beside the p50 and
marked on the plot (not accelerate's: it reads its offload files buffered and in order).
Where that time is most of the p50, the disk bounds the token and only fewer bytes make it faster.
Belady's reference: MIN needs the future, so it runs in the replay's simulator instead, on the very
routing ours and lru were forced to and the same slots (``bench.e2e_reference``): the simulated
LRU's bytes printed beside the measured ones (they agree), Belady's bytes and, with the ``cpu-e2e``
timing model calibrated on this run (the store reads measured first, the compute's CPU per token),
its speed-up over LRU; then ours' share of Belady's gain, (ours - 1) / (belady - 1), in speed
(ours measured) and in bytes saved against LRU. The replay's prediction for ours and LRU is
printed beside their measured mean per token, and judged (within 10%, the same order).
Every process runs ``--threads`` torch threads (default 1: see ``main``). Default sizes (3 x 96
tokens for ours and lru, 16 for accelerate) take about 4 minutes here on 2 cores once the model is
built (about 1.5 minutes, once); the first ~50 tokens of a request are its cold start (the trace's
requests average 306). Writes bench/results/e2e.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import llama_cpp  # noqa: E402
from bench.e2e_accelerate import merge_accelerate, run_accelerate  # noqa: E402
from bench.e2e_reference import fit_disk, forced_routes, measured_timing, simulate, timing_errors  # noqa: E402
from bench.e2e_reference import shares as belady_shares  # noqa: E402
from bench.e2e_report import (  # noqa: E402
    compare_runs,
    gap_shares,
    judge,
    print_baseline,
    print_disk_time,
    print_gap_shares,
    print_memory,
    print_systems,
    print_tiers_and_ceilings,
    write_e2e_png,
)
from bench.e2e_sweep import parse_shares, run_sweep  # noqa: E402
from bench.e2e_tracing import tracing_costs  # noqa: E402
from bench.gpt_oss import DEFAULT_TRACE, PROMPT, add_model_arguments, build_from_args, use_torch_threads  # noqa: E402
from bench.io_bench import random_expert_reads, store_pass  # noqa: E402
from bench.profile import print_profiles  # noqa: E402
from bench.report import GIB, MIB, RESULTS_DIR, fmt, say, write_json  # noqa: E402
from bench.stats import summarise  # noqa: E402
from bench.systems import (  # noqa: E402
    PEERS,
    ProcessSystem,
    add_check_tokens_argument,
    add_tier_arguments,
    all_stopped,
    begin_paging,
    check_baseline,
    finish_all,
    llama_cpp_figures,
    measure_link,
    start_peer,
    take_turns,
)
from cache_daemon.decisions.next_visit import NextVisitModelError  # noqa: E402
from cache_daemon.decisions.next_visit import read as read_next_visit  # noqa: E402
from cache_daemon.decisions.scheduler import PrefetchConfig  # noqa: E402
from compute_svc.config import ComputeConfig  # noqa: E402
from expertcache.manifest import StoreManifest  # noqa: E402
from expertcache.trace import read_trace  # noqa: E402
from replay.forced_compute import ForcedRoutingConfig  # noqa: E402
from replay.forced_routing import modelled_accuracy  # noqa: E402
from replay.learn_next_visit import (  # noqa: E402
    DEFAULT_HORIZON_VISITS,
    fit_trace,
)
from replay.learn_next_visit import DEFAULT_ITERATIONS as DEFAULT_FIT_ITERATIONS  # noqa: E402
from replay.learn_next_visit import MAX_ITERATIONS as MAX_FIT_ITERATIONS  # noqa: E402
from replay.learn_next_visit import write as write_next_visit  # noqa: E402

RESULTS = RESULTS_DIR / "e2e.json"
# resident: every expert fits (the compute-bound floor of this machine); a warm-up request, not
# measured, loads them first.
SYSTEMS = ("ours", "lru", "resident", "transformers", "accelerate", *llama_cpp.SYSTEMS)
# ours with the routing transitions in place of the learned next-visit model (the daemon without
# a next_visit_model file): what the model is worth, side by side in one run. ours-eviction: ours'
# policy on ours' signals with no prefetch and no lookahead: what the eviction alone is worth, and
# what prefetch's reads and decisions add or cost.
EXTRA_SYSTEMS: tuple[str, ...] = ("ours-transitions", "ours-eviction")
# The label of ``--spare``'s system (not one of the systems: it is never measured nor reported).
SPARE = "spare"
# ``--baseline DIR``'s system: that checkout's ours, in the same rounds as this one's.
BASELINE = "baseline-ours"


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
    if not 1 <= args.next_visit_iterations <= MAX_FIT_ITERATIONS:
        parser.error(
            f"--next-visit-iterations must be in [1, {MAX_FIT_ITERATIONS}], got {args.next_visit_iterations}"
        )
    learn = range(first, first + args.next_visit_requests)
    iterations = (
        "" if args.next_visit_iterations == DEFAULT_FIT_ITERATIONS else f"-it{args.next_visit_iterations}"
    )
    head = f"-h{DEFAULT_HORIZON_VISITS}"  # a file of before the horizon head is not reused
    path = (
        args.data_dir
        / f"next_visit-{args.trace.stem}-{learn.start}-{learn.stop}{iterations}{head}.safetensors"
    )
    note = (
        f"the learned model with its horizon head ({DEFAULT_HORIZON_VISITS} visits), fitted on trace "
        f"requests {learn.start}..{learn.stop - 1} (after the measured ones)"
    )
    try:
        read_next_visit(path)
        return path, f"{note}, cached in {path}"
    except NextVisitModelError:
        pass
    started = time.perf_counter()
    say(f"fitting the next-visit model on trace requests {learn.start}..{learn.stop - 1} ...")
    model = fit_trace(trace, learn, iterations=args.next_visit_iterations)
    args.data_dir.mkdir(parents=True, exist_ok=True)
    write_next_visit(model, path)
    return path, f"{note} in {time.perf_counter() - started:.0f} s, written to {path}"


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


def ours_bar(args: argparse.Namespace) -> float:
    """The prefetch bar ours' daemon runs under (``--prefetch-min-probability``, else the daemon's
    default)."""
    return (
        PrefetchConfig().min_probability
        if args.prefetch_min_probability is None
        else args.prefetch_min_probability
    )


def prefetch_start_delay_s(system: dict) -> float:
    """A system's mean lag of a prefetch start behind the change that asked for its decision
    (GetStats' ``start_delay_seconds`` over ``started``, every class); 0 when it started none."""
    classes = (system.get("prefetch") or {}).values()
    started = sum(c["started"] for c in classes)
    return sum(c.get("start_delay_s", 0.0) for c in classes) / started if started else 0.0


def simulated_reference(
    args: argparse.Namespace, manifest: StoreManifest, budget: int, results: dict, store_reads: dict | None
) -> dict | None:
    """Belady's MIN and the replay's prediction on the routing ours and lru were forced to
    (``bench.e2e_reference``), printed beside the measurement; None unless lru ran. Ours' share
    of Belady's gain: (ours - 1) / (belady - 1) in speed-up over lru (ours measured, Belady
    simulated), and in bytes saved against lru. Times are simulated under the timing model
    calibrated on this run (``measured_timing``: the store reads measured first, the compute's
    CPU per token of lru and ours), and each is compared with the measured mean per token."""
    if "lru" not in results:
        return None
    routes = forced_routes(args.trace, manifest, args.request, args.repeats * args.requests, args.tokens)
    ours = {}
    if "ours" in results:
        ours["ours"] = args.next_visit_path
    if "ours-transitions" in results:
        ours["ours-transitions"] = None
    # A token's compute: its time less its wait for experts (mean per decode token), lru's and ours'.
    compute = [
        1.0 / results[name]["tokens_per_s"] - results[name]["stall_s_per_decode_token"]
        for name in ("lru", *ours)
        if results[name].get("tokens_per_s") and results[name].get("stall_s_per_decode_token") is not None
    ]
    compute = [c for c in compute if c > 0]
    slots = budget // manifest.blob_bytes
    started = time.perf_counter()
    timing = None
    if store_reads and compute and results["lru"].get("tokens_per_s"):
        timing = measured_timing(
            manifest,
            link_bytes_per_s=store_reads["four_in_flight"]["gb_per_s"] * 1e9,
            compute_s_per_token=sum(compute) / len(compute),
            read_latency_s=store_reads["alone"]["latency_ms_p50"] / 1e3,
            decision_lag_s=prefetch_start_delay_s(results.get("ours", {})),
        )
        timing = fit_disk(routes, manifest, slots, timing, 1e3 / results["lru"]["tokens_per_s"])
    depth = args.layer_ahead_depth or ComputeConfig().layer_ahead_depth
    drop = ForcedRoutingConfig().force_routing_accuracy_drop_per_depth
    accuracy = tuple(modelled_accuracy(args.layer_ahead_accuracy, drop, d) for d in range(1, depth + 1))
    eviction_only = {"ours-eviction": args.next_visit_path} if "ours-eviction" in results else {}
    simulated = simulate(
        routes,
        manifest,
        slots,
        ours=ours,
        lookahead_accuracy=accuracy,
        timing=timing,
        eviction_only=eviction_only,
        prefetch_config=None
        if args.prefetch_min_probability is None
        else PrefetchConfig(min_probability=args.prefetch_min_probability),
    )
    say("")
    say(
        f"simulated on the same routing (trace requests {routes.requests[0]}..{routes.requests[-1]}, {args.tokens} "
        f"tokens each, {slots} slots; replay.simulator, "
        + (
            "timing model cpu-e2e calibrated on this run: " + "; ".join(timing.notes)
            if timing is not None
            else "bytes only: no store reads measured (--store-reads 0) or no decode times to calibrate its timing "
            "model on"
        )
        + f"; {time.perf_counter() - started:.1f} s):"
    )
    measured_ms = {name: 1e3 / r["tokens_per_s"] for name, r in results.items() if r.get("tokens_per_s")}
    say(
        f"  {'system':<18}{'MiB/tok':>9}{'measured':>10}{'x lru':>8}{'ms/tok':>9}{'measured':>10}{'x lru':>7}"
    )
    sim_lru = simulated["lru"]
    for system, sim in simulated.items():
        measured = results.get(system, {}).get("bytes_per_token")
        lat = sim["latency_ms_per_token"]
        speedup = sim_lru["latency_ms_per_token"] / lat if lat else None
        say(
            f"  {system:<18}{sim['bytes_per_token'] / MIB:>9.1f}{fmt(measured and measured / MIB, '>10.1f'):>10}"
            f"{sim['bytes_per_token'] / sim_lru['bytes_per_token']:>8.3f}"
            f"{fmt(lat, '>9.1f'):>9}{fmt(measured_ms.get(system) if lat else None, '>10.1f'):>10}"
            f"{fmt(speedup, '>7.2f'):>7}"
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
    errors = timing_errors({k: {"ms_per_token": v} for k, v in measured_ms.items()}, simulated)
    if errors is not None:
        verdict = "PASS" if errors["within_tolerance"] and errors["same_order"] else "FAIL"
        say(
            "the simulator against the measurement (mean ms per decode token): "
            + ", ".join(
                f"{name} {r['simulated_ms']:.1f} vs {r['measured_ms']:.1f} ({r['error']:+.0%})"
                for name, r in errors["systems"].items()
            )
            + f"; {'the same order' if errors['same_order'] else 'NOT the measured order'} "
            f"(goal: each within {errors['tolerance']:.0%}, the same order) {verdict}"
        )
        errors["verdict"] = verdict
    return {
        "requests": list(routes.requests),
        "slots": slots,
        "calibrated": timing is not None,
        "timing": None if timing is None else {"name": timing.name, "notes": list(timing.notes)},
        "timing_errors": errors,
        "lookahead_accuracy": list(accuracy),
        "systems": simulated,
        "shares": share,
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
        "--llama-budget-tokens",
        type=int,
        default=24,
        help="tokens per request for llama.cpp-budget (it pages its GGUF from the disk: about a second a token here)",
    )
    parser.add_argument(
        "--budget-share",
        default="0.25",
        help="expert memory budget of every system, as a share of the expert total in encoded bytes; "
        "a comma-separated list (0.1,0.25,0.5) runs the benchmark at each and prints ours vs lru per share",
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
    add_tier_arguments(parser)
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
        "--prefetch-min-probability",
        type=float,
        default=None,
        metavar="BAR",
        help="ours' prefetch bar (the daemon's live prefetch_min_probability, 0 to 1; default: the daemon's "
        "own). The --baseline checkout keeps its own default, so that --baseline pointing at this same "
        "checkout measures a bar against the default side by side: bytes read against misses hidden",
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
    parser.add_argument(
        "--next-visit-iterations",
        type=int,
        default=DEFAULT_FIT_ITERATIONS,
        help="with --next-visit-model fit: optimizer iterations per layer (fewer: a faster, rougher "
        "model; the smoke test's)",
    )
    add_model_arguments(parser, hidden=512, intermediate=1280, precision="mxfp4")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--progress-every", type=int, default=8)
    parser.add_argument(
        "--store-reads",
        type=int,
        default=128,
        help="random expert reads that measure the disk before the systems run, one at a time and "
        "then 4 in flight (the disk time per token is printed from them); 0 = skip",
    )
    parser.add_argument(
        "--store-pass",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="read every blob of the store once before the systems run, so that the storage's own "
        "caches beneath O_DIRECT (a virtual disk's host cache) favour none of them (on a VM here the "
        "first system to read a cold store ran its first tokens up to 15x slower)",
    )
    parser.add_argument("--min-ratio", type=float, default=4.0, help="required expert total / budget")
    parser.add_argument(
        "--cgroups",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run each system in a memory cgroup of its own, limited to its measured baseline + its "
        "budget + headroom (page cache charged); where none can be made the run goes on without",
    )
    parser.add_argument(
        "--spare",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="start an lru system first and keep it up, never measured: the first system started runs "
        "5-12%% slower than an identical one started after it",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of compute and of accelerate, llama.cpp's threads",
    )
    add_check_tokens_argument(parser)
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        metavar="DIR",
        help=f"another checkout of this project (with its .venv: make install there) whose ours runs "
        f"beside this one's as {BASELINE!r}, taking turns in the same rounds: a change measured side by "
        "side on the same disk and CPU, which drift from one run to the next by more than most changes",
    )
    parser.add_argument(
        "--baseline-first",
        action="store_true",
        help=f"start {BASELINE!r} before this checkout's systems instead of after them: of two identical "
        "checkouts, the one started first runs 5-9%% slower, so an A/B is read as the geometric mean "
        "of a run in each order",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        metavar="DIR",
        help="record the daemon and compute of ours, lru and resident with py-spy over the measured "
        "requests (raw stacks under DIR) and print where each spends its CPU (bench/profile.py)",
    )
    parser.add_argument(
        "--tracing-costs",
        action="store_true",
        help="instead of the systems: ours with tracing off, on at the default layer ratio, on at full "
        "sampling (OTLP/gRPC to an in-process receiver); prints the per-token p50 of each",
    )
    args = parser.parse_args(argv)
    try:
        shares = parse_shares(args.budget_share)
    except ValueError as exc:
        parser.error(str(exc))
    if len(shares) > 1:
        if args.budget_mib is not None:
            parser.error("--budget-mib fixes one budget: it cannot go with a list of --budget-share")
        # Each run takes the sweep's own arguments; its --budget-share and --out come last (and win).
        return run_sweep(list(sys.argv[1:] if argv is None else argv), shares, args.out, main)
    args.budget_share = shares[0]
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(systems) - set(SYSTEMS) - set(EXTRA_SYSTEMS))
    if unknown or not systems:
        parser.error(f"--systems {args.systems!r}: choose from {', '.join(SYSTEMS + EXTRA_SYSTEMS)}")
    systems = llama_cpp.checked_systems(parser, args, systems)
    if args.baseline is not None:
        check_baseline(parser, args.baseline)
        # Started (and first in the rotation) in this place: see --baseline-first.
        if args.baseline_first:
            systems.insert(0, BASELINE)
        else:
            systems.append(BASELINE)
    elif args.baseline_first:
        parser.error("--baseline-first needs --baseline")
    args.systems = ",".join(systems)
    if not 0 <= args.store_reads <= 100_000:
        parser.error(f"--store-reads must be in [0, 100000], got {args.store_reads}")
    if args.prefetch_min_probability is not None and not 0.0 <= args.prefetch_min_probability <= 1.0:
        parser.error(f"--prefetch-min-probability must be in [0, 1], got {args.prefetch_min_probability}")
    if not 0 <= args.layer_ahead_depth <= 64:
        parser.error(
            f"--layer-ahead-depth must be in [1, 64] (0: compute's default), got {args.layer_ahead_depth}"
        )
    if not 2 <= args.llama_budget_tokens <= 100_000:
        parser.error(f"--llama-budget-tokens must be in [2, 100000], got {args.llama_budget_tokens}")
    if args.repeats < 1 or args.requests < 1:
        parser.error(f"--repeats and --requests must be >= 1, got {args.repeats} and {args.requests}")
    if args.host_share is not None and not 0.0 <= args.host_share < 1.0:
        parser.error(f"--host-share {args.host_share} is out of range [0, 1)")
    if not args.trace.is_file():
        parser.error(f"--trace {args.trace} does not exist")
    baseline = None
    if args.compare_with is not None:
        try:
            baseline = json.loads(args.compare_with.read_text())
        except (OSError, ValueError) as exc:
            parser.error(f"--compare-with {args.compare_with}: {exc}")

    use_torch_threads(args.threads)  # every process's, compute's and accelerate's
    started = time.perf_counter()
    checkpoint, store, manifest = build_from_args(args)
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
        f"{args.layer_ahead_depth or ComputeConfig().layer_ahead_depth} MoE layers, ours' prefetch bar "
        f"{ours_bar(args):g}"
        + (" (the baseline checkout: its own default)" if args.baseline is not None else "")
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
    gguf = llama_cpp.convert_or_drop(
        parser, args, systems, checkpoint, args.precision, total + manifest.dense_bytes, total
    )
    passed = None
    if args.store_pass:
        passed = store_pass(store, manifest)
        say(
            f"store pass: every blob read once before the systems (O_DIRECT, 4 in flight), "
            f"{passed['bytes'] / GIB:.2f} GiB in {passed['seconds']:.1f} s ({passed['gb_per_s']:.2f} GB/s): "
            "the storage's own caches beneath O_DIRECT start alike for every system"
        )
    store_reads = measure_store_reads(store, manifest, args.store_reads)
    link = measure_link(manifest, args.device)

    with tempfile.TemporaryDirectory(prefix="e2e-", dir=args.data_dir) as tmp:
        accelerate_runs: list[dict] = []
        with all_stopped() as spare, all_stopped() as started_systems:
            if args.spare:
                say(
                    f"[{SPARE}] started first and kept up, never measured (the first system started runs slow)"
                )
                spare[SPARE] = ProcessSystem(
                    "lru", store, manifest, Path(tmp) / SPARE, args, budget, label=SPARE
                )
            # All up at once, to take turns below; but llama.cpp-budget, which starts once the others
            # are done (begin_paging).
            for system in systems:
                if system == llama_cpp.BUDGETED:
                    continue
                if system == "transformers":
                    say(
                        f"[transformers] {checkpoint} loaded by transformers on {args.device}, every expert in memory"
                    )
                if system in PEERS:
                    started_systems[system] = start_peer(system, checkpoint, gguf, args, budget)
                elif system == BASELINE:
                    say(f"[{BASELINE}] ours of the checkout {args.baseline}")
                    proc = ProcessSystem(
                        "ours",
                        store,
                        manifest,
                        Path(tmp) / system,
                        args,
                        budget,
                        checkout=args.baseline,
                        label=system,
                    )
                    started_systems[system] = proc
                elif system != "accelerate":
                    proc = ProcessSystem(system, store, manifest, Path(tmp) / system, args, budget)
                    started_systems[system] = proc
                    if not proc.io_mode.lower().startswith("o_direct"):
                        say(f"  WARNING: the daemon reads the store as {proc.io_mode!r}, not O_DIRECT")
            # llama.cpp-budget pages its GGUF from the disk, hundreds of MiB a token: it would slow
            # the disk for whoever comes after it, so its warm-up and its turns follow everyone's.
            last = [system for system in systems if system == llama_cpp.BUDGETED]
            turns = [system for system in systems if system not in last]
            for proc in started_systems.values():  # accelerate starts a process per run
                proc.begin()

            def measure(system: str, repeat: int, r: int) -> None:
                if system != "accelerate":
                    started_systems[system].measure(repeat, r)
                elif r == 0:  # its own process per run: one run (of its requests) per repeat
                    run = run_accelerate(checkpoint, Path(tmp) / system, args, budget + manifest.dense_bytes)
                    run["repeat"] = repeat
                    accelerate_runs.append(run)

            # Interleaved: request r of every system before request r + 1 of any, the order of the
            # systems rotated each repeat, so that drift of the machine and the disk hits all alike.
            if turns:
                take_turns(turns, args, measure)
            done: dict[str, dict] = {}
            if last:
                say(f"{', '.join(last)}: after the others (it pages from the disk they read)")
                done = begin_paging(
                    started_systems, last, lambda system: start_peer(system, checkpoint, gguf, args, budget)
                )
                take_turns(last, args, measure)
            # transformers_answer: its greedy tokens, where it ran, for llama.cpp's
            results, transformers_answer = finish_all(started_systems)
            results.update(done)
        if accelerate_runs:
            results["accelerate"] = merge_accelerate(accelerate_runs)
        results = {system: results[system] for system in systems}
        for r in results.values():
            r.update(summarise(r))

    print_systems(results, systems)
    print_profiles(results)
    if store_reads:
        print_disk_time(results, store_reads)
    print_tiers_and_ceilings(results, store_reads, link)
    verdicts = judge(results, args.precision)
    if BASELINE in results:
        verdicts["ours_vs_baseline"] = print_baseline(results, BASELINE, args.baseline, args.baseline_first)
    verdicts["memory"] = print_memory(results)
    verdicts.update(llama_cpp_figures(results, args, checkpoint, transformers_answer, args.precision))
    reference = simulated_reference(args, manifest, budget, results, store_reads)
    if reference is not None:
        verdicts["belady_share"] = reference["shares"]
        if reference["timing_errors"] is not None:
            verdicts["simulator"] = reference["timing_errors"]
    shares = gap_shares(results)
    if shares:
        verdicts["share_of_lru_resident_gap"] = shares
        print_gap_shares(results, shares)
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
        "baseline_first": bool(args.baseline is not None and args.baseline_first),
        "tokens": args.tokens,
        "accelerate_tokens": args.accelerate_tokens,
        "llama_budget_tokens": args.llama_budget_tokens,
        "layer_ahead_accuracy_modelled": args.layer_ahead_accuracy,
        "layer_ahead_depth": args.layer_ahead_depth or ComputeConfig().layer_ahead_depth,
        "prefetch_min_probability": ours_bar(args),
        "page_cache": "store: O_DIRECT; accelerate: posix_fadvise(POSIX_FADV_DONTNEED) on offload folder and "
        "checkpoint after load and after every token; compute dense file after start-up",
        "store_pass": passed,
        "store_reads": store_reads,
        "link": link,
        "cpu_count": os.cpu_count(),
        "torch_threads": args.threads,
        "systems": results,
        "simulated_reference": reference,
        "verdicts": verdicts,
        "wall_s": time.perf_counter() - started,
    }
    write_json(args.out, report)
    say(f"wrote {args.out} ({report['wall_s']:.0f} s in all)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
