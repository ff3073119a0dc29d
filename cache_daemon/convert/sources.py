"""How checkpoint tensors map to the runtime model's tensors, per architecture (``SOURCES``): a
checkpoint key is renamed to its runtime name, then each stacked expert parameter is read, one
expert at a time, by a recipe (stacked, mxfp4, stacked-fp8, per-expert, per-expert-fp8). The
forms, with worked examples, are in ``docs/daemon.md``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import ClassVar

import torch

from expertcache.encodings import (
    BLOCKS_SUFFIX,
    MXFP4_GROUP,
    SCALE_INV_SUFFIX,
    SCALES_SUFFIX,
    ExpertTensor,
    decode,
    dtype_name,
    get_encoding,
    torch_dtype,
)
from expertcache.errors import InvalidArgument, NotFound, Unsupported
from expertcache.model_structure import ExpertsSite, ExpertTensorSpec

# safetensors dtype codes each stored form accepts from the checkpoint.
FLOAT_CODES = ("F16", "BF16", "F32", "F64")
SCALE_CODES = ("F32", "BF16", "F16")  # FP8 multipliers: widened to float32 exactly


@dataclass(frozen=True)
class SourceLayout:
    """How one architecture's checkpoints name their tensors.

    ``renames``: ``(regex, replacement)`` pairs applied in order to every checkpoint key, giving
    the runtime state-dict name (dense keys and per-expert keys alike).
    ``per_expert``: runtime expert parameter → suffixes under ``<experts path>.<e>.`` of the
    renamed per-expert checkpoint tensors, concatenated along dim 0 to form ``param[e]``.
    """

    renames: tuple[tuple[str, str], ...] = ()
    per_expert: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def runtime_name(self, checkpoint_key: str) -> str:
        for pattern, replacement in self.renames:
            checkpoint_key = re.sub(pattern, replacement, checkpoint_key)
        return checkpoint_key


# gate_up_proj[e] = cat([gate [I, H], up [I, H]], 0) → [2I, H]; down_proj[e] = down [H, I].
_GATE_UP_DOWN = MappingProxyType(
    {"gate_up_proj": ("gate_proj.weight", "up_proj.weight"), "down_proj": ("down_proj.weight",)}
)

SOURCES: Mapping[str, SourceLayout] = MappingProxyType(
    {
        "mixtral": SourceLayout(
            renames=((r"\.block_sparse_moe\.", ".mlp."),),
            # w1 = gate, w3 = up, w2 = down (the names of Mistral's reference code)
            per_expert=MappingProxyType(
                {"gate_up_proj": ("w1.weight", "w3.weight"), "down_proj": ("w2.weight",)}
            ),
        ),
        "qwen2_moe": SourceLayout(per_expert=_GATE_UP_DOWN),
        "qwen3_moe": SourceLayout(per_expert=_GATE_UP_DOWN),
        "olmoe": SourceLayout(per_expert=_GATE_UP_DOWN),
        "deepseek_v2": SourceLayout(per_expert=_GATE_UP_DOWN),
        "deepseek_v3": SourceLayout(per_expert=_GATE_UP_DOWN),
        # GPT-OSS checkpoints are stacked (bf16/f32) or MXFP4: both handled for every architecture.
        "gpt_oss": SourceLayout(),
    }
)

SUPPORTED_MODEL_TYPES = tuple(sorted(SOURCES))


def source_layout(model_type: str) -> SourceLayout:
    """The registered layout of ``model_type``; ``Unsupported`` listing the valid ones otherwise."""
    try:
        return SOURCES[model_type]
    except KeyError:
        raise Unsupported(
            f"model_type {model_type!r} is not supported by the expert-store converter; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        ) from None


# -- the checkpoint's quantization_config ---------------------------------------------------------


@dataclass(frozen=True)
class Quantization:
    """What a checkpoint's ``quantization_config`` means for its tensors."""

    method: str | None = None  # None (not quantized), "mxfp4", "fp8"
    fp8_block_size: tuple[int, int] | None = None  # weight_block_size; None: one scale per tensor


def _no_quantization(config: Mapping[str, object]) -> Quantization:
    return Quantization()


def _mxfp4(config: Mapping[str, object]) -> Quantization:
    return Quantization(method="mxfp4")


