"""Loading dense weights only: experts stay on meta, every other weight is checked present."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from compute_svc.engine.model_loader import load_model
from compute_svc.errors import DataLoss, FailedPrecondition
from compute_svc.experts.moe import LAYER_ATTR
from expertcache.model_structure import expert_parameter_names, find_experts_sites


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3", "gpt_oss"])
def test_experts_stay_on_meta_and_dense_is_real(arch, tiny_store):
    tiny = tiny_store(arch)
    loaded = load_model(tiny.store, tiny.manifest, torch.device("cpu"))
    experts = expert_parameter_names(find_experts_sites(loaded.model))
    for name, param in loaded.model.named_parameters():
        assert param.is_meta == (name in experts), name
    assert [layer for layer, _ in loaded.experts_modules] == list(tiny.manifest.moe_layers)
    assert loaded.tokenizer is not None and loaded.eos_token_ids == frozenset({0})
    assert loaded.dense_bytes == tiny.manifest.dense_bytes or tiny.manifest.dense_bytes == 0
    assert loaded.model.config._experts_implementation == "expertcache"
    assert not any(hasattr(m, LAYER_ATTR) for _, m in loaded.experts_modules)  # tagged later by attach


def test_store_without_tokenizer_loads(tiny_store):
    tiny = tiny_store("olmoe", with_tokenizer=False)
    assert load_model(tiny.store, tiny.manifest, torch.device("cpu")).tokenizer is None


def test_a_missing_dense_weight_is_data_loss(tiny_store, tmp_path):
    tiny = tiny_store("qwen3_moe")
    store = tmp_path / "store"
    shutil.copytree(tiny.store, store)
    state = load_file(store / "dense.safetensors")
    victim = next(name for name in state if "self_attn" in name)
    del state[victim]
    save_file(state, store / "dense.safetensors")
    with pytest.raises(DataLoss, match=f"lacks dense weights \\['{victim}'\\]"):
        load_model(store, tiny.manifest, torch.device("cpu"))


def test_quantized_store_loads_dense_only_and_checks_the_compute_dtype(tiny_store, tmp_path):
    tiny = tiny_store("gpt_oss", quantization="mxfp4", intermediate_size=64, dtype=torch.bfloat16)
    loaded = load_model(tiny.store, tiny.manifest, torch.device("cpu"))
    assert loaded.dtype == torch.bfloat16
    assert all(p.is_meta for _, m in loaded.experts_modules for p in m.parameters())
    # A store whose config names another dtype than its experts decode into is refused.
    store = tmp_path / "store"
    shutil.copytree(tiny.store, store)
    config = json.loads((store / "config.json").read_text())
    config["dtype"] = "float32"
    (store / "config.json").write_text(json.dumps(config))
    with pytest.raises(FailedPrecondition, match="decodes expert tensor gate_up_proj into bfloat16.*float32"):
        load_model(store, tiny.manifest, torch.device("cpu"))


@pytest.mark.parametrize("name", ["tokenizer.json", "config.json", "DENSE"])
def test_a_store_file_symlinked_out_of_the_store_is_refused(tiny_store, tmp_path, name):
    tiny = tiny_store("mixtral")
    store = tmp_path / "store"
    shutil.copytree(tiny.store, store)
    name = tiny.manifest.dense_file if name == "DENSE" else name
    outside = tmp_path / "outside"
    (store / name).rename(outside)
    (store / name).symlink_to(outside)
    with pytest.raises(DataLoss, match=f"'{name}' of store {store} resolves to {outside}, outside the store"):
        load_model(store, tiny.manifest, torch.device("cpu"))
    # The same file reached by a symlink inside the store loads.
    (store / name).unlink()
    outside.rename(store / "kept")
    (store / name).symlink_to("kept")
    load_model(store, tiny.manifest, torch.device("cpu"))
