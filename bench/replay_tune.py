"""Tuning sweep of ``activation-aware`` on a window of the trace *separate* from the reported one.

``python -m bench.replay_tune [--trace PATH] [--first-request 32] [--requests 4] [--budget 0.25]``
runs the replay's ``Simulation`` for a small grid of the few generic parameters (history
half-life in tokens, EAMC hint weight, prior weight, the prefetch bar ``min_probability`` (of
lookahead guesses and speculative prefetch alike), prefetch horizon, lookahead depth, the estimator)
and prints bytes per token, hit rate and latency per setting, with Belady and LRU for scale. The
reported replay (``bench.replay``) starts at request 64 by default, after this window.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

from bench.replay import (
    DEFAULT_LOOKAHEAD_ACCURACY,
    DEFAULT_TRACE,
    load_trace,
    parse_floats,
    run_one,
    warm_hints,
)
from cache_daemon.decisions.scheduler import PrefetchConfig
from cache_daemon.decisions.signals import SignalsConfig
from replay.hazard import HazardEstimator
from replay.simulator import timing_model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.replay_tune", description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--timing", default="gpu")
    ap.add_argument("--first-request", type=int, default=32)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--budget", type=float, default=0.25)
    ap.add_argument("--lookahead-accuracy", default=",".join(map(str, DEFAULT_LOOKAHEAD_ACCURACY)))
    ap.add_argument("--depths", default="0,1,2,3,4", help="lookahead depths to try (0: none)")
    ap.add_argument(
        "--min-probabilities", default="0.3", help="prefetch bars to try (PrefetchConfig.min_probability)"
    )
    ap.add_argument("--half-lives", default=str(SignalsConfig.history_half_life_tokens))
    ap.add_argument("--hint-weights", default="0.3")
    ap.add_argument("--prior-weights", default="0.5")
    ap.add_argument("--horizons", default="2")
    ap.add_argument("--inflight-experts", default="1")
    ap.add_argument("--estimators", default="ema", help="ema (the daemon's) and/or hazard (replay only)")
    ap.add_argument(
        "--signals",
        action="append",
        default=[],
        metavar="FIELD=V1,V2",
        help="also sweep a SignalsConfig field over these values (repeatable), e.g. transition_weight=0,1",
    )
    ap.add_argument("--baselines", default="belady,lru")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    extra: list[tuple[str, list[float]]] = []
    for spec in args.signals:
        name, _, values = spec.partition("=")
        if name not in SignalsConfig.__dataclass_fields__ or not values:
            ap.error(
                f"--signals {spec!r}: expected FIELD=V1,V2 with FIELD one of {sorted(SignalsConfig.__dataclass_fields__)}"
            )
        extra.append((name, [float(v) for v in values.split(",")]))
    trace = load_trace(args.trace)
    first, last = args.first_request, min(args.first_request + args.requests, trace.num_requests)
    requests = range(first, last)
    timing = timing_model(args.timing, trace.num_layers, trace.top_k)
    hints, _notes = warm_hints(trace, first, requests)
    accuracy = parse_floats(args.lookahead_accuracy, "--lookahead-accuracy")
    out = []

    def run(policy: str, label: str, **kw) -> None:
        row = {"label": label, **run_one(trace, requests, timing, policy, args.budget, hints=hints, **kw)}
        out.append(row)
        print(
            f"{label:<72} hit {row['hit_rate']:.3f} MiB/tok {row['bytes_per_token'] / 2**20:7.1f} "
            f"lat {row['latency_ms_per_token']:6.2f} ms pf/tok {row['prefetches_per_token']:.2f} "
            f"pf acc {row['prefetch_accuracy']:.2f}",
            flush=True,
        )

    for b in [x for x in args.baselines.split(",") if x]:
        run(b, b, lookahead=None, max_inflight_bytes=timing.expert_bytes)
    grid = itertools.product(
        [int(x) for x in args.depths.split(",")],
        [float(x) for x in args.min_probabilities.split(",")],
        [float(x) for x in args.half_lives.split(",")],
        [float(x) for x in args.hint_weights.split(",")],
        [float(x) for x in args.prior_weights.split(",")],
        [int(x) for x in args.horizons.split(",")],
        [int(x) for x in args.inflight_experts.split(",")],
        [x for x in args.estimators.split(",") if x],
        *[values for _name, values in extra],
    )
    for depth, bar, hl, hw, pw, hz, inflight, est, *more in grid:
        fields = {
            name: type(getattr(SignalsConfig, name))(v) for (name, _), v in zip(extra, more, strict=True)
        }
        sc = SignalsConfig(history_half_life_tokens=hl, hint_weight=hw, prior_weight=pw, **fields)
        label = f"aa {est} d={depth} bar={bar:g} hl={hl:g} hw={hw:g} pw={pw:g} hz={hz} if={inflight}"
        label += "".join(f" {name}={v:g}" for name, v in fields.items())
        run(
            "activation-aware",
            label,
            lookahead=accuracy[:depth] if depth else None,
            max_inflight_bytes=inflight * timing.expert_bytes,
            signals_config=sc,
            prefetch_config=PrefetchConfig(horizon_layers=hz, min_probability=bar),
            estimator=HazardEstimator() if est == "hazard" else None,
        )
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
