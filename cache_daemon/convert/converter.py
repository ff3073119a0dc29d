"""Streaming converter: a transformers checkpoint directory → an expert store.

The whole plan is checked against the model's skeleton before anything is written; data is read
one tensor (or one expert's slice) at a time; the store is written into ``DST.partial`` and
renamed onto ``DST`` at the end, so an interrupted run never leaves a store that looks complete.
``docs/daemon.md`` draws the flow.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import sys
import zlib
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm
from transformers import AutoConfig, PretrainedConfig

from cache_daemon.convert.checkpoint import (
    CONFIG_NAME,
    SAFETENSORS_ITEMSIZE,
    Checkpoint,
    TensorReader,
    open_checkpoint,
)
from cache_daemon.convert.sources import (
    SCALE_CODES,
    ExpertRecipe,
    Quantization,
    SourceLayout,
    resolve_recipe,
    scale_inv_name,
    source_layout,
)
from cache_daemon.convert.store_dir import existing_store, partial_dir, publish, remove_stale
from expertcache.encodings import ExpertTensor, dequantize_fp8, dtype_name, get_encoding
from expertcache.errors import DataLoss, FailedPrecondition, InvalidArgument, Unsupported
from expertcache.manifest import (
    DENSE_NAME,
    MANIFEST_NAME,
    StoreManifest,
    plan_blob,
)
from expertcache.model_structure import (
    ExpertsSite,
    build_skeleton,
    expert_parameter_names,
    find_experts_sites,
    top_k_of,
)

logger = logging.getLogger(__name__)

EXPERTS_DIR = "experts"
# manifest.source["experts"]: the store keeps the checkpoint's encoding, or dequantised them.
EXPERTS_AS_CHECKPOINT, EXPERTS_DEQUANTIZED = "checkpoint encoding", "dequantized"
# Files compute needs beside the weights (config, generation defaults, tokenizer), top level only.
SIDE_FILE_PATTERNS = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "chat_template.*",
)
# Checkpoint keys transformers drops on load for every model (moved or non-persistent buffers).
ALWAYS_IGNORED = (r"rotary_emb\.inv_freq$", r"(^|\.)position_ids$")
FLOAT_CODES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}
SAFETENSORS_CODE = {dtype_name(dtype): code for code, dtype in FLOAT_CODES.items()}


def layer_file_name(layer: int) -> str:
    return f"{EXPERTS_DIR}/layer_{layer:04d}.bin"


# -- the plan: what goes where, checked before anything is written ----------------------


@dataclass(frozen=True)
class StorePlan:
    """Everything the writers need, resolved and checked against the skeleton."""

    model_type: str
    config: PretrainedConfig  # without quantization_config: the runtime model, experts decoded
    sites: tuple[ExpertsSite, ...]
    tensors: tuple[ExpertTensor, ...]  # blob layout (encodings, stored parts), same for every expert
    blob_bytes: int
    recipes: Mapping[int, tuple[ExpertRecipe, ...]]  # layer → one recipe per blob tensor
    dense_names: tuple[str, ...]  # runtime names written to dense.safetensors, sorted
    dense_scales: Mapping[str, str]  # FP8 dense weight → its weight_scale_inv (dequantised on write)
    # Dense tensors written in another dtype than the checkpoint's: dequantised FP8 weights and
    # parameters the model keeps in float32 (both as from_pretrained loads them).
    dense_dtypes: Mapping[str, torch.dtype]
    fp8_block_size: tuple[int, int] | None
    checkpoint_expert_bytes: int  # bytes of the checkpoint tensors the experts come from

    @property
    def num_experts(self) -> int:
        return self.sites[0].num_experts

    @property
    def num_blobs(self) -> int:
        return len(self.sites) * self.num_experts

    def source_forms(self) -> str:
        return ",".join(sorted({r.kind for recipes in self.recipes.values() for r in recipes}))

    def encodings(self) -> str:
        return ",".join(sorted({t.encoding for t in self.tensors}))


def load_runtime_config(checkpoint: Checkpoint, reader: TensorReader) -> PretrainedConfig:
    """The config the runtime model is built from: quantization dropped (the runtime model holds
    decoded weights; the manifest says how experts are stored), dtype that of the weights when
    config.json names none (as ``from_pretrained`` infers it)."""
    try:
        config = AutoConfig.from_pretrained(str(checkpoint.path))
    except (ValueError, TypeError, KeyError, OSError) as exc:
        raise InvalidArgument(f"transformers cannot load {checkpoint.path / CONFIG_NAME}: {exc}") from exc
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    if not checkpoint.declares_dtype:
        config.dtype = weights_dtype(reader)
        logger.info("%s names no dtype; the weights are %s", CONFIG_NAME, dtype_name(config.dtype))
    return config


def weights_dtype(reader: TensorReader) -> torch.dtype:
    """The most common floating dtype among the checkpoint's tensors (MXFP4 blocks are uint8,
    FP8 weights float8: neither counts)."""
    counts = Counter(reader.safetensors_dtype(name) for name in reader.names)
    floating = [code for code, _ in counts.most_common() if code in FLOAT_CODES]
    return FLOAT_CODES[floating[0]] if floating else torch.float32


def plan_store(
    checkpoint: Checkpoint, layout: SourceLayout, reader: TensorReader, *, dequantize: bool = False
) -> StorePlan:
    """Match every runtime tensor of the model to its checkpoint source; raise on any gap.

    Experts keep the checkpoint's encoding (plain, MXFP4, FP8) unless ``dequantize``, which
    stores them decoded into the model's dtype (the bytes transformers would load).
    """
    quantization = checkpoint.quantization()
    config = load_runtime_config(checkpoint, reader)
    skeleton = build_skeleton(config)
    sites = tuple(find_experts_sites(skeleton))
    if not sites:
        raise Unsupported(f"the {checkpoint.model_type} model built from {checkpoint.path} has no MoE layers")
    _check_uniform(sites)
    experts_module = skeleton.get_submodule(sites[0].path)
    dtypes = tuple(dtype_name(getattr(experts_module, spec.name).dtype) for spec in sites[0].tensors)
    recipes = {site.layer: _site_recipes(layout, site, reader, quantization) for site in sites}
    tensors = _expert_tensors(sites, recipes, dtypes, dequantize)
    tensors, blob_bytes = plan_blob(list(tensors))
    consumed = {name for rs in recipes.values() for r in rs for name in r.consumed_names()}
    dense_names, dense_scales = _plan_dense(skeleton, sites, reader, consumed, quantization)
    params = dict(skeleton.state_dict(keep_vars=True))
    dense_dtypes = {name: params[name].dtype for name in dense_scales}
    for name in dense_names:
        code = reader.safetensors_dtype(name)
        if name in params and name not in dense_scales and code in FLOAT_CODES:
            if params[name].dtype == torch.float32 and FLOAT_CODES[code] != torch.float32:
                dense_dtypes[name] = torch.float32  # e.g. _keep_in_fp32_modules_strict
    return StorePlan(
        model_type=checkpoint.model_type,
        config=config,
        sites=sites,
        tensors=tensors,
        blob_bytes=blob_bytes,
        recipes=recipes,
        dense_names=dense_names,
        dense_scales=dense_scales,
        dense_dtypes=dense_dtypes,
        fp8_block_size=quantization.fp8_block_size,
        checkpoint_expert_bytes=sum(reader.nbytes(name) for name in consumed),
    )


def _expert_tensors(
    sites: tuple[ExpertsSite, ...],
    recipes: Mapping[int, tuple[ExpertRecipe, ...]],
    dtypes: tuple[str, ...],
    dequantize: bool,
) -> list[ExpertTensor]:
    """One ExpertTensor per experts parameter; every layer must store it the same way (one blob
    layout serves every (layer, expert))."""
    first = recipes[sites[0].layer]
    tensors = []
    for i, (spec, dtype) in enumerate(zip(sites[0].tensors, dtypes, strict=True)):
        if dequantize:
            tensor = get_encoding("plain").plan(spec.name, dtype, spec.shape)
        else:
            tensor = first[i].encoded(dtype)
        for site in sites[1:]:
            other = recipes[site.layer][i]
            if not dequantize and other.encoded(dtype) != tensor:
                raise Unsupported(
                    f"layer {site.layer} stores {spec.name} as {other.encoding} ({other.describe(0)}) but layer "
                    f"{sites[0].layer} as {first[i].encoding} ({first[i].describe(0)}): one store layout needs "
                    "one encoding per expert tensor; convert with --dequantize"
                )
        if tensor.encoding == "plain" and sites[0].transposed and len(spec.shape) == 2:
            # x @ W with W [in, out] (GPT-OSS): stored as [out, in] rows, as its MXFP4 blocks are,
            # which the CPU kernels stream a row at a time (expertcache.encodings.Plain).
            tensor = get_encoding("plain").plan(spec.name, dtype, spec.shape, transposed=True)
        tensors.append(tensor)
    return tensors


def _check_uniform(sites: tuple[ExpertsSite, ...]) -> None:
    # One blob layout serves every (layer, expert): the store format needs identical experts.
    first = sites[0]
    for site in sites[1:]:
        if site.num_experts != first.num_experts or site.tensors != first.tensors:
            raise Unsupported(
                f"layer {site.layer}'s experts ({site.num_experts} × {site.tensors}) differ from layer "
                f"{first.layer}'s ({first.num_experts} × {first.tensors}); the store needs uniform experts"
            )


def _site_recipes(
    layout: SourceLayout, site: ExpertsSite, reader: TensorReader, quantization: Quantization
) -> tuple[ExpertRecipe, ...]:
    recipes = tuple(resolve_recipe(layout, site, spec, reader.names, quantization) for spec in site.tensors)
    for recipe in recipes:
        recipe.check_sources(reader.shape, reader.safetensors_dtype)
    return recipes


def _plan_dense(
    skeleton: torch.nn.Module,
    sites: tuple[ExpertsSite, ...],
    reader: TensorReader,
    consumed: set[str],
    quantization: Quantization,
) -> tuple[tuple[str, ...], dict[str, str]]:
    """Runtime names of the dense tensors, every one known to the model and none missing, and
    the FP8 ones among them → their ``weight_scale_inv`` (dequantised into the model's dtype when
    written: dense weights stay resident, so only the experts are worth keeping encoded)."""
    expected = {name: tuple(t.shape) for name, t in skeleton.state_dict().items()}
    for name in expert_parameter_names(sites):
        expected.pop(name, None)
    scales = {
        name: scale_inv_name(name)
        for name in reader.names
        if name not in consumed and scale_inv_name(name) in reader.names
    }
    for name, scale in scales.items():
        _check_dense_fp8(reader, name, scale, quantization)
    consumed = consumed | set(scales.values())
    ignored = _ignored_pattern(skeleton)
    dense, skipped, unexpected, mismatched = [], [], [], []
    for name in sorted(set(reader.names) - consumed):
        if name not in expected and ignored.search(name):
            skipped.append(name)
        elif name not in expected:
            unexpected.append(name)
        elif reader.shape(name) != expected[name]:
            mismatched.append(f"{name} {reader.shape(name)} (model: {expected[name]})")
        elif reader.safetensors_dtype(name) == "F8_E4M3" and name not in scales:
            raise InvalidArgument(
                f"dense tensor {name} is F8_E4M3 but the checkpoint has no {scale_inv_name(name)}"
            )
        else:
            dense.append(name)
    if skipped:  # e.g. DeepSeek-V3's multi-token-prediction layer 61, old rotary buffers
        logger.info(
            "%s (transformers ignores them on load)", _name_list("checkpoint tensors skipped", skipped)
        )
    tied = set(getattr(skeleton, "all_tied_weights_keys", {}) or {})
    missing = sorted(set(expected) - set(dense) - tied)
    problems = [
        _name_list("checkpoint tensors unknown to the model", unexpected),
        _name_list("tensors with the wrong shape", mismatched),
        _name_list("model tensors missing from the checkpoint", missing),
    ]
    problems = [p for p in problems if p]
    if problems:
        raise InvalidArgument(
            "checkpoint does not match the model built from its config: " + "; ".join(problems)
        )
    return tuple(dense), {name: scales[name] for name in dense if name in scales}


def _fp8_block(shape: tuple[int, ...], quantization: Quantization) -> tuple[int, int]:
    return quantization.fp8_block_size or (int(shape[0]), int(shape[1]))


def _check_dense_fp8(reader: TensorReader, name: str, scale: str, quantization: Quantization) -> None:
    shape, scale_shape = reader.shape(name), reader.shape(scale)
    if reader.safetensors_dtype(name) != "F8_E4M3" or len(shape) != 2:
        raise InvalidArgument(
            f"checkpoint tensor {name} has a {scale} beside it but is {reader.safetensors_dtype(name)} "
            f"{shape}, not a 2-D F8_E4M3 weight"
        )
    if reader.safetensors_dtype(scale) not in SCALE_CODES:
        raise InvalidArgument(f"checkpoint tensor {scale} is {reader.safetensors_dtype(scale)}, not float")
    bm, bn = _fp8_block(shape, quantization)
    grid = (math.ceil(shape[0] / bm), math.ceil(shape[1] / bn))
    if scale_shape != grid:
        raise InvalidArgument(
            f"checkpoint tensor {scale} has shape {scale_shape}; {name} {shape} in {bm}x{bn} blocks needs {grid}"
        )


def _ignored_pattern(skeleton: torch.nn.Module) -> re.Pattern[str]:
    """Keys transformers drops on load: the model's ignore list and non-persistent buffers."""
    patterns = list(ALWAYS_IGNORED) + list(
        getattr(skeleton, "_keys_to_ignore_on_load_unexpected", None) or ()
    )
    for prefix, module in skeleton.named_modules():
        for buffer in getattr(module, "_non_persistent_buffers_set", ()):
            patterns.append("^" + re.escape(f"{prefix}.{buffer}" if prefix else buffer) + "$")
    return re.compile("|".join(f"(?:{p})" for p in patterns))


