"""A tiny, fast run of the end-to-end benchmark harness (bench.e2e), all real processes.

A 24-layer x 32-expert top-4 gpt_oss model (the trace's shape) with tiny hidden sizes: the
daemon and compute processes for ours, lru and resident with routing forced from the real trace,
and HF Accelerate disk offload, each a few tokens, interleaved over two repeats, with the experts
in MXFP4 as gpt-oss ships them, beside a bf16 run of ours. Also: compute refuses a trace of another shape at start-up with exit
status 2.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench import e2e
from cache_daemon.decisions.next_visit import read as read_next_visit
from devtools.launch import REPO
from devtools.memory_cgroup import MemoryCgroup
from tests.procs import start_daemon

pytestmark = pytest.mark.integration

TRACE = e2e.DEFAULT_TRACE
needs_trace = pytest.mark.skipif(not TRACE.is_file(), reason=f"{TRACE} is not present")


def bytes_ratio_of(systems: dict) -> float:
    return systems["ours"]["bytes_per_token"] / systems["lru"]["bytes_per_token"]


@needs_trace
def test_e2e_harness_runs_every_system_interleaved(tmp_path, capsys, monkeypatch):
    # The default systems without llama.cpp, whether or not this machine has built it (its own
    # tests are tests/unit/test_bench_llama_cpp.py).
    monkeypatch.setenv("EXPERTCACHE_LLAMA_CPP", "off")
    common = [
        "--hidden", "64", "--intermediate", "64",
        "--tokens", "4", "--requests", "2",
        "--request", "5",
        "--next-visit-requests", "2",
        # A rough model is enough to run ours with it; the default 60 iterations took 300 s of
        # this test's 600 on a loaded 2-core machine.
        "--next-visit-iterations", "3",
        "--data-dir", str(tmp_path),
        "--progress-every", "2",
    ]  # fmt: skip
    bf16 = tmp_path / "e2e-bf16.json"
    assert (
        e2e.main(
            [
                *common,
                "--precision",
                "bf16",
                "--systems",
                "ours,ours-transitions,ours-eviction",
                "--no-store-pass",
                "--out",
                str(bf16),
            ]
        )
        == 0
    )
    assert json.loads(bf16.read_text())["store_pass"] is None  # --no-store-pass: none made
    # Ours without the learned next-visit model, side by side with ours.
    beside = json.loads(bf16.read_text())["verdicts"]["ours_vs_ours_transitions"]
    assert beside["p50_speedup"] > 0 and beside["bytes_ratio"] > 0 and len(beside["per_repeat"]) == 1
    # Ours' eviction alone: ours' policy, no prefetch started.
    evict = json.loads(bf16.read_text())["systems"]["ours-eviction"]
    assert evict["policy"] == "activation-aware" and not evict["prefetch_on"]
    assert sum(c["started"] for c in evict["prefetch"].values()) == 0
    out = tmp_path / "e2e.json"
    rc = e2e.main(
        [
            *common,
            "--accelerate-tokens",
            "3",
            "--repeats",
            "2",
            "--out",
            str(out),
            "--compare-with",
            str(bf16),
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["precision"] == "mxfp4" and report["model"]["expert_encodings"] == ["mxfp4", "plain"]
    assert report["experts_over_budget"] >= 4 and report["budget_share"] == pytest.approx(0.25, abs=1e-3)
    assert report["model"]["blob_bytes"] < json.loads(bf16.read_text())["model"]["blob_bytes"] / 2
    systems = report["systems"]
    assert (
        list(systems) == ["ours", "lru", "resident", "transformers", "accelerate"] and report["repeats"] == 2
    )
    # The spare, started before them and never measured, takes the first start's place.
    assert printed.index("[spare] started first") < printed.index("[ours] daemon:")
    for name in ("ours", "lru", "resident"):
        r = systems[name]
        assert r["tokens"] == 2 * 2 * 3  # decode tokens: the first of each request (prefill) left out
        assert [len(x) for x in r["latencies_by_repeat_s"]] == [2 * 3, 2 * 3]
        assert r["store_io_mode"].lower().startswith("o_direct")
        assert 0.0 <= r["hit_rate"] <= 1.0 and r["hits"] + r["misses"] > 0
        assert r["p50_s"] > 0 and r["p99_s"] >= r["p50_s"]
        assert r["bytes_per_token"] > 0
    # Every blob of the store read once before the systems, so that what lies beneath O_DIRECT
    # starts alike for each of them.
    passed = report["store_pass"]
    assert passed["blobs"] == report["model"]["layers"] * report["model"]["experts"]
    assert passed["bytes"] == passed["blobs"] * report["model"]["blob_bytes"] and passed["gb_per_s"] > 0
    assert "store pass: every blob read once before the systems" in printed
    reads = report["store_reads"]  # the disk, measured before the systems ran
    assert reads["alone"]["in_flight"] == 1 and reads["alone"]["reads"] == 128
    assert reads["four_in_flight"]["in_flight"] == 4 and reads["four_in_flight"]["reads"] == 256
    for batch in reads.values():
        assert batch["bytes"] == batch["reads"] * report["model"]["blob_bytes"]
        assert batch["gb_per_s"] > 0 and batch["latency_ms_p50"] > 0
    assert "disk_s_per_token" not in systems["accelerate"]  # buffered, in order: not the store's rate
    for name in ("ours", "lru", "resident"):
        assert systems[name]["disk_s_per_token"] == pytest.approx(
            systems[name]["bytes_per_token"] / (reads["four_in_flight"]["gb_per_s"] * 1e9)
        )
    assert systems["ours"]["policy"] == "activation-aware" and systems["ours"]["prefetch_on"]
    # Ours' daemon ran the learned next-visit model with its horizon head, fitted on the two
    # requests after the measured ones (5..8) and cached for the next run with the same range.
    assert report["next_visit_model"].startswith(
        "the learned model with its horizon head (4 visits), fitted on trace requests 9..10 (after"
    )
    cached = tmp_path / f"next_visit-{TRACE.stem}-9-11-it3-h4.safetensors"
    assert cached.is_file() and read_next_visit(cached).horizon_visits == 4
    assert systems["lru"]["policy"] == "lru" and not systems["lru"]["prefetch_on"]
    assert sum(c["started"] for c in systems["lru"]["prefetch"].values()) == 0
    assert systems["resident"]["device_bytes"] == report["model"]["total_expert_bytes"]
    # transformers itself, every expert in memory: the same decode tokens, its own process.
    plain = systems["transformers"]
    assert (
        plain["tokens"] == 2 * 2 * 3 and plain["p50_s"] > 0 and plain["cpu_s_per_token"]["transformers"] > 0
    )
    assert report["verdicts"]["resident_vs_transformers"]["p50_ratio"] == pytest.approx(
        systems["resident"]["p50_s"] / plain["p50_s"]
    )
    for name in ("ours", "lru", "resident"):  # no host tier on the CPU: every byte came from the store
        r = systems[name]
        assert r["host_bytes_per_token"] == 0 and r["store_bytes_per_token"] == r["bytes_per_token"]
        assert r["link_s_per_token"] >= 0
    assert report["link"]["gb_per_s"] > 0
    acc = systems["accelerate"]
    assert acc["tokens"] == 2 * 2 and acc["page_cache_files_dropped"] > 0
    assert acc["bytes_per_token"] > 0  # offloaded weights really come from storage every token
    verdicts = set(report["verdicts"]) - {"share_of_lru_resident_gap"}  # only when resident is faster
    assert verdicts == {
        "ours_vs_accelerate",
        "ours_vs_lru",
        "ours_bytes_vs_lru",
        "compared",
        "ours_bytes_vs_bf16",
        "belady_share",
        "simulator",
        "resident_vs_transformers",
        "memory",
    }
    # Every system in a memory cgroup of its own, held to its budget, where this machine can make
    # one (root, a memory controller); said so in each system's report where it cannot.
    confined = MemoryCgroup.make("smoke-probe")[0]
    for name, r in systems.items():
        memory = r["memory"]
        if confined is None:
            assert memory["cgroup"] is None and "no memory cgroup" in memory["note"]
            continue
        assert memory["oom_kills"] == 0 and 0 < memory["peak_bytes"] <= memory["limit_bytes"], (name, memory)
        assert (
            memory["limit_bytes"]
            == memory["baseline_bytes"] + memory["budget_bytes"] + memory["headroom_bytes"]
        )
    if confined is not None:
        confined.remove()
        assert report["verdicts"]["memory"]["every_system_confined"]
        assert systems["ours"]["memory"]["budget_bytes"] == report["budget_bytes"]  # arena + host tier
    assert report["verdicts"]["memory"]["accelerate_reads_storage"]["verdict"] == "PASS"
    # The same routing simulated (bench.e2e_reference): trace requests 5..8, the slots of the
    # budget; the simulated LRU loads what the real one did, Belady fewer. The timing model is
    # calibrated on the run (the store reads measured first, the tokens' compute, the disk fitted
    # to lru's time) and the simulated times are judged against the measured ones.
    ref = report["simulated_reference"]
    assert ref["requests"] == [5, 6, 7, 8] and ref["calibrated"]
    assert any("disk fitted to lru's measured" in note for note in ref["timing"]["notes"])
    assert ref["slots"] == report["budget_bytes"] // report["model"]["blob_bytes"]
    sim = ref["systems"]
    assert list(sim) == ["lru", "belady", "oracle-next-token", "ours"]
    assert sim["lru"]["bytes_per_token"] == pytest.approx(systems["lru"]["bytes_per_token"], rel=0.05)
    assert sim["belady"]["bytes_per_token"] < sim["lru"]["bytes_per_token"]
    assert all(r["latency_ms_per_token"] > 0 for r in sim.values())
    judged = report["verdicts"]["simulator"]
    assert set(judged["systems"]) == {"lru", "ours"} and judged["verdict"] in ("PASS", "FAIL")
    for name, r in judged["systems"].items():
        assert r["measured_ms"] == pytest.approx(1e3 / systems[name]["tokens_per_s"])
        assert r["simulated_ms"] == pytest.approx(sim[name]["latency_ms_per_token"])
    assert "the simulator against the measurement (mean ms per decode token): lru " in printed
    belady = report["verdicts"]["belady_share"]
    assert belady["speed_share"] is not None or belady["belady_speedup"] <= 1.0
    assert belady["bytes_share"] == pytest.approx(
        (1 - bytes_ratio_of(systems)) / (1 - sim["belady"]["bytes_per_token"] / sim["lru"]["bytes_per_token"])
    )
    assert "ours' share of Belady's byte saving" in printed
    assert len(report["verdicts"]["ours_vs_lru"]["per_repeat"]) == 2
    shares = report["verdicts"].get("share_of_lru_resident_gap")
    if shares:
        assert shares["lru"]["share"] == pytest.approx(0.0) and shares["resident"]["share"] == pytest.approx(
            1.0
        )
        assert "share of the gap between lru" in printed
    assert report["verdicts"]["ours_vs_accelerate"]["goal"] == 15.0  # at the checkpoint's precision
    assert report["verdicts"]["ours_vs_lru"]["goal"] == 1.3
    bytes_vs_lru = report["verdicts"]["ours_bytes_vs_lru"]
    assert bytes_vs_lru["goal"] == 0.75
    assert bytes_vs_lru["ratio"] == pytest.approx(
        systems["ours"]["bytes_per_token"] / systems["lru"]["bytes_per_token"]
    )
    assert 0 < report["verdicts"]["ours_bytes_vs_bf16"]["ratio"] < 0.6
    assert (tmp_path / "e2e-mxfp4-vs-bf16.png").stat().st_size > 0  # the plot, next to the JSON
    assert (tmp_path / "e2e.png").stat().st_size > 0  # p50s with their spread, shares of the gap
    for line in (
        "page cache:",
        "ours vs accelerate:",
        "ours vs lru:",
        "x lru's MiB per token (goal <= 0.75x)",
        "p50 ms",
        "beside the bf16 run",
        "repeat 1/2: order ours, lru, resident, transformers, accelerate",
        "simulated on the same routing (trace requests 5..8, 4 tokens each",
        "repeat 2/2: order lru, resident, transformers, accelerate, ours",
        "resident vs transformers (every expert in memory",
        "MiB per token per tier (arena fills = from the host tier + from the store)",
        "over 2 repeats",
        "store reads (O_DIRECT, the daemon's reader, random experts of",
        "disk time per token: MiB read per token / the",
    ):
        assert line in printed


@pytest.mark.parametrize("bad", ["-1", "100001"])
def test_e2e_refuses_store_reads_out_of_range(bad, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        e2e.main(["--store-reads", bad, "--data-dir", str(tmp_path)])
    assert exc.value.code == 2
    assert f"--store-reads must be in [0, 100000], got {bad}" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # refused before building anything


def refused_forced_compute(tiny_store, tmp_path, *routing_args: str) -> str:
    """The forced-routing compute started beside a real daemon on the tiny mixtral store with
    ``routing_args``: it must exit 2 (a refused start); its stderr."""
    tiny = tiny_store("mixtral")
    daemon = start_daemon(
        tiny.store, tmp_path, device="cpu", device_budget_bytes=tiny.manifest.blob_bytes * 8
    )
    try:
        proc = subprocess.run(
            [
                sys.executable, "-m", "replay.forced_compute",
                "--store-dir", str(tiny.store),
                "--daemon-address", daemon.address,
                "--listen-address", "127.0.0.1:0",
                *routing_args,
            ],
            cwd=REPO, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    finally:
        daemon.stop()
    assert proc.returncode == 2, proc.stderr
    return proc.stderr


@needs_trace
def test_compute_refuses_a_trace_of_another_shape(tiny_store, tmp_path):
    # tiny mixtral: 3 MoE layers x 8 experts, top-2; the trace is 24 x 32, top-4
    stderr = refused_forced_compute(tiny_store, tmp_path, "--force-routing", str(TRACE))
    assert "has 24 MoE layers x 32 experts, top-4 but the model has 3 MoE layers x 8 experts, top-2" in stderr


def test_compute_refuses_a_missing_trace(tiny_store, tmp_path):
    stderr = refused_forced_compute(tiny_store, tmp_path, "--force-routing-path", str(tmp_path / "nope.npz"))
    assert f"force_routing_path '{tmp_path / 'nope.npz'}' does not exist" in stderr


@needs_trace
def test_e2e_refuses_a_next_visit_model_it_cannot_use(tmp_path, capsys):
    common = ["--data-dir", str(tmp_path), "--systems", "ours", "--hidden", "64", "--intermediate", "64"]
    with pytest.raises(SystemExit) as exc:
        e2e.main([*common, "--next-visit-model", str(tmp_path / "missing.safetensors")])
    assert exc.value.code == 2
    assert "--next-visit-model: next-visit model" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        e2e.main([*common, "--next-visit-requests", "100000"])
    assert exc.value.code == 2
    assert "--next-visit-requests must be in [1, " in capsys.readouterr().err
