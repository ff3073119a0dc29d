"""The fused CPU expert FFN (``ExpertFfn``, csrc/src/expert_ffn.cc) against transformers' math on
the same weights: every layout (plain weights read as rows or transposed, MXFP4, block FP8), every
activation, with and without biases, 1 to 16 rows per expert, several experts per call, float32
and bfloat16 compute, one thread and several. Sums are float32 in another order than a BLAS
GEMM, so the tolerance is the last bits of a float32 sum (float32 compute) or one bfloat16
rounding flipped by them (bfloat16). Every argument a caller can get wrong is refused by name.
"""

from __future__ import annotations

import platform
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from devtools.expert_ffn_cases import ExpertLayout, reference
from expertcache import _native
from expertcache.encodings import dequantize_fp8, dequantize_mxfp4
from tests.slot_tables import ChannelServer

TOL = {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}
# Rows of up to 512 products, added in another order than transformers' matmul: float32 sums whose
# terms cancel keep about 1e-4 of their largest term.
TOL_LONG = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: TOL[torch.bfloat16]}
H, INTER = 64, 96  # hidden, intermediate: MXFP4 needs multiples of 32
AVX512_PATHS = ("avx512", "avx512-bf16", "amx")  # the paths of the AVX-512 kernels
# A float32 NaN whose payload is all ones: rounded to bfloat16 by adding 0x7FFF it would wrap to -0.
NAN_ALL_ONES = np.array([0x7FFFFFFF], dtype=np.uint32).view(np.float32)[0].item()


@pytest.fixture(autouse=True, params=_native.FFN_PATHS)
def ffn_path(request, monkeypatch) -> str:
    """Every test runs on every SIMD path this CPU has (``FFN_PATHS``; the portable one is the
    reference the others are held to): the layouts' specs name it."""
    spec = ExpertLayout.spec
    monkeypatch.setattr(
        ExpertLayout, "spec", property(lambda self: {**spec.fget(self), "path": request.param})
    )
    return request.param


def run(layout: ExpertLayout, arena: np.ndarray, experts, x: torch.Tensor, top_k: int, threads: int = 1):
    """ExpertFfn over ``experts`` [(slot, [(token, k, weight), ...])]: out [T * K, H]."""
    ffn = _native.ExpertFfn(layout.spec)
    ffn.set_threads(threads)
    slots = np.array([s for s, _ in experts], dtype=np.int64)
    bounds = np.cumsum([0] + [len(rows) for _, rows in experts]).astype(np.int64)
    pairs = [r for _, rows in experts for r in rows]
    rows = np.array([t * top_k + k for t, k, _ in pairs], dtype=np.int64)
    tokens = np.array([t for t, _, _ in pairs], dtype=np.int64)
    weights = np.array([w for _, _, w in pairs], dtype=np.float32)
    out = np.full((x.shape[0] * top_k, layout.hidden), np.nan, dtype=np.float32)
    ffn.run(arena, slots, bounds, rows, tokens, weights, x.float().numpy(), out)
    return torch.from_numpy(out), ffn


def plain_layout(seed: int) -> ExpertLayout:
    """Plain weights read as rows, GLU halves, no bias, float32 compute."""
    gen = torch.Generator().manual_seed(seed)
    return ExpertLayout(H, INTER, "plain-dot", "plain-dot", "glu_halves", False, torch.float32, gen)


def refuses(seed: int, method: str, change: dict, message: str, **args):
    """``method`` of a ``plain_layout(seed)`` ExpertFfn, called on a two-slot arena and slot 1 with
    ``args`` overridden by ``change``, raises ValueError naming ``message``. Returns the ffn."""
    layout = plain_layout(seed)
    ffn = _native.ExpertFfn(layout.spec)
    args = dict(arena=layout.arena(slots=2), slots=np.array([1], dtype=np.int64), **args)
    args.update(change)
    with pytest.raises(ValueError, match=message):
        getattr(ffn, method)(**args)
    return ffn


