"""``python -m predictor_svc.replay TRACE --address HOST:PORT``: feed a routing trace through a
running predictor as if its requests were live.

The trace is read by ``expertcache.trace`` (its format is documented there). Requests are replayed in file order, after one ``RegisterModel`` of the trace's shape, one ``Observe`` stream per request, one ``Activation`` per
token (all layers), ``request_done`` on the request's last token — exactly what compute sends.
``--speed`` paces tokens (tokens per second over the whole replay) or ``max``.

Exit codes: 0 done, 2 bad trace file or arguments (the message says which), 1 the predictor
failed (its gRPC status is printed).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
from moe.predictor.v1 import predictor_pb2, predictor_pb2_grpc
from tqdm import tqdm

from expertcache.trace import RoutingTrace, TraceError, read_trace


class ReplayError(RuntimeError):
    """The predictor cannot be reached."""


class Pacer:
    """Sleeps so that tokens leave at ``tokens_per_s`` overall (None = as fast as possible)."""

    def __init__(self, tokens_per_s: float | None) -> None:
        self._period = 1.0 / tokens_per_s if tokens_per_s else 0.0
        self._next = time.monotonic()

    def wait(self) -> None:
        if not self._period:
            return
        self._next += self._period
        delay = self._next - time.monotonic()
        if delay > 0:
            time.sleep(delay)


def activations(
    trace: RoutingTrace, r: int, model_id: str, pod: str, request_id: str, pacer: Pacer, progress: tqdm | None
) -> Iterator[predictor_pb2.Activation]:
    tokens = trace.request(r)
    for t, routing in enumerate(tokens):
        pacer.wait()
        yield predictor_pb2.Activation(
            request_id=request_id,
            model_id=model_id,
            pod=pod,
            token_index=t,
            experts=routing.reshape(-1).tolist(),
            top_k=trace.top_k,
            num_moe_layers=trace.num_layers,
            num_experts=trace.num_experts,
            request_done=t == len(tokens) - 1,
        )
        if progress is not None:
            progress.update(1)


def replay(
    trace: RoutingTrace,
    address: str,
    *,
    model_id: str,
    pod: str,
    requests: int | None = None,
    tokens_per_s: float | None = None,
    run_id: str | None = None,
    show_progress: bool = True,
    connect_timeout_s: float = 10.0,
) -> tuple[int, int]:
    """Replay the first ``requests`` requests; returns (activations, requests done) acknowledged."""
    count = trace.num_requests if requests is None else min(requests, trace.num_requests)
    total_tokens = int(trace.req_offsets[count])
    run_id = run_id or f"replay-{int(time.time() * 1000)}"
    pacer = Pacer(tokens_per_s)
    sent = done = 0
    with (
        grpc.insecure_channel(address) as channel,
        tqdm(total=total_tokens, unit="tok", disable=not show_progress, file=sys.stderr) as progress,
    ):
        try:
            grpc.channel_ready_future(channel).result(timeout=connect_timeout_s)
        except grpc.FutureTimeoutError:
            raise ReplayError(f"no predictor answers at {address} after {connect_timeout_s:g}s") from None
        stub = predictor_pb2_grpc.PredictorStub(channel)
        try:  # the predictor takes shapes only from its model catalog
            stub.RegisterModel(
                predictor_pb2.RegisterModelRequest(
                    model_id=model_id,
                    num_moe_layers=trace.num_layers,
                    num_experts=trace.num_experts,
                    top_k=trace.top_k,
                ),
                timeout=connect_timeout_s,
            )
        except grpc.RpcError as exc:
            raise ReplayError(
                f"the predictor at {address} refused model {model_id!r}: {exc.code().name}: {exc.details()}"
            ) from None
        for r in range(count):
            if trace.req_offsets[r + 1] == trace.req_offsets[r]:
                continue  # a request without tokens has nothing to report
            summary = stub.Observe(activations(trace, r, model_id, pod, f"{run_id}-{r}", pacer, progress))
            sent += summary.activations
            done += summary.requests_done
    return sent, done


def parse_speed(text: str) -> float | None:
    if text == "max":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--speed must be tokens per second (> 0) or 'max', got {text!r}"
        ) from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"--speed must be > 0 tokens per second or 'max', got {text!r}")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m predictor_svc.replay",
        description="Feed a routing trace (.npz, format in expertcache.trace) through a running predictor's Observe.",
    )
    parser.add_argument("trace", type=Path, help="trace file (.npz)")
    parser.add_argument("--address", required=True, help="predictor host:port")
    parser.add_argument("--model-id", default=None, help="model id to report (default: the trace's model)")
    parser.add_argument(
        "--pod", default="replay", help="pod whose hint subscribers get the hints (default: replay)"
    )
    parser.add_argument(
        "--requests", type=positive_int, default=None, help="replay only the first N requests"
    )
    parser.add_argument(
        "--speed", type=parse_speed, default=None, help="tokens per second, or 'max' (default)"
    )
    parser.add_argument("--run-id", default=None, help="request id prefix (default: replay-<ms since epoch>)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        trace = read_trace(args.trace)
    except TraceError as exc:
        print(f"predictor_svc.replay: {exc}", file=sys.stderr)
        return 2
    model_id = args.model_id or trace.model
    start = time.monotonic()
    try:
        sent, done = replay(
            trace,
            args.address,
            model_id=model_id,
            pod=args.pod,
            requests=args.requests,
            tokens_per_s=args.speed,
            run_id=args.run_id,
            show_progress=not args.no_progress,
        )
    except ReplayError as exc:
        print(f"predictor_svc.replay: {exc}", file=sys.stderr)
        return 1
    except grpc.RpcError as exc:
        print(
            f"predictor_svc.replay: predictor at {args.address} failed: {exc.code().name}: {exc.details()}",
            file=sys.stderr,
        )
        return 1
    elapsed = time.monotonic() - start
    print(
        f"replayed {done} requests, {sent} tokens of {args.trace.name} as model {model_id!r} "
        f"in {elapsed:.1f}s ({sent / elapsed if elapsed else 0:.0f} tokens/s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
