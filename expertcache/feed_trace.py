"""``expertcache feed-trace TRACE --address HOST:PORT``: feed a routing trace into a running
predictor as if its requests were live (a client tool: load, demos, warming an EAMC).

After one ``RegisterModel`` of the trace's shape, requests go in file order, one ``Observe``
stream each, one ``Activation`` per token (all layers), ``request_done`` on the last token:
exactly what compute sends. The trace is read by ``expertcache.trace``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator

import grpc
from moe.predictor.v1 import predictor_pb2, predictor_pb2_grpc
from tqdm import tqdm

from expertcache.grpc_client import wait_ready
from expertcache.trace import RoutingTrace


class FeedError(RuntimeError):
    """The predictor cannot be reached, or refused the trace's model."""


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


def feed(
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
    """Feed the first ``requests`` requests; returns (activations, requests done) acknowledged."""
    count = trace.num_requests if requests is None else min(requests, trace.num_requests)
    total_tokens = int(trace.req_offsets[count])
    run_id = run_id or f"replay-{int(time.time() * 1000)}"
    pacer = Pacer(tokens_per_s)
    sent = done = 0
    with (
        grpc.insecure_channel(address) as channel,
        tqdm(total=total_tokens, unit="tok", disable=not show_progress, file=sys.stderr) as progress,
    ):
        if not wait_ready(channel, connect_timeout_s):
            raise FeedError(f"no predictor answers at {address} after {connect_timeout_s:g}s")
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
            raise FeedError(
                f"the predictor at {address} refused model {model_id!r}: {exc.code().name}: {exc.details()}"
            ) from None
        for r in range(count):
            if trace.req_offsets[r + 1] == trace.req_offsets[r]:
                continue  # a request without tokens has nothing to report
            summary = stub.Observe(activations(trace, r, model_id, pod, f"{run_id}-{r}", pacer, progress))
            sent += summary.activations
            done += summary.requests_done
    return sent, done