CASES = [
    # (first encoding/form, down encoding/form, gate, bias)
    ("plain-dot", "plain-dot", "glu_halves", False),  # Mixtral, Qwen-MoE, OLMoE, DeepSeek
    ("plain-axpy", "plain-axpy", "gpt_oss", True),  # GPT-OSS bf16
    ("mxfp4", "mxfp4", "gpt_oss", True),  # GPT-OSS as it ships
    ("fp8", "fp8", "glu_halves", False),  # DeepSeek-V3 / Qwen3 FP8
    ("fp8-axpy", "fp8-axpy", "gpt_oss", True),  # GPT-OSS in block FP8
    ("plain-dot", "plain-dot", "plain", False),  # experts without a gate
    ("plain-dot", "plain-axpy", "glu_halves", True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
@pytest.mark.parametrize("rows", [1, 3, 4, 7, 16, 21])
def test_equals_transformers_math(case, dtype, rows, ffn_path):
    first, down, gate, bias = case
    gen = torch.Generator().manual_seed(rows)
    layout = ExpertLayout(H, INTER, first, down, gate, bias, dtype, gen)
    arena = layout.arena(slots=3)
    x = torch.randn(rows, H, generator=gen).to(dtype)
    experts = [
        (2, [(t, 0, 0.25 + 0.5 * t / rows) for t in range(rows)]),
        (0, [(t, 1, 0.75) for t in range(rows)]),
    ]
    got, ffn = run(layout, arena, experts, x, top_k=2)
    for slot, pairs in experts:
        for t, k, w in pairs:
            want = reference(layout, arena, slot, x[t : t + 1], torch.tensor([[w]], dtype=torch.float32))
            torch.testing.assert_close(got[t * 2 + k : t * 2 + k + 1], want, **TOL[dtype])
    assert ffn.path == ffn_path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize(("hidden", "inter"), [(192, 160), (512, 96)])
def test_long_rows_equal_transformers_math(case, dtype, rows, hidden, inter, ffn_path):
    """Rows of many MXFP4 groups (and long plain rows) against transformers' math: a kernel
    that steps two or four groups at a time, with several accumulators, reads each step's own
    inputs. Hidden 192 is 6 groups (three pairs: a step of two pairs, then one pair), hidden 512
    16 (four steps of two pairs); an intermediate of 160 gives the down rows 5 groups (a step,
    then the last group alone)."""
    first, down, gate, bias = case
    gen = torch.Generator().manual_seed(70 + rows + hidden)
    layout = ExpertLayout(hidden, inter, first, down, gate, bias, dtype, gen)
    arena = layout.arena(slots=2)
    x = torch.randn(rows, hidden, generator=gen).to(dtype)
    experts = [(1, [(t, 0, 0.5 + 0.25 * t) for t in range(rows)])]
    got, _ = run(layout, arena, experts, x, top_k=1)
    for t, _k, w in experts[0][1]:
        want = reference(layout, arena, 1, x[t : t + 1], torch.tensor([[w]], dtype=torch.float32))
        torch.testing.assert_close(got[t : t + 1], want, **TOL_LONG[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
@pytest.mark.parametrize("rows", [2, 3, 4])
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(case, dtype, rows, ffn_path):
    """Up to 4 rows an expert (a decode step's batch), a token's output is the same bits alone and
    beside other tokens: a kernel reading several input rows at once adds each row's products as
    the one-row kernel does. Not the AVX2 path's MXFP4 kernel, which keeps 2 accumulators a row
    from 3 rows on (4 below): its 16 registers hold no more. (From 5 rows on, the AMX path may
    take an expert to its tiles.) In bfloat16 compute another order shows only where a float32 sum
    lies at a rounding boundary of bfloat16: this test sees another order there rarely, a row
    mixed up always."""
    first, down, gate, bias = case
    if ffn_path == "avx2" and "mxfp4" in (first, down):
        pytest.skip("the AVX2 MXFP4 kernel adds in another order from 3 rows an expert")
    gen = torch.Generator().manual_seed(90 + rows)
    hidden = 512  # 8 pairs of MXFP4 groups a row: sums long enough for an order to show
    layout = ExpertLayout(hidden, INTER, first, down, gate, bias, dtype, gen)
    arena = layout.arena(slots=2)
    # Inputs over 2**-12 .. 2**12: an E2M1 weight times a bfloat16 input is exact in float32, and
    # sums of such products over a narrow range would be exact in any order.
    spread = torch.exp2(torch.randint(-12, 13, (rows, hidden), generator=gen).float())
    x = (torch.randn(rows, hidden, generator=gen) * spread).to(dtype)
    together, _ = run(layout, arena, [(1, [(t, 0, 0.5) for t in range(rows)])], x, top_k=1)
    for t in range(rows):
        alone, _ = run(layout, arena, [(1, [(0, 0, 0.5)])], x[t : t + 1], top_k=1)
        assert torch.equal(together[t].view(torch.int32), alone[0].view(torch.int32)), (t, rows)


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_mxfp4_rows_past_the_last_block_of_eight(rows):
    # The MXFP4 dot adds its rows' sums eight rows at a time; an intermediate of 99 gives the
    # first projection 198 outputs, whose last work item (16 rows each) ends 6 rows past a block.
    gen = torch.Generator().manual_seed(70 + rows)
    layout = ExpertLayout(H, 99, "mxfp4", "plain-dot", "glu_halves", True, torch.float32, gen)
    arena = layout.arena(slots=2)
    x = torch.randn(rows, H, generator=gen)
    experts = [(1, [(t, 0, 0.5 + 0.25 * t) for t in range(rows)])]
    got, _ = run(layout, arena, experts, x, top_k=1)
    for t in range(rows):
        want = reference(layout, arena, 1, x[t : t + 1], torch.tensor([[0.5 + 0.25 * t]]))
        torch.testing.assert_close(got[t : t + 1], want, **TOL[torch.float32])


def scaled_mxfp4_case(
    seed: int, dtype: torch.dtype, hidden: int = H
) -> tuple[ExpertLayout, np.ndarray, dict]:
    gen = torch.Generator().manual_seed(seed)
    layout = ExpertLayout(hidden, INTER, "mxfp4", "mxfp4", "gpt_oss", True, dtype, gen)
    arena = layout.arena(slots=1)
    return layout, arena, layout.parts(arena, 0)


@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")  # torch's, on mkldnn.flags
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 4, 6])
@pytest.mark.parametrize("hidden", [H, 160])
def test_mxfp4_subnormal_scales_stay_exact(dtype, rows, hidden):
    """The AVX2 kernel folds each E8M0 scale into its group's 16 values. At scales 0-2 they are
    float32 (and bfloat16) subnormals, still exact: with no bias and inputs near 2**100, the
    first projection's outputs are normal numbers that only those products make (the AMX kernel,
    which would read them as zero, leaves such rows to the AVX-512 one: hidden 160 gives a work
    item's 16 rows 80 scales to check, more than one vector of them)."""
    layout, arena, parts = scaled_mxfp4_case(50 + rows, dtype, hidden)
    scales = parts["gate_up_proj_scales"]
    scales[:] = torch.randint(
        0, 3, scales.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(rows)
    )
    if (
        hidden == 160
    ):  # past a work item's first 64 scales all normal: only the check's vector part sees the others
        scales.view(-1, 16 * scales.shape[1])[:, 64:] = 2
    parts["gate_up_proj_bias"].zero_()
    parts["down_proj_bias"].zero_()
    x = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(7)).to(dtype) * 2.0**100
    got, _ = run(layout, arena, [(0, [(t, 0, 1.0) for t in range(rows)])], x, top_k=1)
    # The reference's bfloat16 matmul without oneDNN: on a CPU with AVX-512 BF16 or AMX, oneDNN's
    # kernels flush bfloat16 subnormals to zero, which torch's own GEMM does not.
    with torch.backends.mkldnn.flags(enabled=False):
        want = reference(layout, arena, 0, x, torch.ones(rows, 1))
    assert want.abs().max() > 2.0**-40  # the products reached the output
    torch.testing.assert_close(got, want, rtol=TOL[dtype]["rtol"], atol=want.abs().max().item() * 1e-3)


def assert_products_of_subnormals_count(layout: ExpertLayout, arena: np.ndarray, x: torch.Tensor) -> None:
    """Slot 0 over every row of x [rows, H] equals transformers' (subnormals read as they are)."""
    rows = x.shape[0]
    got, _ = run(layout, arena, [(0, [(t, 0, 1.0) for t in range(rows)])], x, top_k=1)
    with torch.backends.mkldnn.flags(enabled=False):  # oneDNN reads bfloat16 subnormals as zero too
        want = reference(layout, arena, 0, x, torch.ones(rows, 1))
    assert want.abs().max() > 2.0**-60  # the products reached the output
    torch.testing.assert_close(
        got, want, rtol=TOL[torch.bfloat16]["rtol"], atol=want.abs().max().item() * 1e-3
    )


@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")  # torch's, on mkldnn.flags
@pytest.mark.parametrize("which", ["inputs", "activations"])
@pytest.mark.parametrize("rows", [1, 4, 6])
def test_mxfp4_subnormal_inputs_count(rows, which):
    """bfloat16 inputs of a projection that are all subnormal (the layer's inputs, or the
    activations the down projection reads), against weights scaled up to meet them: the products
    are normal numbers, which a kernel that reads subnormals as zero (vdpbf16ps, oneDNN's bf16
    GEMM here) would lose."""
    layout, arena, parts = scaled_mxfp4_case(80 + rows, torch.bfloat16)
    parts["gate_up_proj_bias"].zero_()
    parts["down_proj_bias"].zero_()
    gen = torch.Generator().manual_seed(9)
    sign = torch.randint(0, 2, (rows, H), generator=gen) * 2 - 1
    if which == "inputs":  # in [2**-130, 2**-129]
        parts["gate_up_proj_scales"][:] = 127 + 100
        x = (sign * (1 + torch.rand(rows, H, generator=gen)) * 2.0**-130).to(torch.bfloat16)
        assert ((x != 0) & (x.abs() < 2.0**-126)).all()
    else:  # the first projection's outputs near 2**-132, and so the activations
        parts["gate_up_proj_scales"][:] = 0
        parts["down_proj_scales"][:] = 127 + 100
        x = (sign * (1 + torch.rand(rows, H, generator=gen)) * 2.0**-10).to(torch.bfloat16)
    assert_products_of_subnormals_count(layout, arena, x)


@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")  # torch's, on mkldnn.flags
@pytest.mark.parametrize("which", ["inputs", "activations"])
@pytest.mark.parametrize("rows", [1, 4, 6])
def test_bf16_dot_subnormal_inputs_count(rows, which):
    """As test_mxfp4_subnormal_inputs_count, for plain bfloat16 [out, in] weights (the avx512-bf16
    path multiplies them by vdpbf16ps, which reads subnormals as zero): subnormal inputs of the
    first projection, or activations of the down one, against weights scaled up to meet them."""
    gen = torch.Generator().manual_seed(140 + rows)
    layout = ExpertLayout(H, INTER, "plain-dot", "plain-dot", "glu_halves", False, torch.bfloat16, gen)
    arena = layout.arena(slots=1)
    parts = layout.parts(arena, 0)
    sign = torch.randint(0, 2, (rows, H), generator=gen) * 2 - 1
    if which == "inputs":  # in [2**-130, 2**-129], the weights near 2**100
        parts["gate_up_proj"].mul_(2.0**100)
        x = (sign * (1 + torch.rand(rows, H, generator=gen)) * 2.0**-130).to(torch.bfloat16)
        assert ((x != 0) & (x.abs() < 2.0**-126)).all()
    else:  # the first projection's outputs near 2**-64, so silu(gate) * up near 2**-129
        parts["gate_up_proj"].mul_(2.0**-66)
        parts["down_proj"].mul_(2.0**100)
        x = (sign * (1 + torch.rand(rows, H, generator=gen))).to(torch.bfloat16)
        h = (x.float() @ parts["gate_up_proj"].float().T).to(torch.bfloat16)
        act = (torch.nn.functional.silu(h[:, :INTER]) * h[:, INTER:]).float()
        assert ((act != 0) & (act.abs() < 2.0**-126)).float().mean() > 0.5
    assert_products_of_subnormals_count(layout, arena, x)


@pytest.mark.parametrize("rows", [1, 4])
def test_mxfp4_zero_group_at_scale_255_adds_zero(rows):
    """Scale 255 is 2**128, beyond float32: a group of zero codes under it adds 0, not NaN (0 x
    inf), as the encodings module decodes it."""
    layout, arena, parts = scaled_mxfp4_case(60 + rows, torch.float32)
    parts["gate_up_proj_blocks"][:, 1] = 0
    parts["gate_up_proj_scales"][:, 1] = 255
    x = torch.randn(rows, H, generator=torch.Generator().manual_seed(8))
    got, _ = run(layout, arena, [(0, [(t, 0, 1.0) for t in range(rows)])], x, top_k=1)
    want = reference(layout, arena, 0, x, torch.ones(rows, 1))
    assert not want.isnan().any()
    torch.testing.assert_close(got, want, **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 4])
