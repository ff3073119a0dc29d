"""Trace replay (``make bench-replay``): the daemon's decision code driven by a real routing trace.

::

    trace (npz) ──routes──▶ replay.simulator.Simulation ──▶ rows per policy × budget
       └─ earlier requests ─▶ predictor_svc Eamc + predict_request ─▶ hints per token

The signals, policies and prefetch scheduler are the daemon's own (``cache_daemon.decisions``);
only the tier and the clock are simulated (``simulator``). Prints, per policy × budget ×
lookahead: hit rate, bytes per token (and × Belady's), stall and latency per token (and × the
floor ``max(all-resident compute, Belady's bytes / link bandwidth)``), prefetch accuracy; then
each policy's speed-up over plain LRU beside Belady's and the share of Belady's gain captured,
the recall of the signals' prediction at each lookahead depth, an ablation of the routing
transitions, the EAMC hints and the lookahead at 25%, the EAMC class's prefetches at a lowered use-probability threshold (with and
without hints: what they buy once it issues some), and the cost of ``ActivationSignals.observe`` per routed layer.

Usage: ``python -m bench.replay [--trace PATH] [--timing gpu|cpu-e2e] [--requests N|all]
[--budgets 0.1,0.25,0.5] [--policies lru,...] [--lookahead-accuracy 0.9,0.8,...]
[--lookahead-depth D] [--precision mxfp4|bf16|fp8]``. The gpu model moves experts at their
checkpoint's precision (gpt-oss-20b ships MXFP4: the default), counting encoded bytes on the link
and the decode into a bf16 scratch in compute.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
from tqdm import tqdm

from cache_daemon.decisions.next_visit import NextVisitModel, NextVisitModelError
from cache_daemon.decisions.next_visit import read as read_model
from cache_daemon.decisions.scheduler import PrefetchConfig
from cache_daemon.decisions.signals import ActivationSignals, LayerPrediction, SignalsConfig
from expertcache.trace import RoutingTrace, TraceError, read_trace
from replay.batch_ceiling import batch_ceiling
from replay.learn_next_visit import fit_trace
from replay.learn_next_visit import write as write_model
from replay.policies import REFERENCE_POLICIES, REPLAY_POLICIES
from replay.simulator import (
    EXPERT_PRECISIONS,
    TIMING_MODELS,
    Simulation,
    TimingModel,
    floor_ms,
    gpt_oss_20b_expert_bytes,
    timing_model,
)

logger = logging.getLogger(__name__)

DEFAULT_TRACE = (
    Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "gpt-oss-20b_decode_703req.npz"
)
RESULTS_DIR = Path(__file__).resolve().parent / "results"
GOAL_BUDGET = 0.25
SPECULATIVE_MIN_PROBABILITY = 0.2  # the ablation's lowered prefetch bar (no lookahead: the EAMC class's)
MIN_PROBABILITY = PrefetchConfig().min_probability  # the daemon's bar
GOAL_BYTES_RATIO = 1.4  # activation-aware bytes / Belady bytes, at bf16 and mxfp4
GOAL_FLOOR_RATIO = 1.6  # activation-aware latency / floor
GOAL_OBSERVE_US = 20.0  # ActivationSignals.observe per routed layer
# Modelled accuracy of compute's lookahead (router of layer l + d on layer l's state) at depth
# d = 1, 2, ...: an assumption, not a measurement (the trace has no hidden states); the scheduler
# measures each depth's precision and the share of its prefetches used online, and stops using a
# depth that falls below min_probability or min_usefulness.
DEFAULT_LOOKAHEAD_ACCURACY = (0.9, 0.8, 0.7, 0.6)
DEFAULT_LOOKAHEAD_DEPTH = 4

__all__ = ["gpt_oss_20b_expert_bytes", "load_trace", "main", "run_one"]


def load_trace(path: Path) -> RoutingTrace:
    """The decode rows of the trace at ``path`` (``expertcache.trace``); prefill is batched and
    has another cost model."""
    try:
        return read_trace(path).decode_only()
    except TraceError as exc:
        raise SystemExit(f"{exc} (make bench-replay TRACE=path)") from None


# -- hints from the predictor's own code ---------------------------------------------------------


class HintSource:
    """The hints the daemon would receive: predictor_svc's Eamc (embedded store) and its request
    predictor, warmed only by requests before the one replayed. (predictor_svc is imported where
    used: it brings torch.)"""

    def __init__(self, trace: RoutingTrace, *, capacity: int = 512, top_n: int | None = None) -> None:
        from predictor_svc.config import PredictorConfig
        from predictor_svc.eam import EamShape
        from predictor_svc.eamc import Eamc
        from predictor_svc.predict import PredictionConfig
        from predictor_svc.store.embedded import EmbeddedStore
        from predictor_svc.subscriptions import HINT_SOURCE

        pcfg = PredictorConfig()
        self._shape = EamShape(trace.num_layers, trace.num_experts, trace.top_k)
        self._eamc = Eamc(EmbeddedStore(), "replay", self._shape, capacity)
        self._config = PredictionConfig(top_n=pcfg.match_top_n)
        self._top_n = top_n or pcfg.hint_top_n
        self._min_score = pcfg.min_score
        self.inserted = 0
        self.notes = (
            f"hints: predictor_svc Eamc (embedded store, capacity {capacity}) + predict_request "
            f"(= RequestPredictor, source {HINT_SOURCE!r}, match_top_n {pcfg.match_top_n}); per token "
            f"the top {self._top_n} per layer with score >= {self._min_score}, available from the "
            "token's first layer; the EAMC holds only requests before the replayed one"
        )

    def insert(self, experts: np.ndarray) -> None:
        """A finished request's routing ``experts`` int [T, L, K] joins the EAMC."""
        from predictor_svc.eam import add_token, new_eam

        eam = new_eam(self._shape)
        for row in experts:
            add_token(eam, row)
        self._eamc.insert(eam, len(experts))
        self.inserted += 1

    def request_hints(self, experts: np.ndarray) -> list[list[tuple[int, int, float]]]:
        """Per token of a request (int [T, L, K]) the hints known before that token."""
        from predictor_svc.predict import predict_request
        from predictor_svc.subscriptions import HINT_SOURCE, top_hints

        scores = predict_request(self._eamc, self._shape, self._config, experts)[HINT_SOURCE]
        out = []
        for t in range(len(experts)):
            layers = top_hints(scores[t], self._top_n, self._min_score)
            out.append([(h.moe_layer, h.expert, h.score) for hs in layers.values() for h in hs])
        return out


