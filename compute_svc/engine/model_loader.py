"""Loading the dense part of the model from the expert store; experts stay on the meta device.

After loading, a strict check: every non-expert parameter and buffer is real, and the store's
blob layout matches this model's experts modules. Steps: docs/compute.md."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoTokenizer, GenerationConfig, PretrainedConfig

import compute_svc.experts.moe  # noqa: F401 - registers the "expertcache" experts implementation
from compute_svc.errors import DataLoss, FailedPrecondition
from compute_svc.experts.moe import IMPLEMENTATION
from expertcache.manifest import StoreManifest, store_path
from expertcache.model_structure import build_skeleton, expert_parameter_names, find_experts_sites

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True)
class LoadedModel:
    """The dense model on ``device`` with its experts modules, tokenizer and end-of-sequence ids."""

    model: torch.nn.Module
    config: PretrainedConfig
    tokenizer: object | None  # a transformers tokenizer, or None when the store has none
    manifest: StoreManifest
    experts_modules: tuple[tuple[int, torch.nn.Module], ...]  # (decoder layer, experts module)
    device: torch.device
    dtype: torch.dtype  # dtype of the dense weights
    eos_token_ids: frozenset[int]
    vocab_size: int
    dense_bytes: int  # bytes of the loaded dense tensors


def load_model(store_dir: str | Path, manifest: StoreManifest, device: torch.device) -> LoadedModel:
    """Build the skeleton from ``store_dir``, load dense weights onto ``device``, keep experts on meta."""
    store = Path(store_dir)
    _check_links_stay_inside(store)
    config = _load_config(store)
    model = build_skeleton(config, experts_implementation=IMPLEMENTATION)
    sites = find_experts_sites(model)
    _check_store_matches(manifest, sites, store)
    _check_compute_dtypes(manifest, model, sites, store)
    expert_names = expert_parameter_names(sites)

    dense_path = store_path(store, manifest.dense_file, "the dense weights file (dense_file)")
    if not dense_path.is_file():
        raise DataLoss(f"{dense_path} does not exist: the expert store at {store} is incomplete")
    try:
        state = load_file(str(dense_path), device=str(device))  # name -> tensor, on device
    except Exception as exc:  # noqa: BLE001 - safetensors raises several types for a bad file
        raise DataLoss(f"cannot read dense weights {dense_path}: {exc}") from exc
    stray = sorted(set(state) & expert_names)
    if stray:
        raise DataLoss(
            f"{dense_path} holds expert tensors {stray[:3]}: experts must come from the arena only"
        )
    dense_bytes = sum(t.numel() * t.element_size() for t in state.values())
    result = model.load_state_dict(state, strict=False, assign=True)
    del state
    if result.unexpected_keys:
        raise DataLoss(
            f"{dense_path} has tensors this {config.model_type} model does not know: {sorted(result.unexpected_keys)[:5]}"
        )
    _move_buffers(model, device)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    missing = [
        name
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]
        if tensor.is_meta and name not in expert_names
    ]
    if missing:
        raise DataLoss(f"{dense_path} lacks dense weights {missing[:5]} ({len(missing)} in all)")
    for param in model.parameters():
        param.requires_grad_(False)

    experts_modules = tuple((site.layer, model.get_submodule(site.path)) for site in sites)
    tokenizer = _load_tokenizer(store)
    dtype = next(p.dtype for n, p in model.named_parameters() if n not in expert_names)
    loaded = LoadedModel(
        model=model,
        config=config,
        tokenizer=tokenizer,
        manifest=manifest,
        experts_modules=experts_modules,
        device=device,
        dtype=dtype,
        eos_token_ids=_eos_ids(store, config, tokenizer),
        vocab_size=int(config.get_text_config().vocab_size),
        dense_bytes=dense_bytes,
    )
    logger.info(
        "loaded %s dense weights (%.1f MiB %s) on %s; %d MoE layers stay in the arena; tokenizer: %s",
        config.model_type,
        dense_bytes / 2**20,
        str(dtype).removeprefix("torch."),
        device,
        len(experts_modules),
        "yes" if tokenizer is not None else "no",
    )
    return loaded


def _check_links_stay_inside(store: Path) -> None:
    """transformers reads config, tokenizer and generation files from the store by name: none of
    them may be a symlink leading out of it (``DataLoss`` naming it)."""
    try:
        entries = list(store.iterdir())
    except OSError:
        return  # a missing store: _load_config says so
    for entry in entries:
        if entry.is_symlink():
            store_path(store, entry.name, "store file")


def _load_config(store: Path) -> PretrainedConfig:
    if not (store / "config.json").is_file():
        raise DataLoss(f"{store / 'config.json'} does not exist: {store} is not a complete expert store")
    return AutoConfig.from_pretrained(store)


def _check_store_matches(manifest: StoreManifest, sites, store: Path) -> None:
    """The store's blob layout must be exactly the experts modules' per-expert parameters."""
    layers = tuple(site.layer for site in sites)
    if tuple(manifest.moe_layers) != layers:
        raise FailedPrecondition(
            f"store {store} has MoE layers {list(manifest.moe_layers)} but the model built from its config "
            f"has {list(layers)}: convert the checkpoint again"
        )
    want = {t.name: tuple(t.shape) for t in manifest.tensors}
    for site in sites:
        have = {t.name: tuple(t.shape) for t in site.tensors}
        if have != want or site.num_experts != manifest.num_experts:
            raise FailedPrecondition(
                f"store {store} lays out experts as {want} x {manifest.num_experts} but layer {site.layer} "
                f"of the model expects {have} x {site.num_experts}: convert the checkpoint again"
            )


def _check_compute_dtypes(manifest: StoreManifest, model: torch.nn.Module, sites, store: Path) -> None:
    """Experts decode into the dtype of the model's expert parameters (e.g. MXFP4 → bfloat16)."""
    module = model.get_submodule(sites[0].path)
    for tensor in manifest.tensors:
        want = str(getattr(module, tensor.name).dtype).removeprefix("torch.")
        if tensor.dtype != want:
            raise FailedPrecondition(
                f"store {store} decodes expert tensor {tensor.name} into {tensor.dtype} but the model built "
                f"from its config holds {want}: convert the checkpoint again"
            )


