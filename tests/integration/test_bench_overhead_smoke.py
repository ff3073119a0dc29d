"""A tiny, fast run of the fixed-costs benchmark (bench.overhead), all real processes: resident,
lru with every expert in a host tier, and transformers itself, interleaved; the JSON has every
figure the issue asks for, each equal to its definition."""

from __future__ import annotations

import json

import pytest

from bench import e2e, overhead

pytestmark = pytest.mark.integration
needs_trace = pytest.mark.skipif(
    not e2e.DEFAULT_TRACE.is_file(), reason=f"{e2e.DEFAULT_TRACE} is not present"
)


@needs_trace
def test_overhead_harness_reports_every_figure(tmp_path, capsys):
    out = tmp_path / "overhead.json"
    args = [
        "--tokens",
        "4",
        "--requests",
        "1",
        "--repeats",
        "2",
        "--data-dir",
        str(tmp_path),
        "--out",
        str(out),
    ]
    assert overhead.main([*args, "--systems", "resident,lru,transformers,ours-resident"]) == 0
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
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
    assert out.with_suffix(".png").stat().st_size > 0
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
