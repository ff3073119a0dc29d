"""How checkpoint tensors map to the runtime model's tensors, per architecture.

A checkpoint key is first *renamed* to its runtime name (the architecture's ``renames``), then
each stacked expert parameter of the runtime model is matched to a *recipe* that reads one
expert's slice of it from the checkpoint. Three checkpoint forms exist::

    runtime parameter (experts module at P = model.layers.L.mlp.experts)
      P.gate_up_proj[e]  ◀── stacked   P.gate_up_proj            [E, ...] slice [e]
                         ◀── mxfp4     P.gate_up_proj_blocks/_scales      slice [e], dequantise
                         ◀── per-expert cat(P.e.gate_proj.weight, P.e.up_proj.weight; dim 0)

Stacked and MXFP4 are the same for every architecture (transformers 5's own layout, GPT-OSS);
the per-expert form and the renames are the architecture's, in ``SOURCES``. Worked example
(Mixtral, layer 1, expert 3)::

    model.layers.1.block_sparse_moe.experts.3.w1.weight [I, H]  ─rename─▶ model.layers.1.mlp.experts.3.w1.weight
    runtime model.layers.1.mlp.experts.gate_up_proj[3] [2I, H] = cat(…3.w1.weight, …3.w3.weight)
    runtime model.layers.1.mlp.experts.down_proj[3]    [H, I]  = …3.w2.weight
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import ClassVar

import torch

from cache_daemon.convert.mxfp4 import GROUP_SIZE, VALUES_PER_BYTE, dequantize_mxfp4
from expertcache.errors import InvalidArgument, NotFound, Unsupported
from expertcache.model_structure import ExpertsSite, ExpertTensorSpec

MXFP4_SUFFIXES = ("_blocks", "_scales")


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


# -- recipes: how to read param[e] ---------------------------------------------------------

# Read one checkpoint tensor by *runtime* name: whole, or its slice [e] along dim 0.
TensorGetter = Callable[[str], torch.Tensor]
SliceGetter = Callable[[str, int], torch.Tensor]
ShapeGetter = Callable[[str], tuple[int, ...]]


@dataclass(frozen=True)
class ExpertRecipe:
    """How to build ``<experts path>.<spec.name>[e]`` from checkpoint tensors (by runtime name)."""

    kind: ClassVar[str]
    spec: ExpertTensorSpec
    num_experts: int

    def consumed_names(self) -> list[str]:
        """Every checkpoint tensor (runtime name) this recipe reads, over all experts."""
        raise NotImplementedError

    def expected_shapes(self, shape_of: ShapeGetter) -> dict[str, tuple[int, ...]]:
        """Checkpoint tensor → the header shape this recipe needs."""
        raise NotImplementedError

    def _read(
        self, expert: int, dtype: torch.dtype, get: TensorGetter, get_slice: SliceGetter
    ) -> torch.Tensor:
        raise NotImplementedError

    def describe(self, expert: int) -> str:
        raise NotImplementedError

    def read(
        self, expert: int, dtype: torch.dtype, get: TensorGetter, get_slice: SliceGetter
    ) -> torch.Tensor:
        """``param[expert]`` as a contiguous ``dtype`` tensor of shape ``spec.shape``."""
        tensor = self._read(expert, dtype, get, get_slice)
        if tuple(tensor.shape) != self.spec.shape:
            raise InvalidArgument(
                f"checkpoint tensors {self.describe(expert)} give shape {tuple(tensor.shape)}, but the "
                f"model's {self.spec.name}[{expert}] has shape {self.spec.shape}"
            )
        return tensor.contiguous()

    def check_shapes(self, shape_of: ShapeGetter) -> None:
        """Check the checkpoint's header shapes before any data is read, so a bad layer fails fast."""
        for name, shape in self.expected_shapes(shape_of).items():
            if shape_of(name) != shape:
                raise InvalidArgument(
                    f"checkpoint tensor {name} has shape {shape_of(name)}; the model's {self.spec.name} "
                    f"{self.spec.shape} per expert needs {shape} ({self.kind} form)"
                )


