"""Generating through a compute process's gRPC Inference API, as a client does."""

from __future__ import annotations

import grpc
from moe.inference.v1 import inference_pb2, inference_pb2_grpc


def generate_replies(
    address: str, prompt: list[int], max_new_tokens: int
) -> list[inference_pb2.GenerateResponse]:
    """Every reply to a plain request (the server's default sampling) sent to compute at ``address``."""
    with grpc.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        request = inference_pb2.GenerateRequest(token_ids=prompt, max_new_tokens=max_new_tokens)
        return list(stub.Generate(request, timeout=120))


def greedy_tokens(
    channel: grpc.Channel,
    prompt: list[int],
    max_new_tokens: int,
    *,
    timeout_s: float,
    request_id: str = "",
    metadata=None,
) -> list[int]:
    """The tokens of a greedy request (temperature 0) that ignores EOS: the same prompt gives the
    same tokens, and always ``max_new_tokens`` of them, on every run."""
    request = inference_pb2.GenerateRequest(
        token_ids=prompt,
        max_new_tokens=max_new_tokens,
        ignore_eos=True,
        request_id=request_id,
        sampling=inference_pb2.SamplingParams(temperature=0.0),
    )
    stub = inference_pb2_grpc.InferenceStub(channel)
    return [e.token_id for e in stub.Generate(request, timeout=timeout_s, metadata=metadata)]
