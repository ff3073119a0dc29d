"""Decode steps on a GPU replayed as CUDA graphs, one per layer half.

A step's one-token requests run as rows through the model's own modules, in pieces captured once
per (rows, context bucket) and replayed; ``GraphStep.build`` returns None where this does not
apply. Without CUDA the same pieces run eagerly. Design: docs/compute.md."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Sequence

import torch

from compute_svc.engine.kv_cache import KVPool, PooledKV, SequenceKV, batched_attention
from compute_svc.experts.moe import RUNTIME_ATTR

logger = logging.getLogger(__name__)

_MODELS = ("gpt_oss", "mixtral", "qwen3_moe")
MIN_BUCKET = 32  # the shortest context a plan reads


class GraphStep:
    """One model's decode steps as replayed pieces (see the module docstring)."""

    @classmethod
    def build(
        cls,
        model: torch.nn.Module,
        original_attention: str,
        *,
        rows: int,
        tokens: int,
        graphs: bool | None = None,
    ) -> GraphStep | None:
        """The graph step of ``model`` with a KV pool of ``rows`` requests of up to ``tokens``
        tokens, or None where it does not apply (saying why in the log). ``graphs``: capture
        CUDA graphs (default: on a GPU)."""
        config = model.config
        param = next(model.parameters())
        why = None
        if config.model_type not in _MODELS:
            why = f"model type {config.model_type} is not one it covers ({', '.join(_MODELS)})"
        elif original_attention not in ("sdpa", "eager"):
            why = f"attention {original_attention!r}"
        elif rows < 1 or tokens < 1:
            why = "no KV pool (graph_kv_rows or graph_kv_tokens is 0)"
        else:
            for layer in model.model.layers:
                if _router(layer.mlp) is None and _has_experts(layer.mlp):
                    why = f"the MLP of {type(layer.mlp).__name__} is more than a router and experts"
                    break
        if why is not None:
            logger.info("decode steps on %s run through transformers: %s", param.device, why)
            return None
        return cls(
            model, original_attention, rows, tokens, param.device.type == "cuda" if graphs is None else graphs
        )

    def __init__(
        self, model: torch.nn.Module, original_attention: str, rows: int, tokens: int, graphs: bool
    ) -> None:
        from compute_svc.engine.decode_step import attention_window

        config = model.config
        inner = model.model
        self.model = model
        self.inner = inner
        self.layers = list(inner.layers)
        self.eager = original_attention == "eager"
        self.graphs = graphs
        param = next(model.parameters())
        self.device = param.device
        self.dtype = param.dtype
        first = self.layers[0].self_attn
        self.hidden = int(config.hidden_size)
        self.windows = [attention_window(config, layer.self_attn) for layer in self.layers]
        self.routers = [_router(layer.mlp) for layer in self.layers]
        self.pool = KVPool(
            len(self.layers),
            rows,
            tokens,
            int(config.num_key_value_heads),
            int(first.head_dim),
            self.dtype,
            self.device,
        )
        params = inspect.signature(first.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._plans: dict[tuple[int, int], _Plan] = {}
        self.capture_failed: str | None = None
        self.captures = 0
        logger.info(
            "decode steps: %d layers in replayed pieces (%s), KV pool of %d rows x %d tokens (%.1f MiB on %s)",
            len(self.layers),
            "CUDA graphs" if graphs else "eager",
            rows,
            tokens,
            self.pool.nbytes / 2**20,
            self.device,
        )

    # -- the requests' KV ---------------------------------------------------------------------
    def new_kv(self, tokens: int) -> SequenceKV:
        """A request's KV: a pool row when one is free and long enough for ``tokens``, else its
        own growing buffers (its steps then run through transformers)."""
        return self.pool.take(tokens) or SequenceKV()

    def covers(self, caches: Sequence[SequenceKV]) -> bool:
        return all(isinstance(kv, PooledKV) and kv.row >= 0 and kv.pool is self.pool for kv in caches)

    # -- a step --------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, caches: Sequence[PooledKV]
    ) -> torch.Tensor:
        """Logits [R, V] of R requests' next tokens: ``input_ids``/``position_ids`` [1, R] on the
        device, one token per request, ``caches`` their pool rows (holding everything before it).
        The new keys and values are written at each row's position; ``commit`` is the caller's."""
        rows = input_ids.shape[1]
        longest = max(kv.length for kv in caches) + 1
        bucket = min(self.pool.tokens, max(MIN_BUCKET, 1 << (longest - 1).bit_length()))
        key = (rows, bucket)
        plan = self._plans.get(key)
        fresh = plan is None
        if fresh:
            plan = self._plans[key] = _Plan(self, rows, bucket)
        plan.inputs.load(input_ids, position_ids, [kv.row for kv in caches])
        with batched_attention():
            logits = plan.run()
            if fresh and self.graphs and self.capture_failed is None:
                plan.capture()
        return logits


