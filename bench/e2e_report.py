"""What ``bench.e2e`` prints and plots of its measurements: the table of the systems, where their
time goes (CPU, the wait for experts, the disk, the link), the verdicts against the goals, each
system's share of the gap between lru and resident, and a previous run (``--compare-with``)
beside this one."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bench import llama_cpp
from bench.report import MIB, fmt, p50_bars, pyplot, save_figure, say
from bench.stats import repeat_p50s, repeat_ratios, spread_text

GOAL_VS_ACCELERATE = 10.0
GOAL_VS_ACCELERATE_BY_PRECISION = {"mxfp4": 15.0}  # experts at the checkpoint's precision
GOAL_VS_LRU = 1.3
# llama.cpp held to the same expert memory (its GGUF mapped, experts paged in from the file).
GOAL_VS_LLAMA_CPP_BUDGET = 2.0
# The systems that run without the cache (each expert in its own memory, or its own paging).
UNCACHED = ("transformers", *llama_cpp.SYSTEMS)
GOAL_BYTES_VS_LRU = 0.75  # ours' MiB read per token / LRU's
GOAL_BYTES_VS_BF16 = 0.3  # ours' MiB read per token, mxfp4 run / bf16 run


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
        if not r.get("p50_s") or system in UNCACHED:  # no cache: no place on that scale
            continue
        per = [
            (a - x) / (a - b)
            for a, b, x in zip(lru_r, res_r, repeat_p50s(r), strict=False)
            if a > b  # a repeat where resident was not the faster has no gap to share
        ]
        out[system] = {"share": (lru - r["p50_s"]) / (lru - resident), "per_repeat": per}
    return out


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
    plt = pyplot()
    systems = [s for s in results if results[s].get("p50_s")]
    panels = 1 + bool(shares) + bool(reference)
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4.2), squeeze=False)
    ax = axes[0][0]
    p50_bars(ax, results, systems, "%.0f")
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
    save_figure(fig, path)


def write_comparison_png(results: dict, baseline: dict, precision: str, other: str, path: Path) -> None:
    """Bars of MiB read per token and p50 per token, per system, this run beside the baseline."""
    plt = pyplot()
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
    save_figure(fig, path)


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


def print_systems(results: dict, systems: list[str]) -> None:
    """The table of the systems (p50, p99, tokens per second, bytes in, hit rate), then
    where the daemon-backed systems' time goes: CPU per token, the wait for experts, the
    prefetches."""
    say("")
    say(
        f"{'system':<18}{'p50 ms':>10}{'p99 ms':>10}{'tok/s':>8}{'MiB in/tok':>14}{'hit rate':>10}{'tokens':>8}  io"
    )
    for system in systems:
        r = results[system]
        bpt = r.get("bytes_per_token")
        io = r.get(
            "store_io_mode",
            {
                "accelerate": "buffered+fadvise(DONTNEED) per token",
                llama_cpp.SYSTEM: "GGUF mmap, every expert in memory",
                llama_cpp.BUDGETED: "GGUF mmap, no repacking, paged from the file",
            }.get(system, "-"),
        )
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
    for system in ("ours", "ours-transitions", "ours-eviction", "lru", "resident"):
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


def print_memory(results: dict) -> dict:
    """Each system's memory cgroup (limit = baseline + budget + headroom), its peak and its OOM
    kills, printed; Accelerate must have read from storage (bytes > 0), or it ran on more memory
    than its budget. The verdicts."""
    verdicts: dict = {}
    confined = {name: r["memory"] for name, r in results.items() if r.get("memory", {}).get("cgroup")}
    for name, r in results.items():
        memory = r.get("memory") or {"note": "not measured"}
        if memory.get("cgroup") is None:
            say(f"  memory {name:<12} {memory.get('note', 'not confined')}")
            continue
        peak = memory["peak_bytes"]
        say(
            f"  memory {name:<12} limit {memory['limit_bytes'] / MIB:8.0f} MiB (baseline "
            f"{memory['baseline_bytes'] / MIB:.0f} + budget {memory['budget_bytes'] / MIB:.0f} + headroom "
            f"{memory['headroom_bytes'] / MIB:.0f}), peak {fmt(peak / MIB if peak is not None else None, '.0f')} MiB, "
            f"OOM kills {memory['oom_kills']}"
        )
    if confined:
        verdicts["every_system_confined"] = sorted(confined) == sorted(results)
        verdicts["oom_kills"] = {name: m["oom_kills"] for name, m in confined.items()}
    if "accelerate" in results:
        read = results["accelerate"].get("bytes_per_token") or 0.0
        verdict = "PASS" if read > 0 else "FAIL"
        verdicts["accelerate_reads_storage"] = {"bytes_per_token": read, "verdict": verdict}
        say(
            f"accelerate read {read / MIB:.2f} MiB per token from storage (must be > 0: held to its budget) {verdict}"
        )
    return verdicts


def print_disk_time(results: dict, store_reads: dict) -> None:
    """Each daemon-backed system's disk time per token (``add_disk_time``) and its share of the
    system's p50."""
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


