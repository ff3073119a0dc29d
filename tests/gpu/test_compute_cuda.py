"""Compute on a GPU: offloaded generation equals the plain model on CUDA, a MoE layer costs one host
synchronisation, slots are released only after the kernels reading them are done, and the native
core never leaves a CUDA context current on a thread that had none.

Run where a GPU exists (``pytest -m gpu``); skipped elsewhere.
"""

from __future__ import annotations

import ctypes
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from compute_svc.engine.requests import GenerationRequest
from compute_svc.experts.moe import ExpertProvider
from expertcache import native
from tests.cuda_engines import DEVICE, NEW_TOKENS, PROMPT, TOL, cuda_engine, plain
from tests.inference import generate_replies
from tests.procs import start_compute, start_daemon
from tests.providers import LocalProvider

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not native.CUDA_BUILT, reason="native core built without nvcc"),
]


@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss", "deepseek_v3"])
def test_cuda_engine_equals_the_plain_model_and_syncs_once_per_layer(arch, tiny_store):
    tiny = tiny_store(arch)
    want_logits, want_tokens = plain(tiny)
    engine, provider = cuda_engine(tiny, slots=max(1, tiny.manifest.num_blobs // 4))
    torch.testing.assert_close(engine.forward_logits(PROMPT), want_logits, **TOL)

    runtime = engine.runtime
    runtime.host_transfers = runtime.event_waits = 0
    events = list(
        engine.generate(
            engine.requests.prepare(GenerationRequest(token_ids=tuple(PROMPT), max_new_tokens=NEW_TOKENS))
        )
    )
    assert [e.token_id for e in events] == want_tokens
    layers = len(tiny.manifest.moe_layers)
    assert runtime.host_transfers == NEW_TOKENS * layers  # one per MoE layer per forward
    assert runtime.event_waits == 0  # no layer needed waves
    assert all(not n for n in provider.pins.values())  # the last layers' pins went at each step's end


def test_synchronising_operations_per_decode_step(tiny_store):
    # torch's sync debug mode warns at every operation that blocks the host on the device: a decode
    # step may have one per MoE layer (routing + layer-ahead in one transfer) and the token pick.
    tiny = tiny_store("mixtral")
    engine, _ = cuda_engine(tiny, slots=tiny.manifest.num_blobs)
    list(
        engine.generate(engine.requests.prepare(GenerationRequest(token_ids=tuple(PROMPT), max_new_tokens=2)))
    )  # warm
    torch.cuda.synchronize(DEVICE)
    layers = len(tiny.manifest.moe_layers)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            list(
                engine.generate(
                    engine.requests.prepare(GenerationRequest(token_ids=tuple(PROMPT), max_new_tokens=3))
                )
            )
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    per_step = len(syncs) / 3
    print(f"synchronising operations per decode step: {per_step:.1f} over {layers} MoE layers")
    assert per_step <= layers + 3, [str(w.message) for w in syncs[:10]]


class SlowKernels(ExpertProvider):
    """A provider whose waves' kernels run long: after a wave's experts were computed (their
    kernels queued), a sleep kernel is queued behind them on the same stream, before the runtime
    records the wave's event. The next wave then finds them still running when it wants the
    slots. (On an H100 the tiny model's kernels were done long before the host asked, so no wait
    was ever needed: the guard was there, the test could not see it.)"""

    def __init__(self, provider: LocalProvider) -> None:
        self.provider = provider
        self.pins = provider.pins

    def acquire_batches(self, layer, experts, deadline=None, trace_context=None):
        yield from self.provider.acquire_batches(layer, experts, deadline, trace_context)
        torch.cuda._sleep(50_000_000)  # tens of milliseconds of GPU time on the current stream

    def release(self, layer, experts):
        self.provider.release(layer, experts)


def test_waves_wait_for_the_kernels_before_the_slots_are_reused(tiny_store):
    # One slot: every expert is its own wave, and each next wave overwrites the slot the previous
    # one's kernels read: the event wait between waves is what keeps the output right.
    tiny = tiny_store("qwen2_moe")
    want_logits, _ = plain(tiny)
    engine, provider = cuda_engine(tiny, slots=1)
    runtime = engine.runtime
    runtime.provider = SlowKernels(provider)
    runtime.event_waits = 0
    torch.testing.assert_close(engine.forward_logits(PROMPT), want_logits, **TOL)
    assert runtime.event_waits > 0
    assert all(not n for n in provider.pins.values())


def test_native_calls_leave_no_context_current_on_a_thread_that_had_none():
    libcuda = ctypes.CDLL("libcuda.so.1")
    seen: dict[str, int] = {}

    def current() -> int:
        ctx = ctypes.c_void_p()
        assert libcuda.cuCtxGetCurrent(ctypes.byref(ctx)) == 0
        return ctx.value or 0

    def work() -> None:
        seen["before"] = current()
        arena = native.CudaArena.allocate(0, 2, 4096)
        engine = native.CopyEngine(0)
        engine.synchronize()
        arena.close()
        seen["after"] = current()

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert seen == {"before": 0, "after": 0}


def test_device_numa_node_is_known_or_minus_one():
    assert native.cuda_device_numa_node(0) >= -1
    assert native.cuda_driver_mismatch(native.cuda_driver_version()) == ""


def test_generation_through_a_cuda_daemon_equals_the_plain_model(tiny_store, tmp_path):
    tiny = tiny_store("mixtral")
    _, want_tokens = plain(tiny)
    budget = max(1, tiny.manifest.num_blobs // 4) * tiny.manifest.blob_bytes
    daemon = start_daemon(
        tiny.store, tmp_path, device="cuda", device_budget_bytes=budget, host_budget_bytes=budget
    )
    compute = None
    try:
        compute = ThreadPoolExecutor(1).submit(start_compute, tiny.store, daemon, tmp_path).result()
        replies = generate_replies(compute.address, PROMPT, NEW_TOKENS)
        assert [r.token_id for r in replies] == want_tokens
    finally:
        if compute is not None:
            compute.stop()
        daemon.stop()