def _move_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Buffers not in the dense file (rotary tables) were built on CPU by the skeleton."""
    if device.type == "cpu":
        return
    for module in model.modules():
        for name, buf in list(module._buffers.items()):
            if buf is not None and not buf.is_meta and buf.device != device:
                module._buffers[name] = buf.to(device)
        original = getattr(module, "original_inv_freq", None)  # rotary: a plain tensor attribute
        if isinstance(original, torch.Tensor) and original.device != device:
            module.original_inv_freq = original.to(device)


def _load_tokenizer(store: Path):
    if not any((store / name).is_file() for name in _TOKENIZER_FILES):
        return None
    try:
        return AutoTokenizer.from_pretrained(store)
    except Exception as exc:  # noqa: BLE001 - tokenizer loading raises many types
        raise FailedPrecondition(f"the tokenizer files in {store} cannot be loaded: {exc}") from exc


def _eos_ids(store: Path, config: PretrainedConfig, tokenizer) -> frozenset[int]:
    """End-of-sequence ids as ``model.generate`` sees them: generation_config first, then config."""
    value = None
    if (store / "generation_config.json").is_file():
        value = GenerationConfig.from_pretrained(store).eos_token_id
    if value is None:
        value = getattr(config.get_text_config(), "eos_token_id", None)
    if value is None and tokenizer is not None:
        value = tokenizer.eos_token_id
    if value is None:
        return frozenset()
    return frozenset([int(value)] if isinstance(value, int) else [int(v) for v in value])