# -- runs ------------------------------------------------------------------------------------------


def run_one(
    trace: RoutingTrace,
    requests: range,
    timing: TimingModel,
    policy: str,
    budget: float,
    *,
    lookahead: tuple[float, ...] | None,
    hints: dict[int, list] | None,
    max_inflight_bytes: int,
    signals_config: SignalsConfig | None = None,
    prefetch_config: PrefetchConfig | None = None,
    policy_kwargs: dict | None = None,
    estimator=None,
    next_visit_model: NextVisitModel | None = None,
    progress: tqdm | None = None,
    measure_depths: bool = False,
) -> dict:
    """One ``Simulation`` over ``requests`` of ``trace``; its summary row."""
    lo, hi = int(trace.req_offsets[requests.start]), int(trace.req_offsets[requests.stop])
    offsets = trace.req_offsets[requests.start : requests.stop + 1] - lo
    local_hints = None if hints is None else {r - requests.start: hints[r] for r in requests if r in hints}
    sim = Simulation(
        trace.expert_ids[lo:hi],
        trace.gate_weights[lo:hi],
        offsets,
        trace.num_experts,
        timing,
        policy,
        budget,
        lookahead_accuracy=lookahead,
        hints=local_hints,
        signals_config=signals_config,
        prefetch_config=prefetch_config,
        max_inflight_bytes=max_inflight_bytes,
        policy_kwargs=policy_kwargs,
        estimator=estimator,
        next_visit_model=next_visit_model,
    )
    row = sim.run(progress, measure_depths=measure_depths).summary(timing)
    row["hints"] = hints is not None
    row["lookahead_depth"] = len(lookahead) if lookahead else 0
    return row


def warm_hints(trace: RoutingTrace, first: int, requests: range) -> tuple[dict[int, list], str]:
    """Per replayed request the per-token hints of an EAMC warmed by every earlier request."""
    src = HintSource(trace)
    for r in range(first):
        src.insert(trace.expert_ids[trace.req_offsets[r] : trace.req_offsets[r + 1]])
    hints: dict[int, list] = {}
    for r in requests:
        rows = trace.expert_ids[trace.req_offsets[r] : trace.req_offsets[r + 1]]
        hints[r] = src.request_hints(rows)
        src.insert(rows)
    return hints, src.notes


def next_visit_model(
    trace: RoutingTrace, first: int, args: argparse.Namespace
) -> tuple[NextVisitModel | None, str]:
    """The signals' learned next-visit model as ``--next-visit-model`` asks, and a line saying what
    it is; fitted models are written to ``args.out``."""
    choice = args.next_visit_model
    if choice == "none":
        return None, "the routing transitions (--next-visit-model none)"
    if choice != "fit":
        try:
            model = read_model(choice)
        except NextVisitModelError as exc:
            raise SystemExit(f"--next-visit-model: {exc}") from None
        if (model.num_layers, model.num_experts) != (trace.num_layers, trace.num_experts):
            raise SystemExit(
                f"--next-visit-model {choice} is for {model.num_layers} x {model.num_experts}, the trace has "
                f"{trace.num_layers} x {trace.num_experts}"
            )
        return model, f"the learned model of {choice} ({model.trained_on or 'its training data unrecorded'})"
    n = args.next_visit_requests
    if not 1 <= n <= 100_000:
        raise SystemExit(f"--next-visit-requests must be in [1, 100000], got {n}")
    learn = range(max(0, first - n), first)
    if not learn:
        return (
            None,
            "the routing transitions (no request before the replayed ones to fit the learned model on)",
        )
    started = time.perf_counter()
    print(f"fitting the next-visit model on requests {learn.start}..{learn.stop - 1}", flush=True)
    bar = None if args.no_progress else tqdm(total=trace.num_layers, unit="layer", desc="next-visit model")
    try:
        model = fit_trace(trace, learn, progress=(lambda j, n: bar.update(1)) if bar is not None else None)
    except ValueError as exc:
        raise SystemExit(f"next-visit model: {exc}") from None
    finally:
        if bar is not None:
            bar.close()
    args.out.mkdir(parents=True, exist_ok=True)
    write_model(model, args.out / "next_visit.safetensors")
    return model, (
        f"the learned model (cache_daemon.decisions.next_visit), fitted on requests {learn.start}..{learn.stop - 1} "
        f"in {time.perf_counter() - started:.0f} s, written to {args.out / 'next_visit.safetensors'}"
    )


