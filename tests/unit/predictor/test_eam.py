"""EAM counting and the entry encoding: round trip and every way a blob can be corrupt."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from predictor_svc.eam import (
    HEADER_BYTES,
    MAGIC,
    EamShape,
    add_token,
    decode_eam,
    encode_eam,
    new_eam,
)
from predictor_svc.errors import CorruptEntry

SHAPE = EamShape(layers=3, experts=5, top_k=2)


def test_shape_validation_names_the_field():
    with pytest.raises(ValueError, match="EamShape.layers must be a positive int"):
        EamShape(0, 4, 2)
    with pytest.raises(ValueError, match=r"top_k \(5\) must not exceed experts \(4\)"):
        EamShape(2, 4, 5)


def test_add_token_counts_and_skips_unseen_layers():
    eam = new_eam(SHAPE)
    assert eam.dtype == np.uint32 and eam.shape == (3, 5)
    add_token(eam, np.array([[1, 3], [0, 1], [4, 2]]))
    add_token(eam, np.array([[1, 2], [-1, -1], [-1, -1]]))  # partial: layer 0 only
    expected = np.zeros((3, 5), dtype=np.uint32)
    expected[0, [1, 3]] += 1
    expected[1, [0, 1]] += 1
    expected[2, [4, 2]] += 1
    expected[0, [1, 2]] += 1
    np.testing.assert_array_equal(eam, expected)


def test_add_token_rejects_bad_input():
    eam = new_eam(SHAPE)
    with pytest.raises(ValueError, match=r"experts must be int \[3, top_k\]"):
        add_token(eam, np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="expert id 5 out of range for 5 experts"):
        add_token(eam, np.array([[5, 0], [0, 1], [0, 1]]))
    with pytest.raises(ValueError, match="integer array"):
        add_token(eam, np.zeros((3, 2), dtype=np.float32))


def test_round_trip():
    rng = np.random.default_rng(0)
    eam = rng.integers(0, 1000, size=(3, 5)).astype(np.uint32)
    blob = encode_eam(eam, tokens=777)
    assert blob[:4] == MAGIC and len(blob) == HEADER_BYTES + 3 * 5 * 4
    out, tokens = decode_eam(blob, SHAPE)
    np.testing.assert_array_equal(out, eam)
    assert out.dtype == np.uint32 and tokens == 777
    assert b"pickle" not in blob and not blob.startswith(b"\x80")


def _blob() -> bytes:
    return encode_eam(np.arange(15, dtype=np.uint32).reshape(3, 5), tokens=4)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda b: b[:10], "truncated: 10 bytes, the header alone is 24"),
        (lambda b: b"XXXX" + b[4:], "bad magic b'XXXX'"),
        (lambda b: b[:4] + struct.pack("<H", 9) + b[6:], "unknown version 9"),
        (lambda b: b[:-4], "does not match 3x5 uint32"),
        (lambda b: b + b"\0", "does not match 3x5 uint32"),
        (lambda b: b[:8] + struct.pack("<I", 0) + b[12:], "impossible shape 0x5"),
        (lambda b: b[:-1] + bytes([b[-1] ^ 1]), "checksum mismatch"),
    ],
)
def test_corrupt_blobs_name_the_problem(mutate, message):
    with pytest.raises(CorruptEntry, match=message) as info:
        decode_eam(mutate(_blob()), SHAPE)
    assert info.value.grpc_code == "DATA_LOSS"


def test_wrong_model_shape_is_corrupt():
    with pytest.raises(CorruptEntry, match="shape 3x5 does not match the model's 4x5"):
        decode_eam(_blob(), EamShape(4, 5, 2))
