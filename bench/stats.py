"""The benchmarks' summaries of latencies. Three percentile rules live here, each kept as its
benchmark has always printed it (a figure must not move because the rule did): numpy's linear
interpolation for the per-token latencies of the systems (``summarise``, ``repeat_p50s``), the
nearest rank for the client-side latencies of ``bench.serve`` and ``bench.hostile``
(``percentile``), and the plain index for the microsecond timings of ``bench.io_bench``
(``percentiles_us``)."""

from __future__ import annotations

import statistics

import numpy as np


def summarise(result: dict) -> dict:
    """p50, p99 and tokens per second of ``result["latencies_s"]`` (decode tokens)."""
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


def spread_text(values: list[float], fmt: str = ".2f") -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:{fmt}} (one repeat: no spread)"
    return (
        f"median {statistics.median(values):{fmt}}, min {min(values):{fmt}}, max {max(values):{fmt}} "
        f"over {len(values)} repeats"
    )


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile of ``values``; NaN when there are none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def percentiles_us(samples_ns: list[int]) -> dict[str, float]:
    """Mean, p50 and p99 of nanosecond timings, in microseconds."""
    s = sorted(samples_ns)
    return {
        "mean_us": statistics.fmean(s) / 1e3,
        "p50_us": s[len(s) // 2] / 1e3,
        "p99_us": s[min(len(s) - 1, int(len(s) * 0.99))] / 1e3,
        "iterations": len(s),
    }
