"""The streaming expert-store converter, checked against the transformers model itself.

Every store is compared with ``AutoModelForCausalLM.from_pretrained(checkpoint)``: each blob
tensor, decoded from its stored parts, must equal ``experts_module.<name>[e]`` bit for bit,
dense.safetensors must equal the model's other tensors. Quantized checkpoints (MXFP4, FP8) are
compared with transformers' own dequantising load on CPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from cache_daemon.convert import convert, run_conversion
from cache_daemon.convert import converter as converter_module
from cache_daemon.convert.__main__ import main as cli_main
from cache_daemon.convert.sources import SUPPORTED_MODEL_TYPES
from devtools.tiny import SUPPORTED_ARCHS, make_checkpoint, make_config
from expertcache.errors import FailedPrecondition, InvalidArgument, NotFound, Unsupported
from expertcache.manifest import read_manifest
from tests.stores import assert_store_matches, assert_store_matches_model, bits, model_tensors, read_parts

REPO = Path(__file__).resolve().parents[3]


# -- helpers ---------------------------------------------------------------------------------


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


@pytest.mark.parametrize(("arch", "transposed"), [("gpt_oss", True), ("mixtral", False)])
def test_plain_experts_of_a_module_computing_x_at_w_are_stored_as_rows(arch, transposed, tmp_path):
    # GPT-OSS computes x @ W with W [in, out]: its bf16 expert weights are stored transposed, as
    # [out, in] rows (as its MXFP4 blocks are), which the CPU kernels stream a row at a time;
    # Mixtral's [out, in] weights stay as they are. The biases stay 1-D and as they are.
    src = make_checkpoint(arch, tmp_path / "ckpt", dtype=torch.bfloat16, with_tokenizer=False)
    manifest = convert(src, tmp_path / "store", progress=False)
    model = AutoModelForCausalLM.from_pretrained(src)
    experts, _ = model_tensors(model)
    layer = sorted(experts)[0]
    parts = read_parts(tmp_path / "store", manifest, layer, 1)
    for t in manifest.tensors:
        param = experts[layer][t.name][1]
        if param.dim() != 2:
            assert not t.transposed, t.name
            continue
        assert (t.encoding, t.transposed) == ("plain", transposed), t.name
        assert t.parts[0].shape == (param.shape[::-1] if transposed else param.shape), t.name
        assert torch.equal(bits(parts[t.name]), bits(param.t() if transposed else param)), t.name
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


def test_corrupt_manifest_in_destination_needs_force(tmp_path):
    src = make_checkpoint("olmoe", tmp_path / "ckpt", with_tokenizer=False)
    convert(src, tmp_path / "store", progress=False)
    (tmp_path / "store" / "manifest.json").write_text("{not json")
    with pytest.raises(FailedPrecondition, match="--force"):
        convert(src, tmp_path / "store", progress=False)
    convert(src, tmp_path / "store", force=True, progress=False)
    assert_store_matches_model(tmp_path / "store", src)
