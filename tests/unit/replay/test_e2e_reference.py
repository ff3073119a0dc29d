"""bench.e2e's simulated references: the e2e's own routing, replayed for LRU, Belady and ours."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest

from bench.e2e_reference import (
    DISK_FIT_BOUND,
    TIMING_TOLERANCE,
    fit_disk,
    forced_routes,
    measured_timing,
    shares,
    simulate,
    timing_errors,
)
from expertcache.manifest import StoreManifest, plan_blob
from expertcache.trace import read_trace
from replay.forced_routing import ForcedRouting, load_trace
from replay.learn_next_visit import fit_trace, write
from replay.simulator import cpu_e2e_timing
from tests.traces import write_trace  # 3 layers x 8 experts, top-2

LAYERS, EXPERTS, TOP_K = 3, 8, 2


def manifest(blob_shape=(8, 4), dtype="float32") -> StoreManifest:
    tensors, blob = plan_blob([("gate_up_proj", dtype, blob_shape), ("down_proj", dtype, (4, 4))])
    return StoreManifest(
        model_type="gpt_oss",
        model_id="test-model",
        num_layers=LAYERS,
        moe_layers=tuple(range(LAYERS)),
        num_experts=EXPERTS,
        top_k=TOP_K,
        blob_bytes=blob,
        tensors=tensors,
        layer_files={i: f"experts/layer_{i:04d}.bin" for i in range(LAYERS)},
        checksums={i: (0,) * EXPERTS for i in range(LAYERS)},
    )


def lru_loads(routes: np.ndarray, slots: int) -> int:
    """Demand LRU over (layer, expert) entries, counted by hand: the loads it makes. The layer
    being computed holds its experts pinned (compute pins them all at once), so a miss never
    evicts another expert of its own layer; a missed expert counts as used once it arrived,
    after the layer's hits."""
    cache: OrderedDict[tuple[int, int], None] = OrderedDict()
    loads = 0
    for token in routes:
        for layer, experts in enumerate(token):
            now = [(layer, e) for e in experts.tolist()]
            missed = []
            for key in now:
                if key in cache:
                    cache.move_to_end(key)
                    continue
                loads += 1
                if len(cache) >= slots:
                    del cache[next(k for k in cache if k not in now)]
                cache[key] = None
                missed.append(key)
            for key in missed:
                cache.move_to_end(key)
    return loads


def belady_loads(routes: np.ndarray, slots: int) -> int:
    """Belady's MIN by brute force, with the layer being computed pinned: a miss evicts the
    entry (of another layer) whose next use is furthest away."""
    seq = [[(layer, e) for e in experts.tolist()] for token in routes for layer, experts in enumerate(token)]
    cache: set[tuple[int, int]] = set()
    loads = 0
    for i, now in enumerate(seq):
        for key in now:
            if key in cache:
                continue
            loads += 1
            if len(cache) >= slots:

                def next_use(k, i=i):
                    return next((j for j in range(i + 1, len(seq)) if k in seq[j]), len(seq) + 1)

                cache.remove(max((k for k in cache if k not in now), key=next_use))
            cache.add(key)
    return loads


def test_forced_routes_are_the_rows_compute_forces(tmp_path):
    # Request 1 has no decode rows (skipped, as compute skips it); request 2 wraps after 3 rows.
    path = write_trace(tmp_path / "t.npz", [5, 2, 5, 6], decode_start=[0, 2, 2, 0])
    m = manifest()
    routes = forced_routes(path, m, first_request=0, count=3, tokens=4)
    assert routes.requests == (0, 2, 3)
    assert routes.offsets.tolist() == [0, 4, 8, 12]
    trace = load_trace(path)
    routing = ForcedRouting(trace, m.moe_layers, EXPERTS, TOP_K, first_request=0)
    expect = []
    for g in range(3):
        rid = f"g{g}"
        routing.begin_request(rid)
        expect += [routing.row(rid, s) for s in range(4)]
    np.testing.assert_array_equal(routes.expert_ids, trace.expert_ids[expect])
    np.testing.assert_array_equal(routes.gate_weights, trace.gate_weights[expect].astype(np.float32))
    # request 2's decode rows are 7..9: its 4th forward wraps to its first row
    assert expect[4:8] == [9, 10, 11, 9]


def test_forced_routes_refuses_empty_runs(tmp_path):
    path = write_trace(tmp_path / "t.npz", [4])
    with pytest.raises(ValueError, match="count and tokens"):
        forced_routes(path, manifest(), 0, 0, 4)
    with pytest.raises(ValueError, match="count and tokens"):
        forced_routes(path, manifest(), 0, 1, 0)


