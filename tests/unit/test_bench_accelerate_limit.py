"""Accelerate's memory limit in ``bench.e2e``: like every system's, its idle baseline (measured in
its own process before loading) + its budget + headroom, set by the process itself once loaded.
Accelerate places whole modules and may keep less than its budget in memory: the limit is still
the budget's, never the smaller footprint it chose (it once printed a baseline of -470 MiB); and
where it keeps more than the budget, the weights it placed stay. A child in a real memory group."""

from __future__ import annotations

import json
import subprocess
import sys

from bench.e2e_accelerate import hold_to_budget, idle_baseline
from devtools.memory_cgroup import MemoryCgroup

MIB = 1 << 20

CHILD = """
import json, sys
from bench.e2e_accelerate import hold_to_budget, idle_baseline
kept, budget, headroom = (int(a) << 20 for a in sys.argv[1:4])
baseline = idle_baseline()
weights = bytearray(kept)
for i in range(0, len(weights), 4096):
    weights[i] = 1
print(json.dumps({"idle": baseline, "held": hold_to_budget(baseline, budget, headroom)}))
"""


def _loaded(group: MemoryCgroup, kept_mib: int, budget_mib: int, headroom_mib: int = 64) -> dict:
    argv = [sys.executable, "-c", CHILD, str(kept_mib), str(budget_mib), str(headroom_mib)]
    proc = subprocess.run(group.command(argv), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_keeping_less_than_its_budget_it_is_still_limited_to_baseline_plus_budget(real_memory_group):
    out = _loaded(real_memory_group, kept_mib=32, budget_mib=200)
    held = out["held"]
    assert held["baseline_bytes"] == out["idle"] > 0  # the baseline measured before loading
    assert held["limit_bytes"] == out["idle"] + 200 * MIB + 64 * MIB == real_memory_group.limit_bytes
    assert held["anon_bytes"] >= out["idle"] + 32 * MIB


def test_keeping_more_than_its_budget_the_weights_it_placed_stay(real_memory_group):
    out = _loaded(real_memory_group, kept_mib=96, budget_mib=16)
    held = out["held"]
    assert held["baseline_bytes"] == held["anon_bytes"] - 16 * MIB > out["idle"]
    assert held["limit_bytes"] == held["anon_bytes"] + 64 * MIB == real_memory_group.limit_bytes


def test_outside_a_benchmark_group_nothing_is_limited():
    assert hold_to_budget(None, 100 * MIB, 64 * MIB) is None
    assert hold_to_budget(10 * MIB, 100 * MIB, 0) is None  # no headroom: not confined
    in_group = idle_baseline()
    assert in_group is None or in_group > 0
