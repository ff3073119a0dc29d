"""bench.e2e's ours-eviction ablation (ours' policy on ours' signals, no prefetch, no lookahead) is
a known system and is judged against lru: the speed-up per token, per repeat, and the bytes."""

from __future__ import annotations

import pytest

from bench import e2e, e2e_report


def ran(p50_s: float, repeats: list[float], bytes_per_token: float) -> dict:
    return {
        "p50_s": p50_s,
        "latencies_by_repeat_s": [[p] for p in repeats],
        "bytes_per_token": bytes_per_token,
    }


def test_ours_eviction_is_an_extra_system_judged_against_lru(capsys):
    assert "ours-eviction" in e2e.EXTRA_SYSTEMS and "ours-eviction" not in e2e.SYSTEMS
    results = {"ours-eviction": ran(0.08, [0.08, 0.1], 30.0), "lru": ran(0.1, [0.12, 0.1], 40.0)}
    verdict = e2e_report.judge(results, "mxfp4")["ours_eviction_vs_lru"]
    assert verdict["p50_speedup"] == pytest.approx(1.25)
    assert verdict["per_repeat"] == pytest.approx([1.5, 1.0])
    assert verdict["bytes_ratio"] == pytest.approx(0.75)
    printed = capsys.readouterr().out
    assert "ours-eviction vs lru (ours' eviction alone: no prefetch, no lookahead): 1.25x faster" in printed
    # Without lru beside it there is nothing to judge.
    assert "ours_eviction_vs_lru" not in e2e_report.judge(
        {"ours-eviction": results["ours-eviction"]}, "mxfp4"
    )
