"""The compute process over real sockets: health, model info, errors, queueing, memory.

Every process is real: a cache daemon on a unix socket and ``python -m compute_svc`` on TCP.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from moe.inference.v1 import inference_pb2, inference_pb2_grpc
from transformers import AutoModelForCausalLM

from compute_svc.server import SERVICE_NAME
from devtools.launch import REPO
from expertcache.manifest import read_manifest
from tests.procs import compute_over, start_compute, start_daemon
from tests.threads import run_in_threads

pytestmark = pytest.mark.integration

LIMIT = 64
PROMPT = list(range(5, 30))


def quarter_of_experts(manifest) -> int:
    return max(1, manifest.num_blobs // 4) * manifest.blob_bytes


@pytest.fixture(scope="module")
def served(tiny_store, tmp_path_factory):
    """A mixtral store served by a daemon (a quarter of the experts fit) and a compute process."""
    tiny = tiny_store("mixtral")
    work = tmp_path_factory.mktemp("served")
    daemon = start_daemon(
        tiny.store, work, device="cpu", device_budget_bytes=quarter_of_experts(tiny.manifest)
    )
    try:
        compute = start_compute(tiny.store, daemon, work, extra=["--max-new-tokens-limit", str(LIMIT)])
    except BaseException:
        daemon.stop()
        raise
    channel = grpc.insecure_channel(compute.address)
    yield tiny, daemon, compute, channel
    channel.close()
    compute.stop()
    daemon.stop()


def stub(channel) -> inference_pb2_grpc.InferenceStub:
    return inference_pb2_grpc.InferenceStub(channel)


def generate(channel, **fields) -> list[inference_pb2.GenerateResponse]:
    return list(stub(channel).Generate(inference_pb2.GenerateRequest(**fields), timeout=120))


def test_health_is_serving(served):
    *_, channel = served
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", SERVICE_NAME):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_model_info_describes_the_store(served):
    tiny, *_, channel = served
    info = stub(channel).GetModelInfo(inference_pb2.GetModelInfoRequest(), timeout=10)
    manifest = tiny.manifest
    assert info.model_type == "mixtral"
    assert info.num_layers == manifest.num_layers == 3
    assert list(info.moe_layers) == list(manifest.moe_layers)
    assert (info.num_experts, info.top_k, info.vocab_size) == (manifest.num_experts, manifest.top_k, 320)
    assert info.expert_bytes == manifest.blob_bytes
    assert info.total_expert_bytes == manifest.total_expert_bytes
    assert info.device_slots == manifest.num_blobs // 4
    assert info.has_tokenizer and info.max_new_tokens_limit == LIMIT and info.dtype == "float32"


def test_text_generation_streams_pieces_and_stats(served):
    tiny, *_, channel = served
    replies = generate(
        channel, text="The quick brown fox", max_new_tokens=10, ignore_eos=True, request_id="t1"
    )
    assert [r.index for r in replies] == list(range(10))
    assert replies[0].prompt_tokens > 0
    assert replies[-1].finish_reason == inference_pb2.FINISH_REASON_LENGTH
    assert all(r.latency_s > 0 for r in replies)
    assert replies[0].cache.hits + replies[0].cache.misses > 0
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny.store)
    text = tokenizer.decode([r.token_id for r in replies], skip_special_tokens=True)
    assert "".join(r.text for r in replies) == text


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(max_new_tokens=4), "prompt is empty: set text, token_ids or messages"),
        (dict(token_ids=PROMPT, max_new_tokens=0), f"max_new_tokens 0 is out of range [1, {LIMIT}]"),
        (
            dict(token_ids=PROMPT, max_new_tokens=LIMIT + 1),
            f"max_new_tokens {LIMIT + 1} is out of range [1, {LIMIT}]",
        ),
        (dict(token_ids=[1, 320], max_new_tokens=4), "token_ids[1] = 320 is out of range [0, 320)"),
    ],
)
def test_bad_requests_are_invalid_argument(served, fields, message):
    *_, channel = served
    with pytest.raises(grpc.RpcError) as info:
        generate(channel, **fields)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details()


def test_concurrent_requests_are_queued_not_dropped(served):
    *_, channel = served
    reference = [r.token_id for r in generate(channel, token_ids=PROMPT, max_new_tokens=12, ignore_eos=True)]
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def client(i: int) -> None:
        try:
            replies = generate(
                channel, token_ids=PROMPT, max_new_tokens=12, ignore_eos=True, request_id=f"c{i}"
            )
            results[i] = [r.token_id for r in replies]
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    run_in_threads(client, range(3), timeout_s=120)
    assert not errors
    assert results == {i: reference for i in range(3)}


def test_unreachable_daemon_exits_with_a_clear_message(tiny_store, tmp_path):
    tiny = tiny_store("mixtral")
    address = f"unix://{tmp_path}/no-daemon.sock"
    started = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "compute_svc",
            "--store-dir",
            str(tiny.store),
            "--daemon-address",
            address,
            "--listen-address",
            "127.0.0.1:0",
            "--daemon-connect-timeout-s",
            "1",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    elapsed = time.monotonic() - started
    assert proc.returncode == 2, proc.stderr
    assert f"cache daemon at {address} is not reachable after 1s" in proc.stderr
    # Interpreter start and imports take most of it (20 s seen on a loaded 2-core machine); a
    # compute that kept retrying would reach the 60 s timeout above.
    assert elapsed < 45, f"took {elapsed:.1f}s to give up"


def routed_experts(checkpoint: Path, layer: int, prompt: list[int]) -> list[int]:
    """Experts the plain model's router picks for ``prompt`` at decoder ``layer``."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    seen: list[torch.Tensor] = []
    hook = model.model.layers[layer].mlp.experts.register_forward_pre_hook(
        lambda m, args: seen.append(args[1])
    )
    with torch.no_grad():
        model(input_ids=torch.tensor([prompt]))
    hook.remove()
    return sorted(set(seen[0].reshape(-1).tolist()))


