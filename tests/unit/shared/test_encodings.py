"""The expert encodings registry: decoding equals transformers' own dequantisation bit for bit
(every MXFP4 code with every scale, every e4m3 value) by the native CPU decode and by the torch
ops (what CUDA runs, forced on CPU with ``native=False``), the two agree on realistic tensors, the
torch ops keep the e4m3 NaNs' bits when the device's arithmetic does not (CUDA), layouts are
checked, buffers are reused."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.finegrained_fp8 import Fp8Dequantize
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

import expertcache.encodings as encodings
from expertcache.encodings import (
    ENCODINGS,
    ExpertTensor,
    Scratch,
    TensorLayout,
    check_tensor,
    decode,
    dequantize_fp8,
    dequantize_mxfp4,
    get_encoding,
)
from expertcache.errors import DataLoss
from expertcache.manifest import StoreManifest, plan_blob
from tests.stores import bits

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# The decode paths on CPU: the native core (the default there) and the torch ops (CUDA's).
PATHS = [pytest.param(True, id="native"), pytest.param(False, id="torch-ops")]


def all_mxfp4_codes() -> tuple[torch.Tensor, torch.Tensor]:
    """blocks [256, 16, 16]: every byte in every row; scales [256, 16]: row r has scale byte r."""
    blocks = torch.arange(256, dtype=torch.uint8).reshape(1, 16, 16).expand(256, 16, 16).contiguous()
    scales = torch.arange(256, dtype=torch.uint8).reshape(256, 1).expand(256, 16).contiguous()
    return blocks, scales


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_mxfp4_equals_transformers_for_every_code_and_scale(dtype, native):
    blocks, scales = all_mxfp4_codes()
    want = convert_moe_packed_tensors(blocks[None], scales[None], dtype=dtype)[0]  # [C, R]
    got = dequantize_mxfp4(blocks, scales, dtype, native=native)  # [R, C]
    assert got.dtype == dtype and got.shape == (256, 512)
    assert torch.equal(bits(got.t()), bits(want))  # NaN-free: ldexp(0, 128) is 0, not 0 * inf


def test_mxfp4_encoding_decodes_to_the_transposed_runtime_parameter():
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (96, 2, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(110, 140, (96, 2), dtype=torch.uint8, generator=gen)
    tensor = get_encoding("mxfp4").plan("gate_up_proj", "bfloat16", (64, 96))
    check_tensor(tensor)
    out = decode(tensor, {"gate_up_proj_blocks": blocks, "gate_up_proj_scales": scales})
    assert out.shape == (64, 96) and out.dtype == torch.bfloat16  # runtime [H, 2I] (x @ W)
    want = convert_moe_packed_tensors(blocks[None], scales[None], dtype=torch.bfloat16)[0]
    assert torch.equal(bits(out), bits(want))


def test_plain_transposed_decodes_to_the_runtime_parameter_as_a_view_of_its_rows():
    tensor = get_encoding("plain").plan("gate_up_proj", "bfloat16", (64, 96), transposed=True)
    check_tensor(tensor)
    assert tensor.transposed and tensor.parts[0].shape == (96, 64)  # stored [out, in] rows
    rows = torch.randn(96, 64).to(torch.bfloat16)
    out = decode(tensor, {"gate_up_proj": rows})
    assert out.shape == (64, 96) and out.data_ptr() == rows.data_ptr()  # runtime [H, 2I], no copy
    assert torch.equal(out, rows.t())
    with pytest.raises(ValueError, match="plain tensor 'b' is transposed but \\[96\\] is not 2-D"):
        get_encoding("plain").plan("b", "bfloat16", (96,), transposed=True)


def all_e4m3_values() -> torch.Tensor:
    """float8_e4m3fn [48, 64]: every e4m3 byte (NaNs included) in every 16 x 16 block."""
    return torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).reshape(16, 16).repeat(3, 4)


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_equals_transformers_for_every_value(dtype, native):
    # Every e4m3 byte (NaNs included) in every 16 x 16 block, with scales over a wide range.
    values = all_e4m3_values()
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        scale_inv = torch.exp(torch.randn(3, 4, generator=gen) * 8).float()
        want = Fp8Dequantize(None)._dequantize_one(values, scale_inv, output_dtype=dtype)
        got = dequantize_fp8(values, scale_inv, (16, 16), dtype, native=native)
        assert got.dtype == dtype and torch.equal(bits(got), bits(want))


def cuda_mul_(values: torch.Tensor, factors: torch.Tensor) -> None:
    """The product as a CUDA device computes it: a NaN result is the canonical NaN 0x7FFFFFFF,
    whatever NaN operand it came from (x86 keeps the operand's sign and payload)."""
    values.mul_(factors)
    values.view(torch.int32).masked_fill_(values.isnan(), 0x7FFFFFFF)


def cuda_round_into(out: torch.Tensor, values: torch.Tensor) -> None:
    """The rounding to bf16 / fp16 as the H100 showed it: a NaN becomes 0x7FFF."""
    out.copy_(values)
    if out.dtype != torch.float32:
        out.view(torch.int16).masked_fill_(values.isnan(), 0x7FFF)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_torch_ops_keep_the_nan_bits_where_the_arithmetic_does_not(dtype, monkeypatch):
    # What an H100 showed: the torch ops gave +NaN for e4m3 0xFF (bf16 0x7FFF, fp16 0x7FFF, fp32
    # 0x7FFFFFFF) where transformers' CPU reference has -NaN (0xFFFF, 0xFF80, 0xFFF00000). The
    # cause, reproduced on CPU: CUDA's arithmetic canonicalises NaN. The rounding is CUDA's too:
    # torch's CPU rounding to bf16 makes every NaN 0xFFFF, which would hide the product's NaN here,
    # while CUDA's made it 0x7FFF; so the fix puts the NaN codes' values back from a table after
    # the rounding, not between the product and the rounding.
    values = all_e4m3_values()
    scale_inv = torch.exp(torch.randn(3, 4, generator=torch.Generator().manual_seed(5)) * 8).float()
    want = Fp8Dequantize(None)._dequantize_one(values, scale_inv, output_dtype=dtype)
    monkeypatch.setattr(encodings, "_mul_", cuda_mul_)
    monkeypatch.setattr(encodings, "_round_into", cuda_round_into)
    nan = values.view(torch.uint8).bitwise_and(0x7F) == 0x7F

    with monkeypatch.context() as unfixed:
        unfixed.setattr(encodings, "_restore_fp8_nans", lambda *args: None)
        broken = dequantize_fp8(values, scale_inv, (16, 16), dtype, native=False)
        assert torch.equal(bits(broken)[~nan], bits(want)[~nan])  # only the NaNs differ ...
        canonical = 0x7FFFFFFF if dtype == torch.float32 else 0x7FFF
        assert {b & 0xFFFFFFFF for b in bits(broken)[nan].tolist()} == {canonical}
        assert not torch.equal(bits(broken)[nan], bits(want)[nan])  # ... from the reference's

    fixed = dequantize_fp8(values, scale_inv, (16, 16), dtype, native=False)
    assert torch.equal(bits(fixed), bits(want))


@pytest.mark.parametrize("dtype", DTYPES)
def test_native_decode_equals_the_torch_ops_on_realistic_tensors(dtype):
    # gpt-oss-like MXFP4 (scales around 2**-10 .. 2**10) of odd sizes, and FP8 weights (NaN codes
    # sprinkled in) whose blocks are partial on both edges, in both the look-up (128 x 128) and the
    # arithmetic (16 x 16) code of the native decode.
    gen = torch.Generator().manual_seed(6)
    for rows, groups in [(97, 3), (2560, 16), (1, 1)]:
        blocks = torch.randint(0, 256, (rows, groups, 16), dtype=torch.uint8, generator=gen)
        scales = torch.randint(117, 138, (rows, groups), dtype=torch.uint8, generator=gen)
        native = dequantize_mxfp4(blocks, scales, dtype, native=True)
        ops = dequantize_mxfp4(blocks, scales, dtype, native=False)
        assert native.shape == ops.shape == (rows, groups * 32) and torch.equal(bits(native), bits(ops))
    for shape, block in [((300, 161), (128, 128)), ((40, 37), (16, 16)), ((512, 2560), (128, 128))]:
        values = (torch.randn(shape, generator=gen) * 30).to(torch.float8_e4m3fn)
        values.view(torch.uint8).view(-1)[::97] = 0xFF
        values.view(torch.uint8).view(-1)[5::101] = 0x7F
        grid = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
        scale_inv = (torch.rand(grid, generator=gen) + 0.1) * 2e-3
        native = dequantize_fp8(values, scale_inv, block, dtype, native=True)
        ops = dequantize_fp8(values, scale_inv, block, dtype, native=False)
        assert native.shape == ops.shape == shape and torch.equal(bits(native), bits(ops))


def test_native_decode_refuses_what_it_cannot_run():
    blocks, scales = torch.zeros(4, 1, 16, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.uint8)
    meta = Scratch("meta")
    with pytest.raises(
        ValueError, match="the native decode runs on CPU tensors only, and the tensors are on meta"
    ):
        dequantize_mxfp4(blocks.to("meta"), scales.to("meta"), torch.bfloat16, meta, native=True)
    with pytest.raises(ValueError, match="unknown decode output dtype 'float64'"):
        dequantize_mxfp4(blocks, scales, torch.float64, native=True)
    with pytest.raises(ValueError, match="scratch on cpu, values on meta"):
        dequantize_fp8(torch.zeros(4, 4, dtype=torch.float8_e4m3fn, device="meta"), torch.ones(1, 1), (4, 4),
                       torch.bfloat16, Scratch("cpu"))  # fmt: skip


def test_non_contiguous_parts_decode_like_contiguous_ones():
    blocks, scales = all_mxfp4_codes()
    strided_blocks = blocks.transpose(0, 1).contiguous().transpose(0, 1)  # same values, other strides
    assert not strided_blocks.is_contiguous()
    got = dequantize_mxfp4(strided_blocks, scales, torch.bfloat16)
    assert torch.equal(bits(got), bits(dequantize_mxfp4(blocks, scales, torch.bfloat16, native=False)))


@pytest.mark.parametrize("native", PATHS)
def test_fp8_partial_blocks_take_their_blocks_scale(native):
    # DeepSeek-V3's kv_a_proj_with_mqa is [576, 7168] with [5, 56] scales (ceil): the last rows
    # form a partial block. Reference: the scale grid expanded element by element.
    gen = torch.Generator().manual_seed(2)
    values = (torch.randn(40, 37, generator=gen) * 4).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(3, 3, generator=gen) + 0.5
    full = scale_inv.repeat_interleave(16, 0)[:40].repeat_interleave(16, 1)[:, :37]
    want = (values.float() * full).to(torch.bfloat16)
    assert torch.equal(dequantize_fp8(values, scale_inv, (16, 16), torch.bfloat16, native=native), want)
    with pytest.raises(ValueError, match=r"need scales \(3, 3\), got \(2, 3\)"):
        dequantize_fp8(values, scale_inv[:2], (16, 16), torch.bfloat16, native=native)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("native", PATHS)
def test_scratch_buffers_are_reused(native, dtype):
    blocks, scales = all_mxfp4_codes()
    values = all_e4m3_values()
    scale_inv = torch.rand(3, 4, generator=torch.Generator().manual_seed(7)) + 0.5
    scratch = Scratch("cpu")
    first = dequantize_mxfp4(blocks, scales, dtype, scratch, key="w", native=native)
    first_fp8 = dequantize_fp8(values, scale_inv, (16, 16), dtype, scratch, key="v", native=native)
    ptrs, held = (first.data_ptr(), first_fp8.data_ptr()), scratch.nbytes
    kept = bits(first).clone(), bits(first_fp8).clone()
    for _ in range(3):
        second = dequantize_mxfp4(
            blocks.flip(0).contiguous(), scales.flip(0).contiguous(), dtype, scratch, "w", native=native
        )
        second_fp8 = dequantize_fp8(values, scale_inv.flip(0), (16, 16), dtype, scratch, "v", native=native)
        assert (second.data_ptr(), second_fp8.data_ptr()) == ptrs and scratch.nbytes == held  # no allocation
    assert not torch.equal(bits(first), kept[0]) and not torch.equal(bits(first_fp8), kept[1])  # overwritten


def test_registry_refuses_unknown_names_listing_the_valid_ones():
    assert set(ENCODINGS) == {"plain", "mxfp4", "fp8"}
    with pytest.raises(ValueError, match="unknown expert encoding 'nf4'; valid: plain, mxfp4, fp8"):
        get_encoding("nf4")


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        (
            ExpertTensor("w", "bfloat16", (64, 96), parts=(TensorLayout("w_blocks", "uint8", (96, 2, 16), 0),),
                         encoding="mxfp4", block_size=(1, 32), scale_layout="ue8m0", transposed=True),
            "expert tensor 'w'.*has stored parts",
        ),  # scales missing
        (
            ExpertTensor("w", "bfloat16", (64, 96), parts=(), encoding="mxfp4", block_size=(1, 16),
                         scale_layout="ue8m0", transposed=True),
            "block size must be|block size \\[1, 16\\]",
        ),
        (
            ExpertTensor("w", "bfloat16", (60, 96), parts=(), encoding="mxfp4", block_size=(1, 32),
                         scale_layout="ue8m0", transposed=True),
            "60 input features are not a multiple of 32",
        ),
        (
            ExpertTensor("w", "int8", (4, 4), parts=(TensorLayout("w", "int8", (4, 4), 0),)),
            "decodes to 'int8'",
        ),
        (
            ExpertTensor("w", "bfloat16", (64, 96), parts=(TensorLayout("w", "bfloat16", (64, 96), 0),),
                         transposed=True),
            "expert tensor 'w'.*has stored parts",
        ),  # transposed: the rows [96, 64] are stored
        (
            ExpertTensor("w", "bfloat16", (4, 8, 2), parts=(TensorLayout("w", "bfloat16", (2, 8, 4), 0),),
                         transposed=True),
            "plain tensor 'w' is transposed but \\[4, 8, 2\\] is not 2-D",
        ),
        (
            ExpertTensor("w", "bfloat16", (32, 32), parts=(TensorLayout("w", "float8_e4m3fn", (32, 32), 0),
                         TensorLayout("w_scale_inv", "float32", (2, 1), 0)), encoding="fp8",
                         block_size=(16, 16), scale_layout="float32"),
            "has stored parts",
        ),
    ],
)  # fmt: skip
def test_check_names_the_tensor(tensor, message):
    with pytest.raises(ValueError, match=message):
        check_tensor(tensor)


