"""A budget sweep of ``bench.e2e``: ``--budget-share 0.1,0.25,0.5`` runs the benchmark once per
share (each run whole: its systems, its interleaving, its JSON beside ``--out``) and then prints
ours against lru at every share, with a plot. The goal: ours never slower than lru at any share.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from bench.report import fmt, pyplot, save_figure, say, write_json

GOAL_VS_LRU_EVERY_SHARE = 1.0


def parse_shares(text: str) -> list[float]:
    """``0.25`` or ``0.1,0.25,0.5``: each share in (0, 1], distinct, ascending; ValueError naming
    what is wrong."""
    try:
        shares = [float(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(
            f"--budget-share {text!r}: not a number or a comma-separated list of numbers"
        ) from None
    bad = [s for s in shares if not 0.0 < s <= 1.0]
    if bad:
        raise ValueError(f"--budget-share {text!r}: {bad[0]} is out of range (0, 1]")
    if len(set(shares)) != len(shares):
        raise ValueError(f"--budget-share {text!r}: a share is given twice")
    return sorted(shares)


def share_out(out: Path, share: float) -> Path:
    """Where the run at ``share`` writes its JSON: beside ``out``, the share in its name (and
    ``.json`` where ``out`` has no suffix, so that each run's PNG beside it keeps the share)."""
    return out.with_name(f"{out.stem}-share{share:g}{out.suffix or '.json'}")


def run_sweep(argv: list[str], shares: list[float], out: Path, run: Callable[[list[str]], int]) -> int:
    """``run`` (``bench.e2e.main``) at each share, then the sweep's table, JSON (``out``) and
    PNG. The experts need only exceed the budget (``--min-ratio 1``) at the larger shares."""
    rows = []
    for i, share in enumerate(shares):
        say(f"=== budget sweep {i + 1}/{len(shares)}: --budget-share {share:g} ===")
        path = share_out(out, share)
        rc = run([*argv, "--budget-share", str(share), "--out", str(path), "--min-ratio", "1"])
        if rc:
            return rc
        rows.append(sweep_row(share, json.loads(path.read_text()), path))
    say("budget sweep: ours vs lru per share (per-token p50; goal: ours >= 1.0x lru at every share)")
    say(
        f"  {'share':>6} {'budget MiB':>10} {'lru ms':>8} {'ours ms':>8} {'ours x lru':>10} {'bytes x lru':>11}"
    )
    for row in rows:
        say(
            f"  {row['share']:>6g} {row['budget_mib']:>10.0f} {fmt(row['lru_p50_ms'], '8.1f')} "
            f"{fmt(row['ours_p50_ms'], '8.1f')} {fmt(row['ours_vs_lru'], '10.3f')} "
            f"{fmt(row['bytes_vs_lru'], '11.3f')}  {row['verdict']}"
        )
    compared = [row for row in rows if row["ours_vs_lru"] is not None]
    verdict = "PASS" if compared and all(row["verdict"] == "PASS" for row in compared) else "FAIL"
    say(f"ours >= {GOAL_VS_LRU_EVERY_SHARE:g}x lru at every share: {verdict}")
    report = {"shares": shares, "rows": rows, "goal": GOAL_VS_LRU_EVERY_SHARE, "verdict": verdict}
    write_json(out, report)
    png = out.with_suffix(".png")
    write_sweep_png(rows, png)
    say(f"wrote {out} and {png}")
    return 0


def sweep_row(share: float, report: dict, path: Path) -> dict:
    """One share's figures from its run's report."""
    systems = report["systems"]
    ours, lru = systems.get("ours"), systems.get("lru")
    ratio = lru["p50_s"] / ours["p50_s"] if ours and lru and ours["p50_s"] else None
    bytes_ratio = (
        ours["bytes_per_token"] / lru["bytes_per_token"] if ours and lru and lru["bytes_per_token"] else None
    )
    return {
        "share": share,
        "budget_mib": report["budget_bytes"] / (1 << 20),
        "lru_p50_ms": lru["p50_s"] * 1e3 if lru else None,
        "ours_p50_ms": ours["p50_s"] * 1e3 if ours else None,
        "ours_vs_lru": ratio,
        "bytes_vs_lru": bytes_ratio,
        "verdict": "-" if ratio is None else "PASS" if ratio >= GOAL_VS_LRU_EVERY_SHARE else "FAIL",
        "run": str(path),
    }


def write_sweep_png(rows: list[dict], path: Path) -> None:
    """Per-token p50 of lru and ours against the budget share, and ours' speedup over lru."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    shares = [row["share"] for row in rows]
    for name in ("lru", "ours"):
        left.plot(shares, [row[f"{name}_p50_ms"] for row in rows], marker="o", label=name)
    left.set(xlabel="expert budget (share of the experts' bytes)", ylabel="per-token p50 (ms)")
    left.legend()
    right.plot(shares, [row["ours_vs_lru"] for row in rows], marker="o", color="tab:green")
    right.axhline(GOAL_VS_LRU_EVERY_SHARE, color="gray", linestyle="--", label="goal")
    right.set(xlabel="expert budget (share of the experts' bytes)", ylabel="ours' speedup over lru (p50)")
    right.legend()
    save_figure(fig, path)


__all__ = ["parse_shares", "run_sweep", "share_out", "sweep_row"]
