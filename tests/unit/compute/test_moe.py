"""The experts forward over arena views equals the plain transformers model (CPU, no processes)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from compute_svc.experts.fused import max_fused_rows
from compute_svc.experts.moe import IMPLEMENTATION
from compute_svc.experts.stages import route, waves
from devtools.tiny import SUPPORTED_ARCHS, make_config
from expertcache.model_structure import build_skeleton

# fp32 logits: the plain model runs grouped_mm/batched GEMMs, we run one GEMM per expert, so
# the summation order inside the matmuls differs (observed max |diff| ~1e-5 on O(1) logits).
TOL = dict(rtol=1e-4, atol=1e-4)
PROMPT = list(range(3, 40))


def plain_logits(checkpoint, ids):
    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]


def test_route_groups_pairs_by_expert():
    # The worked example of the module docstring: T=2, K=2.
    top_k_index = torch.tensor([[3, 1], [1, 6]])
    top_k_weights = torch.tensor([[0.7, 0.3], [0.6, 0.4]])
    routing = route(top_k_index, top_k_weights)
    assert routing.experts == (1, 3, 6)
    assert routing.rows[1].tolist() == [1, 2]  # token 0 k=1, token 1 k=0
    assert routing.rows[3].tolist() == [0]
    assert routing.rows[6].tolist() == [3]
    assert routing.weights.tolist() == pytest.approx([0.7, 0.3, 0.6, 0.4])


def test_waves_fit_the_arena():
    assert waves((0, 1, 2, 3, 4), 2) == [(0, 1), (2, 3), (4,)]
    assert waves((5,), 8) == [(5,)]


def test_implementation_is_registered_with_transformers():
    # build_skeleton validates the name against transformers' ExpertsInterface.
    model = build_skeleton(make_config("mixtral"), experts_implementation=IMPLEMENTATION)
    assert model.config._experts_implementation == IMPLEMENTATION


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
def test_logits_match_plain_model(arch, local_engine):
    # A quarter of the experts fit: every layer evicts.
    engine, provider, tiny = local_engine(arch)
    got = engine.forward_logits(PROMPT)
    torch.testing.assert_close(got, plain_logits(tiny.checkpoint, PROMPT), **TOL)
    assert provider.loads > provider.num_slots  # eviction happened
    assert all(not n for n in provider.pins.values())  # every pin released


@pytest.mark.parametrize(
    ("arch", "num_experts", "top_k"),
    [("mixtral", 4, 1), ("mixtral", 16, 4), ("qwen3_moe", 12, 3), ("gpt_oss", 6, 1), ("deepseek_v2", 16, 6)],
)
def test_logits_match_across_expert_counts_and_top_k(arch, num_experts, top_k, local_engine):
    engine, _, tiny = local_engine(arch, num_experts=num_experts, top_k=top_k)
    torch.testing.assert_close(engine.forward_logits(PROMPT), plain_logits(tiny.checkpoint, PROMPT), **TOL)


@pytest.mark.parametrize("reverse", [False, True])
def test_one_slot_and_reordered_readiness_give_the_same_output(reverse, local_engine):
    # One slot: every expert is its own wave; reverse: experts arrive in the opposite order.
    engine, provider, tiny = local_engine("qwen2_moe", slots=1, reverse=reverse)
    torch.testing.assert_close(engine.forward_logits(PROMPT), plain_logits(tiny.checkpoint, PROMPT), **TOL)
    assert all(len(experts) == 1 for _, experts in provider.acquires)


def test_counters_count_hits_and_misses(local_engine):
    engine, provider, _ = local_engine("mixtral", slots=64)  # everything fits after the first pass
    engine.runtime.reset_counters()
    engine.forward_logits(PROMPT)
    first = engine.runtime.reset_counters()
    engine.forward_logits(PROMPT)
    second = engine.runtime.reset_counters()
    assert first.misses == provider.loads and first.hits == 0
    assert second.misses == 0 and second.hits == first.misses


def test_route_takes_the_host_copy_of_the_indices():
    top_k_index = torch.tensor([[3, 1], [1, 6]])
    routing = route(top_k_index, torch.ones(2, 2), top_k_index.reshape(-1).numpy())
    assert routing.experts == (1, 3, 6)
    assert routing.rows[1].tolist() == [1, 2]


@pytest.mark.parametrize("layer_ahead", [False, True])
def test_one_host_transfer_per_moe_layer_and_no_waits(layer_ahead, local_engine):
    # On a GPU each device→host transfer blocks the host: one per MoE layer carries the routing
    # and the layer-ahead prediction together; event waits happen only between waves.
    from compute_svc.engine.activations import RoutingCapture
    from compute_svc.engine.requests import GenerationRequest
    from compute_svc.experts.layer_ahead import LayerAheadPredictor

    engine, provider, tiny = local_engine("mixtral", slots=64)
    runtime = engine.runtime
    if layer_ahead:
        loaded = engine.loaded
        runtime.layer_ahead = LayerAheadPredictor(loaded.model, loaded.experts_modules)
    engine.enable_routing(RoutingCapture(tiny.manifest.moe_layers))  # routing observed with weights
    runtime.host_transfers = runtime.event_waits = 0
    prepared = engine.requests.prepare(
        GenerationRequest(token_ids=tuple(PROMPT), max_new_tokens=3, ignore_eos=True)
    )
    events = list(engine.generate(prepared))
    assert len(events) == 3
    assert runtime.host_transfers == 3 * len(tiny.manifest.moe_layers)
    assert runtime.event_waits == 0
    assert all(not n for n in provider.pins.values())


# -- experts stored at their checkpoint's precision ---------------------------------------------

# (arch, quantization, dtype, tolerance). fp32: as above. bf16: torch's default bf16 tolerance
# (rtol 1.6e-2, one bf16 rounding); observed equal to the last bit on these models.
BF16_TOL = dict(rtol=1.6e-2, atol=1e-5)
QUANTIZED = [
    pytest.param("gpt_oss", "mxfp4", torch.float32, TOL, id="gpt_oss-mxfp4-fp32"),
    pytest.param("gpt_oss", "mxfp4", torch.bfloat16, BF16_TOL, id="gpt_oss-mxfp4-bf16"),
    pytest.param("deepseek_v3", "fp8", torch.float32, TOL, id="deepseek_v3-fp8-fp32"),
    pytest.param("deepseek_v3", "fp8", torch.bfloat16, BF16_TOL, id="deepseek_v3-fp8-bf16"),
    pytest.param("qwen3_moe", "fp8", torch.float32, TOL, id="qwen3_moe-fp8-fp32"),
]


def quantized_config(arch: str, quantization: str, dtype: torch.dtype) -> dict:
    extra = {"intermediate_size": 64} if arch == "gpt_oss" else {}  # MXFP4 groups of 32
    return dict(quantization=quantization, dtype=dtype, **extra)


@pytest.mark.parametrize(("arch", "quantization", "dtype", "tol"), QUANTIZED)
def test_quantized_experts_match_transformers_dequantised_model(arch, quantization, dtype, tol, local_engine):
    # The reference: transformers' own load of the quantized checkpoint on CPU (it dequantises).
    engine, provider, tiny = local_engine(arch, **quantized_config(arch, quantization, dtype))
    encodings = {t.name: t.encoding for t in tiny.manifest.tensors}
    assert encodings["gate_up_proj"] == encodings["down_proj"] == quantization
    # The arena's slots hold the encoded blobs: that is all that moves.
    assert provider.arena.slot_bytes == tiny.manifest.blob_bytes
    assert tiny.manifest.blob_bytes < tiny.manifest.decoded_blob_bytes
    got = engine.forward_logits(PROMPT)
    want = plain_logits(tiny.checkpoint, PROMPT)
    assert got.dtype == want.dtype == dtype
    torch.testing.assert_close(got, want, **tol)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert provider.loads > provider.num_slots
    assert engine.runtime.decoder.scratch_bytes > 0


# -- decode-sized layers through the fused CPU kernel (compute_svc.experts.fused) ----------------
# 2 tokens: every expert has at most 2 rows, so every layer is fused (max_fused_rows)
SHORT = [5, 17]
FUSED = [
    *(pytest.param(arch, {}, TOL, id=arch) for arch in SUPPORTED_ARCHS),
    *(pytest.param(arch, {"dtype": torch.bfloat16}, BF16_TOL, id=f"{arch}-bf16") for arch in SUPPORTED_ARCHS),
]
FUSED += [pytest.param(p.values[0], quantized_config(*p.values[:3]), p.values[3], id=p.id) for p in QUANTIZED]


@pytest.mark.parametrize(("arch", "config", "tol"), FUSED)
def test_fused_kernel_matches_transformers_at_decode_sizes(arch, config, tol, local_engine):
    engine, _, tiny = local_engine(arch, **config)
    got = engine.forward_logits(SHORT)
    fused = engine.runtime.reader.fused
    assert fused is not None and fused.calls > 0, "the fused kernel did not run"
    assert all(k is not None for k in fused._by_module.values()), "a layer fell back to the torch path"
    want = plain_logits(tiny.checkpoint, SHORT)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(got, local_engine(arch, fused=False, **config)[0].forward_logits(SHORT), **tol)


def test_a_store_converted_before_rows_is_read_by_the_axpy_kernel(local_engine):
    # GPT-OSS's bf16 [in, out] weights as a store converted before they were stored as rows holds
    # them: served as they are, read as axpy, and equal to transformers.
    engine, _, tiny = local_engine("gpt_oss", dtype=torch.bfloat16, columns=True)
    assert not any(t.transposed for t in tiny.manifest.tensors)
    got = engine.forward_logits(SHORT)
    fused = engine.runtime.reader.fused
    assert fused is not None and fused.calls > 0, "the fused kernel did not run"
    assert all(k is not None for k in fused._by_module.values()), "a layer fell back to the torch path"
    assert all("'form': 'axpy'" in text for text in fused._by_spec), list(fused._by_spec)
    torch.testing.assert_close(got, plain_logits(tiny.checkpoint, SHORT), **BF16_TOL)


def test_a_layer_is_fused_up_to_the_rows_measured_for_both_its_projections_layouts():
    mxfp4, plain_t, plain = (
        {"encoding": e, "form": f} for e, f in (("mxfp4", "dot"), ("plain", "axpy"), ("plain", "dot"))
    )
    assert max_fused_rows({"compute": "bfloat16", "first": mxfp4, "down": mxfp4}) == 64
    assert max_fused_rows({"compute": "bfloat16", "first": plain_t, "down": plain_t}) == 8
    assert max_fused_rows({"compute": "bfloat16", "first": plain_t, "down": plain}) == 2
    # avx512-bf16 (vdpbf16ps dot rows): its own crossovers
    assert max_fused_rows({"compute": "bfloat16", "first": plain_t, "down": plain}, "avx512-bf16") == 8
    assert max_fused_rows({"compute": "bfloat16", "first": plain_t, "down": plain_t}, "avx512-bf16") == 16
    assert max_fused_rows({"compute": "bfloat16", "first": mxfp4, "down": plain}, "avx2") == 2
    assert max_fused_rows({"compute": "float32", "first": plain, "down": plain}) == 32
    assert max_fused_rows({"compute": "int8", "first": plain, "down": plain}) == 0


def test_greedy_decode_through_the_fused_kernel_matches_generate(local_engine):
    from compute_svc.engine.requests import GenerationRequest

    engine, _, tiny = local_engine("gpt_oss", **quantized_config("gpt_oss", "mxfp4", torch.float32))
    plain = AutoModelForCausalLM.from_pretrained(tiny.checkpoint).eval()
    with torch.no_grad():
        want = plain.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False)
    request = engine.requests.prepare(
        GenerationRequest(token_ids=tuple(PROMPT), max_new_tokens=12, ignore_eos=True)
    )
    assert [e.token_id for e in engine.generate(request)] == want[0, len(PROMPT) :].tolist()
    assert engine.runtime.reader.fused.calls > 0


# -- the routing-aware comparison that the GPU test uses (tests/equality.py) ----------------------
def test_the_routing_aware_comparison_agrees_on_the_cpu_and_finds_a_flip(local_engine):
    from tests.equality import compare_with_routing

    engine, _, tiny = local_engine("gpt_oss", **quantized_config("gpt_oss", "mxfp4", torch.float32))
    plain = AutoModelForCausalLM.from_pretrained(tiny.checkpoint).eval()
    cpu = torch.device("cpu")
    result = compare_with_routing(engine, plain, PROMPT, cpu)
    assert result.routing_agrees and result.flips == [] and result.forced is None
    torch.testing.assert_close(result.got, result.want, **TOL)

    # A fault that changes one token's experts in one layer: found, at no tie, and undone by
    # forcing transformers' routing.
    runtime = engine.runtime
    original = runtime.forward
    first_layer = tiny.manifest.moe_layers[0]

    def faulty(module, layer, hidden_states, top_k_index, top_k_weights):
        if layer == first_layer and top_k_index.shape[0] > 5:
            top_k_index = top_k_index.clone()
            taken = set(top_k_index[5].tolist())
            top_k_index[5, 0] = next(e for e in range(tiny.manifest.num_experts) if e not in taken)
        return original(module, layer, hidden_states, top_k_index, top_k_weights)

    runtime.forward = faulty
    try:
        result = compare_with_routing(engine, plain, PROMPT, cpu)
    finally:
        del runtime.forward
    assert not result.routing_agrees and (0, 5) in result.flips
    assert result.max_tie_gap > 1e-3  # not a tie: the GPU test would call it a fault
    assert not torch.allclose(result.got, result.want, **TOL)
    torch.testing.assert_close(result.forced, result.want, **TOL)
