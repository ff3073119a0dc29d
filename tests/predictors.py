"""The predictor as a real process in tests (``python -m predictor_svc`` on a loopback port):
starting it, its stub and stats, registering the tiny model, and the activations of a request."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
from moe.predictor.v1 import predictor_pb2, predictor_pb2_grpc

from devtools.launch import Proc, free_port, start

MODEL = "tiny-moe"
L, E, K = 4, 8, 2
SHAPE = f"{MODEL}={L}x{E}x{K}"


def start_predictor(work_dir: Path, *flags: str, address: str | None = None, name: str = "predictor") -> Proc:
    """A predictor syncing its store every 0.1 s, ``flags`` after those (a later flag wins); its log
    is ``work_dir/<name>.log``."""
    address = address or f"127.0.0.1:{free_port()}"
    args = ["--listen-address", address, "--sync-interval-s", "0.1", *flags]
    return start("predictor_svc", args, address, work_dir / f"{name}.log")


def stub(target: Proc | str) -> predictor_pb2_grpc.PredictorStub:
    """A stub on a started predictor or on an address."""
    address = target if isinstance(target, str) else target.address
    return predictor_pb2_grpc.PredictorStub(grpc.insecure_channel(address))


def stats(proc: Proc) -> predictor_pb2.PredictorStats:
    return stub(proc).GetStats(predictor_pb2.GetStatsRequest(), timeout=5)


def wait_stats(proc: Proc, predicate, timeout_s: float = 15.0) -> predictor_pb2.PredictorStats:
    deadline = time.monotonic() + timeout_s
    while True:
        current = stats(proc)
        if predicate(current):
            return current
        if time.monotonic() > deadline:
            raise AssertionError(f"predictor stats never matched: {current}\n{proc.log()[-3000:]}")
        time.sleep(0.05)


def register(address: str, model: str = MODEL, layers: int = L, experts: int = E, top_k: int = K):
    return stub(address).RegisterModel(
        predictor_pb2.RegisterModelRequest(
            model_id=model, num_moe_layers=layers, num_experts=experts, top_k=top_k
        ),
        timeout=10,
    )


def pattern(token: int, alternate: bool) -> list[int]:
    """Routing of one token: experts (0, 1) in every layer, or (2, 3) on odd tokens if alternating."""
    base = 2 if alternate and token % 2 else 0
    return [base + j for _layer in range(L) for j in range(K)]


def request(request_id: str, tokens: int, *, alternate: bool = False, done: bool = True, pod: str = "pod-a"):
    """The activations of one request of MODEL, ``tokens`` long (the last one ``done``)."""
    for t in range(tokens):
        yield predictor_pb2.Activation(
            request_id=request_id,
            model_id=MODEL,
            pod=pod,
            token_index=t,
            experts=pattern(t, alternate),
            top_k=K,
            num_experts=E,
            request_done=done and t == tokens - 1,
        )


def first_hints(proc: Proc, request_id: str, send) -> dict[int, set[int]]:
    """Subscribe on ``proc``, run ``send()``, return the experts hinted per layer for ``request_id``."""
    channel = grpc.insecure_channel(proc.address)
    stream = predictor_pb2_grpc.PredictorStub(channel).SubscribeHints(
        predictor_pb2.SubscribeHintsRequest(model_id=MODEL, pod="pod-a"), timeout=10
    )
    wait_stats(proc, lambda s: s.subscribers >= 1)
    send()
    try:
        for batch in stream:
            if batch.request_id == request_id and batch.hints:
                out: dict[int, set[int]] = {}
                for hint in batch.hints:
                    out.setdefault(hint.moe_layer, set()).add(hint.expert)
                return out
    finally:
        stream.cancel()
        channel.close()
    raise AssertionError("hint stream ended without hints")
