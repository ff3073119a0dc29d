"""Offline study: a learned cross-layer next-visit model, plugged into the trace replay.

    python -m bench.cross_layer_study [--trace PATH] [--first 64] [--requests 6] [--budget 0.25]
                                      [--steps 300] [--l2 1e-4]

The daemon estimates each layer's experts at their next visit from that layer's own last routing
(the routing transitions) and the request's history. This study asks what the *other* layers'
routing adds. It fits one logistic model per MoE layer ``j``: the inputs, taken right after ``j``
is routed at token ``t``, are the most recent routing of every layer (one-hot: token ``t``'s for
layers <= ``j``, token ``t - 1``'s for the later ones) and the request's short and long histories
of layer ``j`` (the signals' own short and long half-lives, ``SignalsConfig``); the outputs are the
probabilities of layer ``j``'s experts at token ``t + 1``. It is trained on the trace's requests
before ``--first`` (torch, full-batch Adam, BCE + L2), like the replay warms its EAMC with them.

Then the daemon's decision code replays requests ``--first`` .. (``bench.replay.run_one``:
``cache_daemon.decisions.simulator``, the GPU timing model, EAMC hints, no lookahead) with the
``activation-aware`` policy at ``--budget``, twice: with the signals' built-in estimate, and with
this model plugged in as an ``Estimator`` (next use = distance + L (1 - q) / p_long, q from the
model, p_long the signals' own long-run estimate). It prints each one's hit rate and bytes per
token beside Belady's, and the next-visit top-k recall of the model on the replayed requests.

A study, not the daemon's behaviour: the daemon does not run this model (yet). Writes
bench/results/cross_layer_study.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.replay import DEFAULT_TRACE, load_trace, run_one, warm_hints  # noqa: E402
from cache_daemon.decisions.signals import SignalsConfig  # noqa: E402
from cache_daemon.decisions.simulator import timing_model  # noqa: E402

RESULTS = REPO / "bench" / "results" / "cross_layer_study.json"
# Per-token decay of the short and long histories: the signals' own half-lives.
SHORT_DECAY = 0.5 ** (1.0 / SignalsConfig().history_half_life_tokens)
LONG_DECAY = 0.5 ** (1.0 / SignalsConfig().long_history_half_life_tokens)
MIB = 1 << 20


def one_hot(routes: np.ndarray, num_experts: int) -> np.ndarray:
    """int [T, L, K] expert ids → float32 [T, L, E]."""
    out = np.zeros((*routes.shape[:2], num_experts), np.float32)
    np.put_along_axis(out, routes.astype(np.int64), 1.0, axis=2)
    return out


def _histories(y: np.ndarray, base: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 [T, L, E] short and long histories including each token (start: ``base``)."""
    ha, hb = np.empty_like(y), np.empty_like(y)
    a, b = base * 0.5, base.copy()
    for t in range(len(y)):
        a = a * SHORT_DECAY + (1 - SHORT_DECAY) * y[t]
        b = b * LONG_DECAY + (1 - LONG_DECAY) * y[t]
        ha[t], hb[t] = a, b
    return ha, hb


@dataclass
class CrossLayerModel:
    weights: np.ndarray  # float32 [L, L*E + 2E, E]
    bias: np.ndarray  # float32 [L, E]
    base: np.ndarray  # float32 [L, E]: per-token use rate in training (the histories' start)

    def predict(self, layer: int, last: np.ndarray, short: np.ndarray, long: np.ndarray) -> np.ndarray:
        """float64 [E] probabilities of ``layer``'s experts at its next visit, from the latest
        routing of every layer ``last`` [L, E] and the layer's histories ``short``, ``long`` [E]."""
        x = np.concatenate([last.reshape(-1), short, long]).astype(np.float64)
        return 1.0 / (1.0 + np.exp(-(x @ self.weights[layer] + self.bias[layer])))


