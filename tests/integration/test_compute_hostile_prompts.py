"""Hostile prompts against a running compute: 1 MB texts refused cost neither time nor memory.

Every process is real (a cache daemon, ``python -m compute_svc``); compute's resident set is read
from ``/proc``. Twenty 1 MB prompts that cannot fit the token limit are sent one after the
other; compute's RSS may grow by at most 200 MiB and must be back within 50 MiB of where it
started once the last refusal is answered: a call's memory goes when the call ends (nothing of it
is left for the cyclic garbage collector, ``expertcache.aio_bridge``) and the tokenizer's goes
back to the kernel before the refusal (``compute_svc.engine.prompt_text``), so nothing is waited for.
Two ways to be refused:

- by their size, before the tokenizer sees them (the tiny model's 2048 positions × its longest
  token, 13 bytes, make 26,624 bytes at most): each refusal is immediate, a small part of what
  tokenising the text takes (timed here, on the same machine as loaded now);
- by their token count, after tokenising (a model of 2^20 positions, max_prompt_tokens 100,000:
  1.3 MB of text may fit, so 1 MB is tokenised, ~560,000 tokens, then refused): what the
  tokenizer freed must go back to the kernel. The same as one chat message, through the chat
  template: counted before any id becomes a Python int, as a text prompt is.
"""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest
from moe.inference.v1 import inference_pb2, inference_pb2_grpc

from tests.procs import start_compute, start_daemon

pytestmark = pytest.mark.integration

PROMPTS = 20
PROMPT_BYTES = 1_000_000
MAX_GROWTH = 200 << 20
SETTLED_WITHIN = 50 << 20
# A refusal before tokenising takes less than this share of tokenising the text.
REFUSAL_SHARE = 0.25
SENTENCE = "Mixture of experts models route every token to a few experts in a tiered cache. "
TEXT = (SENTENCE * (PROMPT_BYTES // len(SENTENCE) + 1))[:PROMPT_BYTES]


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise KeyError("VmRSS")


def refuse(stub, text: str, *, chat: bool = False) -> tuple[str, float]:
    """Send ``text`` as the prompt (or as a user message, through the chat template)."""
    if chat:
        request = inference_pb2.GenerateRequest(
            messages=[inference_pb2.ChatMessage(role="user", content=text)], max_new_tokens=1
        )
    else:
        request = inference_pb2.GenerateRequest(text=text, max_new_tokens=1)
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request, timeout=120))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    return info.value.details(), time.monotonic() - started


def tokenising_s(store: Path, text: str) -> float:
    """Seconds the store's tokenizer takes on ``text`` in this process: what an immediate
    refusal is measured against."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(store)
    started = time.monotonic()
    tokenizer.backend_tokenizer.encode(text)
    return time.monotonic() - started


@pytest.mark.parametrize(
    ("model", "flags", "refusal", "immediate", "chat"),
    [
        ({}, [], "more than any prompt of at most 2048 tokens (max_prompt_tokens) can be", True, False),
        (
            {"max_position_embeddings": 1 << 20},
            ["--max-prompt-tokens", "100000"],
            "this service takes at most 100000",
            False,
            False,
        ),
        (
            {"max_position_embeddings": 1 << 20},
            ["--max-prompt-tokens", "100000"],
            "this service takes at most 100000",
            False,
            True,
        ),
    ],
    ids=["refused-before-tokenising", "refused-after-tokenising", "chat-refused-after-tokenising"],
)
def test_refused_megabyte_prompts_leave_no_memory_behind(
    tiny_store, tmp_path, model, flags, refusal, immediate, chat
):
    tiny = tiny_store("mixtral", **model)
    per_prompt_s = REFUSAL_SHARE * tokenising_s(tiny.store, TEXT) if immediate else None
    daemon = start_daemon(
        tiny.store,
        tmp_path,
        device="cpu",
        device_budget_bytes=tiny.manifest.num_blobs * tiny.manifest.blob_bytes,
    )
    compute = None
    try:
        compute = start_compute(tiny.store, daemon, tmp_path, flags)
        pid = compute.popen.pid
        with grpc.insecure_channel(compute.address) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            # Warm up what every request touches once (the tokenizer, the model's first forward).
            warm = inference_pb2.GenerateRequest(text="The quick brown fox", max_new_tokens=2)
            list(stub.Generate(warm, timeout=120))
            start = rss(pid)
            peak = start
            for _ in range(PROMPTS):
                details, took = refuse(stub, TEXT, chat=chat)
                assert refusal in details
                if per_prompt_s is not None:
                    assert took < per_prompt_s, (
                        f"a refusal took {took:.3f}s, tokenising the text {per_prompt_s / REFUSAL_SHARE:.3f}s"
                    )
                peak = max(peak, rss(pid))
            assert peak - start <= MAX_GROWTH, (
                f"compute's RSS grew from {start >> 20} to {peak >> 20} MiB over {PROMPTS} refused prompts"
            )
            now = rss(pid)
            assert now - start <= SETTLED_WITHIN, (
                f"compute's RSS is {now >> 20} MiB after the refusals, from {start >> 20} MiB"
            )
    finally:
        if compute is not None:
            compute.stop()
        daemon.stop()