def _name_list(what: str, names: list[str], limit: int = 8) -> str:
    if not names:
        return ""
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return f"{len(names)} {what}: {', '.join(names[:limit])}{more}"


# -- writing ---------------------------------------------------------------------------------


def pack_blob(
    tensors: tuple[ExpertTensor, ...], parts: Mapping[str, torch.Tensor], blob_bytes: int
) -> np.ndarray:
    """One expert's stored parts at their offsets in a zero-filled uint8 [blob_bytes] buffer."""
    blob = np.zeros(blob_bytes, dtype=np.uint8)
    for layout in (p for t in tensors for p in t.parts):
        raw = parts[layout.name].contiguous().reshape(-1).view(torch.uint8).numpy()  # bytes of any dtype
        if raw.nbytes != layout.nbytes:
            raise InvalidArgument(f"{layout.name}: {raw.nbytes} bytes, the layout needs {layout.nbytes}")
        blob[layout.offset : layout.offset + layout.nbytes] = raw
    return blob


def write_experts(
    plan: StorePlan, reader: TensorReader, out_dir: Path, progress: bool
) -> dict[int, tuple[int, ...]]:
    """Write every MoE layer's file; returns layer → CRC-32 of each expert's full blob."""
    (out_dir / EXPERTS_DIR).mkdir(exist_ok=True)
    checksums = {}
    with tqdm(
        total=plan.num_blobs, desc="experts", unit="expert", file=sys.stderr, disable=not progress
    ) as bar:
        for site in plan.sites:
            checksums[site.layer] = _write_layer(
                plan, site, reader, out_dir / layer_file_name(site.layer), bar
            )
    return checksums