class _Inputs:
    """A plan's static inputs, loaded before each run: token ids, positions and KV pool rows."""

    def __init__(self, rows: int, device: torch.device) -> None:
        self.rows = rows
        self.ids = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.pos = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.kv_rows = torch.zeros(rows, dtype=torch.long, device=device)
        self._rows_host = torch.zeros(rows, dtype=torch.long, pin_memory=device.type == "cuda")

    def load(self, input_ids: torch.Tensor, position_ids: torch.Tensor, kv_rows: list[int]) -> None:
        self.ids.copy_(input_ids.view(self.rows, 1))
        self.pos.copy_(position_ids.view(self.rows, 1))
        self._rows_host.copy_(torch.tensor(kv_rows, dtype=torch.long))
        self.kv_rows.copy_(self._rows_host, non_blocking=True)


class _Positional:
    """What the prologue computes from the positions for every layer: the rotary ``cos`` and
    ``sin``, and the attention mask of each window (made at the first run)."""

    def __init__(self) -> None:
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None
        self.masks: dict[int | None, torch.Tensor] = {}


class _Plan:
    """The static tensors and pieces of one (rows, bucket); their graphs once captured."""

    def __init__(self, step: GraphStep, rows: int, bucket: int) -> None:
        self.step = step
        self.rows = rows
        self.bucket = bucket
        dev, dtype, hidden = step.device, step.dtype, step.hidden
        self.inputs = _Inputs(rows, dev)
        self.positional = _Positional()
        self.h = torch.zeros(rows, 1, hidden, dtype=dtype, device=dev)
        self.moe = torch.zeros(rows, hidden, dtype=dtype, device=dev)
        self.mlp_in = torch.zeros(rows, hidden, dtype=dtype, device=dev)
        self.index: list[torch.Tensor | None] = []
        self.scores: list[torch.Tensor | None] = []
        self.logits: torch.Tensor | None = None
        self.cache = _RowsCache(step.pool, self)
        self.pieces = self._pieces()
        self.graphs: list[torch.cuda.CUDAGraph] | None = None

    # -- pieces: each writes its outputs into the plan's static tensors -------------------------
    def prologue(self) -> None:
        step, inputs, positional = self.step, self.inputs, self.positional
        h = step.inner.embed_tokens(inputs.ids)  # [R, 1, H]
        self.h.copy_(h)
        cos, sin = step.inner.rotary_emb(self.h, inputs.pos)  # [R, 1, D]
        if positional.cos is None:
            positional.cos, positional.sin = torch.empty_like(cos), torch.empty_like(sin)
        positional.cos.copy_(cos)
        positional.sin.copy_(sin)
        at = torch.arange(self.bucket, device=step.device).unsqueeze(0)  # [1, B]
        pos = inputs.pos  # [R, 1]
        for window in set(step.windows):
            allowed = at <= pos
            if window:
                allowed = allowed & (at > pos - window)
            if step.eager:
                zero = torch.zeros((), dtype=step.dtype, device=step.device)
                neg = torch.full((), torch.finfo(step.dtype).min, dtype=step.dtype, device=step.device)
                mask = torch.where(allowed, zero, neg)
            else:
                mask = allowed
            mask = mask[:, None, None, :]  # [R, 1, 1, B]
            if window not in positional.masks:
                positional.masks[window] = torch.empty_like(mask)
            positional.masks[window].copy_(mask)

    def layer(self, i: int, add_moe: bool) -> None:
        step = self.step
        layer = step.layers[i]
        if add_moe:
            self.h.add_(self.moe.view_as(self.h))
        residual = self.h
        x = layer.input_layernorm(residual)
        positional = self.positional
        out, _ = layer.self_attn(
            hidden_states=x,
            position_embeddings=(positional.cos, positional.sin),
            attention_mask=positional.masks[step.windows[i]],
            **{step._cache_kw: self.cache},
        )
        h = residual + out
        router = step.routers[i]
        if router is None:  # a dense MLP: the whole layer here
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            self.h.copy_(h)
            return
        self.h.copy_(h)
        mlp_in = layer.post_attention_layernorm(h).view(self.rows, -1)
        self.mlp_in.copy_(mlp_in)
        _, scores, index = router(self.mlp_in)
        while len(self.index) <= i:
            self.index.append(None)
            self.scores.append(None)
        if self.index[i] is None:
            self.index[i], self.scores[i] = torch.empty_like(index), torch.empty_like(scores)
        self.index[i].copy_(index)
        self.scores[i].copy_(scores)

    def epilogue(self, add_moe: bool) -> None:
        step = self.step
        if add_moe:
            self.h.add_(self.moe.view_as(self.h))
        logits = step.model.lm_head(step.inner.norm(self.h))  # [R, 1, V]
        if self.logits is None:
            self.logits = torch.empty_like(logits)
        self.logits.copy_(logits)

    def experts(self, i: int) -> None:
        """Layer i's experts: the module itself (its hooks run), through the runtime."""
        mlp = self.step.layers[i].mlp
        out = mlp.experts(self.mlp_in, self.index[i], self.scores[i])
        self.moe.copy_(out)

    def _pieces(self) -> list[tuple[Callable[[], None], int | None]]:
        """(piece, the layer whose experts follow it or None), in order."""
        pieces: list[tuple[Callable[[], None], int | None]] = [(self.prologue, None)]
        sparse_before = False
        for i, router in enumerate(self.step.routers):
            pieces.append(
                (lambda i=i, add=sparse_before: self.layer(i, add), i if router is not None else None)
            )
            sparse_before = router is not None
        pieces.append((lambda add=sparse_before: self.epilogue(add), None))
        return pieces

    def run(self) -> torch.Tensor:
        if self.graphs is None:
            for piece, experts in self.pieces:
                piece()
                if experts is not None:
                    self.experts(experts)
        else:
            for graph, (_, experts) in zip(self.graphs, self.pieces, strict=True):
                graph.replay()
                if experts is not None:
                    self.experts(experts)
        return self.logits.view(self.rows, -1)

    def capture(self) -> None:
        """Capture every piece (after an eager run made the static tensors and warmed up the
        libraries). A failure leaves the step eager for good, saying why."""
        step = self.step
        device = step.device
        try:
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            pool = torch.cuda.graph_pool_handle()
            graphs = []
            for piece, _ in self.pieces:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                    piece()
                graphs.append(graph)
            torch.cuda.current_stream(device).wait_stream(stream)
        except Exception as exc:  # noqa: BLE001 - eager from now on, and say why
            step.capture_failed = f"{type(exc).__name__}: {exc}"
            logger.warning(
                "decode steps run eagerly: capturing a CUDA graph failed (%s)", step.capture_failed
            )
            return
        self.graphs = graphs
        step.captures += 1


