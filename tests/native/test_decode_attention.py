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


def test_a_router_top_k_needs_a_2_byte_dtype_a_small_k_and_its_buffers():
    from expertcache.native import router_top_k_supported

    for spec, message in (
        (dict(router_outputs=4, router_top_k=2), "router_top_k needs a 2-byte dtype and k < 8"),
        (dict(dtype="bfloat16", router_outputs=16, router_top_k=8), "k < 8"),
        (dict(dtype="bfloat16", router_outputs=4, router_top_k=5), "more than the router's outputs"),
    ):
        with pytest.raises(ValueError, match=message):
            DecodeAttention({**SPEC, **spec})
    assert router_top_k_supported("bfloat16", 4) and router_top_k_supported("float16", 7)
    assert not router_top_k_supported("float32", 4) and not router_top_k_supported("bfloat16", 8)
    args, _ = step_args()
    att = attention()
    with pytest.raises(ValueError, match="the spec asks for no top k"):
        att.begin_step(**args, top_ids=np.zeros(2, np.int64), top_scores=np.zeros(2, np.float32))
    att = router_attention("bfloat16", 8, 2)
    args, _cache = two_byte_step_args()
    with pytest.raises(ValueError, match="top_ids and top_scores are needed"):
        att.begin_step(**args, logits=np.zeros((1, 8), np.int16))
    with pytest.raises(ValueError, match="top_ids must hold 2 values"):
        att.begin_step(
            **args,
            logits=np.zeros((1, 8), np.int16),
            top_ids=np.zeros(3, np.int64),
            top_scores=np.zeros(2, np.int16),
        )


def router_attention(dtype: str, experts: int, k: int, bias: np.ndarray | None = None) -> DecodeAttention:
    """One layer of ``dtype`` whose router has zero weights: its logits are its bias exactly."""
    import torch

    att = DecodeAttention({**SPEC, "dtype": dtype, "router_outputs": experts, "router_top_k": k})
    tdtype = getattr(torch, dtype)
    weights = {
        name: torch.from_numpy(np.ascontiguousarray(value)).to(tdtype).view(torch.int16).numpy()
        for name, value in layer().items()
    }
    weights["router"] = np.zeros((experts, H), np.int16)
    weights["router_bias"] = np.zeros(experts, np.int16) if bias is None else bias
    att.add_layer(weights)
    return att


def two_byte_step_args() -> tuple[dict, list]:
    """``step_args`` with 2-byte rows (zeros); the caches, which the caller keeps alive."""
    args, cache = step_args()
    two_byte = {
        name: np.zeros(value.shape, np.int16) for name, value in args.items() if value.dtype == np.float32
    }
    return {**args, **two_byte}, cache


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize(("experts", "k"), [(32, 4), (32, 1), (8, 7), (128, 2)])
def test_the_routers_top_k_and_softmax_equal_torchs_bit_for_bit(dtype, experts, k):
    # GPT-OSS's router after its logits: torch.topk(logits, k), then torch.softmax(top, dim=1) in
    # the dtype. Ties (logits from a few values), infinities and NaN are where an order could
    # differ: the indices and the scores' bits must be torch's. (128 experts, k 2: torch's
    # partial_sort branch.)
    import torch

    tdtype = getattr(torch, dtype)
    bias = np.zeros(experts, np.int16)  # the logits, changed in place between steps
    att = router_attention(dtype, experts, k, bias)
    args, _cache = two_byte_step_args()
    rng = np.random.default_rng(experts * 10 + k)
    ids = np.zeros((1, 1, k), np.int64)
    scores = torch.zeros(1, 1, k, dtype=tdtype)
    logits = np.zeros((1, experts), np.int16)
    att.begin_step(**args, logits=logits, top_ids=ids, top_scores=scores.view(torch.int16).numpy())
    for case in range(3000):
        kind = case % 4
        if kind == 0:
            values = rng.standard_normal(experts) * 4
        elif kind == 1:
            values = rng.integers(-2, 2, experts).astype(np.float64)  # many ties
        elif kind == 2:
            values = rng.standard_normal(experts) * 0.01 + 1  # ties once rounded
        else:
            values = rng.standard_normal(experts)
            values[rng.integers(0, experts, 3)] = rng.choice([np.nan, np.inf, -np.inf], 3)
        want_logits = torch.from_numpy(values).to(tdtype)
        bias[:] = want_logits.view(torch.int16).numpy()
        for name in ("h", "mlp_in"):
            args[name][:] = 0
        att.run(0)
        got_logits = torch.from_numpy(logits.copy()).view(tdtype)[0]
        same = (got_logits == want_logits) | (torch.isnan(got_logits) & torch.isnan(want_logits))
        assert bool(same.all()), case  # the bias itself (NaN's bits aside)
        top, index = torch.topk(got_logits[None], k, dim=-1)
        want_scores = torch.softmax(top, 1)
        assert ids[0].tolist() == index.tolist(), (case, values)
        same = (scores[0] == want_scores) | (torch.isnan(scores[0]) & torch.isnan(want_scores))
        assert bool(same.all()), (case, values, scores[0], want_scores)
    att.end_step()