def test_fp8_nan_codes_and_infinite_scales_decode_as_transformers(dtype, rows):
    """A block of FP8 columns is decoded without NaN handling unless its codes hold a NaN (0x7F,
    0xFF) or its scale is not finite: a NaN code still makes its output NaN, an infinite scale
    +-inf or NaN (0 x inf), and the other outputs stay as they were."""
    gen = torch.Generator().manual_seed(80 + rows)
    # Blocks 48 columns wide: the NaN check reads 32 bytes at a time, then one by one.
    layout = ExpertLayout(H, INTER, "fp8", "fp8", "glu_halves", False, dtype, gen, fp8_block=(16, 48))
    arena = layout.arena(slots=1)
    parts = layout.parts(arena, 0)
    codes = parts["down_proj"].view(torch.uint8)
    codes[3, 5] = 0x7F  # NaN codes in output rows 3 and 9: among the first 32 bytes of a block,
    codes[9, 40] = 0xFF  # and past them
    parts["down_proj_scale_inv"][2, 1] = float("inf")  # output rows 32..47, columns 48..95
    parts["down_proj_scale_inv"][3, 0] = NAN_ALL_ONES  # output rows 48..63, columns 0..47
    x = torch.randn(rows, H, generator=gen).to(dtype)
    got, _ = run(layout, arena, [(0, [(t, 0, 1.0) for t in range(rows)])], x, top_k=1)
    want = reference(layout, arena, 0, x, torch.ones(rows, 1))
    assert want[:, [3, 9]].isnan().all()
    assert not want[:, 32:48].isfinite().any()
    assert want[:, 48:].isnan().all()
    assert want[:, [c for c in range(32) if c not in (3, 9)]].isfinite().all()
    torch.testing.assert_close(got, want, equal_nan=True, **TOL[dtype])


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5])
def test_bf16_dot_rows_with_inputs_past_the_last_block_of_32(rows):
    # bfloat16 [out, in] weights: the AVX-512 kernel reads 32 inputs a load, evens then odds. Hidden
    # 66 leaves the first projection 2 inputs past its last such block and an intermediate of 56
    # the down projection 24; the down projection's 66 outputs end in a work item of 2 weight rows,
    # fewer than the 4 it takes at a time for one input row.
    gen = torch.Generator().manual_seed(120 + rows)
    layout = ExpertLayout(66, 56, "plain-dot", "plain-dot", "glu_halves", False, torch.bfloat16, gen)
    arena = layout.arena(slots=2)
    x = torch.randn(rows, 66, generator=gen).to(torch.bfloat16)
    weights = [0.5 + 0.25 * t for t in range(rows)]
    experts = [(1, [(t, 0, weights[t]) for t in range(rows)]), (0, [(t, 1, 1.0) for t in range(rows)])]
    got, _ = run(layout, arena, experts, x, top_k=2)
    for slot, k, w in ((1, 0, torch.tensor(weights)), (0, 1, torch.ones(rows))):
        want = reference(layout, arena, slot, x, w.unsqueeze(1))
        torch.testing.assert_close(got[k::2], want, **TOL[torch.bfloat16])


@pytest.mark.parametrize("inter", [60, 524])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7])
def test_bf16_axpy_columns_past_the_last_step_of_16(rows, inter, ffn_path):
    # bfloat16 [in, out] weights (GPT-OSS): the AVX-512 kernel takes 16 columns a step, the AVX2 one
    # 8. An intermediate of 60 gives the first projection 120 outputs (7 steps of 16, then 8),
    # hidden 66 the down projection 66 (4 steps, then 2 columns one at a time) and 66 inputs (16
    # blocks of 4 weight rows, then 2 rows alone); 7 input rows are 4 + 2 + 1. avx512-bf16 streams
    # rows of at most 1 KiB row by row for one or two input rows: an intermediate of 524 gives the
    # first projection rows of 2096 bytes (65 steps of 16, then 8), in blocks of 16 weight rows at
    # every row count, and the down projection 524 inputs (32 blocks of 16, then 3 of 4).
    gen = torch.Generator().manual_seed(130 + rows + inter)
    layout = ExpertLayout(66, inter, "plain-axpy", "plain-axpy", "gpt_oss", True, torch.bfloat16, gen)
    arena = layout.arena(slots=2)
    x = torch.randn(rows, 66, generator=gen).to(torch.bfloat16)
    experts = [(1, [(t, 0, 1.0) for t in range(rows)])]
    got, _ = run(layout, arena, experts, x, top_k=1)
    want = reference(layout, arena, 1, x, torch.ones(rows, 1))
    torch.testing.assert_close(got, want, **TOL[torch.bfloat16])
    if ffn_path in AVX512_PATHS:  # per column the same sums in the same order as AVX2's
        spec = {**layout.spec, "path": "avx2"}
        ffn = _native.ExpertFfn(spec)
        out = np.full((rows, 66), np.nan, dtype=np.float32)
        ones = np.ones(rows, dtype=np.float32)
        index = np.arange(rows, dtype=np.int64)
        ffn.run(
            arena,
            np.array([1], np.int64),
            np.array([0, rows], np.int64),
            index,
            index,
            ones,
            x.float().numpy(),
            out,
        )
        np.testing.assert_array_equal(got.numpy(), out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("first", ["fp8", "fp8-axpy"])
@pytest.mark.parametrize("rows", [1, 4])
def test_fp8_scales_past_float32_over_256_decode_as_transformers(dtype, first, rows):
    """A finite block scale above float32's largest / 256 (about 1.3e36): the vector decode's
    value / 256 * (scale * 256) would be infinite (a 0 code NaN); transformers' value * scale is
    finite for the codes here (|value| <= 64, the scale 2e36), zeros included."""
    gen = torch.Generator().manual_seed(90 + rows)
    layout = ExpertLayout(H, INTER, first, "fp8", "glu_halves", False, dtype, gen, fp8_block=(16, 48))
    arena = layout.arena(slots=1)
    parts = layout.parts(arena, 0)
    codes = parts["gate_up_proj"].view(torch.uint8)
    values = parts["gate_up_proj"].float()
    codes[values.abs() > 64] = 0x38  # 1.0
    codes.view(-1)[::7] = 0  # zeros in every block
    parts["gate_up_proj_scale_inv"][:] = 2e36
    x = (torch.randn(rows, H, generator=gen) * 2.0**-120).to(dtype)
    got, _ = run(layout, arena, [(0, [(t, 0, 1.0) for t in range(rows)])], x, top_k=1)
    want = reference(layout, arena, 0, x, torch.ones(rows, 1))
    assert want.isfinite().all() and want.abs().max() > 1e-3
    # Sums of products up to ~1e2 that cancel: the tolerance is relative to the largest output.
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=TOL[dtype]["rtol"], atol=TOL[dtype]["atol"] * scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 3, 5])
def test_fp8_dot_with_blocks_cut_anywhere(dtype, rows):
    # [out, in] FP8 with 5 x 28 blocks: a row's 28 columns of a block are cut into 16 (AVX-512),
    # 8 (AVX2) and a scalar tail of 4, an intermediate of 99 leaves down_proj's last block 15
    # columns (8 + 7), and 5 rows are a block of 4 input rows and one more.
    gen = torch.Generator().manual_seed(100 + rows)
    layout = ExpertLayout(H, 99, "fp8", "fp8", "glu_halves", False, dtype, gen, fp8_block=(5, 28))
    arena = layout.arena(slots=2)
    x = torch.randn(rows, H, generator=gen).to(dtype)
    weights = [0.5 + 0.25 * t for t in range(rows)]
    got, _ = run(layout, arena, [(1, [(t, 0, weights[t]) for t in range(rows)])], x, top_k=1)
    want = reference(layout, arena, 1, x, torch.tensor(weights).unsqueeze(1))
    assert want.isfinite().all()
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("rows", [1, 3])
def test_fp8_axpy_with_blocks_and_rows_cut_anywhere(dtype, threads, rows):
    # [in, out] FP8 with 5 x 20 blocks: a block of 4 weight rows straddles a scale block's rows,
    # 20 columns are cut at 16 (8 wide) with a tail of 4, an intermediate of 99 leaves 3 weight
    # rows of down_proj past the blocks of 4 and gives gate_up 198 outputs (threads' shares and
    # scale blocks end anywhere), and the last scale blocks are partial.
    gen = torch.Generator().manual_seed(90 + rows)
    layout = ExpertLayout(H, 99, "fp8-axpy", "fp8-axpy", "gpt_oss", True, dtype, gen, fp8_block=(5, 20))
    arena = layout.arena(slots=2)
    x = torch.randn(rows, H, generator=gen).to(dtype)
    weights = [0.5 + 0.25 * t for t in range(rows)]
    got, _ = run(layout, arena, [(1, [(t, 0, weights[t]) for t in range(rows)])], x, top_k=1, threads=threads)
    want = reference(layout, arena, 1, x, torch.tensor(weights).unsqueeze(1))
    assert want.isfinite().all()
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 4])
def test_fp8_axpy_nan_codes_and_infinite_scales_decode_as_transformers(dtype, rows):
    """As test_fp8_nan_codes_and_infinite_scales_decode_as_transformers for [in, out] FP8: a NaN
    code makes its output column NaN, a scale that is not finite its block's columns."""
    gen = torch.Generator().manual_seed(100 + rows)
    hidden = 128  # output column blocks [0, 40), [40, 80), [80, 120), [120, 128)
    layout = ExpertLayout(
        hidden, INTER, "fp8-axpy", "fp8-axpy", "gpt_oss", False, dtype, gen, fp8_block=(16, 40)
    )
    arena = layout.arena(slots=1)
    parts = layout.parts(arena, 0)
    codes = parts["down_proj"].view(torch.uint8)  # [INTER, hidden]
    codes[3, 5] = 0x7F  # NaN codes in output columns 5 (a block's first 32 bytes) and 76 (past them)
    codes[40, 76] = 0xFF
    parts["down_proj_scale_inv"][2, 2] = float("inf")  # input rows 32..47, output columns 80..119
    parts["down_proj_scale_inv"][5, 3] = NAN_ALL_ONES  # input rows 80..95, output columns 120..127
    x = torch.randn(rows, hidden, generator=gen).to(dtype)
    got, _ = run(layout, arena, [(0, [(t, 0, 1.0) for t in range(rows)])], x, top_k=1)
    want = reference(layout, arena, 0, x, torch.ones(rows, 1))
    assert want[:, [5, 76]].isnan().all()
    assert not want[:, 80:120].isfinite().any()
    assert want[:, 120:].isnan().all()
    assert want[:, [c for c in range(80) if c not in (5, 76)]].isfinite().all()
    torch.testing.assert_close(got, want, equal_nan=True, **TOL[dtype])