def observe_cost(
    trace: RoutingTrace,
    tokens: int,
    lookahead_depth: int,
    hints: list | None,
    next_visit_model: NextVisitModel | None = None,
) -> dict:
    """Wall time of ``ActivationSignals.observe`` per routed layer (and of ``set_lookahead``), on
    ``tokens`` tokens of the trace, with lookahead and hints set as the daemon gets them (and the
    learned next-visit model, when given, in place of the transitions)."""
    L, E, K = trace.num_layers, trace.num_experts, trace.top_k
    sig = ActivationSignals(L, E, next_visit_model=next_visit_model)
    sig.begin_request("bench")
    routes = trace.expert_ids[:tokens].astype(np.int64)
    weights = trace.gate_weights[:tokens].astype(np.float32)
    obs: list[float] = []
    look: list[float] = []
    for g in range(len(routes)):
        if hints is not None and g < len(hints):
            sig.set_hints(hints[g], g, layers=range(L))
        for layer in range(L):
            experts = routes[g, layer].tolist()  # what the daemon's message handler hands over
            t0 = time.perf_counter()
            sig.observe(layer, experts, g)
            obs.append(time.perf_counter() - t0)
            preds = [
                LayerPrediction(layer + d, d, routes[g, layer + d], weights[g, layer + d])
                for d in range(1, lookahead_depth + 1)
                if layer + d < L
            ]
            t0 = time.perf_counter()
            sig.set_lookahead(preds, g)
            look.append(time.perf_counter() - t0)
    o = np.asarray(obs) * 1e6
    s = np.asarray(look) * 1e6
    return {
        "calls": len(o),
        "observe_median_us": float(np.median(o)),
        "observe_p99_us": float(np.percentile(o, 99)),
        "observe_mean_us": float(o.mean()),
        "set_lookahead_median_us": float(np.median(s)),
        "top_k": K,
    }


# -- reports ---------------------------------------------------------------------------------------


def evaluate_goals(rows: list[dict], timing: TimingModel, budget: float = GOAL_BUDGET) -> list[dict]:
    """PASS/FAIL of the issue's goals at ``budget``, per lookahead setting (main rows only)."""
    out = []
    for la in (False, True):
        sel = {
            r["policy"]: r
            for r in rows
            if r["budget"] == budget and r["layer_ahead"] == la and r.get("group", "main") == "main"
        }
        if "activation-aware" not in sel or "belady" not in sel:
            continue
        aa, bel = sel["activation-aware"], sel["belady"]
        fl = floor_ms(timing, bel["bytes_per_token"])
        bytes_ratio = aa["bytes_per_token"] / bel["bytes_per_token"]
        floor_ratio = aa["latency_ms_per_token"] / fl
        goals = [
            (f"bytes <= {GOAL_BYTES_RATIO} x Belady", bytes_ratio, bytes_ratio <= GOAL_BYTES_RATIO),
            (f"latency <= {GOAL_FLOOR_RATIO} x floor", floor_ratio, floor_ratio <= GOAL_FLOOR_RATIO),
        ]
        for other in ("lru", "lfu", "moe-infinity"):
            if other in sel:
                ratio = aa["latency_ms_per_token"] / sel[other]["latency_ms_per_token"]
                goals.append((f"faster than {other}", ratio, ratio < 1.0))
        for name, value, ok in goals:
            out.append({"layer_ahead": la, "goal": name, "value": value, "pass": bool(ok)})
    return out


def belady_shares(rows: list[dict]) -> list[dict]:
    """Per budget and policy: speed-up over plain LRU (demand fetching, no lookahead) beside
    Belady's, and the share of Belady's gain captured, (x - 1) / (belady - 1)."""
    out = []
    for budget in sorted({r["budget"] for r in rows}):
        main = [r for r in rows if r["budget"] == budget and r.get("group", "main") == "main"]
        lru = next((r for r in main if r["policy"] == "lru" and not r["layer_ahead"]), None)
        bel = next((r for r in main if r["policy"] == "belady"), None)
        if lru is None or bel is None:
            continue
        bel_speedup = lru["latency_ms_per_token"] / bel["latency_ms_per_token"]
        for r in main:
            if r["policy"] in REFERENCE_POLICIES:
                continue
            speedup = lru["latency_ms_per_token"] / r["latency_ms_per_token"]
            share = (speedup - 1.0) / (bel_speedup - 1.0) if bel_speedup > 1.0 else math.nan
            out.append(
                {
                    "budget": budget,
                    "policy": r["policy"],
                    "layer_ahead": r["layer_ahead"],
                    "speedup_vs_lru": speedup,
                    "belady_speedup_vs_lru": bel_speedup,
                    "share_of_belady_gain": share,
                }
            )
    return out