def _fp8(config: Mapping[str, object]) -> Quantization:
    """transformers' FineGrainedFP8 / DeepSeek-V3's ``{"quant_method": "fp8", "fmt": "e4m3",
    "activation_scheme": "dynamic", "weight_block_size": [128, 128]}``."""
    fmt = config.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise Unsupported(f"quantization_config.fmt {fmt!r}: only FP8 e4m3 weights are supported")
    scheme = config.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise Unsupported(
            f"quantization_config.activation_scheme {scheme!r}: only 'dynamic' (no stored activation "
            "scales) is supported"
        )
    block = config.get("weight_block_size")
    if block is None:
        return Quantization(method="fp8")
    if (
        not isinstance(block, (list, tuple))
        or len(block) != 2
        or not all(isinstance(b, int) and 0 < b <= 1 << 16 for b in block)
    ):
        raise InvalidArgument(f"quantization_config.weight_block_size {block!r} is not [rows, columns]")
    return Quantization(method="fp8", fp8_block_size=(int(block[0]), int(block[1])))


# quant_method → parser of the rest of quantization_config.
QUANTIZATION_METHODS: Mapping[str | None, Callable[[Mapping[str, object]], Quantization]] = MappingProxyType(
    {None: _no_quantization, "mxfp4": _mxfp4, "fp8": _fp8}
)
SUPPORTED_QUANTIZATION = tuple(m for m in QUANTIZATION_METHODS if m is not None)


def parse_quantization(config: Mapping[str, object]) -> Quantization:
    """The ``Quantization`` of a checkpoint's config.json; ``Unsupported`` naming an unknown method."""
    quantization = config.get("quantization_config")
    if quantization is None:
        return Quantization()
    if not isinstance(quantization, dict):
        raise InvalidArgument(f"quantization_config is not an object: {quantization!r}")
    method = quantization.get("quant_method")
    method = None if method is None else str(method)
    parser = QUANTIZATION_METHODS.get(method)
    if parser is None:
        raise Unsupported(
            f"the checkpoint is quantised with {method!r}; the converter reads "
            f"{', '.join(SUPPORTED_QUANTIZATION)} (and unquantised bf16/fp16/fp32) checkpoints only"
        )
    return parser(quantization)


# -- recipes: how to read param[e] ---------------------------------------------------------

# Read one checkpoint tensor by *runtime* name: whole, or its slice [e] along dim 0.
TensorGetter = Callable[[str], torch.Tensor]
SliceGetter = Callable[[str, int], torch.Tensor]
ShapeGetter = Callable[[str], tuple[int, ...]]
DtypeGetter = Callable[[str], str]  # safetensors dtype code, e.g. "BF16"