def test_manifest_round_trip_keeps_encodings_and_validates_them():
    tensors, blob_bytes = plan_blob(
        [
            get_encoding("mxfp4").plan("gate_up_proj", "bfloat16", (64, 128)),
            ("gate_up_proj_bias", "bfloat16", (128,)),
            get_encoding("fp8").plan("down_proj", "bfloat16", (64, 64), block_size=(16, 16)),
        ]
    )
    manifest = StoreManifest(
        model_type="gpt_oss",
        model_id="x",
        num_layers=1,
        moe_layers=(0,),
        num_experts=2,
        top_k=1,
        blob_bytes=blob_bytes,
        tensors=tensors,
        layer_files={0: "experts/layer_0000.bin"},
        checksums={0: (1, 2)},
    )
    manifest.validate()
    assert StoreManifest.from_json(manifest.to_json()) == manifest
    assert manifest.encodings == ("fp8", "mxfp4", "plain")
    assert [p.name for p in manifest.parts] == [
        "gate_up_proj_blocks",
        "gate_up_proj_scales",
        "gate_up_proj_bias",
        "down_proj",
        "down_proj_scale_inv",
    ]
    assert all(p.offset % 256 == 0 for p in manifest.parts)
    encoded = sum(p.nbytes for p in manifest.parts)
    assert encoded <= blob_bytes < encoded + 4 * 256 + 4096
    assert manifest.decoded_blob_bytes == 2 * (64 * 128 + 128 + 64 * 64)
    text = manifest.to_json().replace('"ue8m0"', '"e4m3"')
    with pytest.raises(DataLoss, match="gate_up_proj.*scale layout 'e4m3'"):
        StoreManifest.from_json(text)
    text = manifest.to_json().replace('"encoding": "fp8"', '"encoding": "nf4"')
    with pytest.raises(DataLoss, match="unknown expert encoding 'nf4'; valid: plain, mxfp4, fp8"):
        StoreManifest.from_json(text)


def test_overlapping_parts_are_data_loss():
    tensors, blob_bytes = plan_blob([("a", "float32", (64,)), ("b", "float32", (64,))])
    a, b = tensors
    moved = ExpertTensor(b.name, b.dtype, b.shape, parts=(TensorLayout("b", "float32", (64,), 0),))
    manifest = StoreManifest("m", "x", 1, (0,), 1, 1, blob_bytes, (a, moved), {0: "f"}, {0: (0,)})
    with pytest.raises(DataLoss, match="'a' and 'b' overlap"):
        manifest.validate()


def test_decode_bench_times_every_method_for_a_small_expert():
    from bench.decode_bench import ExpertShape, decode_times, methods_here

    times = decode_times(ExpertShape("tiny", 64, 96), repeats=1)
    assert set(times) == {"mxfp4", "fp8"}
    for per_method in times.values():
        assert set(per_method) == set(methods_here()) >= {"torch", "native"}
        assert all(ms > 0 for ms in per_method.values())
