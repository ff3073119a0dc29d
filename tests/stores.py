"""Expert stores in tests: small synthetic ones written without the converter (their blobs read
and corrupted), a valid manifest to break, and stores read back: stored parts, decoded experts,
comparison with a model."""

from __future__ import annotations

import errno
import json
import os
import zlib
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from expertcache.encodings import decode, torch_dtype
from expertcache.keys import ExpertKey
from expertcache.manifest import BLOB_ALIGN, MANIFEST_NAME, StoreManifest, plan_blob, read_manifest
from expertcache.model_structure import expert_parameter_names, find_experts_sites

# -- synthetic stores ---------------------------------------------------------------------------


def write_store(
    store: Path, *, layers: tuple[int, ...] = (1, 3), num_experts: int = 6, seed: int = 0
) -> StoreManifest:
    """A complete store of random float32 experts (4 KiB blobs, zero padding) under ``store``."""
    tensors, blob_bytes = plan_blob([("gate_up_proj", "float32", (16, 8)), ("down_proj", "float32", (8, 8))])
    gen = torch.Generator().manual_seed(seed)
    (store / "experts").mkdir(parents=True, exist_ok=True)
    layer_files, checksums = {}, {}
    for layer in layers:
        rel = f"experts/layer_{layer:04d}.bin"
        blobs = []
        for _ in range(num_experts):
            blob = bytearray(blob_bytes)
            for part in (p for t in tensors for p in t.parts):
                data = torch.randn(part.shape, generator=gen).numpy().tobytes()
                blob[part.offset : part.offset + len(data)] = data
            blobs.append(bytes(blob))
        (store / rel).write_bytes(b"".join(blobs))
        layer_files[layer] = rel
        checksums[layer] = tuple(zlib.crc32(b) for b in blobs)
    manifest = StoreManifest(
        model_type="synthetic",
        model_id=f"synthetic-{seed}",
        num_layers=max(layers) + 1,
        moe_layers=tuple(layers),
        num_experts=num_experts,
        top_k=2,
        blob_bytes=blob_bytes,
        tensors=tensors,
        layer_files=layer_files,
        checksums=checksums,
    )
    (store / MANIFEST_NAME).write_text(manifest.to_json())
    return manifest


def blob_of(store: Path, manifest: StoreManifest, key: ExpertKey) -> bytes:
    rel, offset = manifest.blob_location(key)
    with open(store / rel, "rb") as f:
        f.seek(offset)
        return f.read(manifest.blob_bytes)


def corrupt(store: Path, manifest: StoreManifest, key: ExpertKey) -> None:
    """Flip one byte inside ``key``'s blob."""
    rel, offset = manifest.blob_location(key)
    with open(store / rel, "r+b") as f:
        f.seek(offset + 5)
        byte = f.read(1)
        f.seek(offset + 5)
        f.write(bytes([byte[0] ^ 0xFF]))


def supports_o_direct(directory: Path) -> bool:
    probe = directory / ".o_direct_probe"
    probe.write_bytes(b"\0" * 4096)
    try:
        fd = os.open(probe, os.O_RDONLY | os.O_DIRECT)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return False
    else:
        os.close(fd)
        return True
    finally:
        probe.unlink()


def two_layer_manifest(
    tensor_specs: list[tuple[str, str, tuple[int, ...]]], *, model_id: str, checksums: dict
) -> StoreManifest:
    """A mixtral manifest of 2 MoE layers x 4 experts, top-2, whose expert blob holds ``tensor_specs``
    (the layer files are named but not written)."""
    tensors, blob_bytes = plan_blob(tensor_specs)
    return StoreManifest(
        model_type="mixtral",
        model_id=model_id,
        num_layers=2,
        moe_layers=(0, 1),
        num_experts=4,
        top_k=2,
        blob_bytes=blob_bytes,
        tensors=tensors,
        layer_files={0: "experts/layer_0000.bin", 1: "experts/layer_0001.bin"},
        checksums=checksums,
    )


def valid_manifest_raw() -> dict:
    """A valid manifest as the JSON object its file holds, for tests to break one key at a time."""
    manifest = two_layer_manifest(
        [("w1", "float32", (8, 4)), ("w2", "float32", (4, 8))],
        model_id="abc123",
        checksums={0: (1, 2, 3, 4), 1: (5, 6, 7, 8)},
    )
    return json.loads(manifest.to_json())


# -- stores read back ----------------------------------------------------------------------------


def read_parts(store: Path, manifest: StoreManifest, layer: int, expert: int) -> dict[str, torch.Tensor]:
    """One expert's stored parts, read from the blob at the manifest's offsets."""
    rel, base = manifest.layer_files[layer], expert * manifest.blob_bytes
    with open(store / rel, "rb") as f:
        f.seek(base)
        blob = bytearray(f.read(manifest.blob_bytes))
    assert len(blob) == manifest.blob_bytes
    assert zlib.crc32(blob) == manifest.checksums[layer][expert], f"checksum of L{layer}E{expert}"
    out = {}
    for p in manifest.parts:
        dtype = torch_dtype(p.dtype)
        count = p.nbytes // dtype.itemsize
        out[p.name] = torch.frombuffer(blob, dtype=dtype, count=count, offset=p.offset).reshape(p.shape)
    return out


def read_expert(store: Path, manifest: StoreManifest, layer: int, expert: int) -> dict[str, torch.Tensor]:
    """One expert's runtime tensors: its stored parts, decoded as the manifest says."""
    parts = read_parts(store, manifest, layer, expert)
    return {t.name: decode(t, parts).contiguous() for t in manifest.tensors}


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns (NaNs compare equal when their bits do)."""
    return tensor.contiguous().view(
        {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    )


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
        assert sorted(t.name for t in manifest.tensors) == sorted(params)
        for e in range(manifest.num_experts):
            stored = read_expert(store, manifest, layer, e)
            for name, param in params.items():
                assert stored[name].dtype == param.dtype, name
                assert torch.equal(bits(stored[name]), bits(param[e])), f"layer {layer} expert {e} {name}"
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
