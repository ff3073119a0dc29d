"""Decode steps on the CPU without transformers' per-op overhead.

Each layer's dense half is one native call (``expertcache.native.DecodeAttention``) over every row
of the step; the MLP stays the model's own. ``DecodeStep.build`` returns None where this does not
apply. Why: docs/compute.md."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.modules.module as _module_hooks

from compute_svc.engine.kv_cache import SequenceKV
from compute_svc.experts.fused import storage_view
from compute_svc.experts.moe import IMPLEMENTATION, LAYER_ATTR, RUNTIME_ATTR

logger = logging.getLogger(__name__)

# model_type -> (RMSNorm rounding, the attention the model runs by default)
_MODELS = {
    "gpt_oss": ("weight_then_cast", "eager"),
    "mixtral": ("cast_then_weight", "sdpa"),
    "qwen2_moe": ("cast_then_weight", "sdpa"),
    "qwen3_moe": ("cast_then_weight", "sdpa"),
}
_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class DecodeStep:
    """One model's decode steps through the native dense half (see the module docstring)."""

    @classmethod
    def build(cls, model: torch.nn.Module, original_attention: str) -> DecodeStep | None:
        """The decode step of ``model`` (loaded, on its device), or None where it does not apply
        (saying why in the log). ``original_attention``: the attention implementation the packed
        attention wraps ("sdpa" or "eager"), whose numerics the native attention follows."""
        config = model.config
        why = None
        kind = _MODELS.get(config.model_type)
        dtype = next(model.parameters()).dtype
        if kind is None:
            why = f"model type {config.model_type} is not one it covers ({', '.join(sorted(_MODELS))})"
        elif next(model.parameters()).device.type != "cpu":
            why = "the model is not on the CPU"
        elif dtype not in _DTYPES:
            why = f"dtype {dtype}"
        elif original_attention not in ("sdpa", "eager") or (kind[1] == "eager") != (
            original_attention == "eager"
        ):
            why = f"attention {original_attention!r}"
        if why is not None:
            logger.info("decode steps run through transformers: %s", why)
            return None
        try:
            from expertcache import native
        except ImportError as exc:  # pragma: no cover - the native core is part of the package
            logger.info("decode steps run through transformers: no native core (%s)", exc)
            return None
        return cls(model, native, kind[0], "eager" if original_attention == "eager" else "fused", dtype)

    def __init__(self, model: torch.nn.Module, native, norm: str, softmax: str, dtype: torch.dtype) -> None:
        config = model.config
        inner = model.model
        self.model = model
        self.layers = list(inner.layers)
        self.embed = inner.embed_tokens
        self.final_norm = inner.norm
        self.head = model.lm_head
        self.dtype = dtype
        first = self.layers[0].self_attn
        self.mlps = RoutedMlps(self.layers, native, dtype)
        self.head_dim = int(first.head_dim)
        self.rotation = RotaryTable(
            inner.rotary_emb, self.head_dim, int(getattr(config, "max_position_embeddings", 0) or 0) or 4096
        )
        self.kv_heads = int(config.num_key_value_heads)
        self.hidden = int(config.hidden_size)
        self.attention = native.DecodeAttention(
            {
                "hidden": self.hidden,
                "heads": int(config.num_attention_heads),
                "kv_heads": self.kv_heads,
                "head_dim": self.head_dim,
                "dtype": _DTYPES[dtype],
                "eps": float(self.layers[0].input_layernorm.variance_epsilon),
                "scaling": float(first.scaling),
                "norm": norm,
                "softmax": softmax,
                "router_outputs": self.mlps.outputs,
                "router_top_k": self.mlps.top_k,
            }
        )
        for layer in self.layers:
            attn = layer.self_attn
            weights = {
                "input_norm": layer.input_layernorm.weight,
                "post_norm": layer.post_attention_layernorm.weight,
                "q": attn.q_proj.weight,
                "k": attn.k_proj.weight,
                "v": attn.v_proj.weight,
                "o": attn.o_proj.weight,
                "q_bias": attn.q_proj.bias,
                "k_bias": attn.k_proj.bias,
                "v_bias": attn.v_proj.bias,
                "o_bias": attn.o_proj.bias,
                "q_norm": getattr(getattr(attn, "q_norm", None), "weight", None),
                "k_norm": getattr(getattr(attn, "k_norm", None), "weight", None),
                "sinks": getattr(attn, "sinks", None),
                "router": layer.mlp.router.weight if self.mlps.routers else None,
                "router_bias": layer.mlp.router.bias if self.mlps.routers else None,
            }
            self.attention.add_layer(
                {k: None if v is None else storage_view(v.detach()) for k, v in weights.items()},
                attention_window(config, attn) or 0,
            )
        self.native_head = _native_head(self.final_norm, self.head, self.layers[0].input_layernorm, dtype)
        if self.native_head:
            self.attention.set_head(
                {
                    "norm": storage_view(self.final_norm.weight.detach()),
                    "weight": storage_view(self.head.weight.detach()),
                    "bias": None if self.head.bias is None else storage_view(self.head.bias.detach()),
                },
                float(self.final_norm.variance_epsilon),
            )
        # One [1, kv_heads, 1, head_dim] tensor of the cache's dtype: the template of new buffers.
        self._like = torch.empty(1, self.kv_heads, 1, self.head_dim, dtype=dtype)
        logger.info(
            "decode steps: the dense half of each of %d layers in one native call (%s path, %s attention)",
            len(self.layers),
            self.attention.path,
            softmax,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        caches: Sequence[SequenceKV],
        before_layers: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """Logits [R, V] of R requests' next tokens: ``input_ids``/``position_ids`` [1, R], one
        token per request, whose KV (``caches``, in row order) holds everything before it. The new
        keys and values are written past each cache's length; ``commit`` is the caller's.
        ``before_layers`` is called once the step is begun, just before its first layer (its
        first native call without the GIL)."""
        rows = input_ids.shape[1]
        layers = len(self.layers)
        keys = np.empty((layers, rows), dtype=np.int64)
        values = np.empty((layers, rows), dtype=np.int64)
        capacity = np.empty((layers, rows), dtype=np.int64)
        length = np.empty(rows, dtype=np.int64)
        for r, kv in enumerate(caches):
            k, v, c = kv.reserve(layers, self._like, kv.length + 1)
            keys[:, r], values[:, r], capacity[:, r] = k, v, c
            length[r] = kv.length
        h = self.embed(input_ids).view(rows, self.hidden).contiguous()  # [R, H], the residual stream
        mlp_in = torch.empty_like(h)
        cos, sin = self.rotation(h, position_ids)
        attention = self.attention
        mlps = self.mlps
        logits = torch.empty(rows, mlps.outputs, dtype=self.dtype) if mlps.routers else None
        routes = None  # per layer (index [R, K], scores [R, K]) where the native call routes
        top_ids = top_scores = resident = None
        if mlps.top_k:
            # One pair of tensors per layer (views of two): the routing observer keeps each layer's.
            ids_all = torch.empty(layers, rows, mlps.top_k, dtype=torch.int64)
            scores_all = torch.empty(layers, rows, mlps.top_k, dtype=self.dtype)
            routes = list(zip(ids_all.unbind(0), scores_all.unbind(0), strict=True))
            top_ids, top_scores = ids_all.numpy(), storage_view(scores_all)
            # Every layer's experts through one runtime: its resident layers with the step's
            # buffers bound once (the routing rows are filled as each layer's dense half runs).
            if mlps.runtime is not None:
                resident = mlps.runtime.resident_layers(ids_all, scores_all, mlp_in, h)
        attention.begin_step(
            storage_view(h),
            storage_view(mlp_in),
            storage_view(cos),
            storage_view(sin),
            keys,
            values,
            capacity,
            length,
            None if logits is None else storage_view(logits),
            top_ids,
            top_scores,
        )
        try:
            mlp_view = mlp_in.view(1, rows, self.hidden)
            flat = h.view(1, rows, self.hidden)
            # Spans of layers in one native call each (dense half and experts, without the GIL)
            # where every layer's experts run through the resident kernel and nothing hooks them.
            span = (
                resident is not None
                and routes is not None
                and not any(_hooked(experts) for experts, _ in mlps.modules)
                and resident.spans(mlps.modules)
            )
            if before_layers is not None:
                before_layers()
            i = 0
            while i < layers:
                if span:
                    stop = resident.run_from(attention, i)
                    i = stop.layer
                    if i == layers:
                        break
                    if stop.attended:  # its dense half ran; not all its experts are resident
                        experts, at, runtime, _ = mlps.experts[i]
                        index, scores = routes[i]
                        runtime.forward(
                            experts,
                            at,
                            mlp_in,
                            index,
                            scores,
                            residual=h,
                            signalled=stop.signalled,
                            missed=stop.missed,
                        )
                        i += 1
                        continue
                    span = False  # the provider takes no layers now: one by one from here
                attention.run(i)
                if logits is not None:  # GPT-OSS: its router's topk and softmax, then the experts
                    experts, at, runtime, top_k = mlps.experts[i]
                    if routes is not None:
                        index, scores = routes[i]
                    else:
                        top, index = torch.topk(logits, top_k, dim=-1)
                        scores = torch.softmax(top, 1)  # the router's softmax(top, dim=1, dtype=top.dtype)
                    if runtime is None or _hooked(experts):  # the module itself: its hooks run
                        h.add_(experts(mlp_in, index, scores))
                    elif resident is not None:
                        if not resident.run(experts, i, at):
                            runtime.forward(experts, at, mlp_in, index, scores, residual=h)
                    elif not runtime.resident_layer(experts, at, index, scores, mlp_in, h):
                        runtime.forward(experts, at, mlp_in, index, scores, residual=h)
                else:
                    out = self.layers[i].mlp(mlp_view)
                    if isinstance(out, tuple):  # GPT-OSS's MLP also returns its router scores
                        out = out[0]
                    flat.add_(out)
                i += 1
            if self.native_head and not (_hooked(self.final_norm) or _hooked(self.head)):
                logits_out = torch.empty(rows, self.head.out_features, dtype=self.dtype)
                attention.head(storage_view(logits_out))
                return logits_out
        finally:
            attention.end_step()
            if resident is not None:
                resident.finish()
        return self.head(self.final_norm(flat))[0]


class RoutedMlps:
    """GPT-OSS's MLP of every layer taken apart (router, then experts): the router's logits come
    with the native dense half, then its top-k and softmax (in the native call too where it
    computes them as torch does: a 2-byte dtype, top-k < 8; else by torch after it), then our
    experts. Empty (``routers`` []) for the other models, whose MLP is their own module."""

    def __init__(self, layers: Sequence[torch.nn.Module], native, dtype: torch.dtype) -> None:
        self.routers = _gpt_oss_routers(layers)
        # (experts module, its layer, its runtime, top-k) per GPT-OSS layer: where the module
        # dispatches to our runtime and has no hooks, the runtime is called straight, without the
        # module call and transformers' dispatching wrapper around it (``forward``).
        self.experts = [
            (
                layer.mlp.experts,
                getattr(layer.mlp.experts, LAYER_ATTR),
                getattr(layer.mlp.experts, RUNTIME_ATTR)
                if getattr(getattr(layer.mlp.experts, "config", None), "_experts_implementation", None)
                == IMPLEMENTATION
                else None,
                router.top_k,
            )
            for layer, router in zip(layers, self.routers, strict=False)  # [] unless GPT-OSS
        ]
        self.modules = [(experts, at) for experts, at, _, _ in self.experts]  # (experts module, its layer)
        self.outputs = self.routers[0].weight.shape[0] if self.routers else 0  # the router's experts
        top_k = self.routers[0].top_k if self.routers else 0
        self.top_k = top_k if top_k and native.router_top_k_supported(_DTYPES[dtype], top_k) else 0
        # The one runtime every layer's experts run through, if one does.
        runtimes = {id(r): r for _, _, r, _ in self.experts if r is not None}
        self.runtime = (
            next(iter(runtimes.values()))
            if len(runtimes) == 1 and all(r is not None for _, _, r, _ in self.experts)
            else None
        )


class RotaryTable:
    """The rotary embedding's (cos, sin) [R, head_dim / 2] of the compute dtype at a step's
    positions, from a table of the model's own ``rotary_emb`` over positions 0 .. P-1, grown
    (doubling, up to the model's maximum positions) when a position is past it. The same values
    as calling it per step: each is a product of one frequency and one position, then
    elementwise (checked bit for bit in tests/unit/compute/test_decode_step.py), without its dozen
    torch calls per step. Rotary types whose frequencies transformers updates with the positions
    asked for ("dynamic", "longrope") have no table: the model's call itself, every step."""

    def __init__(self, rotary: torch.nn.Module, head_dim: int, max_positions: int) -> None:
        self.rotary = rotary
        self._half = head_dim // 2
        self._max_positions = max_positions
        rope_type = getattr(rotary, "rope_type", "default")
        self.tabled = isinstance(rope_type, str) and "dynamic" not in rope_type and rope_type != "longrope"
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, h: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [R, head_dim / 2] at ``position_ids`` [1, R]; ``h`` gives dtype and device."""
        half = self._half
        if not self.tabled:
            cos, sin = self.rotary(h, position_ids)  # [1, R, head_dim] or [1, R, head_dim / 2]
            rows = position_ids.shape[-1]
            return cos.reshape(rows, -1)[:, :half].contiguous(), sin.reshape(rows, -1)[:, :half].contiguous()
        flat = position_ids.reshape(-1)
        need = int(flat.max()) + 1
        table = self._table
        if table is None or table[0].shape[0] < need:
            have = 0 if table is None else table[0].shape[0]
            size = max(need, min(max(2 * have, 256), self._max_positions))
            cos, sin = self.rotary(h, torch.arange(size).unsqueeze(0))  # [1, P, head_dim or head_dim / 2]
            table = self._table = (cos[0, :, :half].contiguous(), sin[0, :, :half].contiguous())
        return table[0].index_select(0, flat), table[1].index_select(0, flat)


# The most weights [vocab, hidden] the native head takes while torch may use more than one thread:
# the native head is one thread's GEMV, the torch one splits a large head over its threads.
NATIVE_HEAD_WEIGHTS = 1 << 22


def _native_head(norm: torch.nn.Module, head: torch.nn.Module, layer_norm: torch.nn.Module, dtype) -> bool:
    """Whether ``DecodeAttention.head`` computes ``head(norm(h))`` as the modules do: the final
    norm is the layers' own RMSNorm class (the rounding the spec names), the head a plain Linear of
    the dtype, and the head is one thread's work (``NATIVE_HEAD_WEIGHTS``) or torch has one."""
    weight = getattr(head, "weight", None)
    return (
        type(norm) is type(layer_norm)
        and isinstance(getattr(norm, "weight", None), torch.Tensor)
        and getattr(norm, "variance_epsilon", None) is not None
        and type(head) is torch.nn.Linear
        and weight is not None
        and weight.dtype == dtype
        and weight.is_contiguous()
        and norm.weight.dtype == dtype
        and (head.bias is None or head.bias.dtype == dtype)
        and (weight.numel() <= NATIVE_HEAD_WEIGHTS or torch.get_num_threads() == 1)
    )


def _hooked(module: torch.nn.Module) -> bool:
    """Whether calling ``module`` runs hooks (its own or global ones): what ``Module.__call__``
    checks before it goes straight to ``forward``."""
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
        or _module_hooks._global_forward_hooks
        or _module_hooks._global_forward_pre_hooks
        or _module_hooks._global_backward_hooks
        or _module_hooks._global_backward_pre_hooks
    )


def _gpt_oss_routers(layers) -> list:
    """Each layer's GPT-OSS router where every layer's MLP is GPT-OSS's (router, then experts
    attached to our runtime), else []."""
    routers = []
    for layer in layers:
        mlp = layer.mlp
        if (
            type(mlp).__name__ != "GptOssMLP"
            or type(getattr(mlp, "router", None)).__name__ != "GptOssTopKRouter"
            or getattr(mlp.experts, RUNTIME_ATTR, None) is None
        ):
            return []
        routers.append(mlp.router)
    return routers


def attention_window(config, attn) -> int | None:
    """The sliding window packed attention applies to ``attn``'s layer (kv_cache.PackedAttention:
    the window the model passes, else the module's)."""
    passed = attn.sliding_window if config.model_type in ("gpt_oss", "qwen3_moe") else None
    if config.model_type == "mixtral":
        passed = getattr(config, "sliding_window", None)
    return passed or getattr(attn, "sliding_window", None)
