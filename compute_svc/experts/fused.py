"""Decode-sized batches of experts on the CPU through the native fused expert FFN.

The kernel reads each expert straight from its arena slot in its stored encoding; a module whose
math it does not have keeps the torch path (``fused_spec`` is None). Why: docs/compute.md."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch
from transformers import activations
from transformers.integrations import moe as hf_moe

from compute_svc.experts.stages import Combiner, Routing
from expertcache.manifest import ExpertTensor

logger = logging.getLogger(__name__)

# Rows per expert up to which the fused kernel beats the torch path (decode + GEMMs), per compute
# dtype (float32: even at 32 rows, MKL's GEMM ahead beyond; measured at the e2e shape), and in
# bfloat16 per weight layout (encoding, form) of a projection, a layer taking the smaller of its
# two: measured by bench.kernels on 1 thread at the e2e and gpt-oss-20b shapes, the largest row
# count at which the fused kernel is at least as fast at both (torch's bf16 GEMMs run on oneDNN,
# AMX where the CPU has it). Torch / fused at gpt-oss-20b's shape: MXFP4 1.5 at 64 rows (the AMX
# path from 5 rows); plain [in, out] 1.0 at 8, 0.5 at 16; plain [out, in] 1.0 at 2, 0.7 at 4;
# FP8 1.7 at 8, 0.5 at 16; FP8 [in, out] 1.0 at 8, 0.5 at 16.
MAX_FUSED_ROWS = {"float32": 32, "bfloat16": 64, "float16": 64}
MAX_FUSED_ROWS_BF16 = {
    ("mxfp4", "dot"): 64,
    ("plain", "axpy"): 8,
    ("plain", "dot"): 2,
    ("fp8", "dot"): 8,
    ("fp8", "axpy"): 8,
}
# The same, where the native kernel runs another path than the Xeon's above: avx512-bf16 (AMD
# Zen 4) multiplies plain [out, in] rows by vdpbf16ps. Torch / fused there (bench.kernels, 1 thread,
# 3 rounds): plain [out, in] at gpt-oss-20b's shape 1.0 at 8 rows, 0.9 at 16 (the e2e shape 2.3 at
# 8); plain [in, out] 1.6 at 8, 1.0 at 16.
MAX_FUSED_ROWS_BF16_BY_PATH = {"avx512-bf16": {("plain", "dot"): 8, ("plain", "axpy"): 16}}


def max_fused_rows(spec: dict, path: str = "") -> int:
    """Rows per expert up to which the fused kernel runs a layer of ``spec`` (0: never) on the
    native kernel's SIMD ``path`` (``ExpertFfn.path``)."""
    rows = MAX_FUSED_ROWS.get(spec["compute"], 0)
    if spec["compute"] == "bfloat16":
        table = {**MAX_FUSED_ROWS_BF16, **MAX_FUSED_ROWS_BF16_BY_PATH.get(path, {})}
        for projection in (spec["first"], spec["down"]):
            rows = min(rows, table.get((projection["encoding"], projection["form"]), rows))
    return rows


_ACTS = (
    ((activations.SiLUActivation, torch.nn.SiLU), "silu"),
    ((activations.GELUTanh,), "gelu_tanh"),
    ((activations.GELUActivation,), "gelu"),
    ((torch.nn.ReLU,), "relu"),
)
_DTYPES = ("float32", "bfloat16", "float16")


def _act_name(act_fn: object) -> str | None:
    if isinstance(act_fn, activations.GELUActivation) and getattr(act_fn, "act", None) is not None:
        if getattr(act_fn.act, "__name__", "") != "gelu":  # GELUActivation(use_gelu_python=True)
            return None
    return next((name for types, name in _ACTS if type(act_fn) in types), None)


