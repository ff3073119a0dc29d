"""Experts laid out in slots as a store lays them out, and transformers' math over them: the cases
of tests/native/test_expert_ffn.py and bench.kernels."""

from __future__ import annotations

import math

import numpy as np
import torch

from expertcache.encodings import dequantize_fp8, dequantize_mxfp4

FP8_BLOCK = (16, 16)
ALPHA, LIMIT = 1.702, 7.0  # GPT-OSS's
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class ExpertLayout:
    """One expert's parts at fixed offsets in every slot: the first projection (``gate_up_proj``,
    or ``up_proj`` without a gate) and ``down_proj``, each ``plain-dot`` ([out, in]),
    ``plain-axpy`` ([in, out]), ``mxfp4``, ``fp8`` ([out, in]) or ``fp8-axpy`` ([in, out]);
    biases when ``bias``."""

    def __init__(
        self, hidden, inter, first, down, gate, bias, dtype, gen, *, scale=None, fp8_block=FP8_BLOCK
    ):
        self.fp8_block = tuple(fp8_block)
        self.hidden, self.inter, self.gate, self.dtype, self.gen = hidden, inter, gate, dtype, gen
        self.bias = bias
        outs = inter if gate == "plain" else 2 * inter
        self.first_name = "up_proj" if gate == "plain" else "gate_up_proj"
        self.kinds = {self.first_name: first, "down_proj": down}
        self.shapes = {self.first_name: (hidden, outs), "down_proj": (inter, hidden)}  # (in, out)
        self.scale = scale
        self.offsets: dict[str, tuple[int, str, tuple[int, ...]]] = {}
        at = 0
        for name, (inputs, outputs) in self.shapes.items():
            for part, dt, shape in self._parts(name, inputs, outputs):
                at = -(-at // 64) * 64
                self.offsets[part] = (at, dt, shape)
                at += math.prod(shape) * torch.empty((), dtype=dt).element_size()
            if bias:
                at = -(-at // 64) * 64
                self.offsets[name + "_bias"] = (at, dtype, (outputs,))
                at += outputs * torch.empty((), dtype=dtype).element_size()
        self.slot_bytes = -(-at // 64) * 64

    def _parts(self, name, inputs, outputs):
        kind = self.kinds[name]
        if kind == "plain-dot":
            return [(name, self.dtype, (outputs, inputs))]
        if kind == "plain-axpy":
            return [(name, self.dtype, (inputs, outputs))]
        if kind == "mxfp4":
            return [
                (name + "_blocks", torch.uint8, (outputs, inputs // 32, 16)),
                (name + "_scales", torch.uint8, (outputs, inputs // 32)),
            ]
        bm, bn = self.fp8_block
        rows, cols = (inputs, outputs) if kind == "fp8-axpy" else (outputs, inputs)
        return [
            (name, torch.float8_e4m3fn, (rows, cols)),
            (name + "_scale_inv", torch.float32, (-(-rows // bm), -(-cols // bn))),
        ]

    @property
    def spec(self) -> dict:
        def projection(name):
            kind = self.kinds[name]
            inputs, outputs = self.shapes[name]
            p = dict(
                encoding=kind.split("-")[0],
                form="axpy" if kind.endswith("-axpy") else "dot",
                weight_dtype=DTYPE_NAMES[self.dtype],
                inputs=inputs,
                outputs=outputs,
                weight_offset=self.offsets[name + ("_blocks" if kind == "mxfp4" else "")][0],
            )
            if kind == "mxfp4":
                p["scale_offset"] = self.offsets[name + "_scales"][0]
            if kind.startswith("fp8"):
                p.update(
                    scale_offset=self.offsets[name + "_scale_inv"][0],
                    block_rows=self.fp8_block[0],
                    block_cols=self.fp8_block[1],
                )
            if self.bias:
                p.update(bias_offset=self.offsets[name + "_bias"][0], bias_dtype=DTYPE_NAMES[self.dtype])
            return p

        return dict(
            first=projection(self.first_name),
            down=projection("down_proj"),
            gate=self.gate,
            act="silu",
            alpha=ALPHA,
            limit=LIMIT,
            compute=DTYPE_NAMES[self.dtype],
            slot_bytes=self.slot_bytes,
        )

    def part_bytes(self) -> dict[str, int]:
        """Each stored part's bytes."""
        return {
            part: math.prod(shape) * torch.empty((), dtype=dt).element_size()
            for part, (_, dt, shape) in self.offsets.items()
        }

    def arena(self, slots: int) -> np.ndarray:
        """``slots`` slots of random experts (each its own weights), as one uint8 array."""
        arena = np.zeros(slots * self.slot_bytes, dtype=np.uint8)
        for slot in range(slots):
            for part, tensor in self._random_parts().items():
                at = slot * self.slot_bytes + self.offsets[part][0]
                raw = tensor.contiguous().view(torch.uint8).reshape(-1).numpy()
                arena[at : at + raw.size] = raw
        return arena

    def _random_parts(self) -> dict[str, torch.Tensor]:
        g = self.gen
        parts = {}
        for part, (_, dt, shape) in self.offsets.items():
            if dt == torch.uint8 and part.endswith("_blocks"):
                parts[part] = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
            elif dt == torch.uint8:  # E8M0 scales around 2**-4
                parts[part] = torch.randint(120, 126, shape, dtype=torch.uint8, generator=g)
            elif dt == torch.float8_e4m3fn:
                parts[part] = (torch.randn(shape, generator=g) * 8).to(torch.float8_e4m3fn)
            elif part.endswith("_scale_inv"):
                parts[part] = torch.rand(shape, generator=g) * 0.02 + 0.005
            else:
                fan_in = shape[0] if part.endswith("_bias") else self._fan_in(part)
                std = self.scale or 1.0 / math.sqrt(fan_in)
                parts[part] = (torch.randn(shape, generator=g) * std).to(dt)
        return parts

    def _fan_in(self, part: str) -> int:
        name = part.removesuffix("_bias")
        return self.shapes[name][0]

    def parts(self, arena: np.ndarray, slot: int) -> dict[str, torch.Tensor]:
        """Typed views of one slot's parts."""
        base = torch.from_numpy(arena[slot * self.slot_bytes : (slot + 1) * self.slot_bytes])
        out = {}
        for part, (at, dt, shape) in self.offsets.items():
            n = math.prod(shape) * torch.empty((), dtype=dt).element_size()
            out[part] = base[at : at + n].view(dt).reshape(shape)
        return out

    def weight(self, parts, name) -> torch.Tensor:
        """The runtime matrix W with x @ W the projection: [in, out] in the compute dtype."""
        kind = self.kinds[name]
        if kind == "plain-dot":
            return parts[name].t()
        if kind == "plain-axpy":
            return parts[name]
        if kind == "mxfp4":
            return dequantize_mxfp4(parts[name + "_blocks"], parts[name + "_scales"], self.dtype).t()
        w = dequantize_fp8(parts[name], parts[name + "_scale_inv"], self.fp8_block, self.dtype)
        return w if kind == "fp8-axpy" else w.t()


def reference(layout: ExpertLayout, arena: np.ndarray, slot: int, x: torch.Tensor, weight: torch.Tensor):
    """transformers' experts math for the rows ``x`` [n, H] through the expert in ``slot``, times
    the routing ``weight`` [n, 1] (float32): [n, H] float32."""
    parts = layout.parts(arena, slot)
    h = x.to(layout.dtype) @ layout.weight(parts, layout.first_name)
    if layout.bias:
        h = h + parts[layout.first_name + "_bias"]
    if layout.gate == "glu_halves":
        gate, up = h.chunk(2, dim=-1)
        a = torch.nn.functional.silu(gate) * up
    elif layout.gate == "gpt_oss":
        gate, up = h[..., ::2], h[..., 1::2]
        gate = gate.clamp(min=None, max=LIMIT)
        up = up.clamp(min=-LIMIT, max=LIMIT)
        glu = gate * torch.sigmoid(gate * ALPHA)
        a = (up + 1) * glu
    else:
        a = torch.nn.functional.silu(h)
    o = a @ layout.weight(parts, "down_proj")
    if layout.bias:
        o = o + parts["down_proj_bias"]
    return o * weight
