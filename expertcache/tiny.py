"""Small random-weight checkpoints of the supported architectures, written by transformers.

Tests, the demo and the benchmarks cannot download models, so they build real checkpoints
with transformers itself: a config of the real architecture with small sizes, the model
class, ``save_pretrained`` (and a small byte-level BPE tokenizer trained here), so the code
that loads a checkpoint directory is the same one that loads a published model.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

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
    "deepseek_v2": dict(
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
    ),
    "deepseek_v3": dict(
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        intermediate_size=96,
        first_k_dense_replace=1,
        n_shared_experts=1,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        n_group=2,
        topk_group=1,
    ),
    "gpt_oss": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=48, head_dim=16),
}

SUPPORTED_ARCHS = tuple(ARCH_CONFIGS)

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
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


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
    fields.update(overrides)
    config = AutoConfig.for_model(
        arch,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab_size,
        max_position_embeddings=2048,
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
    **config_kwargs,
) -> Path:
    """Write a random-weight ``arch`` checkpoint to ``out_dir`` with ``save_pretrained``."""
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
    if with_tokenizer:
        build_tokenizer(config.vocab_size).save_pretrained(out)
    return out


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
        **extra,
    )
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
