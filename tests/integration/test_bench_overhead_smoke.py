"""A tiny, fast run of the fixed-costs benchmark (bench.overhead), all real processes: resident,
lru with every expert in a host tier, and transformers itself, interleaved; the JSON has every
figure the issue asks for, each equal to its definition."""

from __future__ import annotations

import json
import subprocess

import pytest

from bench import e2e, overhead
from bench.stats import repeat_p50s
from devtools.launch import REPO

pytestmark = pytest.mark.integration
needs_trace = pytest.mark.skipif(
    not e2e.DEFAULT_TRACE.is_file(), reason=f"{e2e.DEFAULT_TRACE} is not present"
)


def run_tiny(tmp_path, *extra: str) -> dict:
    """bench.overhead at 4 tokens, one request, two repeats; its JSON report."""
    out = tmp_path / "overhead.json"
    small = ["--tokens", "4", "--requests", "1", "--repeats", "2"]
    assert overhead.main([*small, "--data-dir", str(tmp_path), "--out", str(out), *extra]) == 0
    return json.loads(out.read_text())


@needs_trace
def test_overhead_harness_reports_every_figure(tmp_path, capsys):
    report = run_tiny(tmp_path, "--systems", "resident,lru,transformers,ours-resident")
    printed = capsys.readouterr().out
    systems = report["systems"]
    assert list(systems) == ["resident", "lru", "transformers", "ours-resident"]
    for r in systems.values():
        assert r["p50_s"] > 0 and r["tokens"] == 2 * 3 and len(r["latencies_by_repeat_s"]) == 2
    res, lru, plain = systems["resident"], systems["lru"], systems["transformers"]
    assert report["resident_vs_transformers"] == pytest.approx(res["p50_s"] / plain["p50_s"])
    assert report["lru_vs_resident"] == pytest.approx(lru["p50_s"] / res["p50_s"])
    copy_read = (lru["arena_copy_s"] + lru["store_read_s"]) / (2 * 4)
    assert report["miss_fixed_cost_us"] == pytest.approx(
        (lru["p50_s"] - res["p50_s"] - copy_read) / lru["misses_per_decode_token"] * 1e6
    )
    assert report["miss_fixed_cost_us_per_repeat"] == pytest.approx(
        [
            (a - b - copy_read) / lru["misses_per_decode_token"] * 1e6
            for a, b in zip(repeat_p50s(lru), repeat_p50s(res), strict=True)
        ]
    )
    assert len(report["miss_fixed_cost_us_per_repeat"]) == 2 and "baseline" not in report
    assert report["daemon_cpu_ms_per_token"] == pytest.approx(res["cpu_s_per_token"]["daemon"] * 1e3)
    assert report["compute_cpu_ms_per_token"] == pytest.approx(res["cpu_s_per_token"]["compute"] * 1e3)
    assert report["ours_resident_daemon_cpu_ms_per_token"] >= 0
    # One device→host transfer per MoE layer (the routing), no event waits on the CPU.
    assert report["host_syncs_per_moe_layer"] == pytest.approx(1.0)
    assert res["host_syncs"]["moe_layers"] == 2 * 4 * 24
    # lru: a quarter of the experts in the arena, every one in the host tier once warmed.
    assert (
        report["lru_arena_experts"] == 768 // 4 and lru["host_bytes"] == report["model"]["blob_bytes"] * 768
    )
    assert lru["host_bytes_per_token"] > 0 and lru["misses_per_decode_token"] > 0
    assert report["checkpoint"].endswith("checkpoint") and report["goals"]["miss_fixed_cost_us"] == 50.0
    assert (tmp_path / "overhead.png").stat().st_size > 0
    for line in (
        "resident_vs_transformers:",
        "lru_vs_resident:",
        "miss_fixed_cost_us:",
        "host_syncs_per_moe_layer",
    ):
        assert line in printed


def test_overhead_refuses_unknown_systems(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        overhead.main(["--systems", "resident,bogus", "--data-dir", str(tmp_path)])
    assert exc.value.code == 2 and "--systems 'resident,bogus'" in capsys.readouterr().err


@needs_trace
def test_a_baseline_checkout_runs_beside_this_one_in_the_same_rounds(tmp_path, capsys):
    """--baseline: another checkout's resident and lru (here this very checkout, run through its
    own .venv as a baseline is) take turns with this one's; each system's p50 over its baseline's
    is reported repeat by repeat, and the baseline's own miss figures beside ours."""
    report = run_tiny(tmp_path, "--systems", "resident,lru", "--baseline", str(REPO))
    printed = capsys.readouterr().out
    systems = report["systems"]
    assert list(systems) == ["resident", "lru", "baseline-resident", "baseline-lru"]
    for r in systems.values():
        assert r["tokens"] == 2 * 3 and len(r["latencies_by_repeat_s"]) == 2
    base = report["baseline"]
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    assert base["checkout"] == str(REPO) and base["revision"] == (head.stdout.strip() or None)
    lru, res = systems["baseline-lru"], systems["baseline-resident"]
    assert base["lru_vs_resident"] == pytest.approx(lru["p50_s"] / res["p50_s"])
    assert len(base["miss_fixed_cost_us_per_repeat"]) == 2 and base["lru_misses_per_token"] > 0
    for system in ("resident", "lru"):
        vs = report["vs_baseline"][system]
        assert vs["p50_ratio"] == pytest.approx(
            systems[system]["p50_s"] / systems[f"baseline-{system}"]["p50_s"]
        )
        assert vs["per_repeat"] == pytest.approx(
            [
                a / b
                for a, b in zip(
                    repeat_p50s(systems[system]), repeat_p50s(systems[f"baseline-{system}"]), strict=True
                )
            ]
        )
        assert f"{system} vs baseline-{system}:" in printed
    assert "baseline miss_fixed_cost_us:" in printed


def test_a_baseline_without_its_own_environment_or_too_old_is_refused(tmp_path, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    with pytest.raises(SystemExit) as exc:
        overhead.main(["--baseline", str(bare), "--data-dir", str(tmp_path)])
    assert exc.value.code == 2 and f"--baseline: {bare} has no .venv/bin/python" in capsys.readouterr().err
    (bare / ".venv" / "bin").mkdir(parents=True)
    (bare / ".venv" / "bin" / "python").write_text("")
    with pytest.raises(SystemExit) as exc:
        overhead.main(["--baseline", str(bare), "--data-dir", str(tmp_path)])
    assert exc.value.code == 2 and "has no replay/forced_compute.py" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        overhead.main(["--baseline", str(REPO), "--systems", "transformers", "--data-dir", str(tmp_path)])
    assert (
        exc.value.code == 2
        and "--baseline runs the other checkout's resident and lru" in capsys.readouterr().err
    )