@dataclass(frozen=True)
class ExpertRecipe:
    """How to build ``<experts path>.<spec.name>[e]`` from checkpoint tensors (by runtime name).

    ``encoding`` is how the checkpoint encodes it (``expertcache.encodings``); ``read`` returns
    the stored parts of one expert in that encoding, or decoded when the store is plain.
    """

    kind: ClassVar[str]
    encoding: ClassVar[str] = "plain"
    spec: ExpertTensorSpec
    num_experts: int

    def consumed_names(self) -> list[str]:
        """Every checkpoint tensor (runtime name) this recipe reads, over all experts."""
        raise NotImplementedError

    def expected(self, shape_of: ShapeGetter) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
        """Checkpoint tensor → (the header shape this recipe needs, the dtype codes it accepts)."""
        raise NotImplementedError

    def block_size(self) -> tuple[int, ...]:
        return ()

    def _read_parts(self, expert: int, get: TensorGetter, get_slice: SliceGetter) -> dict[str, torch.Tensor]:
        """The parts of ``param[expert]`` in the recipe's encoding, as the checkpoint has them."""
        raise NotImplementedError

    def describe(self, expert: int) -> str:
        raise NotImplementedError

    def encoded(self, dtype: str) -> ExpertTensor:
        """The ExpertTensor of this parameter in the checkpoint's encoding (parts not yet placed)."""
        block = self.block_size()
        kwargs = {"block_size": block} if block else {}
        try:
            return get_encoding(self.encoding).plan(self.spec.name, dtype, self.spec.shape, **kwargs)
        except ValueError as exc:
            raise InvalidArgument(f"checkpoint tensors {self.describe(0)}: {exc}") from exc

    def read(
        self, expert: int, tensor: ExpertTensor, get: TensorGetter, get_slice: SliceGetter
    ) -> dict[str, torch.Tensor]:
        """The stored parts of ``param[expert]`` as ``tensor`` lays them out: in the recipe's own
        encoding, or decoded (``--dequantize``) when ``tensor`` is plain."""
        parts = self._read_parts(expert, get, get_slice)
        if tensor.encoding != self.encoding:
            if tensor.encoding != "plain":
                raise InvalidArgument(f"{self.describe(expert)} cannot be stored as {tensor.encoding}")
            source = self.encoded(tensor.dtype)
            self._check(expert, source, parts)
            parts = {tensor.name: decode(source, parts)}
        elif self.encoding == "plain":
            parts = {name: t.to(torch_dtype(tensor.dtype)) for name, t in parts.items()}
        if tensor.encoding == "plain" and tensor.transposed:  # the runtime [in, out] stored as rows
            parts = {name: t.t() for name, t in parts.items()}
        self._check(expert, tensor, parts)
        return {name: t.contiguous() for name, t in parts.items()}

    def _check(self, expert: int, tensor: ExpertTensor, parts: Mapping[str, torch.Tensor]) -> None:
        for part in tensor.parts:
            got = parts.get(part.name)
            if got is None or tuple(got.shape) != part.shape or dtype_name(got.dtype) != part.dtype:
                have = None if got is None else f"{dtype_name(got.dtype)} {tuple(got.shape)}"
                raise InvalidArgument(
                    f"checkpoint tensors {self.describe(expert)} give {part.name} = {have}, but the "
                    f"model's {self.spec.name}[{expert}] {self.spec.shape} needs {part.dtype} {part.shape}"
                )

    def check_sources(self, shape_of: ShapeGetter, dtype_of: DtypeGetter) -> None:
        """Check the checkpoint's headers before any data is read, so a bad layer fails fast."""
        for name, (shape, codes) in self.expected(shape_of).items():
            if shape_of(name) != shape:
                raise InvalidArgument(
                    f"checkpoint tensor {name} has shape {shape_of(name)}; the model's {self.spec.name} "
                    f"{self.spec.shape} per expert needs {shape} ({self.kind} form)"
                )
            if dtype_of(name) not in codes:
                raise InvalidArgument(
                    f"checkpoint tensor {name} is {dtype_of(name)}; the {self.kind} form of {self.spec.name} "
                    f"needs {' or '.join(codes)}"
                )


@dataclass(frozen=True)
class StackedSlice(ExpertRecipe):
    """``param[e] = checkpoint[name][e]``: transformers 5's own layout, GPT-OSS in bf16/f32."""

    kind: ClassVar[str] = "stacked"
    name: str

    def consumed_names(self) -> list[str]:
        return [self.name]

    def expected(self, shape_of):
        return {self.name: ((self.num_experts, *self.spec.shape), FLOAT_CODES)}

    def _read_parts(self, expert, get, get_slice):
        return {self.spec.name: get_slice(self.name, expert)}

    def describe(self, expert: int) -> str:
        return f"{self.name}[{expert}]"


@dataclass(frozen=True)
class Mxfp4Slice(ExpertRecipe):
    """``param[e]`` from ``blocks[e]`` and ``scales[e]``: GPT-OSS experts as published (MXFP4)."""

    kind: ClassVar[str] = "mxfp4"
    encoding: ClassVar[str] = "mxfp4"
    blocks: str
    scales: str

    def consumed_names(self) -> list[str]:
        return [self.blocks, self.scales]

    def block_size(self):
        return (1, MXFP4_GROUP)

    def expected(self, shape_of):
        parts = self.encoded("bfloat16").parts  # the dtype does not change the stored parts
        blocks, scales = (
            next(p for p in parts if p.name == self.spec.name + s) for s in (BLOCKS_SUFFIX, SCALES_SUFFIX)
        )
        return {
            self.blocks: ((self.num_experts, *blocks.shape), ("U8",)),
            self.scales: ((self.num_experts, *scales.shape), ("U8",)),
        }

    def _read_parts(self, expert, get, get_slice):
        return {
            self.spec.name + BLOCKS_SUFFIX: get_slice(self.blocks, expert),
            self.spec.name + SCALES_SUFFIX: get_slice(self.scales, expert),
        }

    def describe(self, expert: int) -> str:
        return f"{self.blocks}[{expert}] + {self.scales}[{expert}]"