def fit(
    requests: list[np.ndarray], num_experts: int, *, steps: int = 300, l2: float = 1e-4
) -> CrossLayerModel:
    """One logistic model per layer over ``requests`` (each int [T, L, K]; those shorter than 3
    tokens teach nothing)."""
    if steps < 1 or l2 < 0:
        raise ValueError(f"steps must be >= 1 and l2 >= 0, got {steps} and {l2}")
    ys = [one_hot(r, num_experts) for r in requests if len(r) >= 3]
    if not ys:
        raise ValueError("no request of 3 tokens or more to train on")
    num_layers = ys[0].shape[1]
    base = np.concatenate(ys).mean(0).astype(np.float32)
    hist = [_histories(y, base) for y in ys]
    weights = np.zeros((num_layers, num_layers * num_experts + 2 * num_experts, num_experts), np.float32)
    bias = np.zeros((num_layers, num_experts), np.float32)
    for j in range(num_layers):
        xs, ts = [], []
        for y, (ha, hb) in zip(ys, hist, strict=True):
            n = len(y) - 2
            latest = np.concatenate([y[1 : n + 1, : j + 1].reshape(n, -1), y[:n, j + 1 :].reshape(n, -1)], 1)
            xs.append(np.concatenate([latest, ha[1 : n + 1, j], hb[1 : n + 1, j]], 1))
            ts.append(y[2:, j])
        x, target = torch.from_numpy(np.concatenate(xs)), torch.from_numpy(np.concatenate(ts))
        rate = np.clip(base[j], 1e-4, 1 - 1e-4)
        w = torch.zeros(x.shape[1], num_experts, requires_grad=True)
        b = torch.tensor(np.log(rate / (1 - rate)), dtype=torch.float32, requires_grad=True)
        opt = torch.optim.Adam([w, b], lr=0.02)
        for _ in range(steps):
            opt.zero_grad()
            loss = torch.nn.functional.binary_cross_entropy_with_logits(x @ w + b, target) + l2 * (w**2).sum()
            loss.backward()
            opt.step()
        weights[j], bias[j] = w.detach().numpy(), b.detach().numpy()
    return CrossLayerModel(weights, bias, base)


