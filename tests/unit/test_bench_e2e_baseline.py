"""``bench.e2e --baseline DIR``: another checkout's ours in the same rounds as this one's. A
checkout that cannot run is a usage error naming what is missing; the comparison is printed from
both systems' figures, repeat by repeat."""

from __future__ import annotations

import pytest

from bench import e2e
from bench.e2e_report import print_baseline

MIB = 1 << 20


def test_a_baseline_that_cannot_run_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        e2e.main(["--baseline", str(tmp_path / "nowhere"), "--systems", "ours,lru"])
    assert exit_.value.code == 2 and "has no .venv/bin/python: run `make install`" in capsys.readouterr().err
    (tmp_path / "other" / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / "other" / ".venv" / "bin" / "python").write_text("")
    with pytest.raises(SystemExit) as exit_:
        e2e.main(["--baseline", str(tmp_path / "other"), "--systems", "ours,lru"])
    assert exit_.value.code == 2 and "no replay/forced_compute.py" in capsys.readouterr().err


def result(p50_ms_by_repeat: list[float], mib: float, misses: float, daemon_ms: float) -> dict:
    latencies = [[ms / 1e3] * 5 for ms in p50_ms_by_repeat]
    return {
        "p50_s": sorted(x for r in latencies for x in r)[len(latencies) * 5 // 2],
        "latencies_by_repeat_s": latencies,
        "bytes_per_token": mib * MIB,
        "misses_per_decode_token": misses,
        "cpu_s_per_token": {"daemon": daemon_ms / 1e3, "compute": 0.01},
    }


def test_the_comparison_is_repeat_by_repeat(capsys):
    results = {
        "ours": result([40.0, 50.0, 44.0], 32.0, 27.0, 20.0),
        "baseline-ours": result([44.0, 50.0, 55.0], 33.0, 28.0, 25.0),
    }
    verdict = print_baseline(results, "baseline-ours", "/work/base")
    assert verdict["per_repeat"] == pytest.approx([1.1, 1.0, 1.25])
    assert verdict["daemon_cpu_s_per_token"] == pytest.approx({"ours": 0.020, "baseline-ours": 0.025})
    out = capsys.readouterr().out
    assert "ours vs baseline-ours (/work/base): 1.136x faster per token (p50)" in out  # 50 / 44 ms
    assert "median 1.100, min 1.000, max 1.250 over 3 repeats" in out
    assert "daemon CPU per token 20.0 vs 25.0 ms" in out


def test_a_prefetch_bar_goes_to_this_checkouts_ours_alone():
    """``--prefetch-min-probability``: ours' daemon runs under it; lru, ours without prefetch and
    the baseline checkout's ours keep their own, so ``--baseline`` at this checkout measures the bar
    against the default."""
    from argparse import Namespace

    from bench.systems import daemon_args

    args = Namespace(next_visit_path=None, prefetch_min_probability=0.85)
    assert daemon_args("ours", args) == [
        "--eviction-policy",
        "activation-aware",
        "--prefetch",
        "--prefetch-min-probability",
        "0.85",
    ]
    assert "--prefetch-min-probability" not in daemon_args("ours", args, baseline=True)
    assert daemon_args("lru", args) == ["--eviction-policy", "lru", "--no-prefetch"]
    assert "--prefetch-min-probability" not in daemon_args("ours-eviction", args)
    assert "--prefetch-min-probability" not in daemon_args("ours", Namespace(next_visit_path=None))


@pytest.mark.parametrize("bad", ["1.5", "-0.1"])
def test_a_prefetch_bar_out_of_range_is_a_usage_error(bad, capsys):
    with pytest.raises(SystemExit) as exit_:
        e2e.main(["--prefetch-min-probability", bad, "--systems", "ours,lru"])
    assert exit_.value.code == 2
    assert f"--prefetch-min-probability must be in [0, 1], got {float(bad)}" in capsys.readouterr().err


def test_the_comparison_says_which_was_started_first(capsys):
    results = {
        "ours": result([40.0], 32.0, 27.0, 20.0),
        "baseline-ours": result([44.0], 33.0, 28.0, 25.0),
    }
    assert print_baseline(results, "baseline-ours", "/b")["started_first"] == "ours"
    assert "started first: ours" in capsys.readouterr().out
    assert (
        print_baseline(results, "baseline-ours", "/b", baseline_first=True)["started_first"]
        == "baseline-ours"
    )
    assert "started first: baseline-ours" in capsys.readouterr().out


def test_baseline_first_needs_a_baseline(capsys):
    with pytest.raises(SystemExit) as exit_:
        e2e.main(["--baseline-first", "--systems", "ours,lru"])
    assert exit_.value.code == 2 and "--baseline-first needs --baseline" in capsys.readouterr().err
