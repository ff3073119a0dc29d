"""``expertcache feed-trace``: the real trace fed into a real predictor, and what it refuses."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest

from devtools.launch import free_port
from expertcache.feed_trace import FeedError, feed
from expertcache.trace import read_trace
from tests import predictors
from tests.predictors import wait_stats
from tests.procs import run_module

TRACE = Path("/work/shared/traces/gpt-oss-20b_decode_703req.npz")


def feed_trace(*args: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """``expertcache feed-trace args`` run to its end."""
    return run_module("expertcache.cli", "feed-trace", *args, timeout_s=timeout_s)


def test_feed_trace_feeds_the_real_trace(tmp_path):
    proc = predictors.start_predictor(
        tmp_path, "--model-shapes", predictors.SHAPE, "--embedded-path", str(tmp_path / "eamc.bin")
    )
    try:
        done = feed_trace(
            str(TRACE),
            "--address",
            proc.address,
            "--requests",
            "5",
            "--speed",
            "max",
            "--no-progress",
            timeout_s=120,
        )
        assert done.returncode == 0, done.stderr
        trace = read_trace(TRACE)
        tokens = int(trace.req_offsets[5])
        assert f"replayed 5 requests, {tokens} tokens" in done.stdout
        model = "openai/gpt-oss-20b"
        s = wait_stats(proc, lambda s: s.eamc_entries == 5)
        assert s.observed_tokens == tokens and s.requests_done == 5 and s.live_requests == 0
        fed = [
            (m.num_moe_layers, m.num_experts, m.top_k, m.eamc_entries)
            for m in s.models
            if m.model_id == model
        ]
        assert fed == [(24, 32, 4, 5)]
    finally:
        proc.stop()


def test_feed_trace_rejects_a_bad_trace_and_a_missing_predictor(tmp_path):
    bad = tmp_path / "bad.npz"
    np.savez(bad, expert_ids=np.zeros((3, 2, 2), dtype=np.int8), req_offsets=np.array([0, 2]))
    done = feed_trace(str(bad), "--address", "127.0.0.1:1", timeout_s=60)
    assert done.returncode == 2
    assert "lacks ['meta_json']" in done.stderr
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"not a zip")
    done = feed_trace(str(garbage), "--address", "127.0.0.1:1", timeout_s=60)
    assert done.returncode == 2 and "is not a routing trace" in done.stderr
    with pytest.raises(FeedError, match="no predictor answers at 127.0.0.1:"):
        feed(
            read_trace(TRACE),
            f"127.0.0.1:{free_port()}",
            model_id="m",
            pod="p",
            requests=1,
            show_progress=False,
            connect_timeout_s=0.5,
        )
