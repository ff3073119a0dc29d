"""The binding of the native decode attention refuses what does not fit, naming it (its numerics
are tested against transformers in tests/unit/compute/test_decode_step.py)."""

from __future__ import annotations

import numpy as np
import pytest

from expertcache.native import DecodeAttention

H, HEADS, KV, D = 16, 2, 1, 8
SPEC = dict(
    hidden=H,
    heads=HEADS,
    kv_heads=KV,
    head_dim=D,
    dtype="float32",
    eps=1e-6,
    scaling=D**-0.5,
    norm="cast_then_weight",
    softmax="fused",
)


def layer(**changes):
    rng = np.random.default_rng(0)
    w = {
        "input_norm": np.ones(H, np.float32),
        "post_norm": np.ones(H, np.float32),
        "q": rng.standard_normal((HEADS * D, H), dtype=np.float32),
        "k": rng.standard_normal((KV * D, H), dtype=np.float32),
        "v": rng.standard_normal((KV * D, H), dtype=np.float32),
        "o": rng.standard_normal((H, HEADS * D), dtype=np.float32),
    }
    w.update(changes)
    return w


def attention(**spec):
    att = DecodeAttention({**SPEC, **spec})
    att.add_layer(layer())
    return att


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(dtype="int8"), "'int8' is not float32"),
        (dict(norm="layer"), "'layer' is not cast_then_weight"),
        (dict(softmax="flash"), "'flash' is not eager or fused"),
        (dict(heads=3, kv_heads=2), "multiple of the key/value heads"),
        (dict(head_dim=7), "head_dim is odd"),
        (dict(hidden=0), "a size is 0"),
    ],
)
def test_a_bad_spec_is_refused_by_name(change, message):
    with pytest.raises(ValueError, match=message):
        DecodeAttention({**SPEC, **change})


def test_a_layer_with_a_missing_or_misshapen_tensor_is_refused():
    att = DecodeAttention(SPEC)
    with pytest.raises(ValueError, match="has no 'q'"):
        att.add_layer({k: v for k, v in layer().items() if k != "q"})
    with pytest.raises(ValueError, match="o must hold 256 values"):
        att.add_layer(layer(o=np.zeros((H, 8), np.float32)))
    with pytest.raises(ValueError, match="q must hold float32 items"):
        att.add_layer(layer(q=np.zeros((HEADS * D, H), np.float16)))
    with pytest.raises(ValueError, match="sinks need the eager softmax"):
        att.add_layer(layer(sinks=np.zeros(HEADS, np.float32)))
    assert att.layers == 0


def step_args(rows=1, length=3, capacity=8):
    cache = [np.zeros((KV, capacity, D), np.float32) for _ in range(2 * rows)]
    return dict(
        h=np.ones((rows, H), np.float32),
        mlp_in=np.zeros((rows, H), np.float32),
        cos=np.ones((rows, D // 2), np.float32),
        sin=np.zeros((rows, D // 2), np.float32),
        keys=np.array([[c.ctypes.data for c in cache[:rows]]], np.int64),
        values=np.array([[c.ctypes.data for c in cache[rows:]]], np.int64),
        capacity=np.full((1, rows), capacity, np.int64),
        length=np.full(rows, length, np.int64),
    ), cache


def test_a_step_that_does_not_fit_is_refused_by_name():
    att = attention()
    with pytest.raises(ValueError, match="run before begin_step"):
        att.run(0)
    args, _ = step_args()
    with pytest.raises(ValueError, match="length 8 leaves no room in a capacity of 8"):
        att.begin_step(**{**args, "length": np.array([8], np.int64)})
    with pytest.raises(ValueError, match="cos must hold 4 values"):
        att.begin_step(**{**args, "cos": np.ones((1, D), np.float32)})
    with pytest.raises(ValueError, match="keys must hold 1 values"):
        att.begin_step(**{**args, "keys": np.zeros((1, 2), np.int64)})
    with pytest.raises(ValueError, match="a cache address is null"):
        att.begin_step(**{**args, "keys": np.zeros((1, 1), np.int64)})
    with pytest.raises(ValueError, match="mlp_in must be writable"):
        ro = args["mlp_in"].copy()
        ro.flags.writeable = False
        att.begin_step(**{**args, "mlp_in": ro})
    att.begin_step(**args)
    with pytest.raises(ValueError, match="no layer 1"):
        att.run(1)


def test_a_step_writes_its_key_and_value_at_the_length_and_updates_the_residual():
    att = attention()
    args, cache = step_args(length=3)
    att.begin_step(**args)
    att.run(0)
    att.end_step()
    keys, values = cache
    assert np.any(keys[0, 3] != 0) and np.any(values[0, 3] != 0)
    assert not np.any(keys[0, 4:]) and not np.any(values[0, 4:])
    assert np.any(args["h"] != 1.0) and np.any(args["mlp_in"] != 0.0)


def test_a_router_needs_its_spec_and_its_logits():
    with pytest.raises(ValueError, match="router_outputs > 0"):
        DecodeAttention(SPEC).add_layer(layer(router=np.ones((4, H), np.float32)))
    att = DecodeAttention({**SPEC, "router_outputs": 4})
    with pytest.raises(ValueError, match="has no 'router'"):
        att.add_layer(layer())
    att.add_layer(layer(router=np.ones((4, H), np.float32), router_bias=np.arange(4, dtype=np.float32)))
    args, _ = step_args()
    with pytest.raises(ValueError, match="logits are needed"):
        att.begin_step(**args)
    logits = np.zeros((1, 4), np.float32)
    att.begin_step(**args, logits=logits)
    att.run(0)
    # A router of ones: every logit is the sum of mlp_in, plus its bias.
    np.testing.assert_allclose(logits[0], args["mlp_in"][0].sum() + np.arange(4), rtol=1e-5)
    with pytest.raises(ValueError, match="no router"):
        attention().begin_step(**args, logits=logits)