def write_png(
    rows: list[dict], depth: list[dict], path: Path, budgets: list[float], policies: list[str]
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(18, 4.8))
    width = 0.8 / max(len(policies), 1)
    main = [r for r in rows if r.get("group", "main") == "main"]
    for ax, la in zip(axes[:2], (False, True), strict=True):
        for i, pol in enumerate(policies):
            vals = []
            for b in budgets:
                r = [x for x in main if x["policy"] == pol and x["budget"] == b and x["layer_ahead"] == la]
                vals.append(r[0]["latency_ms_per_token"] if r else math.nan)
            ax.bar(np.arange(len(budgets)) + (i - (len(policies) - 1) / 2) * width, vals, width, label=pol)
        for j, b in enumerate(budgets):
            fl = [x["floor_ms_per_token"] for x in main if x["budget"] == b and x["layer_ahead"] == la]
            if fl:
                ax.hlines(
                    fl[0], j - 0.45, j + 0.45, colors="k", linestyles="--", label="floor" if j == 0 else None
                )
        ax.set_xticks(np.arange(len(budgets)), [f"{b:.0%}" for b in budgets])
        ax.set_xlabel("budget (share of all experts)")
        ax.set_ylabel("simulated latency per token (ms)")
        ax.set_title("with lookahead" if la else "without lookahead")
    axes[1].legend(fontsize=8)
    ax = axes[2]
    depths = [d["depth"] for d in depth]
    if depths:
        ax.plot(
            depths, [d["modelled_router_accuracy"] for d in depth], "o--", label="router reuse (modelled)"
        )
        ax.plot(
            depths, [d["signals_recall_with_lookahead"] for d in depth], "o-", label="signals, with lookahead"
        )
        ax.plot(
            depths,
            [d["signals_recall_without_lookahead"] for d in depth],
            "s-",
            label="signals, history + EAMC",
        )
        ax.set_xticks(depths)
    ax.set_ylim(0, 1)
    ax.set_xlabel("lookahead depth (MoE layers ahead)")
    ax.set_ylabel("top-k recall")
    ax.set_title("prediction by depth (25%, activation-aware)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_floats(text: str, what: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise SystemExit(f"{what} must be comma-separated numbers, got {text!r}") from None
    return values


def print_batch_ceilings(
    trace: RoutingTrace,
    timing: TimingModel,
    requests: list[int],
    sizes: list[int],
    tokens: int,
    budgets: list[float],
    out: Path,
) -> int:
    """``--batch-size``: the bandwidth-bound ceiling of throughput (``replay.batch_ceiling``)."""
    total = trace.num_layers * trace.num_experts
    print(
        f"bandwidth-bound ceiling: requests {requests[0]}..{requests[-1]} in waves of B, {tokens} tokens each, "
        f"per-layer union loaded once per step, Belady's bytes (cold start) over the {timing.name} link "
        f"({timing.link_bytes_per_s / 1e9:.2f} GB/s, {timing.expert_bytes / 2**20:.2f} MiB per expert)"
    )
    print(f"{'budget':>7} {'B':>4} {'union':>6} {'MiB/token':>10} {'ceiling tok/s':>14}")
    rows = []
    for budget in budgets:
        capacity = max(trace.num_experts, int(budget * total))
        for b in sizes:
            c = batch_ceiling(
                trace,
                batch=b,
                tokens=tokens,
                capacity=capacity,
                expert_bytes=timing.expert_bytes,
                link_bytes_per_s=timing.link_bytes_per_s,
                first_request=requests[0],
                num_requests=max(b, len(requests) // b * b),  # whole waves, at least one
            )
            rows.append(
                {"budget": budget, "capacity": capacity, **asdict(c), "ceiling_tokens_per_s": c.tokens_per_s}
            )
            print(
                f"{budget:>7.0%} {b:>4} {c.mean_union:>6.1f} {c.bytes_per_token / 2**20:>10.2f} {c.tokens_per_s:>14.1f}"
            )
    out.mkdir(parents=True, exist_ok=True)
    (out / "batch_ceiling.json").write_text(json.dumps({"timing": timing.name, "rows": rows}, indent=2))
    print(f"wrote {out / 'batch_ceiling.json'}")
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.replay", description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument(
        "--timing",
        default="gpu",
        help=f"timing model: {', '.join(TIMING_MODELS)} (gpu: gpt-oss-20b on PCIe 4.0 with an A5000-class GPU; "
        "cpu-e2e: this machine running bench.e2e, calibrated)",
    )
    ap.add_argument(
        "--requests", default="6", help="requests replayed (default 6: a few minutes here), or 'all'"
    )
    ap.add_argument(
        "--first-request",
        type=int,
        default=None,
        help="first replayed request; the EAMC is warmed with the requests before it "
        "(default 64, or half the requests of a smaller trace; 0 with --requests all)",
    )
    ap.add_argument("--budgets", default="0.1,0.25,0.5")
    ap.add_argument("--policies", default=",".join(REPLAY_POLICIES))
    ap.add_argument(
        "--lookahead-accuracy",
        default=",".join(map(str, DEFAULT_LOOKAHEAD_ACCURACY)),
        help="modelled accuracy of the lookahead at depth 1, 2, ... (comma-separated)",
    )
    ap.add_argument(
        "--lookahead-depth",
        type=int,
        default=DEFAULT_LOOKAHEAD_DEPTH,
        help="depths of lookahead compute sends (at most the accuracies given)",
    )
    ap.add_argument(
        "--link-gbps", type=float, default=None, help="gpu model: effective link GB/s (default 25)"
    )
    ap.add_argument(
        "--precision",
        choices=tuple(EXPERT_PRECISIONS),
        default=None,
        help="gpu model: the experts' precision in the store and on the link (default mxfp4, as "
        "gpt-oss-20b ships; bytes are the encoded bytes of expertcache.encodings, and compute pays "
        "for decoding them)",
    )
    ap.add_argument("--expert-mib", type=float, default=None, help="gpu model: expert size override")
    ap.add_argument(
        "--layer-compute-ms", type=float, default=None, help="gpu model: per-layer compute override"
    )
    ap.add_argument(
        "--max-inflight-experts",
        type=int,
        default=None,
        help="bytes-in-flight bound in experts (default 1: a prefetch starts only on an idle link)",
    )
    ap.add_argument(
        "--next-visit-model",
        default="fit",
        help="the signals' learned next-visit model: 'fit' (default: fitted on the --next-visit-requests "
        "requests before the replayed ones, like the EAMC is warmed, and written to OUT/next_visit.safetensors), "
        "a model file (replay.learn_next_visit), or 'none' (the routing transitions)",
    )
    ap.add_argument(
        "--next-visit-requests",
        type=int,
        default=64,
        help="with --next-visit-model fit: requests it learns from, the last ones before the replayed ones "
        "(default 64, fewer where fewer precede them)",
    )
    ap.add_argument("--no-ablation", action="store_true", help="skip the hints x lookahead ablation at 25%%")
    ap.add_argument(
        "--batch-size",
        default=None,
        help="instead of the policies: the bandwidth-bound ceiling of throughput of the replayed "
        "requests served in batches of this size (comma-separated sizes), at each budget",
    )
    ap.add_argument(
        "--batch-tokens", type=int, default=16, help="with --batch-size: tokens generated per request"
    )
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    ap.add_argument("--no-progress", action="store_true")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    trace = load_trace(args.trace)
    if args.first_request is None:
        first = 0 if args.requests == "all" else min(64, trace.num_requests // 2)
    else:
        first = args.first_request
    if not 0 <= first < trace.num_requests:
        raise SystemExit(f"--first-request {first} outside 0..{trace.num_requests - 1}")
    if args.requests == "all":
        last = trace.num_requests
    else:
        try:
            n = int(args.requests)
        except ValueError:
            raise SystemExit(f"--requests must be an int or 'all', got {args.requests!r}") from None
        if n < 1:
            raise SystemExit(f"--requests must be >= 1, got {n}")
        last = min(first + n, trace.num_requests)
    requests = range(first, last)
    budgets = [float(b) for b in args.budgets.split(",") if b]
    for b in budgets:
        if not 0.0 < b <= 1.0:
            raise SystemExit(f"budget {b} outside (0, 1]")
    policies = [p for p in args.policies.split(",") if p]
    unknown = [p for p in policies if p not in REPLAY_POLICIES]
    if unknown:
        raise SystemExit(f"unknown policies {unknown}; valid: {', '.join(REPLAY_POLICIES)}")
    if "belady" not in policies:
        policies.append("belady")  # the floor needs it
    if "lru" not in policies:
        policies.append("lru")  # the speed-ups are over it
    accuracy = parse_floats(args.lookahead_accuracy, "--lookahead-accuracy")
    if not accuracy or any(not 0.0 <= a <= 1.0 for a in accuracy):
        raise SystemExit(f"--lookahead-accuracy values must be in [0, 1], got {args.lookahead_accuracy!r}")
    if not 1 <= args.lookahead_depth <= len(accuracy):
        raise SystemExit(
            f"--lookahead-depth must be in [1, {len(accuracy)}] (accuracies given), got {args.lookahead_depth}"
        )
    lookahead = accuracy[: args.lookahead_depth]
    overrides = {
        k: v
        for k, v in (
            ("link_gbps", args.link_gbps),
            ("expert_mib", args.expert_mib),
            ("layer_compute_ms", args.layer_compute_ms),
            ("precision", args.precision),
        )
        if v is not None
    }
    if overrides and args.timing != "gpu":
        raise SystemExit(
            f"--link-gbps/--expert-mib/--layer-compute-ms/--precision apply to --timing gpu, not {args.timing}"
        )
    try:
        timing = timing_model(args.timing, trace.num_layers, trace.top_k, **overrides)
    except ValueError as exc:
        raise SystemExit(f"--timing: {exc}") from None
    if args.max_inflight_experts is not None and args.max_inflight_experts < 1:
        raise SystemExit(f"--max-inflight-experts must be >= 1, got {args.max_inflight_experts}")
    max_inflight = (args.max_inflight_experts or 1) * timing.expert_bytes
    tokens = int(trace.req_offsets[last] - trace.req_offsets[first])
    if args.batch_size is not None:
        sizes = [int(b) for b in parse_floats(args.batch_size, "--batch-size")]
        if not sizes or min(sizes) < 1 or args.batch_tokens < 1:
            raise SystemExit(
                f"--batch-size and --batch-tokens must be >= 1, got {args.batch_size!r}, {args.batch_tokens}"
            )
        return print_batch_ceilings(
            trace, timing, list(requests), sizes, args.batch_tokens, budgets, args.out
        )

    hints, hint_notes = warm_hints(trace, first, requests)
    model, model_note = next_visit_model(trace, first, args)

    print(f"trace {trace.path}: {trace.num_layers} layers x {trace.num_experts} experts, top-{trace.top_k}")
    print(
        f"replaying requests {first}..{last - 1} ({len(requests)} requests, {tokens} tokens) in file order, "
        f"cache warm across requests; EAMC warmed with requests 0..{first - 1}"
    )
    print(f"timing model {timing.name!r}:")
    for note in timing.notes:
        print(f"  - {note}")
    print(
        f"  - bytes in flight bounded at {max_inflight // timing.expert_bytes} experts "
        f"({max_inflight / 2**20:.1f} MiB); budgets are global slots over all (layer, expert) pairs"
    )
    print(
        f"  - lookahead modelled at depths 1..{len(lookahead)} with accuracy {list(lookahead)} (an assumption: "
        "each true expert of (token, l+d) predicted with that probability, misses replaced by wrong experts "
        "drawn by the request's recent use); the scheduler measures each depth's precision itself"
    )
    print(f"  - {hint_notes}")
    print(f"  - next-visit estimate: {model_note}")
    print("  - belady: demand fetching only (the offline optimum of bytes), same row in both settings")
    print(
        "  - oracle-next-token: a reference, not a goal: activation-aware eviction told the exact routing of the "
        "next token (no online predictor has it), demand fetching only, same row in both settings"
    )

    runs = [
        (p, b, la, True, "main")
        for b in budgets
        for p in policies
        for la in ((False,) if p in REFERENCE_POLICIES else (False, True))
    ]
    if not args.no_ablation and GOAL_BUDGET in budgets:
        runs += [("activation-aware", GOAL_BUDGET, la, False, "ablation") for la in (False, True)]
        if model is not None:  # the routing transitions in place of the learned model
            runs += [("activation-aware", GOAL_BUDGET, la, True, "transitions") for la in (False, True)]
        # Neither (the next visit estimated from the history alone).
        runs += [("activation-aware", GOAL_BUDGET, la, True, "no-transitions") for la in (False, True)]
        # The EAMC class with a lower threshold, with and without hints: what its prefetches buy
        # once it issues some (at the default threshold its candidates are already resident).
        runs += [("activation-aware", GOAL_BUDGET, False, h, "speculative") for h in (True, False)]
    rows: list[dict] = []
    bar = None if args.no_progress else tqdm(total=tokens * len(runs), unit="tok", desc="replay")
    for p, b, la, with_hints, group in runs:
        row = run_one(
            trace,
            requests,
            timing,
            p,
            b,
            lookahead=lookahead if la else None,
            hints=hints if with_hints else None,
            max_inflight_bytes=max_inflight,
            prefetch_config=PrefetchConfig(min_probability=SPECULATIVE_MIN_PROBABILITY)
            if group == "speculative"
            else None,
            signals_config=SignalsConfig(transition_weight=0.0) if group == "no-transitions" else None,
            next_visit_model=None if group == "transitions" else model,
            progress=bar,
            measure_depths=p == "activation-aware" and b == GOAL_BUDGET and group in ("main", "transitions"),
        )
        row["group"] = group
        row["next_visit"] = (
            "history"
            if group == "no-transitions"
            else "transitions"
            if model is None or group == "transitions"
            else "model"
        )
        rows.append(row)
        if p in REFERENCE_POLICIES:
            rows.append({**row, "layer_ahead": True})
    if bar is not None:
        bar.close()
    for row in rows:
        bel = next(x for x in rows if x["policy"] == "belady" and x["budget"] == row["budget"])
        fl = floor_ms(timing, bel["bytes_per_token"])
        row["floor_ms_per_token"] = fl
        row["bytes_vs_belady"] = row["bytes_per_token"] / bel["bytes_per_token"]
        row["latency_vs_floor"] = row["latency_ms_per_token"] / fl
    goals = evaluate_goals(rows, timing)
    shares = belady_shares(rows)

    hdr = (
        f"{'budget':>6} {'policy':<17} {'LA':<3} {'hit':>6} {'MiB/tok':>8} {'xBelady':>7} "
        f"{'stall ms':>9} {'lat ms':>8} {'floor':>7} {'xfloor':>6} {'pf/tok':>6} {'pf acc':>6}"
    )
    print(hdr)
    main_rows = [r for r in rows if r["group"] == "main"]
    for row in sorted(
        main_rows, key=lambda x: (x["budget"], x["layer_ahead"], REPLAY_POLICIES.index(x["policy"]))
    ):
        print(
            f"{row['budget']:>6.0%} {row['policy']:<17} {'y' if row['layer_ahead'] else 'n':<3} "
            f"{row['hit_rate']:>6.3f} {row['bytes_per_token'] / 2**20:>8.1f} {row['bytes_vs_belady']:>7.3f} "
            f"{row['stall_ms_per_token']:>9.2f} {row['latency_ms_per_token']:>8.2f} "
            f"{row['floor_ms_per_token']:>7.2f} {row['latency_vs_floor']:>6.3f} "
            f"{row['prefetches_per_token']:>6.2f} {row['prefetch_accuracy']:>6.3f}"
        )
    print("speed-up over plain LRU (demand fetching, no lookahead), beside Belady's; share of Belady's gain:")
    for s in shares:
        print(
            f"  {s['budget']:>4.0%} {s['policy']:<17} {'with' if s['layer_ahead'] else 'without':<7} lookahead: "
            f"{s['speedup_vs_lru']:.3f}x  (Belady {s['belady_speedup_vs_lru']:.3f}x)  share {s['share_of_belady_gain']:.3f}"
        )

    depth = []
    with_la = next(
        (
            r
            for r in main_rows
            if r["policy"] == "activation-aware" and r["budget"] == GOAL_BUDGET and r["layer_ahead"]
        ),
        None,
    )
    without_la = next(
        (
            r
            for r in main_rows
            if r["policy"] == "activation-aware" and r["budget"] == GOAL_BUDGET and not r["layer_ahead"]
        ),
        None,
    )
    if with_la is not None and without_la is not None:
        print(
            f"prediction by depth at {GOAL_BUDGET:.0%} (activation-aware; recall of the top-{trace.top_k}):"
        )
        print(
            f"  {'depth':>5} {'router (modelled)':>18} {'signals+lookahead':>18} {'signals, no LA':>15} "
            f"{'pf started':>10} {'pf used':>8}"
        )
        for d in range(1, max(len(lookahead), 4) + 1):
            rec_la = with_la["depth_recall"].get(str(d))
            rec_no = without_la["depth_recall"].get(str(d))
            pf = with_la["prefetch_by_depth"].get(str(d), {"started": 0, "used": 0})
            entry = {
                "depth": d,
                "modelled_router_accuracy": lookahead[d - 1] if d <= len(lookahead) else math.nan,
                "signals_recall_with_lookahead": rec_la if rec_la is not None else math.nan,
                "signals_recall_without_lookahead": rec_no if rec_no is not None else math.nan,
                "prefetches_started": pf["started"],
                "prefetches_used": pf["used"],
            }
            depth.append(entry)
            print(
                f"  {d:>5} {entry['modelled_router_accuracy']:>18.3f} {entry['signals_recall_with_lookahead']:>18.3f} "
                f"{entry['signals_recall_without_lookahead']:>15.3f} {pf['started']:>10} {pf['used']:>8}"
            )
    recall = {
        r["next_visit"]: r["next_visit_recall"]
        for r in rows
        if r["policy"] == "activation-aware"
        and r["budget"] == GOAL_BUDGET
        and r["group"] in ("main", "transitions")
        and not r["layer_ahead"]
    }
    if recall:
        print(
            f"next-visit estimate at {GOAL_BUDGET:.0%} (a layer's top-{trace.top_k} at its next visit, from its "
            "previous one; before lookahead): recall "
            + ", ".join(f"{name} {value:.3f}" for name, value in sorted(recall.items()))
        )
    ablation = [
        r
        for r in rows
        if r["policy"] == "activation-aware"
        and r["budget"] == GOAL_BUDGET
        and r["group"] in ("main", "ablation", "transitions", "no-transitions")
    ]
    if len(ablation) >= 6:
        print(
            f"ablation at {GOAL_BUDGET:.0%} (activation-aware): what each signal contributes (next visit: the "
            "learned model, the routing transitions, or the history alone)"
        )
        print(
            f"  {'next visit':<11} {'EAMC hints':<10} {'lookahead':<9} {'MiB/tok':>8} {'lat ms':>8} {'pf/tok':>7} "
            f"{'pf acc':>7} {'LA pf/tok':>9} {'LA acc':>7} {'EAMC pf/tok':>11} {'EAMC acc':>8}"
        )
        order = {"history": 0, "transitions": 1, "model": 2}
        for r in sorted(ablation, key=lambda x: (order[x["next_visit"]], x["hints"], x["layer_ahead"])):
            t = max(r["tokens"], 1)
            by = r["prefetch_by_class"]
            la, ea = (
                by.get("layer_ahead", {"started": 0, "used": 0}),
                by.get("eamc", {"started": 0, "used": 0}),
            )
            print(
                f"  {r['next_visit']:<11} "
                f"{'on' if r['hints'] else 'off':<10} {'on' if r['layer_ahead'] else 'off':<9} "
                f"{r['bytes_per_token'] / 2**20:>8.1f} {r['latency_ms_per_token']:>8.2f} "
                f"{r['prefetches_per_token']:>7.2f} {r['prefetch_accuracy']:>7.3f} {la['started'] / t:>9.2f} "
                f"{la['used'] / max(la['started'], 1):>7.3f} {ea['started'] / t:>11.2f} {ea['used'] / max(ea['started'], 1):>8.3f}"
            )
    speculative = sorted((r for r in rows if r["group"] == "speculative"), key=lambda x: not x["hints"])
    if speculative:
        base = next((r for r in ablation if r["group"] == "main" and not r["layer_ahead"]), None)
        base_eamc = base["prefetch_by_class"].get("eamc", {"started": 0}) if base else None
        print(
            f"EAMC class at {GOAL_BUDGET:.0%} with the prefetch bar lowered from "
            f"{MIN_PROBABILITY} to {SPECULATIVE_MIN_PROBABILITY} (no lookahead"
            + (
                f"; at {MIN_PROBABILITY} it started {base_eamc['started'] / max(base['tokens'], 1):.2f}/tok"
                if base
                else ""
            )
            + "):"
        )
        for r in speculative:
            t = max(r["tokens"], 1)
            ea = r["prefetch_by_class"].get("eamc", {"started": 0, "used": 0})
            vs = (
                f" ({r['bytes_per_token'] / base['bytes_per_token']:.3f}x the bytes, "
                f"{r['latency_ms_per_token'] / base['latency_ms_per_token']:.3f}x the latency of "
                f"threshold {MIN_PROBABILITY} with hints)"
                if base
                else ""
            )
            print(
                f"  hints {'on ' if r['hints'] else 'off'}: {r['bytes_per_token'] / 2**20:.1f} MiB/tok, "
                f"{r['latency_ms_per_token']:.2f} ms, EAMC prefetches {ea['started'] / t:.2f}/tok at accuracy "
                f"{ea['used'] / max(ea['started'], 1):.3f}{vs}"
            )
    cost = observe_cost(trace, min(256, trace.num_rows), len(lookahead), hints.get(first), model)
    print(
        f"ActivationSignals.observe: median {cost['observe_median_us']:.1f} us per routed layer, p99 "
        f"{cost['observe_p99_us']:.1f} us ({cost['calls']} calls; goal <= {GOAL_OBSERVE_US:g} us "
        f"{'PASS' if cost['observe_median_us'] <= GOAL_OBSERVE_US else 'FAIL'}); set_lookahead of "
        f"{len(lookahead)} depths: median {cost['set_lookahead_median_us']:.1f} us"
        + (" (with the learned next-visit model)" if model is not None else "")
    )
    print(f"goals at {GOAL_BUDGET:.0%} (activation-aware):")
    for g in goals:
        print(
            f"  {'with' if g['layer_ahead'] else 'without'} lookahead: {g['goal']:<24} "
            f"{g['value']:.3f}  {'PASS' if g['pass'] else 'FAIL'}"
        )
    reference = next(
        (
            r
            for r in main_rows
            if r["policy"] == "oracle-next-token" and r["budget"] == GOAL_BUDGET and not r["layer_ahead"]
        ),
        None,
    )
    if reference is not None:
        print(
            f"reference at {GOAL_BUDGET:.0%}: oracle-next-token (the exact routing of the next token, which no online "
            f"predictor has) loads {reference['bytes_vs_belady']:.3f} x Belady's bytes, latency "
            f"{reference['latency_vs_floor']:.3f} x the floor"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "trace": trace.path,
        "requests": [first, last],
        "tokens": tokens,
        "layers": trace.num_layers,
        "experts": trace.num_experts,
        "top_k": trace.top_k,
        "timing": asdict(timing),
        "max_inflight_bytes": max_inflight,
        "lookahead_accuracy_modelled": list(lookahead),
        "signals_config": asdict(SignalsConfig()),
        "prefetch_config": asdict(PrefetchConfig()),
        "rows": rows,
        "goals": goals,
        "belady_shares": shares,
        "depth": depth,
        "observe_cost": cost,
        "next_visit": model_note,
        "next_visit_recall": recall,
    }
    (args.out / "replay.json").write_text(json.dumps(result, indent=2))
    write_png(rows, depth, args.out / "replay.png", budgets, [p for p in REPLAY_POLICIES if p in policies])
    print(f"wrote {args.out / 'replay.json'} and {args.out / 'replay.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
