"""Decode steps replayed as CUDA graphs (compute_svc.engine.graph_step, compute_svc.experts.slots) on a
GPU: the pieces are captured, the replayed steps equal the eager ones bit for bit and the plain
model's tokens, and a step costs one host synchronisation per MoE layer plus the token pick.

Run where a GPU exists (``pytest -m gpu``); skipped elsewhere.
"""

from __future__ import annotations

import time

import pytest
import torch

from compute_svc.engine.requests import GenerationRequest
from expertcache import native
from tests.cuda_engines import DEVICE, PROMPT, cuda_engine, plain
from tests.decoding import counting

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not native.CUDA_BUILT, reason="native core built without nvcc"),
]


def decode(engine, tokens: int) -> tuple[list[int], list[torch.Tensor], float]:
    """Greedy tokens of PROMPT, each graph step's logits and the mean decode step in ms."""
    step = engine.graph_step
    logits = counting(step)
    try:
        events = []
        request = engine.requests.prepare(
            GenerationRequest(token_ids=tuple(PROMPT), max_new_tokens=tokens, ignore_eos=True)
        )
        torch.cuda.synchronize(DEVICE)
        stamps = []
        for event in engine.generate(request):
            stamps.append(time.perf_counter())
            events.append(event.token_id)
    finally:
        del step.forward
    gaps = [b - a for a, b in zip(stamps[1:], stamps[2:], strict=False)]  # decode steps after the first
    return events, logits, 1e3 * sum(gaps) / max(1, len(gaps))


@pytest.mark.parametrize("arch", ["gpt_oss", "mixtral", "qwen3_moe"])
def test_replayed_steps_equal_eager_ones_and_the_plain_model(arch, tiny_store):
    tiny = tiny_store(arch)
    _, want_tokens = plain(tiny)  # 8 greedy tokens of the plain model on the GPU
    engine, provider = cuda_engine(tiny, slots=tiny.manifest.num_blobs)
    step = engine.graph_step
    assert step is not None and step.graphs
    eager_tokens, eager_logits, _ = decode(engine, 16)  # first use of each plan: eager, then captured
    assert step.capture_failed is None and step.captures >= 1
    slotted = engine.runtime.reader.slotted
    assert slotted is not None and slotted.capture_failed is None and slotted.captures >= 1
    tokens, logits, replay_ms = decode(engine, 16)  # every plan replayed
    assert tokens == eager_tokens
    assert tokens[: len(want_tokens)] == want_tokens
    for got, want in zip(logits, eager_logits, strict=True):
        assert torch.equal(got, want)  # the same kernels, replayed
    step.graphs = False  # the same pieces without graphs, for the figure
    slotted.graphs = False
    step._plans.clear()
    slotted._plans.clear()
    _, _, eager_ms = decode(engine, 16)
    print(
        f"{arch}: decode step {replay_ms:.2f} ms replayed vs {eager_ms:.2f} ms eager over "
        f"{len(tiny.manifest.moe_layers)} MoE layers on {torch.cuda.get_device_name(DEVICE)}"
    )
    assert all(not n for n in provider.pins.values())


def test_a_batch_of_replayed_requests_decodes_as_each_alone(tiny_store):
    tiny = tiny_store("gpt_oss")
    engine, _ = cuda_engine(tiny, slots=tiny.manifest.num_blobs)
    prompts = [PROMPT, PROMPT[:11], PROMPT[5:9]]

    def prepare(p, n):
        return engine.requests.prepare(
            GenerationRequest(token_ids=tuple(p), max_new_tokens=n, ignore_eos=True)
        )

    alone = [[e.token_id for e in engine.generate(prepare(p, 6))] for p in prompts]
    for _ in range(2):  # the second round replays the plans the first one captured
        seqs = [engine.start(prepare(p, 6)) for p in prompts]
        got = {id(s): [] for s in seqs}
        for seq in seqs:
            for _, event in engine.step([(seq, len(seq.pending))]):
                got[id(seq)].append(event.token_id)
        while not all(s.done for s in seqs):
            for s, event in engine.step([(s, 1) for s in reversed(seqs) if not s.done]):
                got[id(s)].append(event.token_id)
        for seq in seqs:
            engine.finish(seq, "length")
        assert [got[id(s)] for s in seqs] == alone
    assert engine.graph_step.capture_failed is None
    assert engine.graph_step.pool.free_rows == engine.graph_step.pool.rows
