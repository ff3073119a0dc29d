"""Dequantising MXFP4 expert weights (as published GPT-OSS checkpoints ship them).

MXFP4 (OCP Microscaling): every run of 32 consecutive values along a weight row shares one
8-bit power-of-two scale (E8M0, bias 127); each value is a 4-bit E2M1 float, two per byte,
low nibble first. A checkpoint stores, per projection::

    <proj>_blocks  uint8 [E, R, G, 16]   R output rows, G = C / 32 groups, 16 bytes = 32 values
    <proj>_scales  uint8 [E, R, G]       exponent + 127 of each group

    value[e, r, 32 g + 2 k    ] = FP4[blocks[e, r, g, k] & 0xF] * 2 ** (scales[e, r, g] - 127)
    value[e, r, 32 g + 2 k + 1] = FP4[blocks[e, r, g, k] >> 4 ] * 2 ** (scales[e, r, g] - 127)

The rows are the *output* features, so the dequantised [R, C] matrix is the transpose of the
runtime parameter: transformers' GPT-OSS experts hold ``gate_up_proj`` [E, H, 2I] and
``down_proj`` [E, I, H] (x @ W), while the blocks hold [E, 2I, H/32, 16] and [E, H, I/32, 16].
This mirrors ``transformers.integrations.mxfp4.convert_moe_packed_tensors`` (same table,
same nibble order, same final transpose, same float32 → target rounding), one expert at a time.
"""

from __future__ import annotations

import torch

from expertcache.errors import InvalidArgument

# E2M1 code → value; codes 8..15 are the negatives of 0..7 (sign bit is the nibble's top bit).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127  # E8M0 scale: 2 ** (byte - 127)
VALUES_PER_BYTE = 2
GROUP_SIZE = 32  # values sharing one scale

_LUT = torch.tensor(FP4_VALUES, dtype=torch.float32)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Dequantise one expert's (or a stack's) MXFP4 weight into the runtime layout.

    ``blocks`` uint8 [..., R, G, 16] and ``scales`` uint8 [..., R, G] → ``dtype`` [..., G*32, R]
    (contiguous). Values are formed in float32, where every FP4 value times a power of two is
    exact, and rounded once to ``dtype``, as transformers does.
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise InvalidArgument(f"MXFP4 blocks/scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 3 or blocks.shape[:-1] != scales.shape:
        raise InvalidArgument(
            f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
            "(expected blocks [..., R, G, 16] and scales [..., R, G])"
        )
    *prefix, rows, groups, nbytes = blocks.shape
    lo = _LUT[(blocks & 0x0F).long()]  # [..., R, G, B] float32
    hi = _LUT[(blocks >> 4).long()]
    values = torch.stack((lo, hi), dim=-1).reshape(*prefix, rows, groups, nbytes * VALUES_PER_BYTE)
    exponents = scales.to(torch.int32) - SCALE_BIAS  # [..., R, G]
    values = torch.ldexp(values, exponents.unsqueeze(-1))  # [..., R, G, 32] float32
    values = values.reshape(*prefix, rows, groups * nbytes * VALUES_PER_BYTE)  # [..., R, C]
    return values.to(dtype).transpose(-1, -2).contiguous()  # [..., C, R]