def _write_layer(
    plan: StorePlan, site: ExpertsSite, reader: TensorReader, path: Path, bar: tqdm
) -> tuple[int, ...]:
    sums = []
    with open(path, "wb") as f:
        for expert in range(site.num_experts):  # blob e lands at e * blob_bytes: written in order
            parts: dict[str, torch.Tensor] = {}
            for recipe, tensor in zip(plan.recipes[site.layer], plan.tensors, strict=True):
                parts.update(recipe.read(expert, tensor, reader.get, reader.get_slice))
            blob = pack_blob(plan.tensors, parts, plan.blob_bytes)
            sums.append(zlib.crc32(blob))
            f.write(blob)
            bar.update()
        _sync(f)
    logger.debug("wrote layer %d: %d experts to %s", site.layer, site.num_experts, path)
    return tuple(sums)


def write_dense(plan: StorePlan, reader: TensorReader, path: Path) -> tuple[int, str]:
    """Stream the dense tensors into a safetensors file; returns (data bytes, main dtype name).

    The header (names, dtypes, shapes, offsets) is known from the checkpoint's headers, so it
    is written first and each tensor follows as it is read: one dense tensor in memory at once.
    """
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in plan.dense_names:
        code, shape = reader.safetensors_dtype(name), reader.shape(name)
        if name in plan.dense_dtypes:  # FP8 dequantised, or kept in float32: in the model's dtype
            code = SAFETENSORS_CODE[dtype_name(plan.dense_dtypes[name])]
        if code not in SAFETENSORS_ITEMSIZE:
            raise Unsupported(
                f"dense tensor {name} has safetensors dtype {code}, which the store does not take"
            )
        nbytes = math.prod(shape) * SAFETENSORS_ITEMSIZE[code]
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # safetensors pads the header to 8 bytes
    bytes_by_dtype: Counter[str] = Counter()
    with open(path, "wb") as f:
        f.write(len(header_bytes).to_bytes(8, "little") + header_bytes)
        for name in plan.dense_names:
            tensor = reader.get(name)
            if name in plan.dense_scales:
                scale = reader.get(plan.dense_scales[name]).float()
                block = _fp8_block(tuple(tensor.shape), Quantization("fp8", plan.fp8_block_size))
                tensor = dequantize_fp8(tensor, scale, block, plan.dense_dtypes[name])
            elif name in plan.dense_dtypes:
                tensor = tensor.to(plan.dense_dtypes[name])
            raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
            if raw.nbytes != header[name]["data_offsets"][1] - header[name]["data_offsets"][0]:
                raise DataLoss(f"checkpoint tensor {name} has {raw.nbytes} bytes, its header says otherwise")
            f.write(raw)
            bytes_by_dtype[dtype_name(tensor.dtype)] += raw.nbytes
        _sync(f)
    main_dtype = bytes_by_dtype.most_common(1)[0][0] if bytes_by_dtype else dtype_name(torch.float32)
    return offset, main_dtype