def print_baseline(results: dict, baseline: str, checkout, baseline_first: bool = False) -> dict:
    """This checkout's ours against ``baseline`` (another checkout's ours, in the same rounds):
    p50 ratio with its spread over the repeats, bytes, misses, and the daemon's CPU per token,
    and which of the two was started first (``baseline_first``: the baseline), which runs slower."""
    ours, base = results["ours"], results[baseline]
    speedup = base["p50_s"] / ours["p50_s"] if ours["p50_s"] and base["p50_s"] else None
    per_repeat = repeat_ratios(base, ours)
    cpu = {name: r["cpu_s_per_token"]["daemon"] for name, r in (("ours", ours), (baseline, base))}
    say(
        f"ours vs {baseline} ({checkout}): {fmt(speedup, '.3f')}x faster per token (p50), per repeat "
        f"{spread_text(per_repeat, '.3f')}; MiB in per token {ours['bytes_per_token'] / MIB:.1f} vs "
        f"{base['bytes_per_token'] / MIB:.1f}; misses per decode token {ours['misses_per_decode_token']:.1f} vs "
        f"{base['misses_per_decode_token']:.1f}; daemon CPU per token {cpu['ours'] * 1e3:.1f} vs "
        f"{cpu[baseline] * 1e3:.1f} ms; started first: {baseline if baseline_first else 'ours'} (the one "
        "started first runs a few % slower: read an A/B as the geometric mean of both orders, --baseline-first)"
    )
    return {
        "p50_speedup": speedup,
        "per_repeat": per_repeat,
        "daemon_cpu_s_per_token": cpu,
        "started_first": baseline if baseline_first else "ours",
    }


def judge(results: dict, precision: str) -> dict:
    """The verdicts on the systems that ran against the goals, printed: resident against
    transformers, ours against accelerate and lru, the learned next-visit model against the
    routing transitions, ours' bytes against lru's, and ours' eviction alone against lru."""
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
        goal_accelerate = GOAL_VS_ACCELERATE_BY_PRECISION.get(precision, GOAL_VS_ACCELERATE)
        for other, goal in (
            ("accelerate", goal_accelerate),
            ("lru", GOAL_VS_LRU),
            (llama_cpp.BUDGETED, GOAL_VS_LLAMA_CPP_BUDGET),
        ):
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
    eviction = results.get("ours-eviction")
    lru = results.get("lru")
    if eviction is not None and lru is not None and eviction["p50_s"] and lru["p50_s"]:
        speedup = lru["p50_s"] / eviction["p50_s"]
        per_repeat = repeat_ratios(lru, eviction)
        bytes_ratio = eviction["bytes_per_token"] / lru["bytes_per_token"]
        verdicts["ours_eviction_vs_lru"] = {
            "p50_speedup": speedup,
            "per_repeat": per_repeat,
            "bytes_ratio": bytes_ratio,
        }
        say(
            f"ours-eviction vs lru (ours' eviction alone: no prefetch, no lookahead): {speedup:.2f}x faster "
            f"per token (p50), per repeat {spread_text(per_repeat)}; {bytes_ratio:.3f}x the MiB per token"
        )
    return verdicts


def print_gap_shares(results: dict, shares: dict) -> None:
    """``gap_shares`` printed, with the p50s of lru and resident that bound the gap."""
    lru_ms, res_ms = results["lru"]["p50_s"] * 1e3, results["resident"]["p50_s"] * 1e3
    say(
        f"share of the gap between lru ({lru_ms:.1f} ms) and resident ({res_ms:.1f} ms, every expert in "
        "memory: the compute-bound floor) that each system closes, (lru - system) / (lru - resident), p50:"
    )
    for system, share in shares.items():
        say(f"  {system:<18}{share['share']:>7.2f}   per repeat {spread_text(share['per_repeat'])}")
