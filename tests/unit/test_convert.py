"""The streaming expert-store converter, checked against the transformers model itself.

Every store is compared with ``AutoModelForCausalLM.from_pretrained(checkpoint)``: each blob
tensor must equal ``experts_module.<name>[e]`` bit for bit, dense.safetensors must equal the
model's other tensors.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from cache_daemon.convert import convert, run_conversion
from cache_daemon.convert import converter as converter_module
from cache_daemon.convert.__main__ import main as cli_main
from cache_daemon.convert.sources import SUPPORTED_MODEL_TYPES
from expertcache.errors import FailedPrecondition, InvalidArgument, NotFound, Unsupported
from expertcache.manifest import BLOB_ALIGN, StoreManifest, read_manifest
from expertcache.model_structure import expert_parameter_names, find_experts_sites
from expertcache.tiny import SUPPORTED_ARCHS, make_checkpoint, make_config

REPO = Path(__file__).resolve().parents[2]


# -- helpers ---------------------------------------------------------------------------------


def read_expert(store: Path, manifest: StoreManifest, layer: int, expert: int) -> dict[str, torch.Tensor]:
    """One expert's tensors, read from the blob at the manifest's offsets."""
    rel, base = manifest.layer_files[layer], expert * manifest.blob_bytes
    with open(store / rel, "rb") as f:
        f.seek(base)
        blob = bytearray(f.read(manifest.blob_bytes))
    assert len(blob) == manifest.blob_bytes
    assert zlib.crc32(blob) == manifest.checksums[layer][expert], f"checksum of L{layer}E{expert}"
    out = {}
    for t in manifest.tensors:
        dtype = getattr(torch, t.dtype)
        count = t.nbytes // dtype.itemsize
        out[t.name] = torch.frombuffer(blob, dtype=dtype, count=count, offset=t.offset).reshape(t.shape)
    return out


def assert_store_matches(
    store: Path, experts: dict[int, dict[str, torch.Tensor]], dense: dict[str, torch.Tensor]
):
    """``experts``: layer → name → stacked [E, ...] tensor; ``dense``: every other tensor."""
    manifest = read_manifest(store)
    assert manifest.blob_bytes % BLOB_ALIGN == 0
    assert sorted(manifest.moe_layers) == sorted(experts)
    for layer, params in experts.items():
        assert (
            store / manifest.layer_files[layer]
        ).stat().st_size == manifest.num_experts * manifest.blob_bytes
        assert [t.name for t in manifest.tensors] == list(params)
        for e in range(manifest.num_experts):
            stored = read_expert(store, manifest, layer, e)
            for name, param in params.items():
                assert stored[name].dtype == param.dtype, name
                assert torch.equal(stored[name], param[e]), f"layer {layer} expert {e} {name}"
    stored_dense = load_file(store / manifest.dense_file)
    assert sorted(stored_dense) == sorted(dense)
    for name, tensor in dense.items():
        assert stored_dense[name].dtype == tensor.dtype, name
        assert torch.equal(stored_dense[name], tensor), name
    assert manifest.dense_bytes == sum(t.nbytes for t in stored_dense.values())
    return manifest


def model_tensors(
    model: torch.nn.Module,
) -> tuple[dict[int, dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """(layer → experts params, dense state dict) of a loaded transformers model."""
    sites = find_experts_sites(model)
    experts = {
        s.layer: {t.name: getattr(model.get_submodule(s.path), t.name).detach() for t in s.tensors}
        for s in sites
    }
    skip = expert_parameter_names(sites) | set(getattr(model, "all_tied_weights_keys", {}) or {})
    dense = {k: v for k, v in model.state_dict().items() if k not in skip}
    return experts, dense


def assert_store_matches_model(store: Path, src: Path) -> StoreManifest:
    model = AutoModelForCausalLM.from_pretrained(src)
    experts, dense = model_tensors(model)
    manifest = assert_store_matches(store, experts, dense)
    assert manifest.model_type == model.config.model_type
    assert manifest.num_layers == model.config.num_hidden_layers
    return manifest


def mtimes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in sorted(root.rglob("*"))}


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cache_daemon.convert", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


# -- round trips -----------------------------------------------------------------------------


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
def test_round_trip_every_architecture(arch, tmp_path):
    src = make_checkpoint(arch, tmp_path / "ckpt")
    manifest = convert(src, tmp_path / "store", progress=False)
    assert manifest == assert_store_matches_model(tmp_path / "store", src)
    assert manifest.source["path"] == str(src.resolve())
    assert manifest.dense_dtype == "float32"
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "store" / name).read_bytes() == (src / name).read_bytes()
    assert not (tmp_path / "store.partial").exists()


def test_sharded_checkpoint_converts_identically(tmp_path):
    single = make_checkpoint("qwen3_moe", tmp_path / "single", with_tokenizer=False)
    sharded = make_checkpoint("qwen3_moe", tmp_path / "sharded", with_tokenizer=False, max_shard_size="20KB")
    assert len(list(sharded.glob("*.safetensors"))) > 2
    a = convert(single, tmp_path / "a", progress=False)
    b = convert(sharded, tmp_path / "b", progress=False)
    assert a.checksums == b.checksums and a.tensors == b.tensors
    for layer in a.moe_layers:
        assert (tmp_path / "a" / a.layer_files[layer]).read_bytes() == (
            tmp_path / "b" / b.layer_files[layer]
        ).read_bytes()
    dense_a, dense_b = (
        load_file(tmp_path / "a" / "dense.safetensors"),
        load_file(tmp_path / "b" / "dense.safetensors"),
    )
    assert sorted(dense_a) == sorted(dense_b) and all(torch.equal(dense_a[k], dense_b[k]) for k in dense_a)
    assert a.model_id != b.model_id  # a different file set is a different source
    assert len(b.source["files"].split(",")) == len(list(sharded.glob("*.safetensors")))
    assert_store_matches_model(tmp_path / "b", sharded)


def test_bf16_checkpoint_round_trip(tmp_path):
    src = make_checkpoint("mixtral", tmp_path / "ckpt", dtype=torch.bfloat16, with_tokenizer=False)
    manifest = convert(src, tmp_path / "store", progress=False)
    assert {t.dtype for t in manifest.tensors} == {"bfloat16"}
    assert manifest.dense_dtype == "bfloat16"
    assert_store_matches_model(tmp_path / "store", src)


def test_stacked_runtime_layout_checkpoint(tmp_path):
    # A checkpoint already in transformers 5's runtime layout (e.g. written from model.state_dict()).
    src = make_checkpoint("qwen3_moe", tmp_path / "ckpt", with_tokenizer=False)
    model = AutoModelForCausalLM.from_pretrained(src)
    stacked = tmp_path / "stacked"
    stacked.mkdir()
    (stacked / "config.json").write_bytes((src / "config.json").read_bytes())
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, stacked / "model.safetensors")
    manifest = convert(stacked, tmp_path / "store", progress=False)
    assert manifest.source["expert_format"] == "stacked"
    experts, dense = model_tensors(model)
    assert_store_matches(tmp_path / "store", experts, dense)


def test_tied_embeddings_without_lm_head(tmp_path):
    config = make_config("olmoe")
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "ckpt")
    with safe_open(tmp_path / "ckpt" / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys()
    convert(tmp_path / "ckpt", tmp_path / "store", progress=False)
    assert "lm_head.weight" not in load_file(tmp_path / "store" / "dense.safetensors")
    assert_store_matches_model(tmp_path / "store", tmp_path / "ckpt")


# -- checkpoint/model mismatches -------------------------------------------------------------


def _rewrite(src: Path, edit) -> None:
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})


def test_missing_dense_tensor_is_named(tmp_path):
    src = make_checkpoint("deepseek_v3", tmp_path / "ckpt", with_tokenizer=False)
    _rewrite(src, lambda t: t.pop("model.layers.1.mlp.gate.e_score_correction_bias"))
    with pytest.raises(
        InvalidArgument, match=r"missing from the checkpoint: model\.layers\.1\.mlp\.gate\.e_score"
    ):
        convert(src, tmp_path / "store", progress=False)
    assert not (tmp_path / "store").exists() and not (tmp_path / "store.partial").exists()


def test_unknown_and_misshapen_tensors_are_named(tmp_path):
    src = make_checkpoint("mixtral", tmp_path / "ckpt", with_tokenizer=False)

    def edit(t):
        t["model.layers.0.extra.weight"] = torch.zeros(2)
        t["model.norm.weight"] = torch.zeros(3)

    _rewrite(src, edit)
    with pytest.raises(InvalidArgument) as info:
        convert(src, tmp_path / "store", progress=False)
    assert "unknown to the model: model.layers.0.extra.weight" in str(info.value)
    assert "model.norm.weight (3,)" in str(info.value)


def test_missing_expert_tensor_is_named(tmp_path):
    src = make_checkpoint("qwen2_moe", tmp_path / "ckpt", with_tokenizer=False)
    _rewrite(src, lambda t: t.pop("model.layers.2.mlp.experts.5.up_proj.weight"))
    with pytest.raises(NotFound, match=r"model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight"):
        convert(src, tmp_path / "store", progress=False)


def test_misshapen_expert_tensor_fails_before_writing(tmp_path):
    src = make_checkpoint("mixtral", tmp_path / "ckpt", with_tokenizer=False)
    _rewrite(
        src, lambda t: t.update({"model.layers.2.block_sparse_moe.experts.3.w3.weight": torch.zeros(95, 64)})
    )
    with pytest.raises(InvalidArgument, match=r"model\.layers\.2\.mlp\.experts\.3\.w3\.weight"):
        convert(src, tmp_path / "store", progress=False)
    assert not (tmp_path / "store").exists() and not (tmp_path / "store.partial").exists()


def test_ignored_checkpoint_keys_are_skipped(tmp_path):
    # Old checkpoints carry rotary inv_freq buffers; transformers drops them on load.
    src = make_checkpoint("mixtral", tmp_path / "ckpt", with_tokenizer=False)
    _rewrite(src, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    convert(src, tmp_path / "store", progress=False)
    assert "model.layers.0.self_attn.rotary_emb.inv_freq" not in load_file(
        tmp_path / "store" / "dense.safetensors"
    )


# -- store lifecycle -------------------------------------------------------------------------


def test_rerun_is_a_noop(tmp_path, capsys):
    src = make_checkpoint("olmoe", tmp_path / "ckpt")
    store = tmp_path / "store"
    first = run_conversion(src, store, progress=False)
    assert first.converted
    before = mtimes(store)
    second = run_conversion(src, store, progress=False)
    assert not second.converted and second.manifest == first.manifest
    assert cli_main([str(src), str(store), "--no-progress"]) == 0
    assert "up to date" in capsys.readouterr().out
    assert mtimes(store) == before


def test_interrupted_run_leaves_no_store_and_next_run_completes(tmp_path, monkeypatch):
    src = make_checkpoint("gpt_oss", tmp_path / "ckpt", with_tokenizer=False)
    store = tmp_path / "store"
    real_pack, calls = converter_module.pack_blob, []

    def failing_pack(*args, **kwargs):
        calls.append(1)
        if len(calls) == 10:
            raise RuntimeError("disk on fire")
        return real_pack(*args, **kwargs)

    monkeypatch.setattr(converter_module, "pack_blob", failing_pack)
    with pytest.raises(RuntimeError, match="disk on fire"):
        convert(src, store, progress=False)
    assert not (store / "manifest.json").exists()
    monkeypatch.undo()

    # A run killed outright leaves its partial directory behind: the next run removes it.
    (tmp_path / "store.partial" / "experts").mkdir(parents=True)
    (tmp_path / "store.partial" / "experts" / "layer_0000.bin").write_bytes(b"junk")
    assert cli_main([str(src), str(store), "--no-progress"]) == 0
    assert not (tmp_path / "store.partial").exists()
    assert_store_matches_model(store, src)


def test_store_of_another_checkpoint_is_refused_without_force(tmp_path, capsys):
    a = make_checkpoint("qwen3_moe", tmp_path / "a", seed=1, with_tokenizer=False)
    b = make_checkpoint("qwen3_moe", tmp_path / "b", seed=2, num_experts=4, with_tokenizer=False)
    store = tmp_path / "store"
    first = convert(a, store, progress=False)
    with pytest.raises(FailedPrecondition, match="--force"):
        convert(b, store, progress=False)
    assert read_manifest(store) == first
    assert cli_main([str(b), str(store), "--no-progress"]) == 2
    assert "holds the store of another checkpoint" in capsys.readouterr().err
    second = convert(b, store, force=True, progress=False)
    assert second.model_id != first.model_id and second.num_experts == 4
    assert_store_matches_model(store, b)
    assert not (tmp_path / "store.replaced").exists()


def test_non_store_destination_is_refused_without_force(tmp_path):
    src = make_checkpoint("olmoe", tmp_path / "ckpt", with_tokenizer=False)
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "precious.txt").write_text("keep me")
    with pytest.raises(FailedPrecondition, match="not empty"):
        convert(src, tmp_path / "dst", progress=False)
    assert (tmp_path / "dst" / "precious.txt").exists()
    with pytest.raises(InvalidArgument, match="must not be the checkpoint"):
        convert(src, src, force=True, progress=False)


# -- refusals and the CLI --------------------------------------------------------------------


def test_unsupported_architecture_cli_exit_2(tmp_path):
    llama = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=64
    )
    LlamaForCausalLM(llama).save_pretrained(tmp_path / "llama")
    with pytest.raises(Unsupported, match="supported: " + ", ".join(SUPPORTED_MODEL_TYPES)):
        convert(tmp_path / "llama", tmp_path / "store", progress=False)
    result = run_cli(str(tmp_path / "llama"), str(tmp_path / "store"))
    assert result.returncode == 2, result.stderr
    assert "'llama' is not supported" in result.stderr
    assert all(arch in result.stderr for arch in SUPPORTED_MODEL_TYPES)
    assert not (tmp_path / "store").exists()


def test_unsupported_model_type_in_config(tmp_path, capsys):
    src = make_checkpoint("mixtral", tmp_path / "ckpt", with_tokenizer=False)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "model_type": "mistral"}))
    assert cli_main([str(src), str(tmp_path / "store")]) == 2
    err = capsys.readouterr().err
    assert "'mistral' is not supported" in err and "qwen3_moe" in err


def test_other_quantisation_is_refused(tmp_path):
    src = make_checkpoint("deepseek_v3", tmp_path / "ckpt", with_tokenizer=False)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(Unsupported, match="'fp8'"):
        convert(src, tmp_path / "store", progress=False)


def test_bad_sources_exit_2(tmp_path, capsys):
    assert cli_main([str(tmp_path / "nope"), str(tmp_path / "store")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert cli_main([str(tmp_path / "empty"), str(tmp_path / "store")]) == 2
    assert "has no config.json" in capsys.readouterr().err
    src = make_checkpoint("olmoe", tmp_path / "ckpt", with_tokenizer=False)
    (src / "model.safetensors").rename(src / "pytorch_model.bin")
    assert cli_main([str(src), str(tmp_path / "store")]) == 2
    assert "no *.safetensors" in capsys.readouterr().err
    assert not (tmp_path / "store").exists()


def test_cli_converts(tmp_path):
    src = make_checkpoint("deepseek_v2", tmp_path / "ckpt", with_tokenizer=False)
    result = run_cli(str(src), str(tmp_path / "store"))
    assert result.returncode == 0, result.stderr
    assert "wrote" in result.stdout and "experts:" in result.stderr  # tqdm bar on stderr
    assert_store_matches_model(tmp_path / "store", src)


# -- MXFP4 -----------------------------------------------------------------------------------

# E2M1 values by 4-bit code, from the OCP Microscaling spec (independent of the code under test).
E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)


def quantise_mxfp4(num_experts: int, out_features: int, in_features: int, gen: torch.Generator):
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
    """A tiny GPT-OSS checkpoint whose experts are MXFP4, as published GPT-OSS ships them."""
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
        blocks, scales, values = quantise_mxfp4(num_experts, out_features, in_features, gen)
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        expected[name] = values.to(torch.bfloat16)  # exact: 3 significant bits, small exponents
    src = tmp_path / "mxfp4"
    config.save_pretrained(src)
    raw = json.loads((src / "config.json").read_text())
    raw["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn"],
    }
    (src / "config.json").write_text(json.dumps(raw))
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    return src, tensors, expected


def _expected_mxfp4_store(tensors, expected):
    experts, dense = {}, {}
    for name, tensor in tensors.items():
        if ".mlp.experts." in name and not name.endswith(("_blocks", "_scales")):
            continue
        if name.endswith(("_blocks", "_scales")):
            continue
        dense[name] = tensor
    for layer in range(3):
        prefix = f"model.layers.{layer}.mlp.experts."
        experts[layer] = {
            "gate_up_proj": expected[prefix + "gate_up_proj"],
            "gate_up_proj_bias": tensors[prefix + "gate_up_proj_bias"],
            "down_proj": expected[prefix + "down_proj"],
            "down_proj_bias": tensors[prefix + "down_proj_bias"],
        }
    return experts, dense


def test_mxfp4_gpt_oss_is_dequantised_to_bf16(mxfp4_checkpoint, tmp_path):
    src, tensors, expected = mxfp4_checkpoint
    manifest = convert(src, tmp_path / "store", progress=False)
    assert manifest.source["expert_format"] == "mxfp4,stacked"  # biases are plain stacked tensors
    assert "mxfp4" in manifest.source["quantization"]
    assert {t.name: t.dtype for t in manifest.tensors}["gate_up_proj"] == "bfloat16"
    experts, dense = _expected_mxfp4_store(tensors, expected)
    assert_store_matches(tmp_path / "store", experts, dense)
    # The store's config describes what it holds: dequantised experts, loadable without mxfp4.
    stored_config = json.loads((tmp_path / "store" / "config.json").read_text())
    assert "quantization_config" not in stored_config
    assert AutoConfig.from_pretrained(tmp_path / "store").model_type == "gpt_oss"


def test_mxfp4_matches_transformers_dequantisation(mxfp4_checkpoint, tmp_path):
    from transformers import Mxfp4Config

    src, _, _ = mxfp4_checkpoint
    try:
        model = AutoModelForCausalLM.from_pretrained(src, quantization_config=Mxfp4Config(dequantize=True))
    except (RuntimeError, ValueError, ImportError) as exc:  # pragma: no cover - depends on the install
        pytest.skip(f"transformers cannot dequantise MXFP4 here: {exc}")
    convert(src, tmp_path / "store", progress=False)
    experts, dense = model_tensors(model)
    assert experts[0]["gate_up_proj"].dtype == torch.bfloat16
    assert_store_matches(tmp_path / "store", experts, dense)


def test_mxfp4_config_without_dtype_gets_the_weights_dtype(mxfp4_checkpoint, tmp_path):
    # A config naming no dtype: from_pretrained infers it from the weights (bf16 here, the blocks
    # are uint8), and so must the store, or experts and dense weights would disagree.
    src, tensors, expected = mxfp4_checkpoint
    raw = json.loads((src / "config.json").read_text())
    raw.pop("dtype", None), raw.pop("torch_dtype", None)
    (src / "config.json").write_text(json.dumps(raw))
    manifest = convert(src, tmp_path / "store", progress=False)
    assert {t.dtype for t in manifest.tensors} == {"bfloat16"}
    assert_store_matches(tmp_path / "store", *_expected_mxfp4_store(tensors, expected))
    assert json.loads((tmp_path / "store" / "config.json").read_text())["dtype"] == "bfloat16"


def test_corrupt_manifest_in_destination_needs_force(tmp_path):
    src = make_checkpoint("olmoe", tmp_path / "ckpt", with_tokenizer=False)
    convert(src, tmp_path / "store", progress=False)
    (tmp_path / "store" / "manifest.json").write_text("{not json")
    with pytest.raises(FailedPrecondition, match="--force"):
        convert(src, tmp_path / "store", progress=False)
    convert(src, tmp_path / "store", force=True, progress=False)
    assert_store_matches_model(tmp_path / "store", src)
