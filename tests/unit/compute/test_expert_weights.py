"""The compute stage's input: arena slot views → one expert's compute-dtype weights."""

from __future__ import annotations

import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from compute_svc.experts.arena import Arena
from compute_svc.experts.weights import ExpertDecoder
from expertcache.encodings import get_encoding
from expertcache.manifest import plan_blob
from tests.stores import bits


def test_plain_weights_are_the_arena_views_themselves():
    tensors, blob = plan_blob([("gate_up_proj", "float32", (8, 4)), ("down_proj", "float32", (4, 4))])
    arena = Arena(torch.arange(2 * blob, dtype=torch.uint8).view(2, blob))
    views = arena.slot_views(1, tensors)
    decoder = ExpertDecoder(tensors, arena.device)
    weights = decoder.weights(views)
    assert decoder.scratch_bytes == 0 and decoder.scratch.nbytes == 0
    for name, view in views.items():
        assert weights[name].data_ptr() == view.data_ptr()  # no copy


def test_mxfp4_weights_are_decoded_into_reused_scratch():
    tensors, blob = plan_blob(
        [
            get_encoding("mxfp4").plan("gate_up_proj", "bfloat16", (64, 96)),
            ("gate_up_proj_bias", "bfloat16", (96,)),
        ]
    )
    gen = torch.Generator().manual_seed(0)
    slots = torch.randint(0, 256, (2, blob), dtype=torch.uint8, generator=gen)
    gate_up = tensors[0]
    scales = gate_up.parts[1]
    slots[:, scales.offset : scales.offset + scales.nbytes] = torch.randint(
        115, 135, (2, scales.nbytes), dtype=torch.uint8, generator=gen
    )
    arena = Arena(slots)
    decoder = ExpertDecoder(tensors, arena.device)
    assert decoder.scratch_bytes == 64 * 96 * 2  # one expert's decoded bf16 gate_up_proj
    seen = []
    for slot in (0, 1):
        views = arena.slot_views(slot, tensors)
        weights = decoder.weights(views)
        want = convert_moe_packed_tensors(
            views["gate_up_proj_blocks"][None], views["gate_up_proj_scales"][None], dtype=torch.bfloat16
        )[0]
        assert weights["gate_up_proj"].shape == (64, 96) and torch.equal(
            bits(weights["gate_up_proj"]), bits(want)
        )
        assert weights["gate_up_proj_bias"].data_ptr() == views["gate_up_proj_bias"].data_ptr()
        seen.append(weights["gate_up_proj"].data_ptr())
    assert seen[0] == seen[1]  # the same scratch for every expert