@pytest.mark.parametrize("threads", [2, 3])
def test_threads_give_the_same_bits(threads):
    gen = torch.Generator().manual_seed(0)
    layout = ExpertLayout(H, INTER, "mxfp4", "plain-axpy", "gpt_oss", True, torch.bfloat16, gen)
    arena = layout.arena(slots=4)
    x = torch.randn(5, H, generator=gen).to(torch.bfloat16)
    experts = [(s, [(t, k, 0.5) for t in range(5)]) for k, s in enumerate((3, 1))]  # one expert per (t, k)
    one, _ = run(layout, arena, experts, x, top_k=2)
    many, ffn = run(layout, arena, experts, x, top_k=2, threads=threads)
    assert ffn.threads == threads
    assert torch.equal(one.view(torch.int32), many.view(torch.int32))  # unwritten rows: NaN in both


@pytest.mark.parametrize("threads", [1, 2])
def test_amx_takes_mxfp4_in_bfloat16_from_five_rows_an_expert(ffn_path, threads):
    """On the AMX path an MXFP4 projection in bfloat16 runs on AMX tiles where an expert has five
    rows or more (below, the AVX-512 kernel is faster), every 16 output rows a work item; its
    outputs are held to the reference by test_equals_transformers_math. No other path, encoding or
    compute dtype uses it."""
    gen = torch.Generator().manual_seed(11)
    for dtype in (torch.bfloat16, torch.float32):
        layout = ExpertLayout(H, INTER, "mxfp4", "mxfp4", "gpt_oss", True, dtype, gen)
        arena = layout.arena(slots=2)
        x = torch.randn(5, H, generator=gen).to(dtype)
        items = {}
        for rows in (4, 5):
            _, ffn = run(layout, arena, [(1, [(t, 0, 0.5) for t in range(rows)])], x[:rows], 1, threads)
            items[rows] = ffn.amx_items
        amx = ffn_path == "amx" and dtype == torch.bfloat16
        # first: 2 x INTER outputs, down: H outputs, 16 a work item
        assert items == {4: 0, 5: (2 * INTER + H) // 16 if amx else 0}


def expected_decode_xor(layout: ExpertLayout, arena: np.ndarray, slot: int) -> int:
    """What ``decode_only`` returns for the expert in ``slot``: every MXFP4 weight's bfloat16 word
    (the encodings module's decode), xor-ed per word of a 64-bit lane. The kernels' decode puts
    element e of a group (32 values) in word (e // 2) % 4 of its lane, for both nibbles."""
    parts = layout.parts(arena, slot)
    out = 0
    for name in ("gate_up_proj", "down_proj"):
        blocks = parts.get(f"{name}_blocks")
        if blocks is None:
            continue
        w = dequantize_mxfp4(blocks, parts[f"{name}_scales"], torch.float32).to(torch.bfloat16)
        words = w.view(torch.int16).numpy().astype(np.uint16).astype(np.uint64)
        lane_word = (np.arange(words.shape[1]) % 32 // 2) % 4
        for k in range(4):
            out ^= int(np.bitwise_xor.reduce(words[:, lane_word == k], axis=None)) << (16 * k)
    return out


@pytest.mark.parametrize("hidden", [H, 96])  # 96: each down row ends in a group without a pair
def test_decode_only_decodes_every_mxfp4_weight_as_the_encodings_module(ffn_path, hidden):
    """``decode_only`` (bench.kernels' bound of the MXFP4 kernels) decodes every weight of the
    expert's MXFP4 projections, and only those, into the words the kernels multiply."""
    gen = torch.Generator().manual_seed(12)
    for down in ("mxfp4", "plain-dot"):
        layout = ExpertLayout(hidden, INTER, "mxfp4", down, "gpt_oss", True, torch.bfloat16, gen)
        arena = layout.arena(slots=2)
        ffn = _native.ExpertFfn(layout.spec)
        if ffn_path not in AVX512_PATHS:
            with pytest.raises(
                ValueError,
                match=f"decode_only runs on the avx512, avx512-bf16 and amx paths, not '{ffn_path}'",
            ):
                ffn.decode_only(arena, 1)
            continue
        assert ffn.decode_only(arena, 1) == expected_decode_xor(layout, arena, 1)
        assert ffn.decode_only(arena, 0) == expected_decode_xor(layout, arena, 0)


def test_decode_only_refuses_what_it_cannot_decode(ffn_path):
    gen = torch.Generator().manual_seed(13)
    layout = ExpertLayout(H, INTER, "mxfp4", "mxfp4", "gpt_oss", True, torch.bfloat16, gen)
    ffn = _native.ExpertFfn(layout.spec)
    arena = layout.arena(slots=2)
    for slot in (2, -1):
        with pytest.raises(ValueError, match=f"slot {slot} is outside the arena's 2"):
            ffn.decode_only(arena, slot)
    with pytest.raises(ValueError, match="arena must be a contiguous numpy uint8 array"):
        ffn.decode_only(arena.view(np.int8), 0)
    if ffn_path in AVX512_PATHS:
        plain = _native.ExpertFfn(plain_layout(3).spec)
        with pytest.raises(ValueError, match="decode_only needs an MXFP4 projection; this expert has none"):
            plain.decode_only(plain_layout(3).arena(slots=1), 0)


def test_decoded_weights_match_the_encodings_module():
    """The layouts the reference reads are the encodings module's own decode."""
    gen = torch.Generator().manual_seed(1)
    layout = ExpertLayout(H, INTER, "mxfp4", "fp8", "glu_halves", False, torch.float32, gen)
    arena = layout.arena(slots=1)
    parts = layout.parts(arena, 0)
    w = dequantize_mxfp4(parts["gate_up_proj_blocks"], parts["gate_up_proj_scales"], torch.float32)
    assert w.shape == (2 * INTER, H)
    d = dequantize_fp8(parts["down_proj"], parts["down_proj_scale_inv"], (16, 16), torch.float32)
    assert d.shape == (H, INTER)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(slots=np.array([5], dtype=np.int64)), "outside the arena"),
        (dict(slots=np.array([-1], dtype=np.int64)), "outside the arena"),
        (dict(tokens=np.array([9], dtype=np.int64)), "outside x"),
        (dict(rows=np.array([99], dtype=np.int64)), "outside out"),
        (dict(bounds=np.array([0, 2], dtype=np.int64)), "bounds\\[-1\\]"),
        (dict(bounds=np.array([1, 1], dtype=np.int64)), "bounds\\[0\\] must be 0"),
        (dict(weights=np.ones(1, dtype=np.float64)), "weights must be a numpy array of float32"),
        (dict(x=np.ones((1, H + 1), dtype=np.float32)), "x must be float32"),
        (dict(out=np.ones((4, H), dtype=np.float32)[:, ::2]), "out must be"),
        (dict(arena=np.ones(10, dtype=np.int32)), "arena must be"),
    ],
)
def test_bad_arguments_are_refused_by_name(change, message):
    refuses(
        2,
        "run",
        change,
        message,
        bounds=np.array([0, 1], dtype=np.int64),
        rows=np.array([0], dtype=np.int64),
        tokens=np.array([0], dtype=np.int64),
        weights=np.ones(1, dtype=np.float32),
        x=np.ones((1, H), dtype=np.float32),
        out=np.zeros((4, H), dtype=np.float32),
    )


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(slot_bytes=16), "past the slot"),
        (dict(gate="swish"), "spec\\['gate'\\]"),
        (dict(act="tanh"), "spec\\['act'\\]"),
        (dict(compute="int8"), "dtype 'int8'"),
        (dict(path="sse"), "spec\\['path'\\] 'sse' is not auto, amx, avx512-bf16, avx512, avx2 or portable"),
    ],
)
def test_bad_specs_are_refused_by_name(change, message):
    layout = plain_layout(3)
    with pytest.raises(ValueError, match=message):
        _native.ExpertFfn({**layout.spec, **change})


