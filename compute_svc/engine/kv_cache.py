"""Many requests in one forward: packed tokens, per-request KV caches, per-request attention.

Through two seams of transformers (the KV ``Cache`` and ``AttentionInterface``) each request's
attention is computed as if it ran alone; only the matmuls see the packed rows. Design:
docs/compute.md."""

from __future__ import annotations

import contextvars
import inspect
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from transformers.cache_utils import Cache
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

IMPLEMENTATION = "expertcache_packed"
_INITIAL_CAPACITY = 64
_MISSING = object()


class SequenceKV:
    """One request's keys and values, per attention layer, in buffers that grow by doubling.

    ``length`` tokens are committed; a step writes ``t`` more in every layer and ``commit(t)``
    makes them part of the past once the whole forward succeeded (a failed forward leaves the
    sequence as it was)."""

    def __init__(self) -> None:
        self.length = 0
        self._keys: dict[int, torch.Tensor] = {}  # layer -> [1, h, capacity, d]
        self._values: dict[int, torch.Tensor] = {}
        self._table: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # see reserve

    def write(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``keys``/``values`` [1, h, t, d] after the committed past; the past and them as views."""
        end = self.length + keys.shape[2]
        k, v = self._buffers(layer, keys, values, end)
        k[:, :, self.length : end] = keys
        v[:, :, self.length : end] = values
        return k[:, :, :end], v[:, :, :end]

    def commit(self, tokens: int) -> None:
        self.length += tokens

    def close(self) -> None:
        """The request is over: its buffers may go (a pooled row goes back to its pool)."""
        self._keys.clear()
        self._values.clear()
        self._table = None

    def reserve(
        self, layers: int, like: torch.Tensor, needed: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Room for ``needed`` tokens in layers 0 .. layers-1 (new buffers like ``like`` [1, h, 1, d]),
        as the buffers' addresses and capacities: (keys [layers], values [layers], capacity
        [layers]) int64, for a native writer (``compute_svc.engine.decode_step``); kept until a buffer grows."""
        table = self._table
        if table is None or len(table[2]) != layers or int(table[2].min()) < needed:
            for layer in range(layers):
                self._buffers(layer, like, like, needed)
            ks = [self._keys[layer] for layer in range(layers)]
            vs = [self._values[layer] for layer in range(layers)]
            table = self._table = (
                np.array([k.data_ptr() for k in ks], dtype=np.int64),
                np.array([v.data_ptr() for v in vs], dtype=np.int64),
                np.array([k.shape[2] for k in ks], dtype=np.int64),
            )
        return table

    def _buffers(
        self, layer: int, key_like: torch.Tensor, value_like: torch.Tensor, needed: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s buffers with room for ``needed`` tokens (grown like the ``*_like``)."""
        k = self._keys.get(layer)
        v = self._values.get(layer)
        if k is None or v is None or k.shape[2] < needed or v.shape[2] < needed:
            self._keys[layer] = k = _ensure(k, key_like, needed)
            self._values[layer] = v = _ensure(v, value_like, needed)
            self._table = None
        return k, v


def _ensure(buf: torch.Tensor | None, like: torch.Tensor, needed: int) -> torch.Tensor:
    """``buf`` with room for ``needed`` tokens (dim 2), grown by doubling and keeping its contents."""
    if buf is not None and buf.shape[2] >= needed:
        return buf
    capacity = max(_INITIAL_CAPACITY, needed, 2 * (buf.shape[2] if buf is not None else 0))
    grown = like.new_empty(like.shape[0], like.shape[1], capacity, like.shape[3])
    if buf is not None:
        grown[:, :, : buf.shape[2]] = buf
    return grown


class KVPool:
    """Keys and values of up to ``rows`` requests at fixed addresses, for steps replayed as CUDA
    graphs (``compute_svc.engine.graph_step``): per attention layer one [rows, kv_heads, tokens, head_dim]
    tensor for keys and one for values, made at the first ``take``. A request holding a row
    (``PooledKV``) keeps its keys and values there for every kind of step, so the packed forward
    of transformers and the replayed step read and write the same memory."""

    def __init__(
        self,
        layers: int,
        rows: int,
        tokens: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if rows < 1 or tokens < 1:
            raise ValueError(f"a KV pool needs rows and tokens, not {rows} x {tokens}")
        self.layers, self.rows, self.tokens = layers, rows, tokens
        self.shape = (rows, kv_heads, tokens, head_dim)
        self.dtype, self.device = dtype, device
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._free = list(range(rows - 1, -1, -1))

    @property
    def nbytes(self) -> int:
        rows, heads, tokens, dim = self.shape
        return (
            2 * self.layers * rows * heads * tokens * dim * torch.empty((), dtype=self.dtype).element_size()
        )

    @property
    def free_rows(self) -> int:
        return len(self._free)

    def take(self, tokens: int) -> PooledKV | None:
        """A row for a request of at most ``tokens`` tokens, or None (none free, or too long)."""
        if tokens > self.tokens or not self._free:
            return None
        if not self.keys:
            # Zeros: a row's tokens past its length are masked, and must not be NaN (0 x NaN).
            self.keys = [
                torch.zeros(self.shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)
            ]
            self.values = [
                torch.zeros(self.shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)
            ]
        return PooledKV(self, self._free.pop())

    def give(self, row: int) -> None:
        self._free.append(row)


class PooledKV(SequenceKV):
    """A request's keys and values in row ``row`` of a ``KVPool`` (room for ``pool.tokens``)."""

    def __init__(self, pool: KVPool, row: int) -> None:
        super().__init__()
        self.pool = pool
        self.row = row

    def _buffers(self, layer, key_like, value_like, needed):  # noqa: ARG002 - the pool's shape
        if needed > self.pool.tokens:
            raise ValueError(f"{needed} tokens do not fit a KV pool row of {self.pool.tokens}")
        k = self._keys.get(layer)
        if k is None:
            k = self._keys[layer] = self.pool.keys[layer][self.row : self.row + 1]
            self._values[layer] = self.pool.values[layer][self.row : self.row + 1]
        return k, self._values[layer]

    def close(self) -> None:
        if self.row >= 0:
            self.pool.give(self.row)
            self.row = -1
        super().close()


@dataclass(frozen=True)
class Segment:
    """One request's ``tokens`` in the step, at request positions ``past .. past + tokens - 1``."""

    kv: SequenceKV
    tokens: int

    @property
    def past(self) -> int:
        return self.kv.length


class PackedCache(Cache):
    """The ``past_key_values`` of a packed forward (see the module docstring).

    ``update`` splits the new keys/values [1, h, T, d] by segment, appends each to its request's
    ``SequenceKV`` and returns every request's past + new keys/values concatenated along the
    sequence ([1, h, Σ(past + t), d]); ``packed_attention`` splits them back by the same layout.
    One segment: its buffers' views, no copy."""

    def __init__(self, segments: Sequence[Segment]) -> None:
        super().__init__(layers=[])
        self.segments = tuple(segments)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):  # noqa: ARG002 - Cache API
        # transformers up to 5.23 passes ``cache_kwargs``; 5.24 renamed it ``kwargs=``. Neither
        # carries anything a packed cache needs (positions come with the segments).
        keys, values = [], []
        start = 0
        for seg in self.segments:
            k, v = seg.kv.write(
                layer_idx,
                key_states[:, :, start : start + seg.tokens],
                value_states[:, :, start : start + seg.tokens],
            )
            keys.append(k)
            values.append(v)
            start += seg.tokens
        if len(keys) == 1:
            return keys[0], values[0]
        return torch.cat(keys, dim=2), torch.cat(values, dim=2)

    def get_seq_length(self, layer_idx: int = 0) -> int:  # noqa: ARG002 - Cache API
        # Positions are given explicitly (position_ids); the model asks only to derive defaults.
        return 0

    def get_mask_sizes(self, query_length, layer_idx=0):  # noqa: ARG002 - Cache API
        return query_length, 0

    @property
    def is_compileable(self) -> bool:
        return False


# The segments of the forward running on this thread (None: a plain forward over one sequence).
_SEGMENTS: contextvars.ContextVar[tuple[Segment, ...] | None] = contextvars.ContextVar(
    "expertcache_segments", default=None
)
# The masks of that forward, made once and shared by its layers (as transformers builds its mask
# once per forward): (past, tokens, window, dtype, device) -> mask.
_MASKS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("expertcache_masks", default=None)
# Set while a step runs requests as a batch (one row per request, its own mask given): attention
# is then the model's own function as called (compute_svc.engine.graph_step).
_BATCHED: contextvars.ContextVar[bool] = contextvars.ContextVar("expertcache_batched", default=False)


@contextmanager
def batched_attention() -> Iterator[None]:
    """Attention calls in this context go straight to the model's own function, with the mask
    and keys they are given (one request per batch row)."""
    token = _BATCHED.set(True)
    try:
        yield
    finally:
        _BATCHED.reset(token)


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword ``model``'s forward takes its KV cache by: ``cache`` from transformers 5.24
    (``past_key_values`` still works there, with a deprecation warning), ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@contextmanager
def packed_forward(segments: Sequence[Segment]) -> Iterator[PackedCache]:
    """The ``past_key_values`` for a forward over ``segments``, and their layout for attention."""
    cache = PackedCache(segments)
    token = _SEGMENTS.set(cache.segments)
    masks = _MASKS.set({})
    try:
        yield cache
    finally:
        _MASKS.reset(masks)
        _SEGMENTS.reset(token)


class PackedAttention:
    """Per-request attention over packed tokens, delegating to the model's own implementation."""

    def __init__(self, original: str) -> None:
        self.original = original

    def function(self, module: torch.nn.Module) -> Callable:
        if self.original == "eager":
            # Models keep their eager attention in their own module (gpt-oss's adds sinks).
            return sys.modules[type(module).__module__].eager_attention_forward
        return ALL_ATTENTION_FUNCTIONS[self.original]

    def __call__(self, module, query, key, value, attention_mask, **kwargs):  # noqa: ARG002 - mask is ours
        """query [1, hq, T, d], key/value [1, hk, Σ(past + t), d] → ([1, T, hq, dv], None)."""
        if _BATCHED.get():
            return self.function(module)(module, query, key, value, attention_mask, **kwargs)
        segments = _SEGMENTS.get()
        if segments is None:  # no cache (forward_logits): one sequence, all of it new
            segments = (Segment(SequenceKV(), query.shape[2]),)
        fn = self.function(module)
        if key.shape[1] == query.shape[1] and getattr(module, "num_key_value_groups", 1) > 1:
            # Keys already expanded to every query head (DeepSeek's MLA): sdpa must not repeat them
            # again, which it would do on the masked path a lone request never takes.
            module = _ExpandedHeads(module)
        window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
        masks = _MASKS.get()
        outs = []
        q0 = k0 = 0
        for seg in segments:
            kv_len = seg.past + seg.tokens
            q = query[:, :, q0 : q0 + seg.tokens]
            k = key[:, :, k0 : k0 + kv_len]
            v = value[:, :, k0 : k0 + kv_len]
            if masks is None:
                mask = self.mask(seg.past, seg.tokens, window, query)
            else:
                key_ = (seg.past, seg.tokens, window, query.dtype, query.device)
                mask = masks.get(key_, _MISSING)
                if mask is _MISSING:
                    mask = masks[key_] = self.mask(seg.past, seg.tokens, window, query)
            out, _ = fn(module, q, k, v, mask, **kwargs)
            outs.append(out)
            q0 += seg.tokens
            k0 += kv_len
        return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)), None

    def mask(self, past: int, tokens: int, window: int | None, query: torch.Tensor) -> torch.Tensor | None:
        """The mask a lone request gets from transformers: queries at ``past .. past+tokens-1``
        over keys ``0 .. past+tokens-1``, causal and within ``window``. sdpa is given None where
        nothing is masked beyond plain causality from position 0 (as transformers skips it);
        eager always gets an additive float mask."""
        q_pos = torch.arange(past, past + tokens, device=query.device).unsqueeze(1)  # [t, 1]
        k_pos = torch.arange(past + tokens, device=query.device).unsqueeze(0)  # [1, kv]
        allowed = k_pos <= q_pos
        windowed = window is not None and past + tokens > window
        if windowed:
            allowed &= k_pos > q_pos - window
        if self.original == "eager":
            zero = torch.zeros((), dtype=query.dtype, device=query.device)
            neg = torch.tensor(torch.finfo(query.dtype).min, dtype=query.dtype, device=query.device)
            return torch.where(allowed, zero, neg)[None, None]
        if not windowed and (tokens == 1 or past == 0):
            return None  # decode over everything, or a whole prompt from 0: is_causal covers it
        return allowed[None, None]


class _ExpandedHeads:
    """``module`` as attention sees it, with one query head per key head."""

    num_key_value_groups = 1

    def __init__(self, module: torch.nn.Module) -> None:
        self._module = module

    def __getattr__(self, name: str):
        return getattr(self._module, name)


def use_packed_attention(model: torch.nn.Module) -> PackedAttention:
    """Route ``model``'s attention through ``packed_attention`` (registered once per original
    implementation); forwards then need ``packed_forward`` for their cache."""
    original = model.config._attn_implementation
    if original not in ("sdpa", "eager"):
        raise ValueError(f"packed attention wraps sdpa or eager attention, not {original!r}")
    packed = PackedAttention(original)
    name = f"{IMPLEMENTATION}_{original}"
    AttentionInterface.register(name, packed)
    assert name not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping  # transformers then builds no mask
    model.set_attn_implementation(name)
    return packed
