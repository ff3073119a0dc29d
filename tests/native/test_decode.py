"""The native expert decode (``decode_mxfp4`` / ``decode_fp8``, csrc/src/decode.cc) on every SIMD
path this CPU has (each forced by name), against transformers' own CPU dequantisation bit for bit:
every MXFP4 code with every scale; every e4m3 byte (the NaN codes included) with scales over a
wide range, at the edges of each output dtype (subnormals, overflow to inf, NaN and infinite
scales) and through both FP8 codes (per-block look-up tables for big blocks, arithmetic for small
ones), whole and partial blocks; any float32 rounded as torch rounds it; and every argument a
caller can get wrong refused with a ValueError that names it, the output left untouched.
"""

from __future__ import annotations

import platform
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers.integrations.finegrained_fp8 import Fp8Dequantize
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from expertcache import _native
from tests.stores import bits

PATHS = list(_native.DECODE_PATHS)
ALL_PATHS = ("avx512", "avx2", "portable")
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# FP8 block sizes: small blocks take the arithmetic code on every path, big ones (>= 32 columns,
# >= 2048 values) the per-block look-up tables on the avx512 path.
ARITHMETIC_BLOCK, TABLE_BLOCK = (16, 16), (64, 64)


def name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def array(t: torch.Tensor) -> np.ndarray:
    """The zero-copy numpy view the decode takes: 2-byte floats as int16 bits, e4m3 as bytes."""
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.view(torch.int16).numpy()
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy()
    return t.numpy()


def mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, path: str) -> torch.Tensor:
    out = torch.empty(blocks.shape[0], blocks.shape[1] * 32, dtype=dtype)
    _native.decode_mxfp4(array(blocks), array(scales), array(out), name(dtype), path)
    return out


def fp8(values: torch.Tensor, scale_inv: torch.Tensor, block, dtype: torch.dtype, path: str) -> torch.Tensor:
    out = torch.empty(values.shape, dtype=dtype)
    _native.decode_fp8(array(values), array(scale_inv), block[0], block[1], array(out), name(dtype), path)
    return out


def all_e4m3_bytes(rows: int, cols: int) -> torch.Tensor:
    """float8_e4m3fn [rows, cols]: the 256 bytes in order, repeated (every block sees every code
    when it holds a multiple of 256 values)."""
    return (
        torch.arange(rows * cols, dtype=torch.int64)
        .remainder(256)
        .to(torch.uint8)
        .view(torch.float8_e4m3fn)
        .reshape(rows, cols)
    )


def nan_codes(values: torch.Tensor) -> torch.Tensor:
    """bool: where a float8_e4m3fn tensor holds one of its two NaN bytes (0x7F, 0xFF)."""
    return values.view(torch.uint8).bitwise_and(0x7F) == 0x7F


def expanded_reference(
    values: torch.Tensor, scale_inv: torch.Tensor, block, dtype: torch.dtype
) -> torch.Tensor:
    """``values.float() * scale`` with the scale grid expanded element by element (partial last
    blocks take their block's scale), rounded once: transformers' formula without its
    divisibility requirement."""
    rows, cols = values.shape
    full = scale_inv.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return (values.float() * full).to(dtype)