def test_corrupt_expert_is_data_loss_and_no_token_is_streamed(tiny_store, tmp_path):
    tiny = tiny_store("mixtral")
    store = tmp_path / "store"
    shutil.copytree(tiny.store, store)  # this test damages its own copy
    manifest = read_manifest(store)
    layer = manifest.moe_layers[0]
    victim = routed_experts(tiny.checkpoint, layer, PROMPT)[0]
    daemon = start_daemon(store, tmp_path, device="cpu", device_budget_bytes=quarter_of_experts(manifest))
    with compute_over(daemon, store, tmp_path) as compute:
        # After both started, before first use: flip one byte inside the victim's blob.
        path = store / manifest.layer_files[layer]
        offset = victim * manifest.blob_bytes + manifest.parts[0].offset + 10
        with open(path, "r+b") as f:
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0xFF]))
            f.flush()
            os.fsync(f.fileno())
        received = []
        with grpc.insecure_channel(compute.address) as channel:
            with pytest.raises(grpc.RpcError) as info:
                for reply in stub(channel).Generate(
                    inference_pb2.GenerateRequest(token_ids=PROMPT, max_new_tokens=8), timeout=60
                ):
                    received.append(reply)
        assert info.value.code() == grpc.StatusCode.DATA_LOSS
        assert f"L{layer}E{victim}" in info.value.details()
        assert received == []


# -- memory: experts are never materialised in compute ------------------------------------------

# Steady-state RSS of a compute process serving a tiny model, measured on CPU with Python 3.11,
# torch 2.13 and transformers 5: ~370 MiB (~260 MiB anonymous: interpreter, torch, transformers,
# tokenizers and gRPC; ~115 MiB file-backed shared libraries). The margin adds room for
# activations, the KV cache, allocator slack and the tokenizer on top of that baseline.
RSS_MARGIN_BYTES = 640 << 20


def vm_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def test_compute_memory_stays_below_dense_plus_arena_plus_margin(tiny_store, tmp_path):
    # 6 layers x 64 experts x 3 MiB = 1.125 GiB of experts: far above the margin, so compute
    # holding the experts (or a good part of them) would fail the bound below.
    big = tiny_store("mixtral", hidden_size=256, num_layers=6, num_experts=64, intermediate_size=1024)
    manifest = big.manifest
    assert manifest.total_expert_bytes > 1.5 * RSS_MARGIN_BYTES
    arena_bytes = (manifest.total_expert_bytes // 10) // manifest.blob_bytes * manifest.blob_bytes
    assert manifest.total_expert_bytes >= 10 * arena_bytes
    daemon = start_daemon(big.store, tmp_path, device="cpu", device_budget_bytes=arena_bytes)
    with compute_over(daemon, big.store, tmp_path) as compute:
        with grpc.insecure_channel(compute.address) as channel:
            replies = generate(channel, token_ids=list(range(1, 60)), max_new_tokens=16, ignore_eos=True)
        assert len(replies) == 16
        assert sum(r.cache.misses for r in replies) > manifest.num_blobs // 10  # experts streamed through
        dense_bytes = (big.store / manifest.dense_file).stat().st_size
        peak = vm_kib(compute.popen.pid, "VmHWM") * 1024  # peak resident set, not just the current one
        limit = dense_bytes + arena_bytes + RSS_MARGIN_BYTES
        assert peak < limit, (
            f"compute peak RSS {peak / 2**20:.0f} MiB >= dense {dense_bytes / 2**20:.0f} MiB + arena "
            f"{arena_bytes / 2**20:.0f} MiB + margin {RSS_MARGIN_BYTES / 2**20:.0f} MiB "
            f"(experts total {manifest.total_expert_bytes / 2**20:.0f} MiB)"
        )


def test_no_shm_fast_path_sends_every_acquire_through_demand(served, tmp_path):
    """``--no-shm-fast-path``: same tokens as the fast-path process, no pin through the slot table."""
    from moe.cache.v1 import cache_pb2, cache_pb2_grpc

    tiny, daemon, _, channel = served
    cache_channel = grpc.insecure_channel(daemon.address)
    cache = cache_pb2_grpc.ExpertCacheStub(cache_channel)

    def demands() -> int:
        return cache.GetStats(cache_pb2.GetStatsRequest(), timeout=10).demands

    fast = generate(channel, token_ids=PROMPT, max_new_tokens=6, ignore_eos=True)
    slow_proc = start_compute(tiny.store, daemon, tmp_path, extra=["--no-shm-fast-path"])
    slow_channel = grpc.insecure_channel(slow_proc.address)
    try:
        before = demands()
        slow = generate(slow_channel, token_ids=PROMPT, max_new_tokens=6, ignore_eos=True)
        after = demands()
    finally:
        slow_channel.close()
        cache_channel.close()
        slow_proc.stop()
    assert [r.token_id for r in slow] == [r.token_id for r in fast]
    # 6 forward passes, each acquiring every MoE layer at least once, all through Demand.
    assert after - before >= 6 * len(tiny.manifest.moe_layers)
