"""Prediction quality and matching cost of the predictor on a routing trace (``make bench-predict``).

Quality: requests in file order; each is evaluated against an EAMC (embedded store, the service's
``Eamc`` / ``predict_request`` code) warmed only by the requests before it, then inserted. For
token t of a request and each layer l, the predicted top-k experts (k = the trace's top_k) come
from the scores ``RequestPredictor.scores(source)`` would give after observing tokens 0..t-1
(``predict_request`` computes them batched, equal by test). Precision and recall against the
routed experts, per source (eamc, history, combined), also at a 2×top_k budget.

Cost: median time of one ``EamcIndex.similarities`` / ``predict`` query at 1 K and 10 K
synthetic entries of the trace's shape (paper: 21 µs and 226 µs).
"""

from __future__ import annotations

import os

# One BLAS thread: a matching query is one small product; threads only add hand-off latency
# (measured here: 15 ms vs 65 us at 1 K entries). Must be set before numpy loads.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from dataclasses import fields  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from expertcache.trace import RoutingTrace, TraceError, read_trace  # noqa: E402
from predictor_svc.config import PredictorConfig  # noqa: E402
from predictor_svc.eam import EamShape  # noqa: E402
from predictor_svc.eamc import Eamc, EamcIndex  # noqa: E402
from predictor_svc.predict import SOURCES, PredictionConfig, predict_request  # noqa: E402
from predictor_svc.store import EmbeddedStore  # noqa: E402

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "gpt-oss-20b_decode_703req.npz"
# The service's default eamc_capacity, read from its config class (not a copy of the number).
DEFAULT_CAPACITY = next(f.default for f in fields(PredictorConfig) if f.name == "eamc_capacity")
PAPER_US = {1000: 21.0, 10000: 226.0}
INFORMATION = (
    "prediction for token t, layer l uses: the complete routing of tokens 0..t-1 of the same "
    "request, and the EAMC holding only earlier requests (file order); not token t's own "
    "earlier layers, not later tokens, not the request's own final EAM"
)


def load_trace(path: Path) -> tuple[EamShape, RoutingTrace]:
    """The trace at ``path`` (``expertcache.trace``) and its EAM shape."""
    try:
        trace = read_trace(path)
    except TraceError as exc:
        raise SystemExit(str(exc)) from None
    return EamShape(trace.num_layers, trace.num_experts, trace.top_k), trace


def hits_at(scores: np.ndarray, routed: np.ndarray, k: int) -> np.ndarray:
    """scores float32 [T, L, E], routed bool [T, L, E] -> hits int [T, L] of the top-k."""
    top = np.argpartition(-scores, k - 1, axis=2)[..., :k]
    return np.take_along_axis(routed, top, axis=2).sum(axis=2)


def quality(
    shape: EamShape,
    experts: np.ndarray,
    offsets: np.ndarray,
    decode_start: np.ndarray,
    capacity: int,
    config: PredictionConfig,
    limit: int | None,
    k: int,
) -> dict:
    eamc = Eamc(EmbeddedStore(), "trace", shape, capacity)
    k2 = min(2 * k, shape.experts)
    n_req = len(offsets) - 1 if limit is None else min(limit, len(offsets) - 1)
    hits = {s: np.zeros(shape.layers) for s in SOURCES}
    hits2 = {s: np.zeros(shape.layers) for s in SOURCES}
    pairs_per_layer = 0
    for r in tqdm(range(n_req), desc="requests", unit="req"):
        req = experts[offsets[r] : offsets[r + 1]].astype(np.int64)  # [T, L, K]
        if len(req) == 0:
            continue
        scores = predict_request(eamc, shape, config, req)
        routed = np.zeros((len(req), shape.layers, shape.experts), dtype=bool)
        tt, ll, kk = np.nonzero(req >= 0)
        routed[tt, ll, req[tt, ll, kk]] = True
        d0 = int(decode_start[r])  # prefill rows inform the prediction but are not scored
        for s in SOURCES:
            hits[s] += hits_at(scores[s][d0:], routed[d0:], k).sum(axis=0)
            hits2[s] += hits_at(scores[s][d0:], routed[d0:], k2).sum(axis=0)
        pairs_per_layer += len(req) - d0
        eam = routed.sum(axis=0, dtype=np.uint32)  # [L, E]
        eamc.insert(eam, len(req))  # only now may later requests match it
    out: dict = {"requests": n_req, "tokens": pairs_per_layer, "eamc_entries_at_end": eamc.entries}
    for s in SOURCES:
        routed_per_layer = pairs_per_layer * shape.top_k
        p_layer = hits[s] / (pairs_per_layer * k)
        r_layer = hits[s] / routed_per_layer  # equals p_layer when k == top_k
        p2_layer = hits2[s] / (pairs_per_layer * k2)
        r2_layer = hits2[s] / routed_per_layer
        out[s] = {
            "precision_at_k": float(p_layer.mean()),
            "recall_at_k": float(r_layer.mean()),
            "precision_at_2k": float(p2_layer.mean()),
            "recall_at_2k": float(r2_layer.mean()),
            "per_layer_precision_at_k": [round(float(x), 5) for x in p_layer],
            "per_layer_recall_at_k": [round(float(x), 5) for x in r_layer],
            "per_layer_precision_at_2k": [round(float(x), 5) for x in p2_layer],
            "per_layer_recall_at_2k": [round(float(x), 5) for x in r2_layer],
        }
    return out


