"""The expert encodings registry: decoding equals transformers' own dequantisation bit for bit
(every MXFP4 code with every scale, every e4m3 value), layouts are checked, buffers are reused."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.finegrained_fp8 import Fp8Dequantize
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

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


def all_mxfp4_codes() -> tuple[torch.Tensor, torch.Tensor]:
    """blocks [256, 16, 16]: every byte in every row; scales [256, 16]: row r has scale byte r."""
    blocks = torch.arange(256, dtype=torch.uint8).reshape(1, 16, 16).expand(256, 16, 16).contiguous()
    scales = torch.arange(256, dtype=torch.uint8).reshape(256, 1).expand(256, 16).contiguous()
    return blocks, scales


@pytest.mark.parametrize("dtype", DTYPES)
def test_mxfp4_equals_transformers_for_every_code_and_scale(dtype):
    blocks, scales = all_mxfp4_codes()
    want = convert_moe_packed_tensors(blocks[None], scales[None], dtype=dtype)[0]  # [C, R]
    got = dequantize_mxfp4(blocks, scales, dtype)  # [R, C]
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


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_equals_transformers_for_every_value(dtype):
    # Every e4m3 byte (NaNs included) in every 16 x 16 block, with scales over a wide range.
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).reshape(16, 16).repeat(3, 4)
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        scale_inv = torch.exp(torch.randn(3, 4, generator=gen) * 8).float()
        want = Fp8Dequantize(None)._dequantize_one(values, scale_inv, output_dtype=dtype)
        got = dequantize_fp8(values, scale_inv, (16, 16), dtype)
        assert got.dtype == dtype and torch.equal(bits(got), bits(want))


def test_fp8_partial_blocks_take_their_blocks_scale():
    # DeepSeek-V3's kv_a_proj_with_mqa is [576, 7168] with [5, 56] scales (ceil): the last rows
    # form a partial block. Reference: the scale grid expanded element by element.
    gen = torch.Generator().manual_seed(2)
    values = (torch.randn(40, 37, generator=gen) * 4).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(3, 3, generator=gen) + 0.5
    full = scale_inv.repeat_interleave(16, 0)[:40].repeat_interleave(16, 1)[:, :37]
    want = (values.float() * full).to(torch.bfloat16)
    assert torch.equal(dequantize_fp8(values, scale_inv, (16, 16), torch.bfloat16), want)
    with pytest.raises(ValueError, match=r"need scales \(3, 3\), got \(2, 3\)"):
        dequantize_fp8(values, scale_inv[:2], (16, 16), torch.bfloat16)


def test_scratch_buffers_are_reused():
    blocks, scales = all_mxfp4_codes()
    scratch = Scratch("cpu")
    first = dequantize_mxfp4(blocks, scales, torch.bfloat16, scratch, key="w")
    ptr, held = first.data_ptr(), scratch.nbytes
    second = dequantize_mxfp4(
        blocks.flip(0).contiguous(), scales.flip(0).contiguous(), torch.bfloat16, scratch, "w"
    )
    assert second.data_ptr() == ptr and scratch.nbytes == held  # nothing allocated per expert
    assert not torch.equal(bits(first), bits(dequantize_mxfp4(blocks, scales, torch.bfloat16)))  # overwritten


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