def _fp8_grid(rows: int, cols: int, block: tuple[int, int]) -> tuple[int, int]:
    return math.ceil(rows / block[0]), math.ceil(cols / block[1])


@dataclass(frozen=True)
class Fp8StackedSlice(ExpertRecipe):
    """``param[e]`` from ``checkpoint[name][e]`` (e4m3) and ``checkpoint[name_scale_inv][e]``:
    transformers 5's own layout quantised by its FineGrainedFP8 (``<param>_scale_inv``)."""

    kind: ClassVar[str] = "stacked-fp8"
    encoding: ClassVar[str] = "fp8"
    name: str
    block: tuple[int, int] | None  # None: one scale for the whole [R, C] matrix

    def consumed_names(self) -> list[str]:
        return [self.name, self.name + SCALE_INV_SUFFIX]

    def block_size(self):
        return self.block or tuple(self.spec.shape)

    def expected(self, shape_of):
        rows, cols = self.spec.shape
        return {
            self.name: ((self.num_experts, rows, cols), ("F8_E4M3",)),
            self.name + SCALE_INV_SUFFIX: (
                (self.num_experts, *_fp8_grid(rows, cols, self.block_size())),
                SCALE_CODES,
            ),
        }

    def _read_parts(self, expert, get, get_slice):
        return {
            self.spec.name: get_slice(self.name, expert),
            self.spec.name + SCALE_INV_SUFFIX: get_slice(self.name + SCALE_INV_SUFFIX, expert).float(),
        }

    def describe(self, expert: int) -> str:
        return f"{self.name}[{expert}] + {self.name}{SCALE_INV_SUFFIX}[{expert}]"


@dataclass(frozen=True)
class PerExpertConcat(ExpertRecipe):
    """``param[e] = cat(checkpoint[t.format(e=e)] for t in templates; dim 0)``: one module per expert."""

    kind: ClassVar[str] = "per-expert"
    templates: tuple[str, ...]  # runtime names with an ``{e}`` placeholder

    def consumed_names(self) -> list[str]:
        return [t.format(e=e) for e in range(self.num_experts) for t in self.templates]

    def _part_rows(self, shape_of: ShapeGetter, expert: int) -> list[int]:
        # Each part contributes its dim 0 (e.g. gate [I, H] + up [I, H] → [2I, H]).
        names = [t.format(e=expert) for t in self.templates]
        rows = [(shape_of(name)[:1] or (0,))[0] for name in names]
        if sum(rows) != self.spec.shape[0]:
            raise InvalidArgument(
                f"checkpoint tensors {self.describe(expert)} have shapes {[shape_of(n) for n in names]}; "
                f"concatenated along dim 0 they must give {self.spec.name}[{expert}] {self.spec.shape}"
            )
        return rows

    def expected(self, shape_of):
        expected = {}
        rest = self.spec.shape[1:]
        for e in range(self.num_experts):
            for t, rows in zip(self.templates, self._part_rows(shape_of, e), strict=True):
                expected[t.format(e=e)] = ((rows, *rest), FLOAT_CODES)
        return expected

    def _read_parts(self, expert, get, get_slice):
        return {self.spec.name: torch.cat([get(t.format(e=expert)) for t in self.templates], dim=0)}

    def describe(self, expert: int) -> str:
        return " + ".join(t.format(e=expert) for t in self.templates)


def scale_inv_name(weight_name: str) -> str:
    """``x.weight`` → ``x.weight_scale_inv`` (the FP8 checkpoints' name for a weight's scales)."""
    return weight_name + SCALE_INV_SUFFIX