def test_paths_follow_the_cpu():
    assert PATHS[-1] == "portable" and set(PATHS) <= set(ALL_PATHS)
    if platform.machine() not in ("x86_64", "AMD64"):
        assert PATHS == ["portable"]
        return
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo to read the CPU's flags from")
    flags = set(next(line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")).split())
    assert ("avx2" in PATHS) == ({"avx2", "f16c"} <= flags)
    assert ("avx512" in PATHS) == ({"avx512f", "avx512bw", "avx512vl"} <= flags)


def test_unknown_and_unsupported_paths_are_refused():
    blocks, scales = np.zeros((1, 1, 16), np.uint8), np.zeros((1, 1), np.uint8)
    out = np.zeros(32, np.int16)
    with pytest.raises(ValueError, match=r"unknown decode path 'sse9': use one of avx512, avx2, portable"):
        _native.decode_mxfp4(blocks, scales, out, "bfloat16", "sse9")
    for missing in set(ALL_PATHS) - set(PATHS):
        with pytest.raises(ValueError, match=rf"'{missing}' is not supported on this CPU \(it has: "):
            _native.decode_mxfp4(blocks, scales, out, "bfloat16", missing)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", [*PATHS, "auto"])
def test_mxfp4_equals_transformers_for_every_code_and_scale(path, dtype):
    # Row r: every byte (both nibbles of every code pair) with scale byte r, 0..255.
    blocks = torch.arange(256, dtype=torch.uint8).reshape(1, 16, 16).expand(256, 16, 16).contiguous()
    scales = torch.arange(256, dtype=torch.uint8).reshape(256, 1).expand(256, 16).contiguous()
    want = convert_moe_packed_tensors(blocks[None], scales[None], dtype=dtype)[0].t()  # [R, C]
    assert torch.equal(bits(mxfp4(blocks, scales, dtype, path)), bits(want))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [ARITHMETIC_BLOCK, TABLE_BLOCK])
@pytest.mark.parametrize("path", PATHS)
def test_fp8_equals_transformers_for_every_byte(path, block, dtype):
    bm, bn = block
    values = all_e4m3_bytes(3 * bm, 4 * bn)
    gen = torch.Generator().manual_seed(1)
    for trial in range(4):
        scale_inv = torch.exp(torch.randn(3, 4, generator=gen) * 8).float()  # ~2**-35 .. 2**35
        if trial % 2:
            scale_inv = -scale_inv
        want = Fp8Dequantize(None)._dequantize_one(values, scale_inv, output_dtype=dtype)
        assert torch.equal(bits(fp8(values, scale_inv, block, dtype, path)), bits(want)), (trial, block)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [ARITHMETIC_BLOCK, TABLE_BLOCK])
@pytest.mark.parametrize("path", PATHS)
def test_fp8_at_the_edges_of_every_dtype(path, block, dtype):
    # Scales that take e4m3 values into the subnormals of fp16 (2**-24 ..) and of bf16 / float32
    # (2**-149 ..), past the largest fp16 (65504) and float32, and the degenerate ones: zero,
    # negative zero, inf (0 * inf is NaN), NaN (a finite code times it is its NaN, quieted).
    specials = [2.0**-140, 1e-38, 2.0**-30, 2.0**-20, 5.9e-8, 1e4, 150.0, 2.0**120, 3e38]
    specials += [0.0, -0.0, 1.0, float("inf"), float("-inf"), -(2.0**-133), float("nan")]
    scale_inv = torch.tensor(specials, dtype=torch.float32).reshape(4, 4)
    scale_inv[2, 3].view(torch.int32).fill_(0xFF800001 - (1 << 32))  # a signalling NaN: the product quiets it
    bm, bn = block
    values = all_e4m3_bytes(4 * bm, 4 * bn)  # the NaN codes meet both NaN scales (column block 3)
    want = Fp8Dequantize(None)._dequantize_one(values, scale_inv, output_dtype=dtype)
    got = fp8(values, scale_inv, block, dtype, path)
    # A NaN code times a NaN scale: x86 returns the first operand's NaN and torch's loops put
    # either operand first (both occur within one tensor), so the reference's bits are arbitrary
    # there; the decode gives the code's NaN, what a NaN code gives with any other scale.
    both = nan_codes(values) & scale_inv.repeat_interleave(bm, 0).repeat_interleave(bn, 1).isnan()
    assert both.any()
    assert torch.equal(bits(got)[~both], bits(want)[~both])
    code_nans = fp8(values[both].reshape(1, -1), torch.ones(1, 1), (1, 1 << 20), dtype, path)
    assert torch.equal(bits(got)[both], bits(code_nans).flatten())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("path", PATHS)
