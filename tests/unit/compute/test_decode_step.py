"""Decode steps through the native dense half (compute_svc.engine.decode_step) against transformers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.decoding import (
    PROMPT,
    check_a_failed_step_changes_nothing,
    check_decode_logits,
    counting,
    greedy,
    plain_greedy,
    prepare,
)

COVERED = ["gpt_oss", "mixtral", "qwen2_moe", "qwen3_moe"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", COVERED)
def test_greedy_decode_through_the_native_dense_half_matches_generate(arch, dtype, local_engine):
    engine, _, tiny = local_engine(arch, dtype=dtype)
    assert engine.decode_step is not None
    assert engine.decode_step.native_head  # the final norm and the LM head in the native call too
    calls = counting(engine.decode_step)
    assert greedy(engine, PROMPT, 12) == plain_greedy(tiny.checkpoint, PROMPT, 12, dtype)
    assert len(calls) == 11  # every token after the prompt's first


# The native sums run in another order than oneDNN's GEMMs and sdpa's flash kernel, so bf16 logits
# may differ in their last bits: at most this many bf16 units in the last place of the largest
# logit, measured 1 (GPT-OSS, eager attention, every other rounding repeated) and 4 (sdpa models).
ULPS = {"gpt_oss": 1, "mixtral": 5, "qwen2_moe": 5, "qwen3_moe": 5}


@pytest.mark.parametrize(
    ("arch", "dtype"), [(arch, torch.bfloat16) for arch in COVERED] + [("gpt_oss", torch.float32)]
)
def test_decode_logits_equal_transformers_past_the_window_and_as_the_cache_grows(arch, dtype, local_engine):
    # 130 prompt tokens: past gpt-oss's 128-token window, and the KV buffers grow while decoding.
    engine, _, tiny = local_engine(arch, dtype=dtype)
    prompt = [(7 * i + 3) % 250 + 1 for i in range(130)]
    calls = counting(engine.decode_step)
    tokens = greedy(engine, prompt, 5)
    assert len(calls) == 4
    check_decode_logits(calls, tiny.checkpoint, prompt, tokens, dtype, ULPS[arch])


def test_a_batch_of_requests_decodes_as_each_alone(local_engine):
    engine, _, tiny = local_engine("gpt_oss", dtype=torch.bfloat16)
    prompts = [PROMPT, [3, 8, 1, 44, 21, 6, 6, 9, 12, 30, 2], [19, 4]]
    alone = [greedy(engine, p, 6) for p in prompts]
    seqs = [engine.start(prepare(engine, p, 6)) for p in prompts]
    got = [[] for _ in prompts]
    for i, seq in enumerate(seqs):  # prefill each, then decode all three in the same steps
        for _, event in engine.step([(seq, len(seq.pending))]):
            got[i].append(event.token_id)
    calls = counting(engine.decode_step)
    while not all(seq.done for seq in seqs):
        plan = [(seq, 1) for seq in seqs if not seq.done]
        for s, event in engine.step(plan):
            got[seqs.index(s)].append(event.token_id)
    for seq in seqs:
        engine.finish(seq, "length")
    assert got == alone
    assert len(calls) == 5 and calls[0].shape[0] == 3


def test_a_failed_decode_step_leaves_the_requests_as_they_were(local_engine):
    engine, _, tiny = local_engine("mixtral")
    check_a_failed_step_changes_nothing(engine, tiny.checkpoint)


@pytest.mark.parametrize("arch", ["olmoe", "deepseek_v2"])
def test_models_it_does_not_cover_decode_through_transformers(arch, local_engine):
    engine, _, tiny = local_engine(arch)
    assert engine.decode_step is None
    assert greedy(engine, PROMPT, 4) == plain_greedy(tiny.checkpoint, PROMPT, 4)


def test_a_hookless_experts_module_is_bypassed_and_a_hooked_one_still_runs_its_hooks(local_engine):
    # GPT-OSS decode steps call the runtime straight where the experts module has no hooks (the
    # module call and transformers' dispatch cost a MoE layer more than its kernel at small sizes).
    engine, _, tiny = local_engine("gpt_oss", dtype=torch.bfloat16)
    experts = engine.decode_step.layers[1].mlp.experts
    forwards = []
    original = experts.forward

    def forward(*args, **kwargs):
        forwards.append(args[0].shape[0])
        return original(*args, **kwargs)

    experts.forward = forward
    try:
        want = greedy(engine, PROMPT, 6)  # the prompt's forward, then 5 decode steps
        assert forwards == [len(PROMPT)]
        hooked = []
        handle = experts.register_forward_pre_hook(lambda _m, args: hooked.append(args[0].shape[0]))
        try:
            assert greedy(engine, PROMPT, 6) == want
        finally:
            handle.remove()
        assert hooked == [len(PROMPT)] + [1] * 5
        assert forwards == [len(PROMPT)] * 2 + [1] * 5
    finally:
        del experts.forward


@pytest.mark.parametrize("arch", COVERED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_rotation_table_equals_the_models_rotary_embedding_bit_for_bit(arch, dtype, local_engine):
    # DecodeStep.rotation reads (cos, sin) from a table of the model's rotary_emb over positions,
    # grown when a position is past it: the same bits as the call it replaces, per row.
    engine, _, _tiny = local_engine(arch, dtype=dtype)
    step = engine.decode_step
    h = torch.zeros(3, step.hidden, dtype=dtype)
    half = step.head_dim // 2
    for positions in ([5, 0, 255], [256, 3, 1000], [2047, 17, 600]):  # the second and third grow it
        position_ids = torch.tensor([positions])
        cos, sin = step.rotation(h, position_ids)
        want_cos, want_sin = step.rotation.rotary(h, position_ids)
        assert cos.dtype == dtype and cos.is_contiguous() and tuple(cos.shape) == (3, half)
        assert torch.equal(cos, want_cos.reshape(3, -1)[:, :half])
        assert torch.equal(sin, want_sin.reshape(3, -1)[:, :half])
    assert step.rotation._table[0].shape[0] == 2048  # grown by doubling, up to the maximum positions


def test_a_rotary_embedding_whose_frequencies_follow_the_positions_is_called_every_step(local_engine):
    # "dynamic" (and "longrope") rescale their frequencies by the longest position asked for: no
    # table is made; each step calls the model's rotary embedding with the step's positions.
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    engine, _, _tiny = local_engine("qwen2_moe", dtype=torch.bfloat16, rope_parameters=rope)
    step = engine.decode_step
    assert step.rotation.rotary.rope_type == "dynamic" and not step.rotation.tabled
    calls = []
    rotary = step.rotation.rotary
    step.rotation.rotary = lambda h, position_ids: (
        calls.append(position_ids.tolist()) or rotary(h, position_ids)
    )
    h = torch.zeros(2, step.hidden, dtype=torch.bfloat16)
    cos, sin = step.rotation(h, torch.tensor([[3000, 7]]))  # past the model's 2048 positions
    want_cos, want_sin = rotary(h, torch.tensor([[3000, 7]]))
    half = step.head_dim // 2
    assert torch.equal(cos, want_cos.reshape(2, -1)[:, :half]) and torch.equal(
        sin, want_sin.reshape(2, -1)[:, :half]
    )
    assert calls == [[[3000, 7]]] and step.rotation._table is None


def test_layer_ahead_routes_a_later_layer_as_its_router_module_does(local_engine):
    # DecodeAttention.route_with: layer j's router on another layer's MoE input, what a native
    # span's lookahead sends: the same top-k experts and softmax weights, bit for bit, as the
    # GPT-OSS router module (LayerAheadPredictor.predict_host's input) on the same rows.
    dtype = torch.bfloat16
    engine, _, _ = local_engine("gpt_oss", dtype=dtype)
    step = engine.decode_step
    attention, top_k = step.attention, step.mlps.top_k
    assert top_k > 0
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(3, step.hidden, generator=gen) * 2).to(dtype)  # 3 rows
    storage = x.view(torch.int16).numpy()
    for j, layer in enumerate(step.layers):
        ids = np.empty((3, top_k), np.int64)
        scores = torch.empty(3, top_k, dtype=dtype)
        attention.route_with(j, storage, ids, scores.view(torch.int16).numpy())
        router = layer.mlp.router
        _, want_scores, want_ids = type(router).forward(router, x)
        assert ids.tolist() == want_ids.tolist(), j
        assert torch.equal(scores, want_scores.to(dtype)), j
    with pytest.raises(ValueError, match="no layer 99"):
        attention.route_with(99, storage, ids, scores.view(torch.int16).numpy())
    with pytest.raises(ValueError, match=f"ids must hold {2 * top_k} values, not {3 * top_k}"):
        attention.route_with(0, storage[:2], ids, scores.view(torch.int16).numpy())
