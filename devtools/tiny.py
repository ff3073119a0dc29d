"""Small random-weight checkpoints of the supported architectures, written by transformers.

Tests, the demo and the benchmarks cannot download models, so they build real checkpoints
with transformers itself: a config of the real architecture with small sizes, the model
class, ``save_pretrained`` (and a small byte-level BPE tokenizer trained here), so the code
that loads a checkpoint directory is the same one that loads a published model.

Quantized checkpoints take the on-disk layout of the published ones (transformers cannot
write them on a machine without a GPU): ``quantization="mxfp4"`` (GPT-OSS) replaces each
stacked expert weight by ``<name>_blocks``/``<name>_scales`` (OCP MX FP4, as gpt-oss-20b
ships), ``quantization="fp8"`` (DeepSeek-V3, Qwen3, …) replaces every linear weight that
transformers' FineGrainedFP8 would quantise by e4m3 values and a ``weight_scale_inv`` per
block, made by transformers' own ``Fp8Quantize``; config.json gets the published
``quantization_config``. Everything else is what ``save_pretrained`` wrote.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

# DeepSeek-V2 (MLA attention, a dense first layer, shared experts); V3 changes two fields of it.
_DEEPSEEK_V2 = dict(
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=48,
    intermediate_size=96,
    first_k_dense_replace=1,
    n_shared_experts=1,
    kv_lora_rank=16,
    q_lora_rank=None,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=16,
    n_group=1,
    topk_group=1,
)

# Per architecture: config fields that give a small model of the real shape family.
# Layers: 3, so every architecture has at least two MoE layers (DeepSeek's first is dense).
ARCH_CONFIGS: dict[str, dict] = {
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=96),
    "qwen2_moe": dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=96,
        intermediate_size=96,
    ),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, intermediate_size=96),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2, intermediate_size=48),
    "deepseek_v2": _DEEPSEEK_V2,
    # DeepSeek-V3 is V2's layout with a low-rank query projection and grouped routing.
    "deepseek_v3": dict(_DEEPSEEK_V2, q_lora_rank=24, n_group=2),
    "gpt_oss": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=48, head_dim=16),
}

SUPPORTED_ARCHS = tuple(ARCH_CONFIGS)
QUANTIZATIONS = ("mxfp4", "fp8")
# Real FP8 releases use 128 x 128 blocks; tiny models are smaller than one such block.
TINY_FP8_BLOCK = (16, 16)

_CORPUS = (
    "Mixture of experts models route every token to a few experts. The experts live in a tiered "
    "cache: device memory, pinned host memory and an expert store on NVMe. What is moved, and "
    "when, is decided from activation awareness. The quick brown fox jumps over the lazy dog. "
    "Once upon a time there was a small model that generated text one token at a time. "
    "0123456789 + - * / = ( ) , . ; : ! ? ' \" "
)


def build_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on a built-in text (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    # A chat template in the usual shape (role headers, the assistant's turn opened at the end), so
    # requests carrying messages are served as with a real chat model.
    fast.chat_template = _CHAT_TEMPLATE
    return fast


_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|endoftext|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def make_config(
    arch: str,
    *,
    hidden_size: int = 64,
    num_layers: int = 3,
    num_experts: int | None = None,
    top_k: int | None = None,
    vocab_size: int = 320,
    dtype: torch.dtype = torch.float32,
    **overrides,
):
    """The config of a small ``arch`` model; ``num_experts``/``top_k`` override the family's."""
    if arch not in ARCH_CONFIGS:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {', '.join(SUPPORTED_ARCHS)}")
    fields = dict(ARCH_CONFIGS[arch])
    expert_field = next(f for f in ("num_local_experts", "num_experts", "n_routed_experts") if f in fields)
    if num_experts is not None:
        fields[expert_field] = num_experts
        if arch == "deepseek_v3" and num_experts % fields["n_group"]:
            fields["n_group"] = 1
    if top_k is not None:
        fields["num_experts_per_tok"] = top_k
    fields["max_position_embeddings"] = 2048
    fields.update(overrides)
    config = AutoConfig.for_model(
        arch,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab_size,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        tie_word_embeddings=False,
        **fields,
    )
    config.dtype = dtype
    return config


def make_checkpoint(
    arch: str,
    out_dir: str | Path,
    *,
    seed: int = 0,
    with_tokenizer: bool = True,
    max_shard_size: str | int | None = None,
    quantization: str | None = None,
    fp8_block_size: tuple[int, int] = TINY_FP8_BLOCK,
    **config_kwargs,
) -> Path:
    """Write a random-weight ``arch`` checkpoint to ``out_dir`` with ``save_pretrained``;
    ``quantization`` ("mxfp4" for gpt_oss, "fp8") rewrites it in that published layout."""
    if quantization not in (None, *QUANTIZATIONS):
        raise ValueError(f"unknown quantization {quantization!r}; choose one of {', '.join(QUANTIZATIONS)}")
    if quantization == "mxfp4" and arch != "gpt_oss":
        raise ValueError("mxfp4 checkpoints exist for gpt_oss only (its experts' published layout)")
    out = Path(out_dir)
    config = make_config(arch, **config_kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=config.dtype)
    # Random init of some families leaves expert weights tiny; give every weight a spread that
    # makes routing and logits depend on it, so a wrong expert shows in the output.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2 and "norm" not in name:
                param.normal_(0.0, 0.5 / param.shape[-1] ** 0.5 * 4)
    kwargs = {}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out, **kwargs)
    del model
    if quantization == "mxfp4":
        _rewrite_shards(
            out, _mxfp4_tensors, {"quant_method": "mxfp4", "modules_to_not_convert": MXFP4_NOT_CONVERTED}
        )
    elif quantization == "fp8":
        _rewrite_shards(out, _fp8_rewriter(fp8_block_size), fp8_quantization_config(fp8_block_size))
    if with_tokenizer:
        build_tokenizer(config.vocab_size).save_pretrained(out)
    return out