def test_simulated_lru_and_belady_load_what_they_must(tmp_path):
    path = write_trace(tmp_path / "t.npz", [40, 30], seed=3)
    m = manifest()
    routes = forced_routes(path, m, 0, 2, 30)
    slots = 6
    out = simulate(routes, m, slots, ours={}, lookahead_accuracy=(), timing=None)
    assert set(out) == {"lru", "belady", "oracle-next-token"}
    tokens = len(routes.expert_ids)
    assert out["lru"]["bytes_per_token"] * tokens == pytest.approx(
        lru_loads(routes.expert_ids, slots) * m.blob_bytes
    )
    assert out["belady"]["bytes_per_token"] * tokens == pytest.approx(
        belady_loads(routes.expert_ids, slots) * m.blob_bytes
    )
    assert out["belady"]["bytes_per_token"] < out["lru"]["bytes_per_token"]
    assert out["lru"]["latency_ms_per_token"] is None  # no timing model: bytes only
    assert out["lru"]["slots"] == slots


def test_simulated_ours_runs_the_daemon_decisions_with_and_without_a_model(tmp_path):
    path = write_trace(tmp_path / "t.npz", [60, 60, 60], seed=5)
    m = manifest()
    model_path = tmp_path / "nv.safetensors"
    write(fit_trace(read_trace(path).decode_only(), range(2, 3)), model_path)
    routes = forced_routes(path, m, 0, 2, 40)
    out = simulate(
        routes,
        m,
        8,
        ours={"ours": model_path, "ours-transitions": None},
        lookahead_accuracy=(1.0,),
        timing=measured_timing(m, link_bytes_per_s=1e6, compute_s_per_token=0.02),
    )
    assert list(out) == ["lru", "belady", "oracle-next-token", "ours", "ours-transitions"]
    # told the next token, eviction alone loads no more than LRU and no fewer than Belady
    oracle = out["oracle-next-token"]["bytes_per_token"]
    assert out["belady"]["bytes_per_token"] <= oracle <= out["lru"]["bytes_per_token"]
    assert out["oracle-next-token"]["prefetches_per_token"] == 0  # demand fetching only
    for name in ("ours", "ours-transitions"):
        assert out[name]["policy"] == "activation-aware"
        assert out[name]["prefetches_per_token"] > 0  # perfect lookahead is prefetched
        assert out[name]["bytes_per_token"] >= out["belady"]["bytes_per_token"]
        assert out[name]["latency_ms_per_token"] > 0
    # with every next layer known ahead, ours stalls less than demand LRU
    assert out["ours"]["latency_ms_per_token"] < out["lru"]["latency_ms_per_token"]


def test_simulate_refuses_slots_outside_the_table(tmp_path):
    path = write_trace(tmp_path / "t.npz", [10])
    m = manifest()
    routes = forced_routes(path, m, 0, 1, 5)
    for slots in (0, LAYERS * EXPERTS + 1):
        with pytest.raises(ValueError, match="slots must be in"):
            simulate(routes, m, slots, ours={}, lookahead_accuracy=(), timing=None)


def test_shares_of_belady_gain():
    measured = {
        "ours": {"p50_s": 0.2, "bytes_per_token": 80.0},
        "lru": {"p50_s": 0.3, "bytes_per_token": 100.0},
    }
    simulated = {
        "lru": {"latency_ms_per_token": 400.0, "bytes_per_token": 200.0},
        "belady": {"latency_ms_per_token": 200.0, "bytes_per_token": 100.0},
    }
    out = shares(measured, simulated)
    assert out["speedup"] == pytest.approx(1.5)
    assert out["belady_speedup"] == pytest.approx(2.0)
    assert out["speed_share"] == pytest.approx(0.5)
    assert out["bytes_ratio"] == pytest.approx(0.8)
    assert out["belady_bytes_ratio"] == pytest.approx(0.5)
    assert out["bytes_share"] == pytest.approx(0.4)
    # bytes only (an uncalibrated timing model): no speed share
    uncalibrated = {k: {**v, "latency_ms_per_token": None} for k, v in simulated.items()}
    out = shares(measured, uncalibrated)
    assert "speed_share" not in out and out["bytes_share"] == pytest.approx(0.4)
    assert shares({"lru": measured["lru"]}, simulated) is None  # ours did not run


def test_the_measured_timing_takes_the_runs_blob_link_and_compute():
    m = manifest()
    timing = measured_timing(m, link_bytes_per_s=2e9, compute_s_per_token=0.03)
    base = cpu_e2e_timing(LAYERS, TOP_K)
    assert timing.expert_bytes == m.blob_bytes and timing.link_bytes_per_s == 2e9
    assert timing.all_resident_token_s == pytest.approx(0.03)
    # the parts in the model's own proportions
    assert timing.attention_s / timing.expert_s == pytest.approx(base.attention_s / base.expert_s)
    assert timing.token_overhead_s / timing.layer_s == pytest.approx(base.token_overhead_s / base.layer_s)
    for link, compute in ((0.0, 0.03), (2e9, 0.0), (-1.0, 0.03)):
        with pytest.raises(ValueError, match="must be > 0"):
            measured_timing(m, link_bytes_per_s=link, compute_s_per_token=compute)


