"""The bandwidth-bound ceiling of a batched run (replay.batch_ceiling)."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest

from expertcache.trace import RoutingTrace
from replay.batch_ceiling import (
    batch_ceiling,
    batched_unions,
    belady_loads,
    requests_with_decode_rows,
)


def make_trace(per_request: list[np.ndarray], num_experts: int) -> RoutingTrace:
    rows = np.concatenate(per_request).astype(np.int8)
    offsets = np.zeros(len(per_request) + 1, np.int64)
    offsets[1:] = np.cumsum([len(r) for r in per_request])
    return RoutingTrace(
        "mem.npz",
        rows,
        np.full(rows.shape, 1.0 / rows.shape[2], np.float32),
        offsets,
        np.zeros(len(per_request), np.int64),
        num_experts,
        {},
        False,
    )


def random_trace(requests=8, rows=6, layers=3, experts=8, top_k=2, seed=0) -> RoutingTrace:
    rng = np.random.default_rng(seed)
    return make_trace(
        [
            np.stack(
                [[rng.choice(experts, top_k, replace=False) for _ in range(layers)] for _ in range(rows)]
            )
            for _ in range(requests)
        ],
        experts,
    )


def lru_loads(steps, num_experts: int, capacity: int) -> int:
    cache: OrderedDict[int, None] = OrderedDict()
    loads = 0
    for layers in steps:
        for layer, experts in enumerate(layers):
            needed = [int(e) + layer * num_experts for e in experts]
            for e in needed:
                if e in cache:
                    cache.move_to_end(e)
                else:
                    loads += 1
                    while len(cache) >= capacity:
                        victim = next(k for k in cache if k not in needed)
                        del cache[victim]
                    cache[e] = None
    return loads


def test_unions_follow_forced_routing_rows():
    # request 0: rows 0,1 ; request 1: rows 0,1,2 ; 1 layer, top-1
    trace = make_trace([np.array([[[0]], [[1]]]), np.array([[[2]], [[3]], [[4]]])], 8)
    steps = batched_unions(trace, [0, 1], batch=2, tokens=4)
    # forward i takes row i of each request, wrapping past its last row
    assert [s[0].tolist() for s in steps] == [[0, 2], [1, 3], [0, 4], [1, 2]]
    single = batched_unions(trace, [0, 1], batch=1, tokens=2)
    assert [s[0].tolist() for s in single] == [[0], [1], [2], [3]]  # two waves of one


def test_belady_loads_counts_distinct_when_everything_fits():
    trace = random_trace()
    steps = batched_unions(trace, list(range(8)), batch=4, tokens=6)
    distinct = {(layer, int(e)) for s in steps for layer, u in enumerate(s) for e in u}
    assert belady_loads(steps, trace.num_experts, capacity=trace.num_layers * trace.num_experts) == len(
        distinct
    )


def test_belady_known_sequence():
    # one layer, capacity 2, accesses a b c a b: at c Belady evicts the farther of a (next at 3) and
    # b (next at 4), so b; then a hits and b misses: 4 loads. LRU evicts a, then b, then c: 5.
    seq = [[np.array([e])] for e in (0, 1, 2, 0, 1)]
    assert belady_loads(seq, 4, capacity=2) == 4
    assert lru_loads(seq, 4, capacity=2) == 5


@pytest.mark.parametrize("seed", range(5))
def test_belady_never_loads_more_than_lru_and_falls_with_capacity(seed):
    trace = random_trace(seed=seed)
    steps = batched_unions(trace, list(range(8)), batch=2, tokens=6)
    widest = max(len(u) for s in steps for u in s)
    previous = None
    for capacity in range(widest, trace.num_layers * trace.num_experts + 1, 3):
        loads = belady_loads(steps, trace.num_experts, capacity)
        assert loads <= lru_loads(steps, trace.num_experts, capacity)
        if previous is not None:
            assert loads <= previous
        previous = loads


def test_capacity_below_a_union_is_refused():
    trace = random_trace()
    steps = batched_unions(trace, list(range(8)), batch=8, tokens=2)
    with pytest.raises(ValueError, match="below one layer's union"):
        belady_loads(steps, trace.num_experts, capacity=1)


def test_ceiling_is_tokens_over_link_time():
    trace = random_trace()
    c = batch_ceiling(trace, batch=4, tokens=6, capacity=10, expert_bytes=1000, link_bytes_per_s=1e6)
    assert c.requests == 4 and c.tokens == 24 and c.steps == 6
    assert c.bytes == c.loads * 1000
    assert c.tokens_per_s == pytest.approx(24 / (c.bytes / 1e6))
    # a wider batch shares loads: fewer bytes per token than one request at a time
    one = batch_ceiling(
        trace, batch=1, tokens=6, capacity=10, expert_bytes=1000, link_bytes_per_s=1e6, num_requests=4
    )
    assert c.bytes_per_token <= one.bytes_per_token


def test_requests_without_decode_rows_are_skipped_and_wrap():
    trace = make_trace([np.array([[[0]]]), np.zeros((0, 1, 1), np.int8), np.array([[[1]]])], 4)
    assert requests_with_decode_rows(trace, 1, 3) == [2, 0, 2]
    with pytest.raises(ValueError):
        batched_unions(trace, [1], batch=1, tokens=1)


def test_bench_replay_prints_the_ceiling_per_batch_size(tmp_path, capsys):
    from bench.replay import DEFAULT_TRACE, main

    if not DEFAULT_TRACE.is_file():
        pytest.skip(f"shared trace {DEFAULT_TRACE} not present")
    argv = ["--batch-size", "1,4", "--requests", "4", "--first-request", "0", "--budgets", "0.25"]
    assert main([*argv, "--timing", "cpu-e2e", "--batch-tokens", "3", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "bandwidth-bound ceiling" in out
    import json

    rows = json.loads((tmp_path / "batch_ceiling.json").read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 4]
    assert all(r["tokens"] == 12 and r["ceiling_tokens_per_s"] > 0 for r in rows)
    assert rows[1]["bytes"] <= rows[0]["bytes"]  # one wave of 4 shares what 4 waves of 1 load
