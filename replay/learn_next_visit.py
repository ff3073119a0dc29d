"""Fit the daemon's learned next-visit model on recorded routing, and write its file.

::

    python -m replay.learn_next_visit --trace TRACE.npz --out next_visit.safetensors
                                      [--requests A:B] [--window W] [--l2 L2] [--iterations N]
                                      [--horizon-visits H]

``TRACE.npz`` is a routing trace (``expertcache.trace``: compute's recorder writes one from
served requests, ``record_trace_path`` in compute's config); its decode rows are learned from
(prompt rows are routed as a batch, not token by token). The model
(``cache_daemon.decisions.next_visit``) learns, per MoE layer, which experts the layer routes at
a request's next token from every layer's latest routing and the request's histories of the
layer: one L2-regularised logistic regression per layer, fitted with L-BFGS (torch, on the CPU;
about 2.5 s per layer on 26 K tokens of gpt-oss-20b on 2 cores), and beside it, on the same
features, the horizon head: which experts the layer routes within the request's next
``--horizon-visits`` tokens (the eviction policy's chance of use after the next visit). The
daemon reads the file named by its ``next_visit_model`` config field at start
(``cache_daemon.decisions.next_visit.read``) and then uses it in place of the routing
transitions; a file fitted for another model shape or other history half-lives is refused at
start with a message that says so.

Exit status: 0 written, 2 for bad arguments or an unreadable trace (the message names it).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from cache_daemon.decisions.next_visit import MAX_HORIZON_VISITS, MAX_WEIGHTS, NextVisitModel, window_start
from cache_daemon.decisions.signals import SignalsConfig

if TYPE_CHECKING:
    from expertcache.trace import RoutingTrace

logger = logging.getLogger(__name__)

DEFAULT_L2 = 1e-4
DEFAULT_HORIZON_VISITS = 4
DEFAULT_ITERATIONS = 60
MAX_ITERATIONS = 10_000


# -- training examples (the features ``NextVisitModel.step`` reads, for a whole recorded request) -


def one_hot(routes: np.ndarray, num_experts: int) -> np.ndarray:
    """int [T, M, K] expert ids → float32 [T, M, E]."""
    out = np.zeros((*routes.shape[:2], num_experts), np.float32)
    np.put_along_axis(out, routes.astype(np.int64), 1.0, axis=2)
    return out


def histories(y: np.ndarray, start: np.ndarray, decays: tuple[float, float]) -> tuple[np.ndarray, np.ndarray]:
    """float32 [T, M, E] short and long histories of a request including each token, as the
    signals keep them (both start at ``start`` [M, E])."""
    short_decay, long_decay = (np.float32(d) for d in decays)
    ha, hb = np.empty_like(y), np.empty_like(y)
    a, b = start.astype(np.float32), start.astype(np.float32)
    for t in range(len(y)):
        a = a * short_decay + (1 - short_decay) * y[t]
        b = b * long_decay + (1 - long_decay) * y[t]
        ha[t], hb[t] = a, b
    return ha, hb


def features(
    y: np.ndarray, ha: np.ndarray, hb: np.ndarray, layer: int, window: int
) -> tuple[np.ndarray, np.ndarray]:
    """Training examples of MoE layer ``layer`` from one request's one-hot routing ``y`` and
    histories ``ha``, ``hb`` (float32 [T, M, E] each): ``(x float32 [T - 1, w * E + 2E],
    target float32 [T - 1, E])``, one per token that has a next one."""
    T, M, E = y.shape
    n = T - 1
    lo = window_start(layer, M, window)
    latest = np.zeros((n, window, E), np.float32)
    upto = min(layer + 1, lo + window) - lo  # window layers routed at token t already
    latest[:, :upto] = y[:n, lo : lo + upto]
    if upto < window:  # the later layers' latest routing is the previous token's (none at t = 0)
        latest[1:, upto:] = y[: n - 1, lo + upto : lo + window]
    x = np.concatenate([latest.reshape(n, -1), ha[:n, layer], hb[:n, layer]], 1)
    return x, y[1:, layer]


def within(y: np.ndarray, layer: int, visits: int) -> np.ndarray:
    """float32 [T - 1, E] the horizon head's targets for ``features``' examples: whether each
    expert of MoE layer ``layer`` is routed at any of the next ``visits`` tokens (those the
    request has: near its end, fewer)."""
    T = len(y)
    out = np.zeros((T - 1, y.shape[2]), np.float32)
    for k in range(1, visits + 1):
        if k < T:
            np.maximum(out[: T - k], y[k:, layer], out=out[: T - k])
    return out


def fit(
    requests: Sequence[np.ndarray],
    num_experts: int,
    *,
    window: int | None = None,
    l2: float = DEFAULT_L2,
    iterations: int = DEFAULT_ITERATIONS,
    config: SignalsConfig | None = None,
    trained_on: str = "",
    progress: Callable[[int, int], None] | None = None,
    horizon_visits: int = DEFAULT_HORIZON_VISITS,
) -> NextVisitModel:
    """The next-visit model of ``requests`` (each int [T, M, K]: a request's routed experts per
    token and MoE layer; requests of one token teach nothing). ``window``: input layers per
    layer (default all M). The histories follow ``config``'s half-lives (the signals' that will
    run it). ``progress(layer, num_layers)`` is called after each layer. ``horizon_visits`` (2 or
    more; 0: none) fits the horizon head beside it, on the same features: each expert's chance of
    use within that many visits (both heads in one L-BFGS run per layer, their losses summed)."""
    import torch

    cfg = config or SignalsConfig()
    ys = [one_hot(np.asarray(r), num_experts) for r in requests if len(r) >= 2]
    if not ys:
        raise ValueError("no request of 2 tokens or more to learn from")
    num_layers = ys[0].shape[1]
    if any(y.shape[1] != num_layers for y in ys):
        raise ValueError("requests disagree on the number of MoE layers")
    window = num_layers if window is None else int(window)
    if not 1 <= window <= num_layers:
        raise ValueError(f"window must be in [1, {num_layers}] layers, got {window}")
    if not (l2 >= 0.0 and 1 <= iterations <= MAX_ITERATIONS):
        raise ValueError(
            f"l2 must be >= 0 and iterations in [1, {MAX_ITERATIONS}], got {l2} and {iterations}"
        )
    if horizon_visits != 0 and not 2 <= horizon_visits <= MAX_HORIZON_VISITS:
        raise ValueError(f"horizon_visits must be 0 or in [2, {MAX_HORIZON_VISITS}], got {horizon_visits}")
    if num_layers * (window + 2) * num_experts * num_experts > MAX_WEIGHTS:
        raise ValueError(
            f"{num_layers} layers x window {window} x {num_experts} experts is over {MAX_WEIGHTS} weights"
        )
    rate = np.concatenate(ys).mean(0)  # [M, E] per-token use rate: what a request's history starts from
    start = (cfg.prior_weight * rate).astype(np.float32)
    decays = tuple(
        0.5 ** (1.0 / h) for h in (cfg.history_half_life_tokens, cfg.long_history_half_life_tokens)
    )
    hist = [histories(y, start, decays) for y in ys]
    E = num_experts
    heads = 2 if horizon_visits else 1
    weights = np.zeros((heads, num_layers, (window + 2) * E, E), np.float32)
    bias = np.zeros((heads, num_layers, E), np.float32)
    for j in range(num_layers):
        pairs = [features(y, ha, hb, j, window) for y, (ha, hb) in zip(ys, hist, strict=True)]
        x = torch.from_numpy(np.concatenate([p[0] for p in pairs]))
        targets = [np.concatenate([p[1] for p in pairs])]
        if horizon_visits:
            targets.append(np.concatenate([within(y, j, horizon_visits) for y in ys]))
        target = torch.from_numpy(np.concatenate(targets, 1))  # [n, heads * E]
        r = np.clip(target.numpy().mean(0), 1e-4, 1 - 1e-4)  # each head's base rate: the start
        w = torch.zeros(x.shape[1], heads * E, requires_grad=True)
        b = torch.tensor(np.log(r / (1 - r)), dtype=torch.float32, requires_grad=True)
        opt = torch.optim.LBFGS(
            [w, b], lr=1.0, max_iter=iterations, history_size=20, line_search_fn="strong_wolfe"
        )

        def closure(x=x, target=target, w=w, b=b, opt=opt):
            opt.zero_grad()
            bce = torch.nn.functional.binary_cross_entropy_with_logits(x @ w + b, target, reduction="none")
            loss = bce.mean(0).view(heads, E).mean(1).sum() + l2 * (w * w).sum()  # each head's mean, summed
            loss.backward()
            return loss

        opt.step(closure)
        fitted_w, fitted_b = w.detach().numpy(), b.detach().numpy()
        for h in range(heads):
            weights[h, j], bias[h, j] = fitted_w[:, h * E : (h + 1) * E], fitted_b[h * E : (h + 1) * E]
        if progress is not None:
            progress(j + 1, num_layers)
    return NextVisitModel(
        weights[0],
        bias[0],
        window,
        cfg.history_half_life_tokens,
        cfg.long_history_half_life_tokens,
        cfg.prior_weight,
        trained_on=trained_on,
        horizon_weights=weights[1] if horizon_visits else None,
        horizon_bias=bias[1] if horizon_visits else None,
        horizon_visits=horizon_visits,
    )


def fit_trace(
    trace: RoutingTrace,
    requests: range,
    *,
    progress: Callable[[int, int], None] | None = None,
    **kw,
) -> NextVisitModel:
    """``fit`` on ``requests`` of ``trace`` (its rows as they are: pass ``decode_only()``'s), the
    model recording the trace's file name and the request range it was fitted on."""
    return fit(
        [trace.request(r) for r in requests],
        trace.num_experts,
        trained_on=f"{Path(trace.path).name} requests {requests.start}:{requests.stop}",
        progress=progress,
        **kw,
    )


def write(model: NextVisitModel, path: str | os.PathLike) -> None:
    """Writes ``model`` to ``path`` atomically (a reader never sees half a file)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent or ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(model.to_bytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _request_range(text: str, num_requests: int) -> range:
    lo, sep, hi = text.partition(":")
    try:
        a = int(lo) if lo else 0
        b = int(hi) if hi else num_requests
    except ValueError:
        raise ValueError(f"--requests must be A:B (request indices), got {text!r}") from None
    if not sep or not 0 <= a < b <= num_requests:
        raise ValueError(f"--requests {text!r} must be A:B with 0 <= A < B <= {num_requests}")
    return range(a, b)


def main(argv: Sequence[str] | None = None) -> int:
    from expertcache.trace import TraceError, read_trace

    ap = argparse.ArgumentParser(
        prog="python -m replay.learn_next_visit", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--trace", required=True, type=Path, help="routing trace (.npz) to learn from")
    ap.add_argument("--out", required=True, type=Path, help="model file to write (.safetensors)")
    ap.add_argument("--requests", default=":", help="requests A:B of the trace to learn from (default all)")
    ap.add_argument(
        "--window", type=int, default=None, help="input layers per layer (default: all MoE layers)"
    )
    ap.add_argument("--l2", type=float, default=DEFAULT_L2, help=f"L2 penalty (default {DEFAULT_L2})")
    ap.add_argument("--iterations", type=int, default=DEFAULT_ITERATIONS, help="L-BFGS iterations per layer")
    ap.add_argument(
        "--horizon-visits",
        type=int,
        default=DEFAULT_HORIZON_VISITS,
        help="also fit the horizon head: each expert's chance of use within this many visits "
        f"(default {DEFAULT_HORIZON_VISITS}; 0: none)",
    )
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        trace = read_trace(args.trace).decode_only()
        requests = _request_range(args.requests, trace.num_requests)
    except (TraceError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not args.out.parent.is_dir():
        print(f"error: --out: directory {args.out.parent} does not exist", file=sys.stderr)
        return 2
    started = time.perf_counter()
    tokens = int(trace.req_offsets[requests.stop] - trace.req_offsets[requests.start])
    print(
        f"learning from requests {requests.start}..{requests.stop - 1} of {args.trace} "
        f"({tokens} tokens, {trace.num_layers} MoE layers x {trace.num_experts} experts)",
        flush=True,
    )
    try:
        model = fit_trace(
            trace,
            requests,
            window=args.window,
            l2=args.l2,
            iterations=args.iterations,
            horizon_visits=args.horizon_visits,
            progress=lambda j, n: print(
                f"  layer {j}/{n} ({time.perf_counter() - started:.0f} s)", flush=True
            ),
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    write(model, args.out)
    print(
        f"wrote {args.out} ({args.out.stat().st_size / 2**20:.1f} MiB) in {time.perf_counter() - started:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
