"""Decode steps as replayed pieces over a KV pool (compute_svc.engine.graph_step) and MoE layers read by
slot index (compute_svc.experts.slots), run eagerly on the CPU, against transformers."""

from __future__ import annotations

import pytest
import torch

from compute_svc.engine.kv_cache import PooledKV, SequenceKV
from tests.decoding import (
    PROMPT,
    check_a_failed_step_changes_nothing,
    check_decode_logits,
    counting,
    greedy,
    plain_greedy,
    prepare,
)

COVERED = ["gpt_oss", "mixtral", "qwen3_moe"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", COVERED)
def test_greedy_decode_through_graph_steps_matches_generate(arch, dtype, local_engine):
    engine, _, tiny = local_engine(arch, dtype=dtype, graph=True)
    assert engine.graph_step is not None
    calls = counting(engine.graph_step)
    assert greedy(engine, PROMPT, 12) == plain_greedy(tiny.checkpoint, PROMPT, 12, dtype)
    assert len(calls) == 11  # every token after the prompt's first
    assert engine.runtime.reader.slotted.calls >= 11 * len(tiny.manifest.moe_layers)  # and small prompts
    assert engine.graph_step.pool.free_rows == engine.graph_step.pool.rows  # the row went back


# Our rows attend over a bucket of the pool (masked past each row's position) and the experts run
# as transformers' batched_mm does, while generate's model runs grouped_mm and attends over exactly
# its tokens: the sums run in another order. Bound on the largest logit's error, in bf16 units in
# the last place (measured: at most 2).
ULPS = 4


@pytest.mark.parametrize(
    ("arch", "dtype"), [(arch, torch.bfloat16) for arch in COVERED] + [("gpt_oss", torch.float32)]
)
def test_decode_logits_equal_transformers_past_the_window_and_across_buckets(arch, dtype, local_engine):
    # 126 prompt tokens: past gpt-oss's 128-token window while decoding, the context bucket grows
    # from 128 to 256, and the pool row holds the prompt written by transformers' packed forward.
    engine, _, tiny = local_engine(arch, dtype=dtype, graph=True, graph_tokens=512)
    prompt = [(7 * i + 3) % 250 + 1 for i in range(126)]
    calls = counting(engine.graph_step)
    tokens = greedy(engine, prompt, 6)  # positions 126 .. 131: buckets 128 then 256
    assert len(calls) == 5
    assert sorted(b for _, b in engine.graph_step._plans) == [128, 256]
    check_decode_logits(calls, tiny.checkpoint, prompt, tokens, dtype, ULPS)


def test_a_batch_decodes_as_each_alone_and_rows_are_reused(local_engine):
    engine, _, tiny = local_engine("gpt_oss", dtype=torch.bfloat16, graph=True, graph_rows=3)
    pool = engine.graph_step.pool
    prompts = [PROMPT, [3, 8, 1, 44, 21, 6, 6, 9, 12, 30, 2], [19, 4], [7, 7, 1]]
    lengths = [6, 3, 6, 5]
    alone = [greedy(engine, p, n) for p, n in zip(prompts, lengths, strict=True)]
    calls = counting(engine.graph_step)
    seqs = [engine.start(prepare(engine, p, n)) for p, n in zip(prompts[:3], lengths[:3], strict=True)]
    assert pool.free_rows == 0 and all(isinstance(s.kv, PooledKV) for s in seqs)
    got = {id(s): [] for s in seqs}
    for seq in seqs:
        for _, event in engine.step([(seq, len(seq.pending))]):
            got[id(seq)].append(event.token_id)
    late = None
    while not all(s.done for s in seqs):
        plan = [(s, 1) for s in reversed(seqs) if not s.done]  # another row order than the pool's
        for s, event in engine.step(plan):
            got[id(s)].append(event.token_id)
            if s.done:
                engine.finish(s, "length")
        if late is None and pool.free_rows:  # the second request's row goes to the fourth
            late = engine.start(prepare(engine, prompts[3], lengths[3]))
            assert isinstance(late.kv, PooledKV)
            seqs.append(late)
            got[id(late)] = []
            for _, event in engine.step([(late, len(late.pending))]):
                got[id(late)].append(event.token_id)
    assert [got[id(s)] for s in seqs] == alone
    assert {c.shape[0] for c in calls} >= {3, 1}
    assert pool.free_rows == pool.rows


def test_requests_without_a_row_decode_through_transformers(local_engine):
    # One row: the second request gets its own buffers, and so does one longer than a row.
    engine, _, tiny = local_engine("mixtral", graph=True, graph_rows=1, graph_tokens=16)
    first = engine.start(prepare(engine, PROMPT, 5))
    second = engine.start(prepare(engine, PROMPT, 5))
    assert isinstance(first.kv, PooledKV) and not isinstance(second.kv, PooledKV)
    calls = counting(engine.graph_step)
    tokens = {id(first): [], id(second): []}
    for seq in (first, second):
        for _, event in engine.step([(seq, len(seq.pending))]):
            tokens[id(seq)].append(event.token_id)
    while not first.done:
        for s, event in engine.step([(first, 1), (second, 1)]):
            tokens[id(s)].append(event.token_id)
    assert calls == []  # a step with a request outside the pool runs through transformers
    want = plain_greedy(tiny.checkpoint, PROMPT, 5)
    assert tokens[id(first)] == want and tokens[id(second)] == want
    for seq in (first, second):
        engine.finish(seq, "length")
    long = engine.start(prepare(engine, PROMPT, 12))  # 7 + 12 tokens > 16
    assert type(long.kv) is SequenceKV
    engine.finish(long, "cancelled")
    assert greedy(engine, PROMPT, 5) == want and len(calls) == 4


def test_a_failed_graph_step_leaves_the_requests_as_they_were(local_engine):
    engine, _, tiny = local_engine("gpt_oss", graph=True)
    check_a_failed_step_changes_nothing(engine, tiny.checkpoint)


def test_layers_with_more_experts_than_slots_take_the_waves(local_engine):
    # Two slots for 2-of-8 routing over 3 tokens: a decode step of 3 requests may route to more
    # experts than there are slots, which the slotted layer (one pass) cannot hold.
    engine, provider, tiny = local_engine("mixtral", graph=True, slots=2)
    prompts = [PROMPT, [3, 8, 1, 44], [19, 4, 90]]
    alone = [greedy(engine, p, 4) for p in prompts]
    seqs = [engine.start(prepare(engine, p, 4)) for p in prompts]
    got = {id(s): [] for s in seqs}
    for seq in seqs:
        for _, event in engine.step([(seq, len(seq.pending))]):
            got[id(seq)].append(event.token_id)
    before = engine.runtime.reader.slotted.calls
    while not seqs[0].done:
        for s, event in engine.step([(s, 1) for s in seqs]):
            got[id(s)].append(event.token_id)
    assert [got[id(s)] for s in seqs] == alone
    assert engine.runtime.reader.slotted.calls - before < 3 * len(tiny.manifest.moe_layers)


@pytest.mark.parametrize("arch", ["qwen2_moe", "olmoe", "deepseek_v2"])
def test_models_it_does_not_cover_decode_through_transformers(arch, local_engine):
    engine, _, tiny = local_engine(arch, graph=True)
    assert engine.graph_step is None
    assert greedy(engine, PROMPT, 4) == plain_greedy(tiny.checkpoint, PROMPT, 4)
