"""Quantized checkpoints (MXFP4 GPT-OSS, block-FP8 DeepSeek-V3/Qwen3) converted into stores that
keep the checkpoint's encoding, checked against transformers' own dequantising load on CPU.

Checkpoints are the published on-disk layouts (``devtools.tiny``: ``*_blocks``/``*_scales``
with ``quantization_config`` mxfp4; e4m3 weights with ``weight_scale_inv`` and DeepSeek-V3's
fp8 ``quantization_config``). An independent MXFP4 oracle (the OCP spec's table, float64)
checks the stored bytes and their decoding without using the code under test.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from cache_daemon.convert import convert, run_conversion
from cache_daemon.convert.__main__ import main as cli_main
from cache_daemon.convert.sources import SUPPORTED_QUANTIZATION
from devtools.tiny import make_checkpoint, make_config
from expertcache.errors import FailedPrecondition, InvalidArgument, NotFound, Unsupported
from expertcache.manifest import read_manifest
from tests.stores import assert_store_matches, bits, model_tensors, read_expert, read_parts

REPO = Path(__file__).resolve().parents[3]


def dequantized_model(src: Path) -> torch.nn.Module:
    """transformers' own load of a quantized checkpoint on CPU: it dequantises (no GPU, no kernels)."""
    model = AutoModelForCausalLM.from_pretrained(src)
    experts = next(m for n, m in model.named_modules() if n.endswith("mlp.experts"))
    assert experts.down_proj.dtype.is_floating_point and experts.down_proj.element_size() >= 2
    return model


def rewrite(src: Path, edit) -> None:
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})


def edit_config(src: Path, edit) -> None:
    config = json.loads((src / "config.json").read_text())
    edit(config)
    (src / "config.json").write_text(json.dumps(config))


# -- MXFP4, against an independent oracle -------------------------------------------------------

# E2M1 values by 4-bit code, from the OCP Microscaling spec (independent of the code under test).
E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)