def _gate(module: torch.nn.Module) -> dict | None:
    """The activation stage as the kernel names it, or None."""
    if not module.has_gate:
        act = _act_name(getattr(module, "act_fn", None))
        return None if act is None else dict(gate="plain", act=act)
    apply_gate = getattr(type(module), "_apply_gate", None)
    if apply_gate is hf_moe._default_apply_gate:
        act = _act_name(getattr(module, "act_fn", None))
        return None if act is None else dict(gate="glu_halves", act=act)
    if type(module).__name__ == "GptOssExperts" and apply_gate.__qualname__ == "GptOssExperts._apply_gate":
        return dict(gate="gpt_oss", alpha=float(module.alpha), limit=float(module.limit))
    return None


def _projection(tensors: dict[str, ExpertTensor], name: str, inputs: int, outputs: int, transposed: bool):
    """How the kernel reads parameter ``name`` (x @ W maps inputs → outputs), or None."""
    t = tensors.get(name)
    if t is None or t.dtype not in _DTYPES:
        return None
    parts = {p.name: p for p in t.parts}
    if t.encoding == "plain":
        # Stored transposed (rows of the module's [in, out] parameter, expertcache.encodings.Plain):
        # [out, in], read as dot rows.
        part = parts[name]
        if part.dtype not in _DTYPES or (t.transposed and not transposed):
            return None
        axpy = transposed and not t.transposed
        want = (inputs, outputs) if axpy else (outputs, inputs)
        if tuple(part.shape) != want:
            return None
        spec = dict(
            encoding="plain",
            form="axpy" if axpy else "dot",
            weight_dtype=part.dtype,
            weight_offset=part.offset,
        )
    elif t.encoding == "mxfp4":
        # Blocks [R, C/32, 16] with the runtime parameter D.T: rows are outputs when the module
        # computes x @ param with param [in, out].
        if not (t.transposed and transposed):
            return None
        blocks, scales = parts[name + "_blocks"], parts[name + "_scales"]
        if tuple(blocks.shape) != (outputs, inputs // 32, 16):
            return None
        spec = dict(encoding="mxfp4", form="dot", weight_offset=blocks.offset, scale_offset=scales.offset)
    elif t.encoding == "fp8":
        # Values [R, C] are the runtime parameter itself: [in, out] (x @ param) when transposed.
        if t.transposed:
            return None
        values, scale = parts[name], parts[name + "_scale_inv"]
        if tuple(values.shape) != ((inputs, outputs) if transposed else (outputs, inputs)):
            return None
        bm, bn = t.block_size
        spec = dict(
            encoding="fp8",
            form="axpy" if transposed else "dot",
            weight_offset=values.offset,
            scale_offset=scale.offset,
            block_rows=bm,
            block_cols=bn,
        )
    else:
        return None
    spec.update(inputs=inputs, outputs=outputs)
    bias = tensors.get(name + "_bias")
    if bias is not None:
        if bias.encoding != "plain" or bias.parts[0].dtype not in _DTYPES or tuple(bias.shape) != (outputs,):
            return None
        spec.update(bias_offset=bias.parts[0].offset, bias_dtype=bias.parts[0].dtype)
    return spec


def fused_spec(module: torch.nn.Module, layouts: Sequence[ExpertTensor], slot_bytes: int) -> dict | None:
    """The native kernel's spec for ``module``'s experts stored as ``layouts``, or None when its
    math or layout is one the kernel does not have."""
    if getattr(module, "has_post_expert_norm", False):
        return None
    gate = _gate(module)
    if gate is None:
        return None
    tensors = {t.name: t for t in layouts}
    first_name = "gate_up_proj" if module.has_gate else "up_proj"
    down = tensors.get("down_proj")
    if down is None or len(down.shape) != 2:
        return None
    transposed = bool(module.is_transposed)
    inter, hidden = down.shape if transposed else down.shape[::-1]
    first_out = 2 * inter if module.has_gate else inter
    has_bias = bool(module.has_bias)
    if has_bias != (first_name + "_bias" in tensors and "down_proj_bias" in tensors):
        return None
    first = _projection(tensors, first_name, hidden, first_out, transposed)
    second = _projection(tensors, "down_proj", inter, hidden, transposed)
    if first is None or second is None:
        return None
    compute = tensors[first_name].dtype
    if tensors["down_proj"].dtype != compute:
        return None
    return dict(first=first, down=second, compute=compute, slot_bytes=int(slot_bytes), **gate)


class FusedKernel(NamedTuple):
    ffn: object  # expertcache.native.ExpertFfn
    max_rows: int  # rows per expert up to which it runs a layer
    compute: torch.dtype  # its compute dtype (the hidden states')


class FusedExperts:
    """The native fused kernel for every experts module of one model (one per distinct spec)."""

    def __init__(self, arena_slots: torch.Tensor, layouts: Sequence[ExpertTensor]) -> None:
        from expertcache import native  # the native core: imported where it runs

        self._native = native
        self.layouts = tuple(layouts)
        self.arena = arena_slots.reshape(-1).numpy()  # [num_slots * slot_bytes] uint8, no copy
        self.slot_bytes = int(arena_slots.shape[1])
        self._by_module: dict[tuple[int, torch.dtype], FusedKernel | None] = {}
        self._by_spec: dict[str, FusedKernel] = {}
        self.calls = 0  # batches run by the kernel
        # The numpy views of the last two buffers viewed (a decode step passes the same hidden
        # states and residual to every layer); holding the tensors keeps their memory, so a match
        # is the same memory.
        self._viewed: list[tuple[torch.Tensor, np.ndarray]] = []
        self._pairs: np.ndarray | None = None  # layer_runner's pair rows (scratch), reused per shape

    def view_of(self, hidden: torch.Tensor) -> np.ndarray:
        """``storage_view(hidden)``, made once per buffer while it is one of the last two viewed."""
        viewed = self._viewed
        for tensor, view in viewed:
            if tensor is hidden:
                return view
        view = storage_view(hidden)
        viewed.append((hidden, view))
        if len(viewed) > 2:
            del viewed[0]
        return view

    @staticmethod
    def supports(arena_slots: torch.Tensor) -> bool:
        return arena_slots.device.type == "cpu" and arena_slots.is_contiguous()

    def kernel(self, module: torch.nn.Module, weights_dtype: torch.dtype) -> FusedKernel | None:
        """The native ExpertFfn for ``module`` with routing weights of ``weights_dtype`` and the
        most rows per expert it takes, or None (the torch path)."""
        key = (id(module), weights_dtype)
        if key not in self._by_module:
            spec = fused_spec(module, self.layouts, self.slot_bytes)
            ffn = None
            if spec is not None:
                # transformers' weighted output: float32 with float32 routing weights, else rounded.
                spec["round_weighted"] = (
                    str(weights_dtype).removeprefix("torch.") == spec["compute"] != "float32"
                )
                text = repr(sorted(spec.items()))
                ffn = self._by_spec.get(text)
                if ffn is None:
                    native_ffn = self._native.expert_ffn(spec, threads=torch.get_num_threads())
                    ffn = FusedKernel(
                        native_ffn, max_fused_rows(spec, native_ffn.path), getattr(torch, spec["compute"])
                    )
                    self._by_spec[text] = ffn
                    logger.info(
                        "experts of %s run by the fused CPU kernel up to %d rows per expert (%s path, %d threads)",
                        type(module).__name__,
                        ffn.max_rows,
                        native_ffn.path,
                        native_ffn.threads,
                    )
            else:
                logger.info(
                    "experts of %s run as torch ops (no fused kernel for their math)", type(module).__name__
                )
            self._by_module[key] = ffn
        return self._by_module[key]

    @staticmethod
    def takes(
        kernel: FusedKernel,
        rows: int,
        weights_dtype: torch.dtype,
        hidden_states: torch.Tensor,
        residual: torch.Tensor,
    ) -> bool:
        """Whether ``kernel``'s ``run_layer`` takes a layer of ``rows`` tokens with routing
        weights of ``weights_dtype``: at most its rows per expert, ``hidden_states`` and
        ``residual`` contiguous [T, H] of its compute dtype, weights float32 or of that dtype."""
        return (
            rows <= kernel.max_rows
            and hidden_states.dtype == kernel.compute
            and residual.dtype == kernel.compute
            and weights_dtype in (torch.float32, kernel.compute)
            and residual.shape == hidden_states.shape
            and hidden_states.is_contiguous()
            and residual.is_contiguous()
        )

    def layer_runner(
        self,
        kernel: FusedKernel,
        layer: int,
        max_experts: int,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor,
    ) -> Callable[[object, int, object], int] | None:
        """A decode step's layer as one call of the kernel's ``run_layer`` (the provider's
        ``run_layer`` gives it the slot table and the experts per layer), adding the result into
        ``residual`` [T, H]; None where ``takes`` says it does not apply."""
        call = self.layer_call(
            kernel, max_experts, top_k_index.shape[0], top_k_weights.dtype, hidden_states, residual
        )
        if call is None:
            return None
        ids = np.ascontiguousarray(top_k_index.numpy()).reshape(-1)  # [S] int64
        weights = np.ascontiguousarray(
            top_k_weights.numpy() if top_k_weights.dtype == torch.float32 else storage_view(top_k_weights)
        ).reshape(-1)
        return lambda table, num_experts, _signals: call(table, layer, num_experts, ids, weights)

    def layer_call(
        self,
        kernel: FusedKernel,
        max_experts: int,
        rows: int,
        weights_dtype: torch.dtype,
        hidden_states: torch.Tensor,
        residual: torch.Tensor,
        *,
        span: bool = False,
    ) -> Callable | None:
        """The kernel's ``run_layer`` bound to a step's buffers: ``call(table, layer, num_experts,
        ids, weights)`` runs a layer of ``rows`` tokens from its routing ([rows * K] int64 ids,
        [rows * K] weights: float32 or the compute dtype's storage) and adds its result into
        ``residual``; the number of experts it ran (0: a miss). With ``span``, its
        ``run_layers``: ``call(attention, table, first, num_experts, ids, weights)`` runs the
        step's layers from ``first`` on, each layer's dense half (``attention``, a begun
        ``DecodeAttention``) then its experts, from ``ids`` / ``weights`` [L, rows * K], in one
        native call without the GIL, up to the first layer whose experts do not run: (that layer
        or L, experts run, why, waited, waits, lost_s) as ``run_layers`` returns them; its
        ``signals`` (a ``native.LayerSignals``), ``ahead`` (the lookahead as given, ids and scores
        [L, depth, rows * K]), ``loading_wait_s`` (how long a layer whose experts are in flight
        waits for them) and ``demand`` (a ``native.SpanDemand``: a layer with a miss demands its
        experts and waits for them within the call) as ``run_layers`` takes them. None where ``takes`` says the kernel does
        not take such layers."""
        if not self.takes(kernel, rows, weights_dtype, hidden_states, residual):
            return None
        x, out = self.view_of(hidden_states), self.view_of(residual)
        ffn, arena = kernel.ffn, self.arena

        def call(table: object, layer: int, num_experts: int, ids: np.ndarray, weights: np.ndarray) -> int:
            pairs = self._pairs_for(ids.size, x)
            ran = ffn.run_layer(
                table, layer, num_experts, max_experts, arena, ids, weights, x, pairs, out, True
            )
            if ran > 0:
                self.calls += 1
            return ran

        def call_span(
            attention: object,
            table: object,
            first: int,
            num_experts: int,
            ids: np.ndarray,
            weights: np.ndarray,
            signals: object = None,
            ahead: tuple[np.ndarray, np.ndarray] | None = None,
            loading_wait_s: float = 0.0,
            demand: object = None,
        ) -> tuple[int, int, str, int, list[float], float]:
            pairs = self._pairs_for(ids.shape[-1], x)
            got = ffn.run_layers(
                attention, table, first, num_experts, max_experts, arena, ids, weights, x, pairs, out,
                signals, *(ahead if ahead is not None else (None, None)), loading_wait_s, demand,
            )  # fmt: skip
            self.calls += got[0] - first
            return got

        return call_span if span else call

    def _pairs_for(self, pairs: int, x: np.ndarray) -> np.ndarray:
        """The pair rows' scratch [pairs, H] float32, reused while the shape is the same."""
        scratch = self._pairs
        if scratch is None or scratch.shape != (pairs, x.shape[-1]):
            scratch = self._pairs = np.empty((pairs, x.shape[-1]), dtype=np.float32)
        return scratch

    def layer(
        self, kernel: FusedKernel, routing: Routing, hidden_states: torch.Tensor, combiner: Combiner
    ) -> FusedLayer:
        """The layer's inputs to ``kernel``, made once per layer."""
        return FusedLayer(self, kernel, routing, hidden_states, combiner)

    def routed(
        self,
        kernel: FusedKernel,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None = None,
    ) -> RoutedLayer | None:
        """A decode step's layer straight from its routing (no ``Routing``, no ``Combiner``), or
        None where ``RoutedLayer`` does not apply: more tokens than the kernel's rows per expert,
        or hidden states not of its compute dtype. ``residual``: see ``RoutedLayer``."""
        if top_k_index.shape[0] > kernel.max_rows or hidden_states.dtype != kernel.compute:
            return None
        if residual is not None and (
            residual.shape != hidden_states.shape or residual.dtype != kernel.compute
        ):
            residual = None  # added by the caller
        return RoutedLayer(self, kernel, top_k_index, top_k_weights, hidden_states, residual)


class RoutedLayer:
    """One decode step's MoE layer through the fused kernel, with the route and combine stages
    native too: the kernel groups the (token, k) pairs by expert itself (``run_routed``) and sums
    them over k into the compute dtype (``combine``), so the layer costs a few Python calls.
    T tokens of at most ``max_rows`` rows per expert (each token picks an expert once). With a
    ``residual`` [T, H] (contiguous, the compute dtype) the result is added into it in place, as
    ``residual.add_(result)`` would, and ``result`` is the residual."""

    def __init__(
        self,
        owner: FusedExperts,
        kernel: FusedKernel,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None = None,
    ) -> None:
        self._owner = owner
        self._ffn = kernel.ffn
        self._hidden = hidden_states.contiguous()
        self._residual_in = residual
        # Added into natively where contiguous (else by torch in ``result``).
        self._residual = residual if residual is not None and residual.is_contiguous() else None
        self._top_k = top_k_index.shape[1]
        # Host tensors, possibly expanded views (forced routing): numpy reads them as they are.
        self._ids = np.ascontiguousarray(top_k_index.numpy()).reshape(-1)  # [S] int64
        self.experts = tuple(sorted(set(self._ids.tolist())))  # np.unique's, without its sort of S
        self._weights = float_array(top_k_weights).reshape(-1)  # [S] float32
        self._x = owner.view_of(self._hidden)
        self._pairs = np.empty((self._ids.size, hidden_states.shape[-1]), dtype=np.float32)
        self._ran = 0  # experts run so far (each comes in one batch)
        self._out: np.ndarray | None = None  # the combined result, once the last batch ran

    def run(self, slots: Sequence[int], experts: Sequence[int]) -> None:
        """The batch ``experts`` (pinned in ``slots``, in the same order) into the pair rows; the
        last batch also combines them (``result``) in the same native call."""
        self._owner.calls += 1
        self._ran += len(experts)
        out = self._last_out() if self._ran == len(self.experts) else None
        self._ffn.run_routed(
            self._owner.arena, np.array(slots, dtype=np.int64), *self._pair_args(experts, out)
        )
        self._out = out

    def run_resident(self, table, entries: list[int]) -> int:
        """The whole layer in one native call where all its experts are resident: the kernel's
        ``run_resident`` over ``table`` (compute's slot table handle) and ``entries`` (one per
        expert of ``experts``, same order); what it returns (1: ran)."""
        out = self._last_out()
        entries = np.array(entries, dtype=np.int64)
        ran = self._ffn.run_resident(table, entries, self._owner.arena, *self._pair_args(self.experts, out))
        if ran > 0:
            self._owner.calls += 1
            self._ran = len(self.experts)
            self._out = out
        return ran

    def _last_out(self) -> np.ndarray:
        """Where the last batch combines the pairs: a new buffer, or the residual's storage."""
        return self._combined() if self._residual is None else self._owner.view_of(self._residual)

    def _pair_args(self, experts: Sequence[int], out: np.ndarray | None) -> tuple:
        """The kernel's arguments from ``experts`` on (run_routed's and run_resident's)."""
        experts = np.array(experts, dtype=np.int64)
        return (experts, self._ids, self._weights, self._x, self._pairs, out, self._residual is not None)

    def result(self) -> torch.Tensor:
        """[T, H] in the compute dtype: the pairs summed over k in order, as transformers sums
        them (or the residual they were added into)."""
        out = self._out
        if out is not None and self._residual is not None:
            return self._residual
        if out is None:  # not every expert ran: the pairs combined as they stand
            out = self._combined()
            self._ffn.combine(self._pairs, self._top_k, out)
        result = torch.from_numpy(out)
        result = result.view(self._hidden.dtype) if out.dtype == np.int16 else result
        if self._residual_in is not None:
            return self._residual_in.add_(result)
        return result

    def _combined(self) -> np.ndarray:
        """A buffer for the result: [T, H] of the compute dtype's storage (2-byte dtypes as int16)."""
        hidden = self._hidden
        return np.empty(tuple(hidden.shape), dtype=np.int16 if hidden.element_size() == 2 else np.float32)


def float_array(t: torch.Tensor) -> np.ndarray:
    """A host tensor's values as a float32 numpy array (bfloat16 widened by its bits: exact, and
    without a torch call)."""
    t = t.detach()
    if t.dtype == torch.float32:
        return t.numpy()
    if t.dtype == torch.bfloat16:
        return (t.view(torch.int16).numpy().astype(np.int32) << 16).view(np.float32)
    return t.float().numpy()


def storage_view(t: torch.Tensor) -> np.ndarray:
    """A numpy view of ``t``'s storage (2-byte dtypes as int16)."""
    return (t.view(torch.int16) if t.element_size() == 2 else t).numpy()


class FusedLayer:
    """One MoE layer run by the fused kernel: its float32 inputs [T, H], its pair rows grouped by
    expert with their tokens and routing weights (numpy, made once), and the combiner's float32
    pair buffer the kernel writes into; ``run`` takes each batch of pinned experts."""

    def __init__(
        self,
        owner: FusedExperts,
        kernel: FusedKernel,
        routing: Routing,
        hidden_states: torch.Tensor,
        combiner: Combiner,
    ) -> None:
        self._owner = owner
        self._ffn = kernel.ffn
        self._experts = routing.experts
        self._spans = routing.spans
        self._x = hidden_states.detach().float().contiguous().numpy()  # [T, H]
        self._rows = routing.order.numpy()  # [S] pair rows, expert by expert
        self._tokens = routing.tokens.numpy()
        self._weights = routing.weights.detach().float().contiguous().numpy()[self._rows]
        self._pairs = combiner.float_pairs()

    def run(self, slots: Sequence[int], experts: Sequence[int]) -> None:
        """The batch ``experts`` (pinned in ``slots``, in the same order) into the pair rows."""
        self._owner.calls += 1
        spans = self._spans
        if tuple(experts) == self._experts:  # the whole layer at once (every expert resident)
            rows, tokens, weights = self._rows, self._tokens, self._weights
            ends = [spans[e][1] for e in experts]
        else:
            take = np.concatenate([np.arange(*spans[e]) for e in experts])
            rows, tokens, weights = self._rows[take], self._tokens[take], self._weights[take]
            ends = np.cumsum([spans[e][1] - spans[e][0] for e in experts]).tolist()
        self._ffn.run(
            self._owner.arena,
            np.array(slots, dtype=np.int64),
            np.array([0, *ends], dtype=np.int64),
            rows,
            tokens,
            weights,
            self._x,
            self._pairs,
        )


def decode_sized(routing: Routing, max_rows: int) -> bool:
    """Every expert of the layer has at most ``max_rows`` rows."""
    return all(b - a <= max_rows for a, b in routing.spans.values())