@dataclass(frozen=True)
class StackedSlice(ExpertRecipe):
    """``param[e] = checkpoint[name][e]``: transformers 5's own layout, GPT-OSS in bf16/f32."""

    kind: ClassVar[str] = "stacked"
    name: str

    def consumed_names(self) -> list[str]:
        return [self.name]

    def expected_shapes(self, shape_of: ShapeGetter) -> dict[str, tuple[int, ...]]:
        return {self.name: (self.num_experts, *self.spec.shape)}

    def _read(
        self, expert: int, dtype: torch.dtype, get: TensorGetter, get_slice: SliceGetter
    ) -> torch.Tensor:
        return get_slice(self.name, expert).to(dtype)

    def describe(self, expert: int) -> str:
        return f"{self.name}[{expert}]"


@dataclass(frozen=True)
class Mxfp4Slice(ExpertRecipe):
    """``param[e] = dequantise(blocks[e], scales[e])``: published GPT-OSS experts."""

    kind: ClassVar[str] = "mxfp4"
    blocks: str
    scales: str

    def consumed_names(self) -> list[str]:
        return [self.blocks, self.scales]

    def expected_shapes(self, shape_of: ShapeGetter) -> dict[str, tuple[int, ...]]:
        if len(self.spec.shape) != 2 or self.spec.shape[0] % GROUP_SIZE:
            raise InvalidArgument(f"{self.spec.name} {self.spec.shape} cannot be MXFP4-quantised")
        # runtime [C_in, R_out] (x @ W) ← blocks [E, R_out, C_in / 32, 16], scales [E, R_out, C_in / 32]
        in_features, out_features = self.spec.shape
        groups = in_features // GROUP_SIZE
        return {
            self.blocks: (self.num_experts, out_features, groups, GROUP_SIZE // VALUES_PER_BYTE),
            self.scales: (self.num_experts, out_features, groups),
        }

    def _read(
        self, expert: int, dtype: torch.dtype, get: TensorGetter, get_slice: SliceGetter
    ) -> torch.Tensor:
        return dequantize_mxfp4(get_slice(self.blocks, expert), get_slice(self.scales, expert), dtype)

    def describe(self, expert: int) -> str:
        return f"{self.blocks}[{expert}] + {self.scales}[{expert}]"


@dataclass(frozen=True)
class PerExpertConcat(ExpertRecipe):
    """``param[e] = cat(checkpoint[t.format(e=e)] for t in templates; dim 0)``: one module per expert."""

    kind: ClassVar[str] = "per-expert"
    templates: tuple[str, ...]  # runtime names with an ``{e}`` placeholder

    def consumed_names(self) -> list[str]:
        return [t.format(e=e) for e in range(self.num_experts) for t in self.templates]

    def expected_shapes(self, shape_of: ShapeGetter) -> dict[str, tuple[int, ...]]:
        # Each part contributes its dim 0 (e.g. gate [I, H] + up [I, H] → [2I, H]).
        expected = {}
        for e in range(self.num_experts):
            names = [t.format(e=e) for t in self.templates]
            rows = [shape_of(name)[:1] or (0,) for name in names]
            rest = self.spec.shape[1:]
            if sum(r[0] for r in rows) != self.spec.shape[0]:
                raise InvalidArgument(
                    f"checkpoint tensors {self.describe(e)} have shapes {[shape_of(n) for n in names]}; "
                    f"concatenated along dim 0 they must give {self.spec.name}[{e}] {self.spec.shape}"
                )
            expected.update({name: (r[0], *rest) for name, r in zip(names, rows, strict=True)})
        return expected

    def _read(
        self, expert: int, dtype: torch.dtype, get: TensorGetter, get_slice: SliceGetter
    ) -> torch.Tensor:
        return torch.cat([get(t.format(e=expert)) for t in self.templates], dim=0).to(dtype)

    def describe(self, expert: int) -> str:
        return " + ".join(t.format(e=expert) for t in self.templates)


def resolve_recipe(
    layout: SourceLayout, site: ExpertsSite, spec: ExpertTensorSpec, names: Mapping[str, object]
) -> ExpertRecipe:
    """Pick the checkpoint form holding ``site``'s ``spec`` among runtime ``names``.

    Raises ``NotFound`` naming every key that was looked for when no form is complete.
    """
    stacked = f"{site.path}.{spec.name}"
    if stacked in names:
        return StackedSlice(spec, site.num_experts, name=stacked)
    blocks, scales = (stacked + suffix for suffix in MXFP4_SUFFIXES)
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
