"""Where a transformers MoE model keeps its experts, found from the model itself.

transformers 5.x holds each MoE layer's experts in one module whose parameters are stacked
along dim 0 (``gate_up_proj`` [E, ...], ``down_proj`` [E, ...], optional ``*_bias`` [E, ...]).
Every such module is decorated by ``use_experts_implementation`` and so carries ``has_gate``
and ``is_transposed``. Finding them by that mark, rather than by a table of module paths per
architecture, keeps the converter and compute in agreement with the model code itself.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from accelerate import init_empty_weights
from transformers import AutoModelForCausalLM, PretrainedConfig

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class ExpertTensorSpec:
    """One stacked parameter of an experts module, per expert: ``param[e]`` has ``shape``."""

    name: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ExpertsSite:
    """An experts module inside the model: decoder ``layer`` at module path ``path``."""

    layer: int
    path: str  # e.g. "model.layers.3.mlp.experts"
    num_experts: int
    tensors: tuple[ExpertTensorSpec, ...]
    transposed: bool = False  # the module computes x @ W (W [in, out]: GPT-OSS), not x @ W.T


def is_experts_module(module: torch.nn.Module) -> bool:
    return hasattr(module, "has_gate") and hasattr(module, "is_transposed") and hasattr(module, "num_experts")


def build_skeleton(config: PretrainedConfig, experts_implementation: str | None = None) -> torch.nn.Module:
    """The model with every parameter on the meta device and real buffers (rotary tables).

    Nothing of the weights is allocated; dense weights are loaded into it afterwards and the
    expert parameters stay on meta for ever. Parameters that ``from_pretrained`` keeps in
    float32 whatever the model's dtype (``_keep_in_fp32_modules_strict``, e.g. DeepSeek-V3's
    ``e_score_correction_bias`` in a bf16 model) are float32 here too.
    """
    kwargs = {}
    if experts_implementation is not None:
        kwargs["experts_implementation"] = experts_implementation
    dtype = _config_dtype(config)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **kwargs)
    _apply_dtype_plan(model, dtype)
    model.eval()
    return model


def _apply_dtype_plan(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Give parameters the dtypes ``from_pretrained`` loads them in (its ``_get_dtype_plan``:
    glob patterns searched in parameter names → dtype)."""
    get_plan = getattr(model, "_get_dtype_plan", None)
    plan = get_plan(dtype) if get_plan is not None else {}
    if not plan:
        return
    patterns = [(re.compile(glob.replace("*", ".*")), wanted) for glob, wanted in plan.items()]
    for prefix, module in model.named_modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                full = f"{prefix}.{name}" if prefix else name
                wanted = next((w for pattern, w in patterns if pattern.search(full)), None)
                if tensor is None or wanted is None or tensor.dtype == wanted:
                    continue
                if isinstance(tensor, torch.nn.Parameter):
                    tensor.data = tensor.data.to(wanted)  # meta tensors: a dtype change only
                else:
                    table[name] = tensor.to(wanted)


def _config_dtype(config: PretrainedConfig) -> torch.dtype:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def find_experts_sites(model: torch.nn.Module) -> list[ExpertsSite]:
    """Every experts module of ``model``, ordered by layer."""
    sites = []
    for path, module in model.named_modules():
        if not is_experts_module(module):
            continue
        match = _LAYER_RE.search(path + ".")
        if match is None:
            raise ValueError(f"experts module {path!r} is not inside a numbered decoder layer")
        num_experts = int(module.num_experts)
        tensors = tuple(
            ExpertTensorSpec(name=name, shape=tuple(param.shape[1:]))
            for name, param in module.named_parameters(recurse=False)
            if param.dim() >= 2 and param.shape[0] == num_experts
        )
        sites.append(
            ExpertsSite(
                layer=int(match.group(1)),
                path=path,
                num_experts=num_experts,
                tensors=tensors,
                transposed=bool(module.is_transposed),
            )
        )
    return sorted(sites, key=lambda s: s.layer)


def expert_parameter_names(sites: list[ExpertsSite]) -> set[str]:
    """Full state-dict names of every stacked expert parameter."""
    return {f"{site.path}.{t.name}" for site in sites for t in site.tensors}


def top_k_of(config: PretrainedConfig) -> int:
    for attr in ("num_experts_per_tok", "moe_topk", "top_k"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError(f"cannot find the number of experts per token in {type(config).__name__}")