def matching_cost(shape: EamShape, sizes: list[int], queries: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    out = {}
    for n in sizes:
        index = EamcIndex(shape, initial_rows=n)
        tokens = rng.integers(20, 512, size=n)
        probs = rng.dirichlet(np.full(shape.experts, 0.3), size=(n, shape.layers))
        for i in range(n):
            counts = np.stack(
                [rng.multinomial(tokens[i] * shape.top_k, probs[i, layer]) for layer in range(shape.layers)]
            )
            index.upsert(f"s{i}", counts.astype(np.uint32), int(tokens[i]))
        qs = [
            rng.multinomial(40 * shape.top_k, probs[rng.integers(n), 0], size=shape.layers).astype(np.uint32)
            for _ in range(queries)
        ]
        timings = {}
        for name, fn in (("similarities", index.similarities), ("predict", index.predict)):
            fn(qs[0], shape.layers)  # warm
            t = []
            for q in qs:
                t0 = time.perf_counter()
                fn(q, shape.layers)
                t.append(time.perf_counter() - t0)
            timings[f"{name}_median_us"] = float(np.median(t) * 1e6)
        out[str(n)] = timings
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--requests", type=int, default=None, help="first N requests (default all)")
    ap.add_argument(
        "--top-k", type=int, default=None, help="predicted experts per layer (default trace top_k)"
    )
    ap.add_argument("--capacity", type=int, default=DEFAULT_CAPACITY, help="EAMC capacity")
    ap.add_argument("--top-n", type=int, default=PredictionConfig.top_n)
    ap.add_argument("--cost-queries", type=int, default=300)
    ap.add_argument("--cost-sizes", type=int, nargs="+", default=[1000, 10000])
    ap.add_argument("--out", type=Path, default=Path("bench/results/predict.json"))
    args = ap.parse_args(argv)

    shape, trace = load_trace(args.trace)
    experts, offsets, decode_start, meta = trace.expert_ids, trace.req_offsets, trace.decode_start, trace.meta
    k = args.top_k or shape.top_k
    if not 1 <= k <= shape.experts:
        ap.error(f"--top-k must be in [1, {shape.experts}], got {k}")
    config = PredictionConfig(top_n=args.top_n)
    print(
        f"trace {args.trace.name}: {len(offsets) - 1} requests, {len(experts)} tokens, "
        f"{shape.layers} layers x {shape.experts} experts, top_k {shape.top_k}"
    )
    print(f"information: {INFORMATION}")
    print(f"config: capacity {args.capacity}, {config}")
    t0 = time.perf_counter()
    q = quality(shape, experts, offsets, decode_start, args.capacity, config, args.requests, k)
    q["seconds"] = round(time.perf_counter() - t0, 1)
    print(f"\nprecision / recall of the top-{k} (means over {q['tokens']} tokens x {shape.layers} layers):")
    for s in SOURCES:
        r = q[s]
        print(
            f"  {s:9s} P@{k} {r['precision_at_k']:.4f}  R@{k} {r['recall_at_k']:.4f}   "
            f"P@{2 * k} {r['precision_at_2k']:.4f}  R@{2 * k} {r['recall_at_2k']:.4f}"
        )
    cost = matching_cost(shape, args.cost_sizes, args.cost_queries)
    print(f"\nmatching cost per query ({shape.layers}x{shape.experts}, median of {args.cost_queries}):")
    for n, c in cost.items():
        print(
            f"  {int(n):>6} entries: similarities {c['similarities_median_us']:8.1f} us, "
            f"predict {c['predict_median_us']:8.1f} us"
            + (f"   (paper {PAPER_US[int(n)]:.0f} us)" if int(n) in PAPER_US else "")
        )
    result = {
        "trace": str(args.trace),
        "model": meta.get("model"),
        "shape": {"layers": shape.layers, "experts": shape.experts, "top_k": shape.top_k},
        "predicted_k": k,
        "capacity": args.capacity,
        "config": {f: getattr(config, f) for f in config.__dataclass_fields__},
        "information": INFORMATION,
        "quality": q,
        "matching_cost_us": cost,
        "paper_matching_cost_us": {str(n): v for n, v in PAPER_US.items()},
        "host": platform.node(),
        "cpu": platform.processor(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