def test_any_float32_is_rounded_as_torch_rounds_it(path, dtype):
    # e4m3 1.0 (0x38) times a 1 x 1 block's scale is the scale itself, so the output is that float
    # rounded: random bit patterns (every exponent, NaN payloads of both signs, signalling NaNs,
    # which the product quiets as torch's does), plus the ties and the overflow thresholds.
    gen = torch.Generator().manual_seed(3)
    patterns = torch.randint(-(2**31), 2**31, (255 * 256,), dtype=torch.int64, generator=gen)
    edges = [0x477FEFFF, 0x477FF000, 0x477FE000, 0x33000000, 0x33000001, 0x387FC000, 0x38800000, 0x7F7FFFFF]
    edges += [0x7F800000, 0x7F800001, 0x7FC00000, 0x3F808000, 0x3F818000, 0x00000001, 0x007FFFFF, 0]
    edges += [0x3F800000 + i * 0x1000 for i in range(256 - len(edges))]
    scale_inv = (
        torch.cat([patterns, torch.tensor(edges)]).to(torch.int32).view(torch.float32).reshape(256, 256)
    )
    scale_inv = torch.cat([scale_inv, -scale_inv])
    values = torch.full(scale_inv.shape, 0x38, dtype=torch.uint8).view(torch.float8_e4m3fn)
    want = Fp8Dequantize(None)._dequantize_one(values, scale_inv, output_dtype=dtype)
    assert torch.equal(bits(fp8(values, scale_inv, (1, 1), dtype, path)), bits(want))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("shape", "block"),
    [
        ((40, 37), (16, 16)),
        ((130, 200), (64, 64)),
        ((300, 161), (128, 128)),
        ((33, 1000), (1, 70)),
        ((5, 3), (128, 128)),
    ],
)
@pytest.mark.parametrize("path", PATHS)
def test_fp8_partial_blocks_take_their_blocks_scale(path, shape, block, dtype):
    gen = torch.Generator().manual_seed(2)
    values = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).view(torch.float8_e4m3fn)
    grid = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    scale_inv = torch.exp(torch.randn(grid, generator=gen) * 4).float()
    want = expanded_reference(values, scale_inv, block, dtype)
    assert torch.equal(bits(fp8(values, scale_inv, block, dtype, path)), bits(want))


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_path_gives_the_same_bits_on_gpt_oss_like_tensors(dtype):
    gen = torch.Generator().manual_seed(4)
    blocks = torch.randint(0, 256, (640, 16, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(110, 135, (640, 16), dtype=torch.uint8, generator=gen)
    values = (torch.randn(300, 700, generator=gen) * 40).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(3, 6, generator=gen) * 1e-2
    got = {p: (mxfp4(blocks, scales, dtype, p), fp8(values, scale_inv, (128, 128), dtype, p)) for p in PATHS}
    for p in PATHS:
        assert torch.equal(bits(got[p][0]), bits(got["portable"][0])), p
        assert torch.equal(bits(got[p][1]), bits(got["portable"][1])), p


def test_empty_tensors_decode_to_nothing():
    out = np.zeros(0, np.int16)
    _native.decode_mxfp4(np.zeros((0, 4, 16), np.uint8), np.zeros((0, 4), np.uint8), out, "bfloat16")
    _native.decode_fp8(np.zeros((0, 7), np.uint8), np.zeros((0, 1), np.float32), 128, 128, out, "float16")


def mxfp4_args(**change):
    args = {
        "blocks": np.zeros((4, 2, 16), np.uint8),
        "scales": np.zeros((4, 2), np.uint8),
        "out": np.full((4, 64), 7, np.int16),
        "out_dtype": "bfloat16",
    }
    args.update(change)
    return args


def fp8_args(**change):
    args = {
        "values": np.zeros((40, 37), np.uint8),
        "scale_inv": np.ones((3, 3), np.float32),
        "block_rows": 16,
        "block_cols": 16,
        "out": np.full((40, 37), 7, np.int16),
        "out_dtype": "bfloat16",
    }
    args.update(change)
    return args


def read_only(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"blocks": np.zeros((4, 2, 16), np.float32)}, r"blocks must be uint8 \[R, G, 16\], got float32 of shape \(4, 2, 16\)"),
        ({"blocks": np.zeros((4, 2, 16), np.int8)}, r"blocks must be uint8 \[R, G, 16\], got int8"),
        ({"blocks": np.zeros((4, 2, 8), np.uint8)}, r"blocks must be uint8 \[R, G, 16\], got uint8 of shape \(4, 2, 8\)"),
        ({"blocks": np.zeros((4, 32), np.uint8)}, r"blocks must be uint8 \[R, G, 16\], got uint8 of shape \(4, 32\)"),
        ({"blocks": [[[0] * 16]]}, r"blocks must be a numpy array \(uint8 \[R, G, 16\]\), got list"),
        ({"blocks": np.zeros((4, 16, 2), np.uint8).transpose(0, 2, 1)}, r"blocks must be C-contiguous"),
        ({"scales": np.zeros((4, 3), np.uint8)}, r"scales must be uint8 \[R, G\] = \(4, 2\) for blocks of shape \(4, 2, 16\), got uint8 of shape \(4, 3\)"),
        ({"scales": np.zeros((2, 4), np.uint8).T}, r"scales must be C-contiguous"),
        ({"out": np.zeros(255, np.int16)}, r"out is too small: it holds 255 values, the decode writes 4 x 64 = 256"),
        ({"out": np.zeros(257, np.int16)}, r"out is too large: it holds 257 values, the decode writes 4 x 64 = 256"),
        ({"out": np.zeros(256, np.float32)}, r"out must be a contiguous array of 2-byte elements \(bfloat16 bits: int16, uint16\), got float32"),
        ({"out": np.zeros(256, np.float16)}, r"out must be a contiguous array of 2-byte elements \(bfloat16 bits"),
        ({"out": np.zeros(256, np.int16), "out_dtype": "float32"}, r"out must be a contiguous array of 4-byte elements \(float32: float32\), got int16"),
        ({"out": np.zeros((64, 4), np.int16).T}, r"out must be C-contiguous"),
        ({"out": read_only(np.zeros(256, np.int16))}, r"out must be writable"),
        ({"out": bytearray(512)}, r"out must be a numpy array .*got bytearray"),
        ({"out_dtype": "float64"}, r"unknown decode output dtype 'float64': use one of bfloat16, float16, float32"),
    ],
)  # fmt: skip
def test_mxfp4_refuses_bad_arguments_naming_them(change, message):
    args = mxfp4_args(**change)
    before = np.array(args["out"], copy=True) if isinstance(args["out"], np.ndarray) else None
    with pytest.raises(ValueError, match=message):
        _native.decode_mxfp4(**args)
    if before is not None:
        assert np.array_equal(args["out"], before)  # nothing written


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"values": np.zeros((40, 37), np.int8)}, r"values must be the uint8 bytes of float8_e4m3fn \[R, C\] .*got int8"),
        ({"values": np.zeros((40, 37, 1), np.uint8)}, r"values must be .*got uint8 of shape \(40, 37, 1\)"),
        ({"values": np.zeros((37, 40), np.uint8).T}, r"values must be C-contiguous"),
        ({"scale_inv": np.ones((2, 3), np.float32)}, r"scale_inv must be float32 \(3, 3\) for values of shape \(40, 37\) in 16 x 16 blocks, got float32 of shape \(2, 3\)"),
        ({"scale_inv": np.ones((3, 3), np.float64)}, r"scale_inv must be float32 \[ceil\(R / bm\), ceil\(C / bn\)\], got float64"),
        ({"scale_inv": np.ones((3, 3), np.float32).T.copy().T}, r"scale_inv must be C-contiguous"),
        ({"block_rows": 0}, r"block_rows and block_cols must be >= 1, got 0 and 16"),
        ({"block_cols": -128}, r"block_rows and block_cols must be >= 1, got 16 and -128"),
        ({"out": np.zeros((40, 36), np.int16)}, r"out is too small: it holds 1440 values, the decode writes 40 x 37 = 1480"),
        ({"out": np.zeros((40, 37), np.int16), "out_dtype": "float32"}, r"4-byte elements \(float32: float32\), got int16"),
        ({"out": np.zeros((40, 37), np.float32), "out_dtype": "float16"}, r"2-byte elements \(float16 bits: int16, uint16 or float16\), got float32"),
    ],
)  # fmt: skip
def test_fp8_refuses_bad_arguments_naming_them(change, message):
    args = fp8_args(**change)
    before = args["out"].copy()
    with pytest.raises(ValueError, match=message):
        _native.decode_fp8(**args)
    assert np.array_equal(args["out"], before)


def test_float16_output_may_be_a_float16_array():
    values = all_e4m3_bytes(16, 16)
    scale_inv = torch.full((1, 1), 0.75)
    out = np.empty((16, 16), np.float16)
    _native.decode_fp8(array(values), array(scale_inv), 16, 16, out, "float16")
    want = Fp8Dequantize(None)._dequantize_one(values, scale_inv, output_dtype=torch.float16)
    assert np.array_equal(out.view(np.int16), array(bits(want)))