class CrossLayerEstimator:
    """``CrossLayerModel`` as the signals' ``Estimator`` (one request at a time, as the replay runs)."""

    def __init__(self, model: CrossLayerModel) -> None:
        self.model = model
        self.recall_hits = 0
        self.recall_total = 0

    def attach(self, signals) -> None:
        self._signals = signals
        self._q = np.full(signals.num_entries, -1.0)
        self.begin_request("")

    def begin_request(self, request_id: str) -> None:
        num_layers, num_experts = self.model.base.shape
        self._last = np.zeros((num_layers, num_experts), np.float32)
        self._short = self.model.base.astype(np.float64) * 0.5
        self._long = self.model.base.astype(np.float64).copy()
        self._q[:] = -1.0

    def observe(self, request_id: str, layer: int, entries: np.ndarray, token: int) -> None:
        num_experts = self.model.base.shape[1]
        sl = slice(layer * num_experts, (layer + 1) * num_experts)
        routed = np.zeros(num_experts, np.float32)
        routed[np.asarray(entries, np.int64) - layer * num_experts] = 1.0
        if self._q[sl.start] >= 0:  # the prediction made at this layer's last visit
            top = np.argsort(-self._q[sl])[: len(entries)]
            self.recall_hits += int(routed[top].sum())
            self.recall_total += len(entries)
        self._last[layer] = routed
        self._short[layer] = self._short[layer] * SHORT_DECAY + (1 - SHORT_DECAY) * routed
        self._long[layer] = self._long[layer] * LONG_DECAY + (1 - LONG_DECAY) * routed
        self._q[sl] = self.model.predict(layer, self._last, self._short[layer], self._long[layer])

    def long_run(self, signals) -> list[np.ndarray]:
        out = [signals._with_hints(req, hist) for req, hist in signals._histories()]
        return out or [signals._prior * signals.config.prior_weight]

    def next_use(self, signals) -> np.ndarray:
        p_long = np.maximum(
            signals.long_run_probability().astype(np.float64), signals.config.probability_floor
        )
        p_next = np.where(self._q >= 0, self._q, p_long)
        return signals.layer_distance().astype(np.float64) + signals.num_moe * (1.0 - p_next) / p_long


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument(
        "--first", type=int, default=64, help="first replayed request; the model learns from those before"
    )
    ap.add_argument("--requests", type=int, default=6, help="requests replayed")
    ap.add_argument("--budget", type=float, default=0.25, help="expert budget, share of all experts")
    ap.add_argument("--steps", type=int, default=300, help="Adam steps per layer")
    ap.add_argument("--l2", type=float, default=1e-4)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    trace = load_trace(args.trace)
    if not 1 <= args.first < trace.num_requests:
        ap.error(f"--first must be in [1, {trace.num_requests - 1}], got {args.first}")
    if not 1 <= args.requests <= trace.num_requests - args.first:
        ap.error(f"--requests must be in [1, {trace.num_requests - args.first}], got {args.requests}")
    if not 0.0 < args.budget <= 1.0:
        ap.error(f"--budget must be in (0, 1], got {args.budget}")
    if not 1 <= args.steps <= 100_000 or args.l2 < 0:
        ap.error(f"--steps must be in [1, 100000] and --l2 >= 0, got {args.steps} and {args.l2}")

    started = time.perf_counter()
    train = [trace.request(r) for r in range(args.first)]
    print(
        f"fitting {trace.num_layers} layers on requests 0..{args.first - 1} ({sum(map(len, train))} tokens)",
        flush=True,
    )
    model = fit(train, trace.num_experts, steps=args.steps, l2=args.l2)
    fit_s = time.perf_counter() - started
    print(f"fitted in {fit_s:.0f} s", flush=True)

    requests = range(args.first, args.first + args.requests)
    timing = timing_model("gpu", trace.num_layers, trace.top_k)
    hints, _ = warm_hints(trace, args.first, requests)
    estimator = CrossLayerEstimator(model)
    rows = {}
    for name, policy, est in (
        ("belady", "belady", None),
        ("activation-aware, built-in estimate", "activation-aware", None),
        ("activation-aware, cross-layer model", "activation-aware", estimator),
    ):
        row = run_one(
            trace, requests, timing, policy, args.budget,
            lookahead=None, hints=hints, max_inflight_bytes=timing.expert_bytes, estimator=est,
        )  # fmt: skip
        rows[name] = {k: row[k] for k in ("hit_rate", "bytes_per_token", "latency_ms_per_token")}
    belady = rows["belady"]["bytes_per_token"]
    print(
        f"replay of requests {requests.start}..{requests.stop - 1}, {args.budget:.0%} budget, no lookahead:"
    )
    print(f"{'':40}{'hit rate':>10}{'MiB/tok':>10}{'x Belady':>10}{'lat ms':>9}")
    for name, r in rows.items():
        r["x_belady"] = r["bytes_per_token"] / belady
        print(
            f"{name:40}{r['hit_rate']:>10.4f}{r['bytes_per_token'] / MIB:>10.1f}{r['x_belady']:>10.3f}"
            f"{r['latency_ms_per_token']:>9.2f}"
        )
    recall = estimator.recall_hits / max(estimator.recall_total, 1)
    print(f"cross-layer model: next-visit top-k recall {recall:.3f} on the replayed requests")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "trace": str(args.trace),
                "trained_on": [0, args.first - 1],
                "replayed": [requests.start, requests.stop - 1],
                "budget": args.budget,
                "steps": args.steps,
                "l2": args.l2,
                "fit_s": fit_s,
                "rows": rows,
                "next_visit_recall": recall,
            },
            indent=2,
        )
    )
    print(f"wrote {args.out} ({time.perf_counter() - started:.0f} s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
