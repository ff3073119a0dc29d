"""Tuning sweep of ``activation-aware`` on a window of the trace *separate* from the reported one.

``python -m bench.replay_tune [--trace PATH] [--first-request 32] [--requests 4] [--budget 0.25]``
runs the shared Simulation for a small grid of the policy's few generic parameters (history
half-life in tokens, EAMC hint weight, speculative-prefetch probability threshold, prefetch
horizon) and prints bytes per token, hit rate and latency per setting, with Belady and LRU for
scale. The reported replay (bench.replay) starts at request 64 by default, after this window.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import replace
from pathlib import Path

from bench.replay import DEFAULT_TRACE, HintSource, Simulation, default_timing, load_trace
from cache_daemon.prefetch import PrefetchConfig
from cache_daemon.signals import SignalsConfig


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.replay_tune")
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--first-request", type=int, default=32)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--budget", type=float, default=0.25)
    ap.add_argument("--layer-ahead-accuracy", type=float, default=None)
    ap.add_argument("--half-lives", default="1,2,4")
    ap.add_argument("--hint-weights", default="0,0.3,0.6")
    ap.add_argument("--min-probabilities", default="0.3")
    ap.add_argument("--horizons", default="2")
    ap.add_argument("--prior-weights", default="0.5")
    ap.add_argument("--estimators", default="hazard,ema")
    ap.add_argument("--prior-counts", default="8")
    ap.add_argument("--baselines", default="belady,lru")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    trace = load_trace(args.trace)
    first, last = args.first_request, min(args.first_request + args.requests, trace.num_requests)
    requests = range(first, last)
    timing = default_timing(trace.num_layers, trace.top_k)
    src = HintSource(trace)
    for r in range(first):
        src.insert(trace.expert_ids[trace.req_offsets[r] : trace.req_offsets[r + 1]])
    hints = {}
    for r in requests:
        rows = trace.expert_ids[trace.req_offsets[r] : trace.req_offsets[r + 1]]
        hints[r] = src.request_hints(rows)
        src.insert(rows)
    la = args.layer_ahead_accuracy
    out = []

    def run(policy: str, label: str, **kw) -> None:
        sim = Simulation(
            trace, timing, policy, args.budget, requests=requests, layer_ahead_accuracy=la, hints=hints, **kw
        )
        row = {"label": label, **sim.run().summary(timing)}
        out.append(row)
        print(
            f"{label:<48} hit {row['hit_rate']:.3f} MiB/tok {row['bytes_per_token'] / 2**20:7.1f} "
            f"lat {row['latency_ms_per_token']:6.2f} ms pf/tok {row['prefetches_per_token']:.2f} "
            f"pf acc {row['prefetch_accuracy']:.2f}",
            flush=True,
        )

    for b in [x for x in args.baselines.split(",") if x]:
        run(b, b)
    grid = itertools.product(
        [float(x) for x in args.half_lives.split(",")],
        [float(x) for x in args.hint_weights.split(",")],
        [float(x) for x in args.min_probabilities.split(",")],
        [int(x) for x in args.horizons.split(",")],
        [float(x) for x in args.prior_weights.split(",")],
        [x for x in args.estimators.split(",") if x],
        [float(x) for x in args.prior_counts.split(",")],
    )
    for hl, hw, mp, hz, pw, est, pc in grid:
        if est == "hazard" and (hl, hw, pw) != (
            float(args.half_lives.split(",")[0]),
            float(args.hint_weights.split(",")[0]),
            float(args.prior_weights.split(",")[0]),
        ):
            continue  # the hazard estimator does not read these
        if est == "ema" and pc != float(args.prior_counts.split(",")[0]):
            continue
        sc = SignalsConfig(
            history_half_life_tokens=hl, hint_weight=hw, prior_weight=pw, estimator=est, hazard_prior_count=pc
        )
        label = f"aa {est} pc={pc:g}" if est == "hazard" else f"aa ema hl={hl:g} hw={hw:g} pw={pw:g}"
        run(
            "activation-aware",
            f"{label} minp={mp:g} hz={hz}",
            signals_config=sc,
            prefetch_config=replace(PrefetchConfig(), horizon_layers=hz),
            policy_kwargs={"min_probability": mp},
        )
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