# -- quantized layouts ----------------------------------------------------------------------------

# gpt-oss-20b's config.json: everything but the experts stays bf16.
MXFP4_NOT_CONVERTED = [
    "model.layers.*.self_attn",
    "model.layers.*.mlp.router",
    "model.embed_tokens",
    "lm_head",
]
E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def fp8_quantization_config(block_size: tuple[int, int]) -> dict:
    """DeepSeek-V3's ``quantization_config`` (with the given block size)."""
    return {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [int(block_size[0]), int(block_size[1])],
    }


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert's weight [C, R] (x @ W, GPT-OSS's runtime layout) → MXFP4 blocks uint8
    [R, C/32, 16] and scales uint8 [R, C/32], per the OCP MX spec: each run of 32 values of an
    output row shares the exponent floor(log2(amax)) - 2, values round to the nearest E2M1
    (saturating at ±6), two codes per byte, low nibble first."""
    rows = weight.t().float()  # [R, C]
    r, c = rows.shape
    groups = rows.reshape(r, c // 32, 32)
    amax = groups.abs().amax(-1, keepdim=True)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.full_like(amax, -127))
    exponent = exponent.clamp(-127, 127)
    scaled = (groups / torch.exp2(exponent)).clamp(-6.0, 6.0)
    magnitude = (scaled.abs().unsqueeze(-1) - E2M1_GRID).abs().argmin(-1)  # nearest of the 8
    codes = magnitude | ((scaled < 0) & (magnitude > 0)).to(torch.int64) << 3
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)  # [R, G, 16]
    return packed.contiguous(), (exponent.squeeze(-1) + 127).to(torch.uint8)


def _mxfp4_tensors(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    if not name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
        return {name: tensor}
    quantized = [quantize_mxfp4(expert) for expert in tensor]  # per expert: bounded memory
    return {
        name + "_blocks": torch.stack([b for b, _ in quantized]),
        name + "_scales": torch.stack([s for _, s in quantized]),
    }


def _fp8_rewriter(block_size: tuple[int, int]):
    """transformers' own FP8 quantiser over every linear weight it would quantise (2-D
    ``*.weight`` but embeddings, routers and the LM head, and stacked experts such as GPT-OSS's
    ``mlp.experts.gate_up_proj`` [E, R, C] → ``…_scale_inv`` [E, R/bm, C/bn]); untileable ones
    stay as they are."""
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    from transformers.utils.quantization_config import FineGrainedFP8Config

    quantizer = Fp8Quantize(
        SimpleNamespace(quantization_config=FineGrainedFP8Config(weight_block_size=list(block_size)))
    )

    def rewrite(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        skip = ("embed_tokens.", "lm_head.", ".gate.weight", ".router.weight")
        stacked = name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))  # [E, R, C]
        linear = tensor.dim() == 2 and name.endswith(".weight") and not any(s in name for s in skip)
        if not (stacked or linear):
            return {name: tensor}
        return {k: v.contiguous() for k, v in quantizer._quantize_one(name, tensor).items()}

    return rewrite


def _rewrite_shards(out: Path, rewrite, quantization_config: dict) -> None:
    """Rewrite every safetensors shard of ``out`` tensor by tensor (one shard in memory at a
    time), update the shard index, and add ``quantization_config`` to config.json."""
    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.is_file() else None
    weight_map: dict[str, str] = {}
    total = 0
    for shard in sorted(out.glob("*.safetensors")):
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(str(shard), framework="pt") as f:
            metadata = f.metadata() or {"format": "pt"}
            for key in f.keys():
                tensors.update(rewrite(key, f.get_tensor(key)))
        save_file(tensors, str(shard), metadata=metadata)
        weight_map.update(dict.fromkeys(tensors, shard.name))
        total += sum(math.prod(t.shape) * t.element_size() for t in tensors.values())
    if index is not None:
        index["weight_map"] = dict(sorted(weight_map.items()))
        index.setdefault("metadata", {})["total_size"] = total
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("arch", choices=SUPPORTED_ARCHS)
    parser.add_argument("out_dir")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=3)
    parser.add_argument("--num-experts", type=int)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--intermediate-size", type=int, help="per-expert intermediate size")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quantization", choices=QUANTIZATIONS, help="write the published quantized layout")
    args = parser.parse_args(argv)
    extra = {}
    if args.intermediate_size:
        key = (
            "moe_intermediate_size"
            if "moe_intermediate_size" in ARCH_CONFIGS[args.arch]
            else "intermediate_size"
        )
        extra[key] = args.intermediate_size
    path = make_checkpoint(
        args.arch,
        args.out_dir,
        seed=args.seed,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        num_experts=args.num_experts,
        top_k=args.top_k,
        dtype=getattr(torch, args.dtype),
        quantization=args.quantization,
        **extra,
    )
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