def copy_side_files(checkpoint: Checkpoint, runtime_dtype: torch.dtype, out_dir: Path) -> list[str]:
    """config.json, generation config and tokenizer files, so compute loads them from the store.

    config.json is copied verbatim unless the store holds something it does not describe: the
    store's config describes the runtime model, whose weights are decoded (``quantization_config``
    dropped; the manifest says how each expert tensor is stored), and a config naming no dtype
    gets the weights' dtype, so a model built from it matches the stored tensors.
    """
    config = dict(checkpoint.config)
    dropped = config.pop("quantization_config", None) is not None
    if not checkpoint.declares_dtype:
        config["dtype"] = dtype_name(runtime_dtype)
    if dropped or not checkpoint.declares_dtype:
        (out_dir / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    else:
        (out_dir / CONFIG_NAME).write_bytes(checkpoint.config_bytes)
    copied = [CONFIG_NAME]
    for pattern in SIDE_FILE_PATTERNS:
        for path in sorted(checkpoint.path.glob(pattern)):
            if path.is_file():
                shutil.copy2(path, out_dir / path.name)
                copied.append(path.name)
    return copied


def _sync(f) -> None:
    f.flush()
    os.fsync(f.fileno())


# -- entry points ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConversionResult:
    manifest: StoreManifest
    converted: bool  # False: the store was already up to date and nothing was written

    @property
    def checkpoint_expert_bytes(self) -> int:
        """Bytes of the checkpoint tensors the experts were read from (headers' sizes)."""
        return int(self.manifest.source.get("checkpoint_expert_bytes", 0))


def run_conversion(
    src: str | Path,
    dst: str | Path,
    *,
    force: bool = False,
    progress: bool = True,
    dequantize: bool = False,
) -> ConversionResult:
    """Convert ``src`` into the store ``dst`` unless it already holds this checkpoint's store
    (with the same ``dequantize`` choice)."""
    src, dst = Path(src).resolve(), Path(dst).resolve()
    checkpoint = open_checkpoint(src)
    if dst == src or dst in src.parents:
        raise InvalidArgument(f"destination {dst} must not be the checkpoint directory {src} or contain it")
    layout = source_layout(checkpoint.model_type)
    checkpoint.quantization()  # an unknown quantisation is refused before anything else
    model_id = checkpoint.source_id()
    experts_as = EXPERTS_DEQUANTIZED if dequantize else EXPERTS_AS_CHECKPOINT
    existing = existing_store(dst, force)
    remove_stale(dst)
    if existing is not None:
        if existing.model_id == model_id and existing.source.get("experts") == experts_as:
            logger.info("store %s is up to date with %s (model_id %s)", dst, src, model_id[:12])
            return ConversionResult(existing, converted=False)
        if existing.model_id == model_id:
            raise FailedPrecondition(
                f"destination {dst} holds this checkpoint's store with experts in "
                f"{existing.source.get('experts', '?')!r} form, not {experts_as!r}; pass --force to replace it"
            )
        raise FailedPrecondition(
            f"destination {dst} holds the store of another checkpoint ({existing.source.get('path', '?')}, "
            f"model_id {existing.model_id[:12]}, this one is {model_id[:12]}); pass --force to replace it"
        )
    partial = partial_dir(dst)
    partial.mkdir(parents=True)
    try:
        manifest = _convert_into(checkpoint, layout, model_id, partial, progress, dequantize)
        publish(partial, dst)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return ConversionResult(manifest, converted=True)


def _convert_into(
    checkpoint: Checkpoint, layout: SourceLayout, model_id: str, out: Path, progress: bool, dequantize: bool
) -> StoreManifest:
    with TensorReader(checkpoint, layout) as reader:
        plan = plan_store(checkpoint, layout, reader, dequantize=dequantize)
        logger.info(
            "converting %s (%s): %d MoE layers × %d experts, %d-byte blobs (%s from %s), %d dense tensors",
            checkpoint.path, plan.model_type, len(plan.sites), plan.num_experts, plan.blob_bytes,
            plan.encodings(), plan.source_forms(), len(plan.dense_names),
        )  # fmt: skip
        dense_bytes, dense_dtype = write_dense(plan, reader, out / DENSE_NAME)
        checksums = write_experts(plan, reader, out, progress)
    copy_side_files(checkpoint, plan.config.dtype, out)
    manifest = _manifest(checkpoint, plan, model_id, checksums, dense_bytes, dense_dtype, dequantize)
    manifest.validate(str(out / MANIFEST_NAME))
    with open(out / MANIFEST_NAME, "w") as f:  # last: its presence marks the store complete
        f.write(manifest.to_json())
        _sync(f)
    return manifest


def _manifest(
    checkpoint: Checkpoint,
    plan: StorePlan,
    model_id: str,
    checksums: dict[int, tuple[int, ...]],
    dense_bytes: int,
    dense_dtype: str,
    dequantize: bool,
) -> StoreManifest:
    source = {
        "path": str(checkpoint.path),
        "files": ",".join(checkpoint.files),
        "expert_format": plan.source_forms(),
        "experts": EXPERTS_DEQUANTIZED if dequantize else EXPERTS_AS_CHECKPOINT,
        "checkpoint_expert_bytes": str(plan.checkpoint_expert_bytes),
    }
    if checkpoint.quant_method is not None:
        kept = "dequantised" if dequantize else f"kept as {plan.encodings()}"
        source["quantization"] = f"{checkpoint.quant_method} (experts {kept})"
        if plan.dense_scales:
            source["quantization"] += f"; {len(plan.dense_scales)} FP8 dense weights dequantised"
    return StoreManifest(
        model_type=plan.model_type,
        model_id=model_id,
        num_layers=int(plan.config.num_hidden_layers),
        moe_layers=tuple(site.layer for site in plan.sites),
        num_experts=plan.num_experts,
        top_k=top_k_of(plan.config),
        blob_bytes=plan.blob_bytes,
        tensors=plan.tensors,
        layer_files={site.layer: layer_file_name(site.layer) for site in plan.sites},
        checksums=checksums,
        dense_file=DENSE_NAME,
        dense_dtype=dense_dtype,
        dense_bytes=dense_bytes,
        source=source,
    )


def convert(src: str | Path, dst: str | Path, **options: bool) -> StoreManifest:
    """Convert the checkpoint directory ``src`` into the expert store ``dst``; returns its manifest
    (``run_conversion``'s, with its keyword ``options``: ``force``, ``progress``, ``dequantize``).

    Experts keep the checkpoint's encoding (bf16/fp16/fp32, MXFP4, block-scaled FP8) unless
    ``dequantize``. A no-op when ``dst`` already holds the store of this very checkpoint made
    the same way. Raises ``FailedPrecondition`` when ``dst`` holds something else, unless
    ``force``; ``Unsupported`` for an architecture or quantisation not handled; ``NotFound`` /
    ``InvalidArgument`` / ``DataLoss`` for a missing, inconsistent or unreadable checkpoint.
    """
    return run_conversion(src, dst, **options).manifest
