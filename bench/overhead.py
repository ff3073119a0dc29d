"""What serving through the cache costs beyond the arithmetic: ours beside plain transformers at
arithmetic-free sizes.

    python -m bench.overhead [--device cuda] [--tokens 48] [--requests 2] [--repeats 3]
                             [--baseline OTHER_CHECKOUT]
    make bench-overhead [BENCH_OVERHEAD_ARGS="--device cuda"]

The e2e model's shape (gpt-oss, 24 layers x 32 experts, top-4) with hidden and expert
intermediate sizes of 64 (``--hidden``, ``--intermediate``): a token's arithmetic is then small
enough that its time is almost all fixed costs, per layer and per miss. A checkpoint of that
shape is written by transformers' ``save_pretrained`` and converted once (``bench.gpt_oss.build``,
cached under bench/.data/). Systems, all up at once and taking turns request by request, the
order rotated each repeat (``bench.e2e``'s interleaving):

- ``resident``: real daemon and compute processes (``devtools.launch``), an arena that holds
  every expert (warmed by one unmeasured request), LRU, no prefetch: the bookkeeping of a layer
  whose experts are all resident;
- ``lru``: the same with 25% of the experts in the arena (``--device-share``) and a host tier
  that holds every expert (warmed until it does), as a GPU node with ample RAM has: each miss is a
  copy of one blob from host memory into the arena, and its cost is almost all bookkeeping;
- ``transformers``: the checkpoint run by transformers itself, every expert in memory on the
  same device (``bench.plain_transformers``), same prompt and tokens;
- ``llama.cpp``: the checkpoint converted to GGUF (bf16) and run by llama.cpp built from the
  llama-cpp-python sdist, every expert in memory (``bench.llama_cpp``; ``make llama-cpp``
  builds it; where it is not built, one line says so and the rest run): its per-token p50 and
  p99, its GGUF's bytes beside the store's, resident / llama.cpp in per-token p50, and its first
  ``--check-tokens`` greedy tokens against transformers';
- ``ours-resident`` (optional, ``--systems``): ``resident`` with ours' policy, prefetch and
  lookahead, so that compute's signals flow: the daemon's CPU per token with them.

Routing is forced from the shared trace for ours (as in ``bench.e2e``); transformers routes with
its own router (the same top-4 per layer). Every process runs ``--threads`` torch threads.
Printed, and written to bench/results/overhead.json (a plot beside it):

- ``resident_vs_transformers``: resident's per-token p50 over transformers' (goal <= 1.15 on
  the CPU, <= 1.25 on a GPU);
- ``lru_vs_resident``: lru's over resident's (goal <= 1.15);
- ``miss_fixed_cost_us``: (lru - resident - the copy and store-read time per token) per expert
  that was not resident when compute asked for it (goal <= 50): the copy time is what the daemon
  measured copying blobs into the arena (``arena_copy_seconds``), the read time its store reads;
  the same from each repeat's p50s (``miss_fixed_cost_us_per_repeat``), whose spread shows how
  far one run's figure is from the next: on a shared 2-core machine separate runs of the same
  code have printed from 8 to 148;
- ``daemon_cpu_ms_per_token`` / ``compute_cpu_ms_per_token`` of resident (goal: daemon <= 1);
- ``host_syncs_per_moe_layer``: compute's host waits for the device per MoE layer forward
  (``moe_compute_host_syncs_total`` over ``moe_compute_moe_layers_total``, from its /metrics);
- ``checkpoint``, and ``systems.NAME.p50_s`` / ``p99_s`` / per repeat for each system.

``--baseline DIR`` compares two builds side by side: DIR is another checkout of this project
(``git worktree add DIR REV``, then ``make install`` there; a revision that has
``replay/forced_compute.py``), whose ``resident`` and ``lru`` run as ``baseline-resident`` and
``baseline-lru`` beside this checkout's, in the same rounds. Printed besides: the baseline's
``lru_vs_resident`` and ``miss_fixed_cost_us``, and each system's p50 over its baseline's, per
repeat (``vs_baseline``): a change that leaves the figures unchanged shows ratios around 1, as
two separate runs cannot show it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import llama_cpp  # noqa: E402
from bench.gpt_oss import DEFAULT_TRACE, add_model_arguments, build_from_args, use_torch_threads  # noqa: E402
from bench.report import RESULTS_DIR, p50_bars, pyplot, save_figure, say, write_json  # noqa: E402
from bench.stats import repeat_p50s, repeat_ratios, spread_text, summarise  # noqa: E402
from bench.systems import (  # noqa: E402
    PEERS,
    ProcessSystem,
    add_check_tokens_argument,
    all_stopped,
    check_baseline,
    finish_all,
    get_stats,
    host_tier,
    llama_cpp_figures,
    start_peer,
    take_turns,
)
from devtools.launch import free_port  # noqa: E402

RESULTS = RESULTS_DIR / "overhead.json"
SYSTEMS = ("resident", "lru", "transformers", llama_cpp.SYSTEM)
OPTIONAL = ("ours-resident",)
BASELINE_SYSTEMS = ("resident", "lru")  # what --baseline runs of the other checkout
GOALS = {
    "resident_vs_transformers": 1.15,
    "resident_vs_transformers_gpu": 1.25,
    "lru_vs_resident": 1.15,
    "miss_fixed_cost_us": 50.0,
    "daemon_cpu_ms_per_token": 1.0,
}
MAX_WARM_UP_REQUESTS = 64


def scrape(port: int) -> dict[str, float]:
    """compute's /metrics: ``name{labels}`` -> value for the counters read here."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith(("moe_compute_host_syncs_total", "moe_compute_moe_layers_total")):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def host_syncs(before: dict[str, float], after: dict[str, float]) -> dict:
    layers = after.get("moe_compute_moe_layers_total", 0) - before.get("moe_compute_moe_layers_total", 0)
    syncs = {
        kind: after.get(f'moe_compute_host_syncs_total{{kind="{kind}"}}', 0)
        - before.get(f'moe_compute_host_syncs_total{{kind="{kind}"}}', 0)
        for kind in ("transfer", "event_wait")
    }
    total = sum(syncs.values())
    return {"moe_layers": layers, **syncs, "per_moe_layer": total / layers if layers else None}


