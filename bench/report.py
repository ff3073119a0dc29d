"""How the benchmarks print and write what they measured: one line at a time, flushed (a run
takes minutes and is read while it runs), numbers that may be missing, the result JSON, and the
PNG figures; and where they keep things: ``bench/results/`` what they measured,
``bench/.data/`` the checkpoints and stores they build once."""

from __future__ import annotations

import json
from pathlib import Path

MIB = 1 << 20
GIB = 1 << 30
RESULTS_DIR = Path(__file__).resolve().parent / "results"
DATA_DIR = Path(__file__).resolve().parent / ".data"


def say(msg: str) -> None:
    print(msg, flush=True)


def fmt(value, spec: str, missing: str = "-") -> str:
    """``value`` formatted with ``spec``, or ``missing`` for None (a figure a run did not get)."""
    return missing if value is None else format(value, spec)


def write_json(path: Path, report: dict, *, indent: int = 1) -> None:
    """The run's report as JSON at ``path`` (its folder made first)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=indent))


def pyplot():
    """matplotlib's pyplot on the Agg backend: the benchmarks write files, no display is needed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path, dpi: int = 110) -> None:
    """Lay out ``fig``, write it to ``path`` (its folder made first) and free it."""
    plt = pyplot()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def p50_bars(ax, results: dict, systems: list[str], label: str) -> None:
    """Per-token p50 of each of ``systems`` as bars, ms, whiskers from the lowest to the highest
    repeat's p50; ``label``: the bars' number format."""
    import numpy as np

    from bench.stats import repeat_p50s

    p50 = np.array([results[s]["p50_s"] * 1e3 for s in systems])
    lo = np.array([min(repeat_p50s(results[s]) or [results[s]["p50_s"]]) * 1e3 for s in systems])
    hi = np.array([max(repeat_p50s(results[s]) or [results[s]["p50_s"]]) * 1e3 for s in systems])
    bars = ax.bar(systems, p50, yerr=[np.maximum(p50 - lo, 0), np.maximum(hi - p50, 0)], capsize=4)
    ax.bar_label(bars, fmt=label, fontsize=8)