def random_mxfp4(num_experts: int, out_features: int, in_features: int, gen: torch.Generator):
    """Random MXFP4 weights: (blocks, scales, exact runtime tensor [E, in, out] float64)."""
    codes = torch.randint(0, 16, (num_experts, out_features, in_features), generator=gen)
    exponents = torch.randint(-8, 4, (num_experts, out_features, in_features // 32), generator=gen)
    values = E2M1[codes] * torch.pow(2.0, exponents.repeat_interleave(32, dim=-1).double())  # [E, out, in]
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)  # low nibble = even element
    blocks = packed.to(torch.uint8).reshape(num_experts, out_features, in_features // 32, 16)
    scales = (exponents + 127).to(torch.uint8)
    return blocks, scales, values.transpose(1, 2)


@pytest.fixture
def mxfp4_checkpoint(tmp_path):
    """A tiny GPT-OSS checkpoint whose experts are random MXFP4 codes, as published GPT-OSS ships them."""
    config = make_config("gpt_oss", intermediate_size=64, dtype=torch.bfloat16)  # I, H multiples of 32
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    tensors, expected = {}, {}
    for name, tensor in model.state_dict().items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name] = tensor.contiguous()
            continue
        num_experts, in_features, out_features = tensor.shape  # runtime [E, in, out]
        blocks, scales, values = random_mxfp4(num_experts, out_features, in_features, gen)
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        expected[name] = values.to(torch.bfloat16)  # exact: 3 significant bits, small exponents
    src = tmp_path / "mxfp4"
    config.save_pretrained(src)
    edit_config(src, lambda c: c.update(quantization_config={"quant_method": "mxfp4"}))
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    return src, tensors, expected


def expected_experts(tensors, expected) -> dict[int, dict[str, torch.Tensor]]:
    out = {}
    for layer in range(3):
        prefix = f"model.layers.{layer}.mlp.experts."
        out[layer] = {
            "gate_up_proj": expected[prefix + "gate_up_proj"],
            "gate_up_proj_bias": tensors[prefix + "gate_up_proj_bias"],
            "down_proj": expected[prefix + "down_proj"],
            "down_proj_bias": tensors[prefix + "down_proj_bias"],
        }
    return out


def expected_dense(tensors) -> dict[str, torch.Tensor]:
    return {n: t for n, t in tensors.items() if ".mlp.experts." not in n}


def test_mxfp4_experts_keep_their_encoding(mxfp4_checkpoint, tmp_path):
    src, tensors, expected = mxfp4_checkpoint
    manifest = convert(src, tmp_path / "store", progress=False)
    by_name = {t.name: t for t in manifest.tensors}
    gate_up = by_name["gate_up_proj"]
    assert (gate_up.encoding, gate_up.block_size, gate_up.scale_layout, gate_up.transposed) == (
        "mxfp4",
        (1, 32),
        "ue8m0",
        True,
    )
    assert (gate_up.dtype, gate_up.shape) == ("bfloat16", (64, 128))  # decoded: runtime [H, 2I]
    assert {p.name: (p.dtype, p.shape) for p in gate_up.parts} == {
        "gate_up_proj_blocks": ("uint8", (128, 2, 16)),
        "gate_up_proj_scales": ("uint8", (128, 2)),
    }
    assert by_name["down_proj_bias"].encoding == "plain"
    assert manifest.encodings == ("mxfp4", "plain")
    assert manifest.source["quantization"] == "mxfp4 (experts kept as mxfp4,plain)"
    # The stored bytes are the checkpoint's own blocks and scales, expert by expert.
    for layer in manifest.moe_layers:
        for e in range(manifest.num_experts):
            parts = read_parts(tmp_path / "store", manifest, layer, e)
            for proj in ("gate_up_proj", "down_proj"):
                for suffix in ("_blocks", "_scales"):
                    want = tensors[f"model.layers.{layer}.mlp.experts.{proj}{suffix}"][e]
                    assert torch.equal(parts[proj + suffix], want)
    # Decoded, they are the exact values (independent oracle), and the dense tensors are the checkpoint's.
    assert_store_matches(tmp_path / "store", expected_experts(tensors, expected), expected_dense(tensors))
    # The store's config describes the runtime model; the manifest says how experts are stored.
    stored_config = json.loads((tmp_path / "store" / "config.json").read_text())
    assert "quantization_config" not in stored_config
    assert AutoConfig.from_pretrained(tmp_path / "store").model_type == "gpt_oss"


def test_mxfp4_dequantize_stores_decoded_experts(mxfp4_checkpoint, tmp_path):
    src, tensors, expected = mxfp4_checkpoint
    manifest = convert(src, tmp_path / "store", progress=False, dequantize=True)
    assert manifest.encodings == ("plain",)
    assert {t.dtype for t in manifest.tensors} == {"bfloat16"}
    assert manifest.source["quantization"] == "mxfp4 (experts dequantised)"
    assert_store_matches(tmp_path / "store", expected_experts(tensors, expected), expected_dense(tensors))
    kept = convert(src, tmp_path / "kept", progress=False)
    assert manifest.blob_bytes > 2 * kept.blob_bytes


def test_mxfp4_config_without_dtype_gets_the_weights_dtype(mxfp4_checkpoint, tmp_path):
    # A config naming no dtype: from_pretrained infers it from the weights (bf16 here, the blocks
    # are uint8), and so must the store, or experts and dense weights would disagree.
    src, tensors, expected = mxfp4_checkpoint
    edit_config(src, lambda c: (c.pop("dtype", None), c.pop("torch_dtype", None)))
    manifest = convert(src, tmp_path / "store", progress=False)
    assert {t.dtype for t in manifest.tensors} == {"bfloat16"}
    assert_store_matches(tmp_path / "store", expected_experts(tensors, expected), expected_dense(tensors))
    assert json.loads((tmp_path / "store" / "config.json").read_text())["dtype"] == "bfloat16"


# -- against transformers' own dequantisation ----------------------------------------------------

QUANTIZED = [
    pytest.param("gpt_oss", "mxfp4", torch.bfloat16, id="gpt_oss-mxfp4-bf16"),
    pytest.param("gpt_oss", "mxfp4", torch.float32, id="gpt_oss-mxfp4-fp32"),
    pytest.param("deepseek_v3", "fp8", torch.bfloat16, id="deepseek_v3-fp8-bf16"),
    pytest.param("deepseek_v3", "fp8", torch.float32, id="deepseek_v3-fp8-fp32"),
    pytest.param("qwen3_moe", "fp8", torch.bfloat16, id="qwen3_moe-fp8-bf16"),
]


def quantized_checkpoint(arch: str, quantization: str, dtype: torch.dtype, path: Path, **sizes) -> Path:
    """A tiny checkpoint without a tokenizer; ``sizes`` (``make_checkpoint``'s) replace the tiny ones."""
    if arch == "gpt_oss":
        sizes.setdefault("intermediate_size", 64)  # MXFP4 groups of 32
    return make_checkpoint(arch, path, quantization=quantization, dtype=dtype, with_tokenizer=False, **sizes)


@pytest.mark.parametrize(("arch", "quantization", "dtype"), QUANTIZED)
@pytest.mark.parametrize("dequantize", [False, True], ids=["kept", "dequantized"])
def test_store_equals_transformers_dequantisation(arch, quantization, dtype, dequantize, tmp_path):
    src = quantized_checkpoint(arch, quantization, dtype, tmp_path / "ckpt")
    manifest = convert(src, tmp_path / "store", progress=False, dequantize=dequantize)
    experts, dense = model_tensors(dequantized_model(src))
    assert_store_matches(tmp_path / "store", experts, dense)  # bit for bit, experts and dense
    projections = {t.encoding for t in manifest.tensors if t.name in ("gate_up_proj", "down_proj")}
    assert projections == {"plain" if dequantize else quantization}
    assert manifest.source["experts"] == ("dequantized" if dequantize else "checkpoint encoding")


def test_fp8_store_layout(tmp_path):
    src = quantized_checkpoint("deepseek_v3", "fp8", torch.bfloat16, tmp_path / "ckpt")
    manifest = convert(src, tmp_path / "store", progress=False)
    gate_up = next(t for t in manifest.tensors if t.name == "gate_up_proj")
    assert (gate_up.encoding, gate_up.block_size, gate_up.scale_layout, gate_up.transposed) == (
        "fp8",
        (16, 16),
        "float32",
        False,
    )
    # gate [48, 64] + up [48, 64] in e4m3, each with a [3, 4] grid of scales: concatenated.
    assert {p.name: (p.dtype, p.shape) for p in gate_up.parts} == {
        "gate_up_proj": ("float8_e4m3fn", (96, 64)),
        "gate_up_proj_scale_inv": ("float32", (6, 4)),
    }
    raw = load_file(src / "model.safetensors")
    parts = read_parts(tmp_path / "store", manifest, 1, 5)
    prefix = "model.layers.1.mlp.experts.5."
    want = torch.cat([raw[prefix + "gate_proj.weight"], raw[prefix + "up_proj.weight"]]).view(torch.uint8)
    assert torch.equal(parts["gate_up_proj"].view(torch.uint8), want)
    assert torch.equal(
        parts["gate_up_proj_scale_inv"],
        torch.cat([raw[prefix + "gate_proj.weight_scale_inv"], raw[prefix + "up_proj.weight_scale_inv"]]),
    )
    assert "FP8 dense weights dequantised" in manifest.source["quantization"]
    dense = load_file(tmp_path / "store" / "dense.safetensors")
    assert not any(n.endswith("_scale_inv") for n in dense)
    assert dense["model.layers.1.self_attn.o_proj.weight"].dtype == torch.bfloat16


def test_stacked_fp8_experts_decode_as_transformers_fp8_dequantize(tmp_path):
    # transformers 5's own layout quantised by its FineGrainedFP8 (``<param>_scale_inv``): its
    # GPT-OSS loader does not read these scales, so each expert is checked against transformers'
    # Fp8Dequantize applied to the checkpoint's own slices.
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    src = quantized_checkpoint("gpt_oss", "fp8", torch.bfloat16, tmp_path / "ckpt")
    manifest = convert(src, tmp_path / "store", progress=False)
    assert manifest.source["expert_format"] == "stacked,stacked-fp8"
    raw = load_file(src / "model.safetensors")
    for layer in manifest.moe_layers:
        for e in (0, manifest.num_experts - 1):
            stored = read_expert(tmp_path / "store", manifest, layer, e)
            for proj in ("gate_up_proj", "down_proj"):
                name = f"model.layers.{layer}.mlp.experts.{proj}"
                want = Fp8Dequantize(None)._dequantize_one(
                    raw[name][e], raw[name + "_scale_inv"][e], output_dtype=torch.bfloat16
                )
                assert torch.equal(bits(stored[proj]), bits(want))


# -- bytes: the store is the checkpoint's size, and a budget holds ~3.8x as many experts ----------


def test_gpt_oss_shaped_mxfp4_store_bytes(tmp_path):
    # gpt-oss's expert shape family at the benchmark's size (hidden 512, expert intermediate 1280).
    src = quantized_checkpoint(
        "gpt_oss",
        "mxfp4",
        torch.bfloat16,
        tmp_path / "ckpt",
        hidden_size=512,
        intermediate_size=1280,
        head_dim=64,
        num_layers=2,
        num_experts=4,
    )
    result = subprocess.run(
        [sys.executable, "-m", "cache_daemon.convert", str(src), str(tmp_path / "store"), "--no-progress"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    manifest = read_manifest(tmp_path / "store")
    checkpoint_bytes = int(manifest.source["checkpoint_expert_bytes"])
    raw = load_file(src / "model.safetensors")
    assert checkpoint_bytes == sum(
        t.numel() * t.element_size() for n, t in raw.items() if ".mlp.experts." in n
    )
    ratio = manifest.total_expert_bytes / checkpoint_bytes
    assert ratio <= 1.05, ratio
    line = next(ln for ln in result.stdout.splitlines() if ln.startswith("expert bytes:"))
    assert f"store {manifest.total_expert_bytes} " in line and f"checkpoint {checkpoint_bytes} " in line
    assert f"= {ratio:.3f}x" in line and "gate_up_proj mxfp4" in line

    dequantized = convert(src, tmp_path / "bf16", progress=False, dequantize=True)
    assert dequantized.blob_bytes / manifest.blob_bytes >= 3.7
    budget = 100 * dequantized.blob_bytes  # the same budget holds ~3.8x as many MXFP4 experts
    assert budget // manifest.blob_bytes >= 370  # device slots of that budget (``Budget.slots``)


# -- refusals ------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["gptq", "awq", "bitsandbytes"])
def test_unknown_quantisation_is_refused_by_name(method, tmp_path, capsys):
    src = make_checkpoint("deepseek_v3", tmp_path / "ckpt", with_tokenizer=False)
    edit_config(src, lambda c: c.update(quantization_config={"quant_method": method, "bits": 4}))
    with pytest.raises(Unsupported, match=f"quantised with '{method}'.*" + ", ".join(SUPPORTED_QUANTIZATION)):
        convert(src, tmp_path / "store", progress=False)
    assert cli_main([str(src), str(tmp_path / "store"), "--no-progress"]) == 2
    assert f"'{method}'" in capsys.readouterr().err
    assert not (tmp_path / "store").exists()


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [("fmt", "e5m2", "only FP8 e4m3"), ("activation_scheme", "static", "only 'dynamic'")],
)
def test_fp8_variants_not_handled_are_refused(field, value, message, tmp_path):
    src = quantized_checkpoint("deepseek_v3", "fp8", torch.float32, tmp_path / "ckpt")
    edit_config(src, lambda c: c["quantization_config"].update({field: value}))
    with pytest.raises(Unsupported, match=message):
        convert(src, tmp_path / "store", progress=False)


def test_mxfp4_scales_not_matching_blocks_are_refused(tmp_path, capsys):
    src = quantized_checkpoint("gpt_oss", "mxfp4", torch.bfloat16, tmp_path / "ckpt")
    bad = "model.layers.1.mlp.experts.down_proj_scales"
    rewrite(src, lambda t: t.update({bad: t[bad][..., :1].contiguous()}))  # one scale per row, blocks have 2
    with pytest.raises(InvalidArgument, match=rf"checkpoint tensor {bad} has shape \(8, 64, 1\)"):
        convert(src, tmp_path / "store", progress=False)
    assert cli_main([str(src), str(tmp_path / "store"), "--no-progress"]) == 2
    assert bad in capsys.readouterr().err
    assert not (tmp_path / "store").exists() and not (tmp_path / "store.partial").exists()


def test_mxfp4_blocks_of_the_wrong_dtype_are_refused(tmp_path):
    src = quantized_checkpoint("gpt_oss", "mxfp4", torch.bfloat16, tmp_path / "ckpt")
    bad = "model.layers.0.mlp.experts.gate_up_proj_blocks"
    rewrite(src, lambda t: t.update({bad: t[bad].to(torch.int16)}))
    with pytest.raises(InvalidArgument, match=rf"{bad} is I16; the mxfp4 form of gate_up_proj needs U8"):
        convert(src, tmp_path / "store", progress=False)


@pytest.mark.parametrize(
    "bad",
    [
        "model.layers.2.mlp.experts.3.up_proj.weight_scale_inv",  # an expert's scales
        "model.layers.1.self_attn.o_proj.weight_scale_inv",  # a dense weight's scales
    ],
)
def test_fp8_scales_not_matching_weights_are_refused(bad, tmp_path):
    src = quantized_checkpoint("deepseek_v3", "fp8", torch.bfloat16, tmp_path / "ckpt")
    rewrite(src, lambda t: t.update({bad: t[bad][:-1].contiguous()}))  # one block row short
    with pytest.raises(InvalidArgument, match=rf"checkpoint tensor {bad} has shape"):
        convert(src, tmp_path / "store", progress=False)
    assert not (tmp_path / "store").exists()


def test_fp8_scales_missing_for_some_experts_are_named(tmp_path):
    src = quantized_checkpoint("deepseek_v3", "fp8", torch.float32, tmp_path / "ckpt")
    gone = "model.layers.2.mlp.experts.6.down_proj.weight_scale_inv"
    rewrite(src, lambda t: t.pop(gone))
    with pytest.raises(NotFound, match=gone.replace(".", r"\.")):
        convert(src, tmp_path / "store", progress=False)


def test_fp8_dense_weight_without_scales_is_refused(tmp_path):
    src = quantized_checkpoint("deepseek_v3", "fp8", torch.float32, tmp_path / "ckpt")
    rewrite(src, lambda t: t.pop("model.layers.1.self_attn.o_proj.weight_scale_inv"))
    with pytest.raises(InvalidArgument, match=r"o_proj\.weight is F8_E4M3 but the checkpoint has no"):
        convert(src, tmp_path / "store", progress=False)


def test_layers_stored_differently_need_dequantize(tmp_path):
    # Layer 2's gate_up_proj in bf16 while the others are MXFP4: one blob layout cannot hold both.
    src = quantized_checkpoint("gpt_oss", "mxfp4", torch.bfloat16, tmp_path / "ckpt")
    prefix = "model.layers.2.mlp.experts.gate_up_proj"

    def edit(t):
        t.pop(prefix + "_blocks"), t.pop(prefix + "_scales")
        t[prefix] = torch.randn(8, 64, 128).to(torch.bfloat16)

    rewrite(src, edit)
    with pytest.raises(Unsupported, match="layer 2 stores gate_up_proj as plain.*--dequantize"):
        convert(src, tmp_path / "store", progress=False)
    manifest = convert(src, tmp_path / "store", progress=False, dequantize=True)
    assert manifest.encodings == ("plain",)


def test_rerun_with_the_other_choice_needs_force(tmp_path):
    src = quantized_checkpoint("gpt_oss", "mxfp4", torch.bfloat16, tmp_path / "ckpt")
    first = run_conversion(src, tmp_path / "store", progress=False)
    again = run_conversion(src, tmp_path / "store", progress=False)
    assert not again.converted and again.manifest == first.manifest
    with pytest.raises(FailedPrecondition, match="'checkpoint encoding' form, not 'dequantized'.*--force"):
        convert(src, tmp_path / "store", progress=False, dequantize=True)
    replaced = convert(src, tmp_path / "store", progress=False, dequantize=True, force=True)
    assert replaced.encodings == ("plain",) and replaced.blob_bytes > first.manifest.blob_bytes
    assert math.isclose(replaced.total_expert_bytes / replaced.blob_bytes, first.manifest.num_blobs)