def warm_host_tier(proc: ProcessSystem, num_blobs: int) -> int:
    """Generate (unmeasured, each on the next trace request) until the host tier holds every
    expert; returns how many requests it took (the host tier's resident count is printed)."""
    for n in range(1, MAX_WARM_UP_REQUESTS + 1):
        proc.generate(f"{proc.label}-warm-up-{n}")
        resident = host_tier(get_stats(proc.daemon.address)).resident
        if resident >= num_blobs:
            return n
    say(f"  [{proc.label}] the host tier holds {resident} of {num_blobs} experts after {n} warm-up requests")
    return n


def miss_figures(lru: dict, res: dict) -> dict:
    """lru's fixed cost per miss beyond resident's: from the two systems' p50s, and from each
    repeat's (the same rounds), the copies and store reads the daemon timed taken out."""
    tokens = max(1, len(lru["latencies_s"]) + len(lru["first_token_s"]))
    copy_read = (lru["arena_copy_s"] + lru["store_read_s"]) / tokens
    misses = lru["misses_per_decode_token"]

    def per_miss(lru_p50: float, res_p50: float) -> float:
        return (lru_p50 - res_p50 - copy_read) / misses * 1e6

    return {
        "lru_misses_per_token": misses,
        "lru_copy_and_read_ms_per_token": copy_read * 1e3,
        "lru_store_bytes_per_token": lru.get("store_bytes_per_token"),
        "miss_fixed_cost_us": per_miss(lru["p50_s"], res["p50_s"]) if misses else None,
        "miss_fixed_cost_us_per_repeat": [
            per_miss(a, b) for a, b in zip(repeat_p50s(lru), repeat_p50s(res), strict=False)
        ]
        if misses
        else [],
    }


def say_miss(key: str, figures: dict, lru: dict, res: dict) -> None:
    fixed = figures["miss_fixed_cost_us"]
    if fixed is None:
        return
    goal = GOALS["miss_fixed_cost_us"]
    say(
        f"{key}: {fixed:.0f} (goal <= {goal:g}) {'PASS' if fixed <= goal else 'FAIL'}: "
        f"({lru['p50_s'] * 1e3:.2f} - {res['p50_s'] * 1e3:.2f} - {figures['lru_copy_and_read_ms_per_token']:.2f} "
        f"ms of copies and reads) per token over {figures['lru_misses_per_token']:.1f} experts not resident "
        f"when asked for ({lru.get('store_bytes_per_token', 0) / 1024:.0f} KiB per token still read from the "
        f"store); per repeat {spread_text(figures['miss_fixed_cost_us_per_repeat'], '.0f')}"
    )