def test_the_head_is_the_final_norm_then_the_lm_head_and_is_refused_until_set_and_begun():
    V = 24
    rng = np.random.default_rng(5)
    norm = rng.standard_normal(H, dtype=np.float32)
    weight = rng.standard_normal((V, H), dtype=np.float32)
    bias = rng.standard_normal(V, dtype=np.float32)
    att = attention()
    args, _ = step_args(rows=2)
    logits = np.zeros((2, V), np.float32)
    with pytest.raises(ValueError, match="head before set_head"):
        att.head(logits)
    with pytest.raises(ValueError, match="the head needs 'norm' and 'weight'"):
        att.set_head({"weight": weight}, 1e-5)
    with pytest.raises(ValueError, match="weight must be \\[vocab, hidden 16\\]"):
        att.set_head({"norm": norm, "weight": weight[:, :8].copy()}, 1e-5)
    with pytest.raises(ValueError, match="bias must hold 24 values"):
        att.set_head({"norm": norm, "weight": weight, "bias": bias[:4].copy()}, 1e-5)
    att.set_head({"norm": norm, "weight": weight, "bias": bias}, 1e-5)
    assert att.vocab == V
    with pytest.raises(ValueError, match="head before begin_step"):
        att.head(logits)
    args["h"] = rng.standard_normal((2, H), dtype=np.float32)
    att.begin_step(**args)
    with pytest.raises(ValueError, match="logits must hold 48 values"):
        att.head(np.zeros((1, V), np.float32))
    att.head(logits)
    att.end_step()
    h = args["h"].astype(np.float64)
    normed = norm * (h / np.sqrt((h * h).mean(-1, keepdims=True) + 1e-5))  # cast_then_weight, float32 compute
    np.testing.assert_allclose(logits, normed @ weight.T + bias, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("hidden", [16, 80])  # 80: a last block of 16 inputs past the 64s
def test_bfloat16_projections_equal_float64_math_on_this_cpus_kernel(rows, hidden):
    """In bfloat16 the projections run on vdpbf16ps rows where the CPU has AVX-512 BF16 (the path
    says so), on the AVX2 kernel otherwise: the head's logits (the final norm, then the head's
    projection) are float64 math's within one bfloat16 rounding, for every row of a call of 1 to 9
    rows (the kernel takes rows 4 at a time)."""
    import torch

    from expertcache import native

    V = 40
    rng = np.random.default_rng(rows * 100 + hidden)
    att = DecodeAttention({**SPEC, "hidden": hidden, "dtype": "bfloat16"})
    want_path = "avx512-bf16" if "avx512-bf16" in native.FFN_PATHS else "avx2"
    assert att.path == want_path

    def bf16(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(torch.bfloat16)

    norm = bf16(rng.uniform(0.5, 1.5, hidden))
    weight = bf16(rng.standard_normal((V, hidden)))
    att.set_head({"norm": norm.view(torch.int16).numpy(), "weight": weight.view(torch.int16).numpy()}, 1e-5)
    args, _ = step_args(rows=rows)
    h = bf16(rng.standard_normal((rows, hidden)))
    args = {
        **args,
        "h": h.view(torch.int16).numpy(),
        "mlp_in": np.zeros((rows, hidden), np.int16),
        "cos": np.zeros((rows, D // 2), np.int16),
        "sin": np.zeros((rows, D // 2), np.int16),
        "keys": np.zeros((0, rows), np.int64),  # no layers: the head alone
        "values": np.zeros((0, rows), np.int64),
        "capacity": np.zeros((0, rows), np.int64),
    }
    logits = np.zeros((rows, V), np.int16)
    att.begin_step(**args)
    att.head(logits)
    att.end_step()
    got = torch.from_numpy(logits).view(torch.bfloat16).double()
    # cast_then_weight, as the kernel rounds: the normed row in bfloat16, then weight times it.
    x = h.double()
    normed = (x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    normed = (norm.double() * normed.double()).to(torch.bfloat16).double()
    want = normed @ weight.double().T
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