def test_the_disk_is_fitted_as_a_whole_so_that_the_simulated_lru_takes_the_measured_time(tmp_path):
    path = write_trace(tmp_path / "t.npz", [40, 30], seed=3)
    m = manifest(blob_shape=(4096, 64))  # blobs of 1 MiB: the link matters
    routes = forced_routes(path, m, 0, 2, 30)
    slots = 8
    timing = measured_timing(m, link_bytes_per_s=1e9, compute_s_per_token=0.01, read_latency_s=2e-3)

    def lru_ms(t) -> float:
        return simulate(routes, m, slots, ours={}, lookahead_accuracy=(), timing=t)["lru"][
            "latency_ms_per_token"
        ]

    for wanted in (lru_ms(timing) * 1.3, lru_ms(timing) * 0.8):  # a disk slower, then faster
        fitted = fit_disk(routes, m, slots, timing, wanted)
        factor = fitted.link_bytes_per_s / timing.link_bytes_per_s
        assert (factor < 1) == (wanted > lru_ms(timing))
        # the rate and the latency move together: the read latency divided by the same factor
        assert fitted.read_latency_s == pytest.approx(timing.read_latency_s / factor)
        assert lru_ms(fitted) == pytest.approx(wanted, rel=0.01)
        assert "disk fitted to lru's measured" in fitted.notes[-1]
        assert f"{factor:.2f}x as fast as measured" in fitted.notes[-1]
    # beyond what any disk within 8x explains: the bound, said so
    fast = fit_disk(routes, m, slots, timing, 1e-3)
    assert fast.link_bytes_per_s == pytest.approx(1e9 * DISK_FIT_BOUND)
    assert fast.read_latency_s == pytest.approx(2e-3 / DISK_FIT_BOUND)
    assert "(the bound)" in fast.notes[-1]
    assert fit_disk(routes, m, slots, timing, 1e6).link_bytes_per_s == pytest.approx(1e9 / DISK_FIT_BOUND)
    with pytest.raises(ValueError, match="lru_ms_per_token must be > 0"):
        fit_disk(routes, m, slots, timing, 0.0)


def test_timing_errors_judge_each_system_and_the_order():
    simulated = {
        "lru": {"latency_ms_per_token": 60.0},
        "belady": {"latency_ms_per_token": 40.0},  # not measured: not judged
        "ours": {"latency_ms_per_token": 46.0},
    }
    got = timing_errors({"lru": {"ms_per_token": 60.0}, "ours": {"ms_per_token": 50.0}}, simulated)
    assert set(got["systems"]) == {"lru", "ours"}
    assert got["systems"]["ours"]["error"] == pytest.approx(-0.08)
    assert got["same_order"] and got["within_tolerance"] and got["tolerance"] == TIMING_TOLERANCE
    far = timing_errors({"lru": {"ms_per_token": 60.0}, "ours": {"ms_per_token": 52.0}}, simulated)
    assert far["same_order"] and not far["within_tolerance"]  # -11.5%
    swapped = timing_errors({"lru": {"ms_per_token": 45.0}, "ours": {"ms_per_token": 50.0}}, simulated)
    assert not swapped["same_order"]
    assert timing_errors({"lru": {"ms_per_token": 60.0}}, simulated) is None  # nothing to compare


def test_the_measured_timing_carries_the_read_latency_and_the_decision_lag():
    m = manifest()
    timing = measured_timing(
        m, link_bytes_per_s=2e9, compute_s_per_token=0.03, read_latency_s=4e-4, decision_lag_s=2e-4
    )
    assert (timing.read_latency_s, timing.decision_lag_s) == (4e-4, 2e-4)
    assert any("0.40 ms after its start" in n for n in timing.notes)
    assert any("0.200 ms after the change" in n for n in timing.notes)
    assert measured_timing(m, link_bytes_per_s=2e9, compute_s_per_token=0.03).read_latency_s == 0.0
    for latency, lag in ((-1e-3, 0.0), (0.0, -1e-3)):
        with pytest.raises(ValueError, match="must be >= 0"):
            measured_timing(
                m, link_bytes_per_s=2e9, compute_s_per_token=0.03, read_latency_s=latency, decision_lag_s=lag
            )


def test_ours_eviction_alone_is_simulated_demand_only(tmp_path):
    path = write_trace(tmp_path / "t.npz", [60, 60, 60], seed=5)
    m = manifest()
    model_path = tmp_path / "nv.safetensors"
    write(fit_trace(read_trace(path).decode_only(), range(2, 3)), model_path)
    routes = forced_routes(path, m, 0, 2, 40)
    out = simulate(
        routes,
        m,
        8,
        ours={"ours": model_path},
        lookahead_accuracy=(1.0,),
        timing=measured_timing(m, link_bytes_per_s=1e6, compute_s_per_token=0.02),
        eviction_only={"ours-eviction": model_path},
    )
    assert list(out)[-1] == "ours-eviction"
    evict = out["ours-eviction"]
    assert evict["policy"] == "activation-aware" and evict["prefetches_per_token"] == 0
    assert out["ours"]["prefetches_per_token"] > 0
    assert out["belady"]["bytes_per_token"] <= evict["bytes_per_token"]