def vs_baseline(results: dict) -> dict:
    """Each system's p50 over its baseline's, overall and repeat by repeat (printed)."""
    out = {}
    for system in BASELINE_SYSTEMS:
        base = results.get(f"baseline-{system}")
        if base is None or system not in results:
            continue
        per = repeat_ratios(results[system], base)
        out[system] = {
            "p50_ratio": results[system]["p50_s"] / base["p50_s"],
            "per_repeat": per,
            "geometric_mean": statistics.geometric_mean(per) if per else None,
        }
        say(
            f"{system} vs baseline-{system}: {out[system]['p50_ratio']:.3f}; per repeat {spread_text(per, '.3f')}"
            + (f", geometric mean {out[system]['geometric_mean']:.3f}" if per else "")
        )
    return out


def revision(checkout: Path) -> str | None:
    """The baseline checkout's commit, for the report (None outside git)."""
    try:
        done = subprocess.run(
            ["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip() or None


def write_png(results: dict, report: dict, path: Path) -> None:
    plt = pyplot()
    systems = [s for s in results if results[s].get("p50_s")]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    ax = axes[0]
    p50_bars(ax, results, systems, "%.1f")
    ax.set_title("per-token p50, ms (whiskers: lowest / highest repeat)")
    ax = axes[1]
    names, vals, goals = [], [], []
    for key in ("resident_vs_transformers", "lru_vs_resident"):
        if report.get(key) is not None:
            names.append(key.replace("_vs_", "\nvs "))
            vals.append(report[key])
            goals.append(report["goals"][key])
    for system, vs in report.get("vs_baseline", {}).items():  # no goal: 1 is "unchanged"
        names.append(f"{system}\nvs baseline")
        vals.append(vs["p50_ratio"])
        goals.append(None)
    bars = ax.bar(names, vals, color=["tab:green" if g is not None else "tab:grey" for g in goals])
    ax.bar_label(bars, fmt="%.3f", fontsize=8)
    for i, g in enumerate(goals):
        if g is not None:
            ax.plot([i - 0.4, i + 0.4], [g, g], "r--")
    ax.axhline(1, color="grey", lw=0.8)
    miss = report.get("miss_fixed_cost_us")
    ax.set_title(
        "p50 ratios (red: goal)" + (f"; fixed cost per miss {miss:.0f} us" if miss is not None else "")
    )
    fig.suptitle(
        f"bench.overhead: gpt-oss shape at hidden {report['model']['hidden']}, {report['device']}, "
        f"{report['cpu_count']} CPUs, interleaved"
    )
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu, or cuda[:n] on a GPU machine")
    parser.add_argument("--tokens", type=int, default=48, help="tokens per request")
    parser.add_argument("--requests", type=int, default=2, help="requests per system per repeat")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads of every process, llama.cpp's threads"
    )
    add_check_tokens_argument(parser)
    add_model_arguments(parser, hidden=64, intermediate=64)
    parser.add_argument(
        "--device-share", type=float, default=0.25, help="lru's arena, as a share of the experts"
    )
    parser.add_argument(
        "--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {SYSTEMS + OPTIONAL}"
    )
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--request", type=int, default=0, help="first trace request")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--progress-every", type=int, default=1000)
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="another checkout (with its .venv) whose resident and lru run beside this one's",
    )
    args = parser.parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(systems) - set(SYSTEMS) - set(OPTIONAL))
    if unknown or not systems:
        parser.error(f"--systems {args.systems!r}: choose from {', '.join(SYSTEMS + OPTIONAL)}")
    if args.tokens < 2 or args.requests < 1 or args.repeats < 1:
        parser.error("--tokens must be >= 2, --requests and --repeats >= 1")
    systems = llama_cpp.checked_systems(parser, args, systems)
    args.systems = ",".join(systems)
    if not 0.0 < args.device_share < 1.0:
        parser.error(f"--device-share {args.device_share} is out of range (0, 1)")
    if not args.trace.is_file():
        parser.error(f"--trace {args.trace} does not exist")
    if args.baseline is not None:
        check_baseline(parser, args.baseline)
        if not set(BASELINE_SYSTEMS) & set(systems):
            parser.error(f"--baseline runs the other checkout's {' and '.join(BASELINE_SYSTEMS)}: choose one")
    # What ProcessSystem reads of bench.e2e's arguments: routing forced from the trace, no
    # lookahead modelling beyond ours' defaults, no learned next-visit model.
    args.layer_ahead_accuracy, args.layer_ahead_depth, args.next_visit_path, args.host_share = (
        0.85,
        0,
        None,
        None,
    )
    use_torch_threads(args.threads)
    started = time.perf_counter()
    checkpoint, store, manifest = build_from_args(args)
    total, blob = manifest.total_expert_bytes, manifest.blob_bytes
    device_bytes = max(manifest.top_k, int(args.device_share * manifest.num_blobs)) * blob
    say(
        f"model: gpt_oss {len(manifest.moe_layers)} layers x {manifest.num_experts} experts, top-{manifest.top_k}, "
        f"hidden {args.hidden}, expert intermediate {args.intermediate}, bf16; {manifest.num_blobs} experts of "
        f"{blob / 1024:.0f} KiB; {args.device}, {args.threads} torch thread(s), {os.cpu_count()} CPUs"
    )
    say(
        f"lru: arena {device_bytes // blob} experts ({device_bytes / total:.0%}), host tier every expert; "
        f"resident: arena every expert; routing forced from {args.trace.name} from request {args.request}"
    )
    gguf = llama_cpp.convert_or_drop(
        parser, args, systems, checkpoint, "bf16", total + manifest.dense_bytes, total
    )
    # (label, system, checkout): this checkout's systems, then the baseline's under their labels.
    runs = [(system, system, None) for system in systems]
    if args.baseline is not None:
        runs += [(f"baseline-{s}", s, args.baseline) for s in systems if s in BASELINE_SYSTEMS]
        say(f"baseline: {', '.join(r[0] for r in runs if r[2])} from {args.baseline}")
    labels = [r[0] for r in runs]
    ports: dict[str, int] = {}
    syncs: dict[str, dict] = {}
    warm_ups: dict[str, int] = {}  # unmeasured requests until each lru's host tier was full
    with tempfile.TemporaryDirectory(prefix="overhead-", dir=args.data_dir) as tmp, all_stopped() as running:
        for label, system, checkout in runs:
            if system in PEERS:
                running[label] = start_peer(system, checkpoint, gguf, args)
                continue
            ports[label] = free_port()
            extra = ("--metrics-port", str(ports[label]))
            sizes = {"device_bytes": device_bytes, "host_bytes": total} if system == "lru" else {}
            running[label] = ProcessSystem(
                system,
                store,
                manifest,
                Path(tmp) / label,
                args,
                device_bytes,
                compute_extra=extra,
                checkout=checkout,
                label=label,
                **sizes,
            )
        for label in ("lru", "baseline-lru"):
            if label in running:
                warm_ups[label] = warm_host_tier(running[label], manifest.num_blobs)
                say(f"[{label}] host tier warmed with {warm_ups[label]} unmeasured request(s)")
        for proc in running.values():
            proc.begin()
        before = {s: scrape(p) for s, p in ports.items()}
        take_turns(labels, args, lambda label, repeat, r: running[label].measure(repeat, r))
        syncs = {s: host_syncs(before[s], scrape(p)) for s, p in ports.items()}
        # transformers_answer: its greedy tokens, where it ran, for llama.cpp's
        results, transformers_answer = finish_all(running)
    for system, r in results.items():
        r.update(summarise(r))
        if system in syncs:
            r["host_syncs"] = syncs[system]

    say("")
    say(f"{'system':<18}{'p50 ms':>9}{'p99 ms':>9}{'tokens':>8}  CPU ms per token")
    for system in labels:
        r = results[system]
        cpu = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in r["cpu_s_per_token"].items())
        say(f"{system:<18}{r['p50_s'] * 1e3:>9.2f}{r['p99_s'] * 1e3:>9.2f}{r['tokens']:>8}  {cpu}")
    report: dict = {
        "device": args.device,
        "model": {
            "hidden": args.hidden,
            "intermediate": args.intermediate,
            "layers": len(manifest.moe_layers),
            "experts": manifest.num_experts,
            "top_k": manifest.top_k,
            "blob_bytes": blob,
        },
        "checkpoint": str(checkpoint),
        "store": str(store),
        "tokens": args.tokens,
        "requests": args.requests,
        "repeats": args.repeats,
        "threads": args.threads,
        "cpu_count": os.cpu_count(),
        "lru_arena_experts": device_bytes // blob,
        "lru_host_warm_up_requests": warm_ups.get("lru", 0),
        "goals": {
            "resident_vs_transformers": GOALS[
                "resident_vs_transformers_gpu"
                if args.device.startswith("cuda")
                else "resident_vs_transformers"
            ],
            **{k: v for k, v in GOALS.items() if not k.startswith("resident_vs")},
        },
        "systems": results,
    }

    def ratio(a: str, b: str, key: str) -> None:
        if a in results and b in results:
            value = results[a]["p50_s"] / results[b]["p50_s"]
            per = repeat_ratios(results[a], results[b])
            report[key] = value
            report[f"{key}_per_repeat"] = per
            goal = report["goals"][key]
            say(
                f"{key}: {value:.3f} (goal <= {goal:g}) {'PASS' if value <= goal else 'FAIL'}; "
                f"per repeat {spread_text(per)}"
            )

    say("")
    ratio("resident", "transformers", "resident_vs_transformers")
    ratio("lru", "resident", "lru_vs_resident")
    if "lru" in results and "resident" in results:
        report.update(miss_figures(results["lru"], results["resident"]))
        say_miss("miss_fixed_cost_us", report, results["lru"], results["resident"])
    report.update(llama_cpp_figures(results, args, checkpoint, transformers_answer, "bf16"))
    if args.baseline is not None:
        baseline = report["baseline"] = {"checkout": str(args.baseline), "revision": revision(args.baseline)}
        if "baseline-lru" in results and "baseline-resident" in results:
            lru, res = results["baseline-lru"], results["baseline-resident"]
            per = repeat_ratios(lru, res)
            baseline |= {
                "lru_vs_resident": lru["p50_s"] / res["p50_s"],
                "lru_vs_resident_per_repeat": per,
                **miss_figures(lru, res),
            }
            say(f"baseline lru_vs_resident: {baseline['lru_vs_resident']:.3f}; per repeat {spread_text(per)}")
            say_miss("baseline miss_fixed_cost_us", baseline, lru, res)
        report["vs_baseline"] = vs_baseline(results)
    for system in ("resident", "ours-resident"):
        if system in results:
            cpu = results[system]["cpu_s_per_token"]
            key = "" if system == "resident" else "ours_resident_"
            report[f"{key}daemon_cpu_ms_per_token"] = cpu["daemon"] * 1e3
            report[f"{key}compute_cpu_ms_per_token"] = cpu["compute"] * 1e3
            goal = GOALS["daemon_cpu_ms_per_token"]
            say(
                f"{system}: daemon CPU {cpu['daemon'] * 1e3:.2f} ms per token (goal <= {goal:g}"
                + (
                    ") " + ("PASS" if cpu["daemon"] * 1e3 <= goal else "FAIL")
                    if system == "resident"
                    else ", signals on)"
                )
                + f", compute CPU {cpu['compute'] * 1e3:.1f} ms per token"
            )
    if "resident" in syncs and syncs["resident"]["per_moe_layer"] is None:
        say("host_syncs_per_moe_layer: compute does not report them (a compute of an older release)")
    elif "resident" in syncs:
        per = syncs["resident"]["per_moe_layer"]
        report["host_syncs_per_moe_layer"] = per
        say(
            f"host_syncs_per_moe_layer (resident): {per:.3f} "
            f"({syncs['resident']['transfer']:.0f} transfers, {syncs['resident']['event_wait']:.0f} event waits over "
            f"{syncs['resident']['moe_layers']:.0f} MoE layer forwards)"
        )
    report["wall_s"] = time.perf_counter() - started
    png = args.out.with_suffix(".png")
    write_png(results, report, png)
    write_json(args.out, report)
    say(f"wrote {png}")
    say(f"wrote {args.out} ({report['wall_s']:.0f} s in all)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