def test_paths_follow_the_cpu():
    paths = list(_native.FFN_PATHS)
    assert paths[-1] == "portable" and set(paths) <= {"amx", *AVX512_PATHS, "avx2", "portable"}
    if platform.machine() not in ("x86_64", "AMD64"):
        assert paths == ["portable"]
        return
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo to read the CPU's flags from")
    flags = set(next(line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")).split())
    assert ("avx2" in paths) == ({"avx2", "fma", "f16c"} <= flags)
    avx512 = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl"}
    assert ("avx512" in paths) == (avx512 <= flags)
    assert ("avx512-bf16" in paths) == (avx512 | {"avx512_bf16"} <= flags)
    # AMX needs the kernel's leave too (asked for at import): where the flags are, it may be refused.
    assert "amx" not in paths or avx512 | {"amx_tile", "amx_bf16"} <= flags
    assert _native.ExpertFfn({**plain_layout(3).spec, "path": "auto"}).path == paths[0]


@pytest.mark.skipif(
    not {"amx", "avx512-bf16", "avx512", "avx2"} - set(_native.FFN_PATHS),
    reason="this CPU runs every SIMD path of the kernel",
)
def test_a_path_this_cpu_does_not_run_is_refused_by_name():
    missing = sorted({"amx", "avx512-bf16", "avx512", "avx2"} - set(_native.FFN_PATHS))[0]
    with pytest.raises(ValueError, match=f"path '{missing}' does not run on this CPU \\(it runs "):
        _native.ExpertFfn({**plain_layout(3).spec, "path": missing})


def test_an_encoded_matrix_cannot_be_read_transposed():
    gen = torch.Generator().manual_seed(4)
    layout = ExpertLayout(H, INTER, "mxfp4", "plain-dot", "glu_halves", False, torch.float32, gen)
    spec = dict(layout.spec, first=dict(layout.spec["first"], form="axpy"))
    with pytest.raises(ValueError, match="only plain and FP8 weights can be read transposed"):
        _native.ExpertFfn(spec)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_routed_runs_and_combine_equal_grouped_runs_and_a_sum_over_k(dtype):
    # run_routed groups the pairs by expert itself; batches in any order fill the same pairs, and
    # combine sums them over k in order into the compute dtype, as the torch combiner does.
    gen = torch.Generator().manual_seed(3)
    layout = ExpertLayout(H, INTER, "mxfp4", "plain-axpy", "gpt_oss", True, dtype, gen)
    arena = layout.arena(slots=4)
    x = torch.randn(3, H, generator=gen).to(dtype)
    ids = np.array([2, 0, 0, 3, 3, 2], dtype=np.int64)  # T = 3 tokens, K = 2
    weights = np.array([0.5, 0.25, 0.75, 0.5, 0.125, 0.875], dtype=np.float32)
    slot_of = {0: 1, 2: 3, 3: 0}
    experts = [
        (slot_of[e], [(r // 2, r % 2, float(weights[r])) for r in range(6) if ids[r] == e]) for e in (0, 2, 3)
    ]
    want, ffn = run(layout, arena, experts, x, top_k=2)
    storage = x.view(torch.int16).numpy() if dtype == torch.bfloat16 else x.numpy()
    pairs = np.full((6, H), np.nan, dtype=np.float32)
    for batch in ([3], [0, 2]):  # the loads' order, not the experts'
        slots = np.array([slot_of[e] for e in batch], dtype=np.int64)
        ffn.run_routed(arena, slots, np.array(batch, dtype=np.int64), ids, weights, storage, pairs)
    assert torch.equal(torch.from_numpy(pairs).view(torch.int32), want.view(torch.int32))
    out = torch.empty(3, H, dtype=dtype)
    ffn.combine(pairs, 2, out.view(torch.int16).numpy() if dtype == torch.bfloat16 else out.numpy())
    assert torch.equal(out, torch.from_numpy(pairs).view(3, 2, H).sum(dim=1).to(dtype))
    # The last batch given `out` combines the pairs in the same call: the same result.
    at_once = torch.full((3, H), float("nan"), dtype=dtype)
    again = np.full((6, H), np.nan, dtype=np.float32)
    for batch, last in (([0, 2], None), ([3], at_once)):
        slots = np.array([slot_of[e] for e in batch], dtype=np.int64)
        into = (
            None
            if last is None
            else last.view(torch.int16).numpy()
            if dtype == torch.bfloat16
            else last.numpy()
        )
        ffn.run_routed(arena, slots, np.array(batch, dtype=np.int64), ids, weights, storage, again, into)
    assert torch.equal(torch.from_numpy(again).view(torch.int32), want.view(torch.int32))
    assert torch.equal(at_once, out)
    # With `add`, the combined result goes into `out` as torch's residual add would put it.
    residual = torch.randn(3, H, generator=gen).to(dtype)
    into = residual.clone()
    slots = np.array([slot_of[e] for e in (0, 2, 3)], dtype=np.int64)
    view = into.view(torch.int16).numpy() if dtype == torch.bfloat16 else into.numpy()
    ffn.run_routed(
        arena, slots, np.array([0, 2, 3], dtype=np.int64), ids, weights, storage, again, view, True
    )
    assert torch.equal(into, residual + out)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(slots=np.array([7], dtype=np.int64)), "outside the arena"),
        (dict(experts=np.array([5], dtype=np.int64)), "expert 5 has no pair in ids"),
        (dict(experts=np.array([0, 1], dtype=np.int64)), "same length"),
        (dict(weights=np.ones(3, dtype=np.float32)), "one value per pair"),
        (dict(x=np.ones((3, H), dtype=np.float32)), "ids must hold T \\* K values"),
        (dict(x=np.ones((2, H), dtype=np.float64)), "x must hold the compute dtype"),
        (dict(pairs=np.zeros((4, H + 1), dtype=np.float32)), "pairs must be a writable float32"),
        (dict(out=np.zeros((3, H), dtype=np.float32)), "out must hold 128 values"),
        (dict(out=np.zeros((2, H), dtype=np.float64)), "out must hold the compute dtype"),
    ],
)
def test_routed_arguments_are_refused_by_name(change, message):
    ffn = refuses(
        4,
        "run_routed",
        change,
        message,
        experts=np.array([0], dtype=np.int64),
        ids=np.array([0, 1, 1, 0], dtype=np.int64),
        weights=np.ones(4, dtype=np.float32),
        x=np.ones((2, H), dtype=np.float32),
        pairs=np.zeros((4, H), dtype=np.float32),
    )
    with pytest.raises(ValueError, match="pairs must be float32"):
        ffn.combine(np.zeros((5, H), dtype=np.float32), 2, np.zeros((2, H), dtype=np.float32))
    with pytest.raises(ValueError, match="out must be writable"):
        out = np.zeros((2, H), dtype=np.float32)
        out.flags.writeable = False
        ffn.combine(np.zeros((4, H), dtype=np.float32), 2, out)


def test_a_resident_layer_runs_in_one_call_through_the_slot_table_and_leaves_no_pin():
    # run_resident: the layer's experts pinned through compute's slot-table handle, run as
    # run_routed runs them into `out` (added with `add`), unpinned; nothing pinned or run where one
    # is not resident, where the ledger was taken back, or where an argument is wrong.
    from expertcache.native import SlotTable, StaleClient
    from tests.slot_tables import claim_and_attach

    gen = torch.Generator().manual_seed(5)
    layout = ExpertLayout(H, INTER, "mxfp4", "plain-axpy", "gpt_oss", True, torch.bfloat16, gen)
    arena = layout.arena(slots=4)
    table = SlotTable.create(f"ffn-resident-{np.random.randint(1 << 30)}", 8, 4, num_clients=1)
    slot_of = {0: 1, 2: 3, 3: 0}  # entry (expert) -> slot; entry 1 stays absent
    for entry, slot in slot_of.items():
        table.begin_load(entry, slot)
        table.finish_load(entry)
    handle = claim_and_attach(table, 0)
    ffn = _native.ExpertFfn(layout.spec)
    x = torch.randn(3, H, generator=gen).to(torch.bfloat16)
    storage = x.view(torch.int16).numpy()
    ids = np.array([2, 0, 0, 3, 3, 2], dtype=np.int64)  # T = 3 tokens, K = 2
    weights = np.array([0.5, 0.25, 0.75, 0.5, 0.125, 0.875], dtype=np.float32)
    experts = np.array([0, 2, 3], dtype=np.int64)
    want_pairs = np.full((6, H), np.nan, dtype=np.float32)
    want = torch.empty(3, H, dtype=torch.bfloat16)
    slots = np.array([slot_of[e] for e in experts.tolist()], dtype=np.int64)
    ffn.run_routed(arena, slots, experts, ids, weights, storage, want_pairs, want.view(torch.int16).numpy())

    def run(entries, out, add=False, pairs=None):
        pairs = np.full((6, H), np.nan, dtype=np.float32) if pairs is None else pairs
        got = ffn.run_resident(
            handle, np.array(entries, dtype=np.int64), arena, experts, ids, weights, storage, pairs, out, add
        )
        assert [table.pins(e) for e in range(8)] == [0] * 8
        return got, pairs

    out = torch.full((3, H), float("nan"), dtype=torch.bfloat16)
    got, pairs = run([0, 2, 3], out.view(torch.int16).numpy())
    assert got == 1
    assert np.array_equal(pairs.view(np.int32), want_pairs.view(np.int32))
    assert torch.equal(out, want)
    residual = torch.randn(3, H, generator=gen).to(torch.bfloat16)
    into = residual.clone()
    assert run([0, 2, 3], into.view(torch.int16).numpy(), add=True)[0] == 1
    assert torch.equal(into, residual + want)
    # Entry 1 is not resident: nothing pinned, nothing run.
    untouched = torch.full((3, H), float("nan"), dtype=torch.bfloat16)
    got, pairs = run([0, 1, 3], untouched.view(torch.int16).numpy())
    assert got == 0 and torch.isnan(untouched).all() and np.isnan(pairs).all()
    # A wrong argument is refused with the pins given back.
    with pytest.raises(ValueError, match="pairs must be a writable float32"):
        run([0, 2, 3], out.view(torch.int16).numpy(), pairs=np.zeros((5, H), dtype=np.float32))
    with pytest.raises(ValueError, match="experts and entries must have the same length"):
        run([0, 2], out.view(torch.int16).numpy())
    # The daemon took the ledger back (a new region for it): the handle is stale, nothing runs.
    table.claim_channel(0)
    with pytest.raises(StaleClient):
        run([0, 2, 3], untouched.view(torch.int16).numpy())
    assert torch.isnan(untouched).all()


def test_a_layer_from_its_routing_finds_its_experts_pins_them_all_or_none_and_leaves_no_pin():
    # run_layer: the experts of the routing (each once, ascending) pinned at layer * E + e through
    # compute's slot-table handle, run as run_routed runs them and added into `out`, unpinned: the
    # number of experts. 0, with nothing pinned or run, where one is not resident or they are more
    # than max_experts; refused by name where an argument is wrong, with no pin left behind.
    from expertcache.native import SlotTable, StaleClient
    from tests.slot_tables import claim_and_attach

    gen = torch.Generator().manual_seed(6)
    layout = ExpertLayout(H, INTER, "mxfp4", "plain-axpy", "gpt_oss", True, torch.bfloat16, gen)
    arena = layout.arena(slots=4)
    table = SlotTable.create(f"ffn-layer-{np.random.randint(1 << 30)}", 8, 4, num_clients=1)  # 2 layers x 4
    slot_of = {0: 1, 2: 3, 3: 0}  # layer 1's expert -> slot; expert 1 stays absent
    for expert, slot in slot_of.items():
        table.begin_load(4 + expert, slot)
        table.finish_load(4 + expert)
    handle = claim_and_attach(table, 0)
    ffn = _native.ExpertFfn(layout.spec)
    x = torch.randn(3, H, generator=gen).to(torch.bfloat16)
    storage = x.view(torch.int16).numpy()
    ids = np.array([2, 0, 0, 3, 3, 2], dtype=np.int64)  # T = 3 tokens, K = 2
    scores = torch.tensor([0.5, 0.25, 0.75, 0.5, 0.125, 0.875]).to(torch.bfloat16)
    experts = np.array([0, 2, 3], dtype=np.int64)
    residual = torch.randn(3, H, generator=gen).to(torch.bfloat16)
    want = residual.clone()
    slots = np.array([slot_of[e] for e in experts.tolist()], dtype=np.int64)
    ffn.run_routed(
        arena, slots, experts, ids, scores.float().numpy(), storage,
        np.empty((6, H), dtype=np.float32), want.view(torch.int16).numpy(), True,
    )  # fmt: skip

    def run(ids=ids, weights=scores.view(torch.int16).numpy(), layer=1, max_experts=4, num_experts=4):
        into = residual.clone()
        got = ffn.run_layer(
            handle, layer, num_experts, max_experts, arena, ids, weights, storage,
            np.full((6, H), np.nan, dtype=np.float32), into.view(torch.int16).numpy(), True,
        )  # fmt: skip
        assert [table.pins(e) for e in range(8)] == [0] * 8
        return got, into

    got, into = run()
    assert got == 3 and torch.equal(into, want)
    # float32 weights: the same (the bf16 values widened exactly)
    got, into = run(weights=scores.float().numpy())
    assert got == 3 and torch.equal(into, want)
    # Expert 1 is not resident, or 3 experts are more than 2: nothing pinned, nothing run.
    for kwargs in (dict(ids=np.array([2, 0, 1, 3, 3, 2], dtype=np.int64)), dict(max_experts=2)):
        got, into = run(**kwargs)
        assert got == 0 and torch.equal(into, residual)
    # Layer 0 holds none of them.
    assert run(layer=0)[0] == 0
    for kwargs, error, message in (
        (
            dict(ids=np.array([2, 0, 4, 3, 3, 2], dtype=np.int64)),
            ValueError,
            "expert 4 is outside the layer's 4",
        ),
        (dict(weights=scores.double().numpy()), ValueError, "weights must hold float32 values"),
        (dict(weights=np.ones(4, dtype=np.float32)), ValueError, "one value per pair"),
        (dict(layer=-1), ValueError, "layer must be >= 0"),
        (dict(num_experts=0), ValueError, "num_experts must be >= 1"),
        (dict(layer=2), IndexError, "entry 8 out of range"),  # entries beyond the table's
    ):
        with pytest.raises(error, match=message):
            run(**kwargs)
    # The daemon took the ledger back (a new region for it): the handle is stale, nothing runs.
    table.claim_channel(0)
    into = residual.clone()
    with pytest.raises(StaleClient):
        ffn.run_layer(
            handle, 1, 4, 4, arena, ids, scores.float().numpy(), storage,
            np.empty((6, H), dtype=np.float32), into.view(torch.int16).numpy(), True,
        )  # fmt: skip
    assert torch.equal(into, residual)


def two_layer_attention(seed: int):
    """A float32 DecodeAttention of two layers (unit norms, random projections) for the span tests,
    and the generator that made them (the tests draw on from it)."""
    from expertcache.native import DecodeAttention

    att = DecodeAttention(
        dict(
            hidden=H, heads=4, kv_heads=1, head_dim=16, dtype="float32", eps=1e-6, scaling=0.25,
            norm="cast_then_weight", softmax="fused",
        )
    )  # fmt: skip
    rng = np.random.default_rng(seed)
    for _ in range(2):
        att.add_layer(
            {
                "input_norm": np.ones(H, np.float32),
                "post_norm": np.ones(H, np.float32),
                "q": rng.standard_normal((64, H), dtype=np.float32) * 0.1,
                "k": rng.standard_normal((16, H), dtype=np.float32) * 0.1,
                "v": rng.standard_normal((16, H), dtype=np.float32) * 0.1,
                "o": rng.standard_normal((H, 64), dtype=np.float32) * 0.1,
            }
        )
    return att, rng


def begin_step(att, h: np.ndarray):
    """Begins a decode step of ``att`` for the rows of ``h`` (position 3, empty caches of 8):
    (the MoE input it writes, the caches, which must outlive the step)."""
    rows = h.shape[0]
    caches = [np.zeros((1, 8, 16), np.float32) for _ in range(4 * rows)]
    address = np.array([c.ctypes.data for c in caches], np.int64).reshape(2, 2 * rows)
    mlp_in = np.zeros((rows, H), np.float32)
    att.begin_step(
        h, mlp_in, np.ones((rows, 8), np.float32), np.zeros((rows, 8), np.float32),
        address[:, :rows].copy(), address[:, rows:].copy(), np.full((2, rows), 8, np.int64),
        np.full(rows, 3, np.int64),
    )  # fmt: skip
    return mlp_in, caches


def test_a_steps_layers_run_in_one_call_as_they_run_one_by_one_up_to_the_first_not_resident():
    # run_layers: per layer, the attention's dense half, then the layer's experts as run_layer
    # runs them (added into the residual), from the layer's row of the routing; stops at the first
    # layer whose experts do not all run (its dense half did): (that layer, experts run, why). The
    # residual equals one-by-one calls bit for bit, and no pin is left behind.
    from expertcache.native import LayerSignals, SlotTable
    from tests.slot_tables import claim_and_attach

    gen = torch.Generator().manual_seed(7)
    layout = ExpertLayout(H, INTER, "plain-axpy", "plain-axpy", "gpt_oss", True, torch.float32, gen)
    arena = layout.arena(slots=6)
    table = SlotTable.create(f"ffn-layers-{np.random.randint(1 << 30)}", 8, 6, num_clients=1)  # 2 layers x 4
    slot_of = {0: 1, 2: 3, 3: 0, 4: 2, 5: 5, 7: 4}  # entry -> slot: layer 0's 1 and layer 1's 2 absent
    for entry, slot in slot_of.items():
        table.begin_load(entry, slot)
        table.finish_load(entry)
    handle = claim_and_attach(table, 0)
    ffn = _native.ExpertFfn(layout.spec)
    att, rng = two_layer_attention(3)
    T, K = 2, 2
    weights = np.array([[0.5, 0.25, 0.75, 0.5], [0.125, 0.875, 0.5, 0.5]], np.float32)
    h0 = rng.standard_normal((T, H), dtype=np.float32)

    def begin(h):
        return begin_step(att, h)

    def one_by_one(ids, stop):
        h = h0.copy()
        mlp_in, _caches = begin(h)
        for layer in range(2):
            att.run(layer)
            if layer == stop:
                break
            got = ffn.run_layer(
                handle,
                layer,
                4,
                6,
                arena,
                ids[layer],
                weights[layer],
                mlp_in,
                np.empty((T * K, H), np.float32),
                h,
                True,
            )
            assert got > 0
        att.end_step()
        return h

    def in_one_call(ids, first=0, h=None, **extra):
        h = h0.copy() if h is None else h
        mlp_in, _caches = begin(h)
        try:
            got = ffn.run_layers(
                att,
                handle,
                first,
                4,
                6,
                arena,
                ids,
                weights,
                mlp_in,
                np.empty((T * K, H), np.float32),
                h,
                **extra,
            )
        finally:
            att.end_step()
            assert [table.pins(e) for e in range(8)] == [0] * 8
        return got, h

    resident = np.array([[0, 2, 3, 0], [1, 3, 0, 0]], np.int64)  # entries 0, 2, 3 and 5, 7, 4
    got, h = in_one_call(resident)
    assert got == (2, 6, "done", 0, [], 0.0) and np.array_equal(h, one_by_one(resident, None))
    assert not np.array_equal(h, h0)
    # Layer 1 names expert 2 (entry 6, absent): layer 0 runs whole, layer 1 its dense half only.
    missing = np.array([[0, 2, 3, 0], [1, 2, 0, 0]], np.int64)
    hits = handle.hits
    got, h = in_one_call(missing)
    # Hits counted (the daemon reports them): layer 0's three, not layer 1's two that were pinned
    # and given back because its third is absent (the layer's acquire pins and counts them).
    assert handle.hits - hits == 3
    assert got == (1, 3, "miss", 0, [], 0.0) and np.array_equal(h, one_by_one(missing, 1))
    # From layer 1 with all of it resident: only layer 1.
    got, _ = in_one_call(resident, first=1)
    assert got == (2, 3, "done", 0, [], 0.0)
    # With signals, each layer that runs writes its routes and lookahead (here as given: this
    # attention routes nothing) once its experts are pinned; the layer with a miss writes its own
    # too, leaving the doorbell to its demand (ExpertRuntime.forward posts it). The residual is the
    # same.
    channel, daemon_side = handle.channel(0), table.channel(0)
    daemon_side.drain()
    signals = LayerSignals(channel, [5, 6], [10, 11], K, 2, 1, [1, -1])
    ahead_ids = np.array([[[3, 1, 0, 2]], [[0, 1, 2, 3]]], np.int64)  # [layers, depth, T * K]
    ahead_scores = np.array([[[0.5, 0.5, 2.0, 0.25]], [[1, 1, 1, 1]]], np.float32)
    got, h = in_one_call(missing, signals=signals, ahead_ids=ahead_ids, ahead_scores=ahead_scores)
    assert got == (1, 3, "miss", 0, [], 0.0) and np.array_equal(h, one_by_one(missing, 1))
    records, corrupt = daemon_side.drain()
    assert not corrupt
    assert [(r[0], r[1], r[2], r[3], r[4].tolist()) for r in records[:2]] == [
        ("route", 5, 10, 0, [0, 2]),
        ("route", 6, 11, 0, [0, 3]),
    ]
    assert [(r[1], [(la, d, e.tolist(), sc.tolist()) for la, d, e, sc in r[3]]) for r in records[2:4]] == [
        (5, [(1, 1, [3, 1], [0.5, 0.5])]),
        (6, [(1, 1, [0, 2], [1.0, 0.25])]),
    ]
    # layer 1 (the miss): its routes, and no lookahead (it predicts no layer)
    assert [(r[0], r[1], r[3], r[4].tolist()) for r in records[4:]] == [
        ("route", 5, 1, [1, 2]),
        ("route", 6, 1, [0]),
    ]
    assert (signals.written, signals.dropped, signals.unrung) == (6, 0, True)
    # An expert in flight (LOADING: entry 6, into the slot entry 7 left) and none absent: with
    # loading_wait_s the span writes the layer's signals and rings, waits for it and runs the layer
    # (the residual as one by one once it landed); it reports the expert as waited for, and the
    # layer's wait. It stops at the layer as before where the load does not land in time (the wait
    # in vain reported), is aborted meanwhile, or another expert of the layer is absent; and with
    # loading_wait_s 0 it never waits.
    assert table.try_evict(7)
    in_flight = np.array([[0, 2, 3, 0], [1, 2, 0, 0]], np.int64)  # entries 0, 2, 3 and 5, 6, 4
    table.begin_load(6, 4)
    got, _ = in_one_call(in_flight, loading_wait_s=0.0)
    assert got == (1, 3, "miss", 0, [], 0.0)
    hits, waited = handle.hits, handle.waited
    got, h = in_one_call(in_flight, loading_wait_s=0.05)
    assert got[:4] == (1, 3, "miss", 0) and got[4] == [] and 0.04 < got[5] < 1.0, got
    assert (handle.hits - hits, handle.waited - waited) == (3, 0)  # layer 0's; layer 1 counts nothing
    assert np.array_equal(h, one_by_one(in_flight, 1))
    threading.Timer(0.05, table.abort_load, (6,)).start()
    got, _ = in_one_call(in_flight, loading_wait_s=30.0)
    # Woken by the abort (a wait > 0: the timer's 50 ms count from its start, and on a busy node the
    # call may begin most of them later, so no lower bound but zero holds every time).
    assert got[:4] == (1, 3, "miss", 0) and 0.0 < got[5] < 10.0, got
    table.begin_load(6, 4)
    daemon_side.drain()
    signals = LayerSignals(channel, [5, 6], [10, 11], K, 2, 1, [1, -1])
    threading.Timer(0.05, table.finish_load, (6,)).start()
    hits, waited = handle.hits, handle.waited
    got, h = in_one_call(
        in_flight, signals=signals, ahead_ids=ahead_ids, ahead_scores=ahead_scores, loading_wait_s=30.0
    )
    # "done" only once the timer landed the load: it waited (how long depends on when the call began).
    assert got[:4] == (2, 6, "done", 1) and len(got[4]) == 1 and 0.0 < got[4][0] < 10.0 and got[5] == 0.0, got
    # Hits: layer 0's three and layer 1's two resident ones; the one in flight counts as waited, for
    # the daemon's misses (table.waited: every ledger's).
    assert (handle.hits - hits, handle.waited - waited) == (3 + 2, 1)
    assert table.waited == handle.waited
    # Its two resident experts ran before the wait, the one in flight after it, then the combine:
    # the residual as one call over the layer makes it.
    assert np.array_equal(h, one_by_one(in_flight, None))
    records, _ = daemon_side.drain()
    assert [(r[0], r[3]) for r in records if r[0] == "route"] == [("route", 0)] * 2 + [("route", 1)] * 2
    assert (signals.written, signals.unrung) == (6, False)  # written once each, and rung
    # Entry 6 resident now; entry 7 absent beside entry 4 in flight: no wait.
    assert table.try_evict(4)
    table.begin_load(4, 2)
    got, _ = in_one_call(np.array([[0, 2, 3, 0], [3, 0, 0, 0]], np.int64), loading_wait_s=30.0)
    assert got == (1, 3, "miss", 0, [], 0.0)
    table.finish_load(4)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="loading_wait_s must be finite and >= 0"):
            in_one_call(resident, loading_wait_s=bad)
    for extra, message in (
        (dict(signals=LayerSignals(channel, [5], [10], K, 2, 0, [])), "signals are for 2 layers of 2 pairs"),
        (dict(ahead_ids=ahead_ids, ahead_scores=ahead_scores), "ahead_ids and ahead_scores go with signals"),
        (dict(signals=signals), "signals with a lookahead need an attention that routes"),
        (
            dict(signals=signals, ahead_ids=ahead_ids[:1].copy(), ahead_scores=ahead_scores),
            "must hold layers x",
        ),
    ):
        with pytest.raises(ValueError, match=message):
            in_one_call(resident, **extra)
    for kwargs, message in (
        (dict(first=2), "first must be below the attention's 2 layers"),
        (dict(ids=np.array([[0, 2, 3, 0], [1, 9, 0, 0]], np.int64)), "expert 9 is outside the layer's 4"),
        (dict(ids=resident[:1].copy()), "weights must be a contiguous array of one value per pair"),
    ):
        with pytest.raises(ValueError, match=message):
            in_one_call(**{"ids": resident, **kwargs})
    with pytest.raises(ValueError, match="lent before begin_step"):
        ffn.run_layers(
            att, handle, 0, 4, 6, arena, resident, weights, h0.copy(), np.empty((4, H), np.float32), h0.copy()
        )
    with pytest.raises(ValueError, match="attention must be a DecodeAttention"):
        ffn.run_layers(
            ffn, handle, 0, 4, 6, arena, resident, weights, h0.copy(), np.empty((4, H), np.float32), h0.copy()
        )
    # The daemon took the ledger back: layer 0's dense half ran, none of its experts.
    table.claim_channel(0)
    got, _ = in_one_call(resident)
    assert got == (0, 0, "stale", 0, [], 0.0)


class SpanDaemon(ChannelServer):
    """The daemon's side of a client channel for ``run_layers``' demands: each demand is recorded;
    then, as scripted by ``mode``, refused, never answered, or admitted (every expert held in the
    client's ledger), its loads landing after ``delay`` s into the free slots ("land"), or one
    failing ("fail")."""

    def __init__(self, table, client: int, free_slots: list[int], mode: str = "land", delay: float = 0.02):
        self.free, self.mode, self.delay = list(free_slots), mode, delay
        self.demands: list[tuple[int, list[int]]] = []
        super().__init__(table, client)

    def serve(self, seq: int, layer: int, experts: list[int], trace: bytes) -> None:
        from expertcache import protocol as codes

        table, channel = self.table, self.channel
        self.demands.append((layer, list(experts)))
        if self.mode == "refuse":
            # Refused, though the experts are resident by then (another client's loads): this
            # client holds no pin of them, so its span must not run them.
            for entry in [layer * 4 + e for e in experts]:
                table.begin_load(entry, self.free.pop(0))
                table.finish_load(entry)
            channel.reply(seq, codes.status_of("RESOURCE_EXHAUSTED"), "no slot free for L1E2")
            return
        if self.mode == "hang":
            return
        epoch = table.client_epoch(self.client)
        entries = [layer * 4 + e for e in experts]
        for entry in entries:
            table.begin_load(entry, self.free.pop(0))
            assert table.hold_for_client(self.client, epoch, entry)
        channel.reply(seq, codes.STATUS_OK, "")
        time.sleep(self.delay)
        for i, entry in enumerate(entries):
            if self.mode == "fail":
                table.unhold_for_client(self.client, epoch, entry)
                channel.fail(
                    codes.status_of("DATA_LOSS"), f"loading expert {entry} failed: checksum mismatch"
                )
                table.abort_load(entry)
                continue
            table.finish_load(entry)
            channel.set_source(i, codes.SOURCE_STORE)
            channel.notify()


def test_a_span_demands_a_layers_misses_itself_and_hands_back_a_wait_that_does_not_end_well():
    # run_layers with a SpanDemand: a layer with an absent expert pins its resident ones (hits),
    # posts the demand for the others on the channel, runs them as they land and combines, then
    # goes on to the next layer: the residual equals the layers run one by one with every expert
    # resident, no pin is left, the demanded experts' sources and the layer's wait are reported.
    # Where the wait does not end well (refused, never answered past the time limit, a failed
    # load, stopped) the layer is handed back with its hits pinned and its demand posted (the
    # caller's acquire adopts them), nothing of it added into the residual.
    from expertcache import protocol as codes
    from expertcache.native import SlotTable, SpanDemand
    from tests.slot_tables import claim_and_attach

    gen = torch.Generator().manual_seed(11)
    layout = ExpertLayout(H, INTER, "plain-axpy", "plain-axpy", "gpt_oss", True, torch.float32, gen)
    arena = layout.arena(slots=8)
    ffn = _native.ExpertFfn(layout.spec)
    att, rng = two_layer_attention(5)
    T, K = 2, 2
    ids = np.array([[0, 2, 3, 0], [1, 2, 0, 3]], np.int64)  # layer 0: entries 0, 2, 3; layer 1: 4, 5, 6, 7
    weights = np.array([[0.5, 0.25, 0.75, 0.5], [0.125, 0.875, 0.5, 0.5]], np.float32)
    h0 = rng.standard_normal((T, H), dtype=np.float32)

    def fresh(absent=(6, 7)):
        """The table with every entry the routing names resident but ``absent``, and slots for them."""
        table = SlotTable.create(f"ffn-demand-{np.random.randint(1 << 30)}", 8, 8, num_clients=1)
        used = 0
        for entry in (0, 2, 3, 4, 5, 6, 7):
            if entry not in absent:
                table.begin_load(entry, used)
                table.finish_load(entry)
                used += 1
        return table, claim_and_attach(table, 0), list(range(used, 8))

    def in_one_call(handle, demand, h=None):
        h = h0.copy() if h is None else h
        mlp_in, _caches = begin_step(att, h)
        try:
            got = ffn.run_layers(
                att, handle, 0, 4, 8, arena, ids, weights, mlp_in, np.empty((T * K, H), np.float32), h,
                demand=demand,
            )  # fmt: skip
        finally:
            att.end_step()
        return got, h

    table, handle, _ = fresh(absent=())
    want_got, want = in_one_call(handle, None)  # every expert resident: the reference
    assert want_got == (2, 7, "done", 0, [], 0.0)

    # Admitted, landing 20 ms later: the span goes through layer 1 and the residual is the same.
    table, handle, free = fresh()
    daemon = SpanDaemon(table, 0, free)
    demand = SpanDemand(handle.channel(0), 5.0, 1e9, 0.0, 20e-6, 5e-6, False)
    hits = handle.hits
    got, h = in_one_call(handle, demand)
    daemon.stop()
    assert got == (2, 7, "done", 0, [], 0.0) and np.array_equal(h, want)
    assert daemon.demands == [(1, [2, 3])]  # only the two absent experts
    assert [table.pins(e) for e in range(8)] == [0] * 8 and table.client_pins(0, 6) == 0
    assert handle.hits - hits == 3 + 2  # layer 0's three, layer 1's two resident ones
    assert demand.sources == [codes.SOURCE_STORE] * 2 and demand.handed_back is None
    assert len(demand.waits) == 1 and 0.015 < demand.waits[0] < 5.0
    # Gathered (small experts): the same residual.
    table, handle, free = fresh()
    daemon = SpanDaemon(table, 0, free)
    got, h = in_one_call(handle, SpanDemand(handle.channel(0), 5.0, 1e9, 0.0, 20e-6, 5e-6, True))
    daemon.stop()
    assert got[:3] == (2, 7, "done") and np.array_equal(h, want)

    def handed_back(mode, timeout_s=5.0, deadline_s=1e9, stop_after=None):
        table, handle, free = fresh()
        daemon = SpanDaemon(table, 0, free, mode=mode)
        demand = SpanDemand(handle.channel(0), timeout_s, deadline_s, 0.0, 20e-6, 5e-6, False)
        if stop_after is not None:
            threading.Timer(stop_after, demand.stop).start()
        started = time.monotonic()
        got, h = in_one_call(handle, demand)
        elapsed = time.monotonic() - started
        daemon.stop()
        assert got == (1, 3, "demand", 0, [], 0.0), got
        layer, seq, fail_seen, hit_experts, hit_slots, misses, waited = demand.handed_back
        assert (layer, seq, hit_experts, misses) == (1, 1, [0, 1], [2, 3])  # the channel's first demand
        assert hit_slots == [table.slot(4), table.slot(5)]
        assert table.client_pins(0, 4) == table.client_pins(0, 5) == 1  # the hits stay pinned: adopted later
        assert fail_seen == 0 and 0 <= waited <= elapsed
        assert demand.sources == [] and demand.waits == []
        # Nothing of layer 1 in the residual: it is layer 0's alone, as a span stopping there leaves it.
        return h, elapsed, demand, handle

    stopped_at_1 = in_one_call(fresh(absent=(4, 5, 6, 7))[1], None)[1]  # a miss at layer 1, no demand
    h, _, demand, handle = handed_back("refuse")
    assert np.array_equal(h, stopped_at_1) and handle.channel(0).reply_status != codes.STATUS_OK
    h, elapsed, _, _ = handed_back("hang", timeout_s=0.1)
    assert np.array_equal(h, stopped_at_1) and 0.09 < elapsed < 3
    _, elapsed, _, _ = handed_back("hang", deadline_s=0.1)
    assert 0.09 < elapsed < 3
    _, elapsed, demand, _ = handed_back("hang", stop_after=0.1)
    assert 0.09 < elapsed < 3 and demand.stopped
    h, _, _, handle = handed_back("fail")
    assert np.array_equal(h, stopped_at_1) and handle.channel(0).fail_seq > 0
    # A call with a layer handed back and not adopted is refused; so are bad limits.
    with pytest.raises(ValueError, match="demand holds a layer handed back"):
        in_one_call(handle, demand)
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="timeout_s must be >= 0"):
            SpanDemand(handle.channel(0), bad, 1e9)
    with pytest.raises(ValueError, match="demand must be a SpanDemand"):
        in_one_call(handle, "a demand")