@dataclass(frozen=True)
class Fp8PerExpertConcat(PerExpertConcat):
    """DeepSeek-V3 / Qwen3-FP8 experts: each per-expert weight in e4m3 with its
    ``weight_scale_inv``; values and scale grids are concatenated along dim 0 alike, which needs
    every part's rows to be whole blocks (DeepSeek-V3: I = 2048, blocks of 128)."""

    kind: ClassVar[str] = "per-expert-fp8"
    encoding: ClassVar[str] = "fp8"
    block: tuple[int, int] | None = None  # None: one scale per checkpoint tensor

    def consumed_names(self) -> list[str]:
        names = super().consumed_names()
        return names + [scale_inv_name(n) for n in names]

    def block_size(self):
        if self.block is not None:
            return self.block
        # One scale per part: the block is a part's [rows, C], and the parts must be alike.
        return (self.spec.shape[0] // len(self.templates), self.spec.shape[1])

    def expected(self, shape_of):
        expected = {}
        block = self.block_size()
        cols = self.spec.shape[1]
        for e in range(self.num_experts):
            rows_of = self._part_rows(shape_of, e)
            for t, rows in zip(self.templates, rows_of, strict=True):
                name = t.format(e=e)
                if len(self.templates) > 1 and rows % block[0]:
                    raise InvalidArgument(
                        f"checkpoint tensor {name} has {rows} rows, not a whole number of {block[0]}-row "
                        f"FP8 blocks: its scales cannot be concatenated into {self.spec.name}'s "
                        "(convert with --dequantize)"
                    )
                expected[name] = ((rows, cols), ("F8_E4M3",))
                expected[scale_inv_name(name)] = (_fp8_grid(rows, cols, block), SCALE_CODES)
        return expected

    def _read_parts(self, expert, get, get_slice):
        names = [t.format(e=expert) for t in self.templates]
        values = torch.cat([get(n).view(torch.uint8) for n in names], dim=0).view(torch.float8_e4m3fn)
        scales = torch.cat([get(scale_inv_name(n)).float() for n in names], dim=0)
        return {self.spec.name: values, self.spec.name + SCALE_INV_SUFFIX: scales}


def resolve_recipe(
    layout: SourceLayout,
    site: ExpertsSite,
    spec: ExpertTensorSpec,
    names: Mapping[str, object],
    quantization: Quantization = Quantization(),
) -> ExpertRecipe:
    """Pick the checkpoint form holding ``site``'s ``spec`` among runtime ``names``.

    Raises ``NotFound`` naming every key that was looked for when no form is complete.
    """
    stacked = f"{site.path}.{spec.name}"
    if stacked in names:
        if stacked + SCALE_INV_SUFFIX in names:
            return Fp8StackedSlice(spec, site.num_experts, name=stacked, block=quantization.fp8_block_size)
        return StackedSlice(spec, site.num_experts, name=stacked)
    blocks, scales = stacked + BLOCKS_SUFFIX, stacked + SCALES_SUFFIX
    if blocks in names and scales in names:
        return Mxfp4Slice(spec, site.num_experts, blocks=blocks, scales=scales)
    looked_for = [stacked, f"{blocks} + {scales}"]
    suffixes = layout.per_expert.get(spec.name)
    if suffixes:
        templates = tuple(f"{site.path}.{{e}}.{suffix}" for suffix in suffixes)
        recipe = PerExpertConcat(spec, site.num_experts, templates=templates)
        wanted = recipe.consumed_names()
        missing = [name for name in wanted if name not in names]
        if not missing:
            scales_of = [scale_inv_name(name) for name in wanted]
            present = [name for name in scales_of if name in names]
            if len(present) == len(scales_of):
                return Fp8PerExpertConcat(
                    spec, site.num_experts, templates=templates, block=quantization.fp8_block_size
                )
            if present:
                lacking = [name for name in scales_of if name not in names]
                raise NotFound(
                    f"checkpoint has FP8 scales for some experts of layer {site.layer} but lacks "
                    f"{len(lacking)}, e.g. {', '.join(lacking[:4])}"
                )
            return recipe
        if len(missing) < len(wanted):
            raise NotFound(
                f"checkpoint lacks {len(missing)} per-expert tensor(s) of layer {site.layer}, "
                f"e.g. {', '.join(missing[:4])} (runtime names, after the architecture's renames)"
            )
        looked_for.append(" + ".join(templates))
    raise NotFound(
        f"checkpoint has no tensors for {stacked} (layer {site.layer}); looked for "
        f"{'; '.join(looked_for)} (runtime names, after the architecture's renames)"
    )