class _RowsCache:
    """The ``cache`` the attention modules get in a graph step: ``update`` writes each row's new
    keys and values at its position in the pool and returns the bucket's first tokens of the
    step's rows ([R, kv_heads, bucket, head_dim]), gathered."""

    def __init__(self, pool: KVPool, plan: _Plan) -> None:
        self.pool = pool
        self.plan = plan

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):  # noqa: ARG002 - Cache API
        plan = self.plan
        rows, pos = plan.inputs.kv_rows, plan.inputs.pos.view(-1)
        keys, values = self.pool.keys[layer_idx], self.pool.values[layer_idx]
        keys[rows, :, pos] = key_states[:, :, 0]
        values[rows, :, pos] = value_states[:, :, 0]
        b = plan.bucket
        return keys[:, :, :b].index_select(0, rows), values[:, :, :b].index_select(0, rows)

    def get_seq_length(self, layer_idx: int = 0) -> int:  # noqa: ARG002 - Cache API
        return 0


def _router(mlp: torch.nn.Module) -> torch.nn.Module | None:
    """The router of an MLP that is a router then experts attached to our runtime, else None."""
    experts = getattr(mlp, "experts", None)
    if experts is None or getattr(experts, RUNTIME_ATTR, None) is None:
        return None
    names = {name for name, _ in mlp.named_children()}
    router_name = "router" if "router" in names else "gate" if "gate" in names else None
    if router_name is None or names != {router_name, "experts"}:
        return None
    return getattr(mlp, router_name)


def _has_experts(mlp: torch.nn.Module) -> bool:
    return getattr(mlp, "experts", None) is not None
