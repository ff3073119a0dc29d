"""Offloaded generation equals the plain transformers model, for every supported architecture.

Per architecture: a tiny random checkpoint → the real converter → a real cache daemon process
whose arena holds about a quarter of the experts (so experts are evicted on every token) →
(1) an in-process engine on that daemon: forward logits ``assert_close`` to the plain model and
greedy tokens equal to ``model.generate``; (2) a real compute process: the same tokens through
the gRPC Generate stream.

Quantized checkpoints in their published layout (GPT-OSS MXFP4, DeepSeek-V3 block-FP8) are
served with their experts kept encoded in every tier; the reference is transformers' own load
of the same checkpoint on CPU, which dequantises it. GPT-OSS in block FP8 (transformers' own
quantiser's layout, ``<param>_scale_inv`` beside each stacked expert parameter) is the one its
loader does not dequantise (it reads the e4m3 values and drops the scales): there the reference
is that model with each expert parameter replaced by transformers' ``Fp8Dequantize`` of the
checkpoint's own tensors.
"""

from __future__ import annotations

import contextlib
import json
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from moe.cache.v1 import cache_pb2, cache_pb2_grpc
from moe.inference.v1 import inference_pb2
from transformers import AutoModelForCausalLM

from compute_svc.daemon.client import DaemonClient
from compute_svc.engine.generation import build_engine
from compute_svc.engine.requests import GenerationRequest
from devtools.tiny import SUPPORTED_ARCHS
from tests.decoding import greedy, plain_greedy, prepare
from tests.inference import generate_replies
from tests.procs import start_compute, start_daemon

pytestmark = pytest.mark.integration

PROMPT = list(range(5, 40))
NEW_TOKENS = 12
# fp32: the plain model runs grouped GEMMs over all experts, we run one GEMM per expert; only
# the summation order inside the matmuls differs (max |diff| observed ~1e-5 on O(1) logits).
TOL = dict(rtol=1e-4, atol=1e-4)


def quarter_of_experts(manifest) -> int:
    return max(1, manifest.num_blobs // 4) * manifest.blob_bytes


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
def test_offloaded_model_equals_plain_model(arch, tiny_store, tmp_path):
    check_offloaded_equals_plain(tiny_store(arch), tmp_path, TOL)


@pytest.mark.parametrize(
    ("arch", "config"),
    [
        ("gpt_oss", dict(quantization="mxfp4", intermediate_size=64, dtype=torch.bfloat16)),
        ("deepseek_v3", dict(quantization="fp8", dtype=torch.bfloat16)),
        # GPT-OSS's projections are [in, out]: block FP8 read by the fused kernel's axpy form
        ("gpt_oss", dict(quantization="fp8", intermediate_size=64, dtype=torch.bfloat16)),
    ],
    ids=["gpt_oss-mxfp4", "deepseek_v3-fp8", "gpt_oss-fp8"],
)
def test_quantized_checkpoint_served_encoded_equals_transformers(arch, config, tiny_store, tmp_path):
    tiny = tiny_store(arch, **config)
    assert {t.encoding for t in tiny.manifest.tensors if t.name == "down_proj"} == {config["quantization"]}
    check_offloaded_equals_plain(tiny, tmp_path, dict(rtol=1.6e-2, atol=1e-5))  # bf16 default


def stacked_fp8_dequantized(model, checkpoint) -> None:
    """Every stacked expert parameter of ``model`` that ``checkpoint`` stores in block FP8
    (``<param>`` + ``<param>_scale_inv``) set to transformers' Fp8Dequantize of it."""
    from safetensors.torch import load_file
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    raw = {}
    for shard in sorted(checkpoint.glob("*.safetensors")):
        raw.update(load_file(shard))
    params = dict(model.named_parameters())
    replaced = 0
    for name, values in raw.items():
        scales = raw.get(name + "_scale_inv")
        if scales is None or values.dim() != 3:
            continue
        param = params[name]
        with torch.no_grad():
            for e in range(values.shape[0]):
                param[e] = Fp8Dequantize(None)._dequantize_one(values[e], scales[e], output_dtype=param.dtype)
        replaced += 1
    assert replaced, "no stacked FP8 expert parameter in the checkpoint"


def check_offloaded_equals_plain(tiny, tmp_path, tol) -> None:
    plain = AutoModelForCausalLM.from_pretrained(tiny.checkpoint).eval()
    if tiny.manifest.source.get("expert_format") == "stacked,stacked-fp8":
        stacked_fp8_dequantized(plain, tiny.checkpoint)
    with torch.no_grad():
        want_logits = plain(input_ids=torch.tensor([PROMPT])).logits[0]
        want_tokens = plain.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False)
    want_tokens = want_tokens[0, len(PROMPT) :].tolist()

    daemon = start_daemon(
        tiny.store, tmp_path, device="cpu", device_budget_bytes=quarter_of_experts(tiny.manifest)
    )
    # The compute process starts (imports, loads) while the in-process engine is checked.
    pool = ThreadPoolExecutor(max_workers=1)
    starting = pool.submit(start_compute, tiny.store, daemon, tmp_path)
    client = DaemonClient.connect(daemon.address, connect_timeout_s=10, acquire_timeout_s=60)
    try:
        assert client.num_slots * 4 <= tiny.manifest.num_blobs
        engine = build_engine(str(tiny.store), client.attachment, client)
        torch.testing.assert_close(engine.forward_logits(PROMPT), want_logits, **tol)
        prepared = engine.requests.prepare(
            GenerationRequest(token_ids=tuple(PROMPT), max_new_tokens=NEW_TOKENS)
        )
        events = list(engine.generate(prepared))
        assert [e.token_id for e in events] == want_tokens
        decode = events[1:]
        assert sum(1 for e in decode if e.cache.misses) >= len(decode) // 2, (
            "expected eviction on most tokens"
        )

        compute = starting.result()
        replies = generate_replies(compute.address, PROMPT, NEW_TOKENS)
        assert [r.token_id for r in replies] == want_tokens
        assert replies[-1].finish_reason in (
            inference_pb2.FINISH_REASON_LENGTH,
            inference_pb2.FINISH_REASON_EOS,
        )

        with grpc.insecure_channel(daemon.address) as channel:
            stats = cache_pb2_grpc.ExpertCacheStub(channel).GetStats(cache_pb2.GetStatsRequest(), timeout=10)
        device = next(t for t in stats.tiers if t.tier == cache_pb2.TIER_DEVICE)
        assert device.evictions > 0 and stats.checksum_failures == 0
        # Every copy into the arena is one whole blob of encoded bytes (the slot size).
        assert device.bytes_in > 0 and device.bytes_in % tiny.manifest.blob_bytes == 0
    finally:
        client.close()
        if starting.exception() is None:
            starting.result().stop()
        pool.shutdown()
        daemon.stop()


@contextlib.contextmanager
def resident_engine(tiny, tmp_path, daemon_extra, budget_bytes=None):
    """A daemon whose arena holds every expert of ``tiny`` (or ``budget_bytes`` of them; run with
    ``daemon_extra``), a client of it and an engine through that client: (engine, client,
    manifest)."""
    manifest = tiny.manifest
    daemon = start_daemon(
        tiny.store,
        tmp_path,
        device="cpu",
        device_budget_bytes=budget_bytes or manifest.num_blobs * manifest.blob_bytes,
        extra=daemon_extra,
    )
    client = DaemonClient.connect(daemon.address, connect_timeout_s=10, acquire_timeout_s=60)
    try:
        yield build_engine(str(tiny.store), client.attachment, client), client, manifest
    finally:
        client.close()
        daemon.stop()


OURS = ["--eviction-policy", "activation-aware", "--prefetch"]
PLAIN_LRU = ["--eviction-policy", "lru", "--no-prefetch"]


@pytest.mark.parametrize(
    ("daemon_extra", "dtype", "path"),
    [
        # ours: the daemon wants the layers' signals, sent before each layer runs
        (OURS, torch.float32, "run_resident"),
        # plain LRU wants none: the kernel finds the layer's experts itself, layer by layer
        # (ExpertRuntime.resident_layer), or at bf16, where the dense half routes natively, with
        # the step's buffers bound once (ExpertRuntime.resident_layers)
        (PLAIN_LRU, torch.float32, "run_layer"),
        (PLAIN_LRU, torch.bfloat16, "run_layer"),
    ],
    ids=["signals", "no-signals", "no-signals-bf16"],
)
def test_layers_with_every_expert_resident_run_in_one_call_and_still_equal_the_plain_model(
    tiny_store, tmp_path, daemon_extra, dtype, path
):
    # An arena that holds every expert: the second generation of the same prompt finds each decode
    # layer's experts resident, and every such layer runs in one native call (pin, kernel,
    # combine into the residual, unpin: DaemonClient.run_resident, or DaemonClient.run_layer where
    # the daemon wants no signals); the tokens equal transformers'.
    tiny = tiny_store("gpt_oss") if dtype == torch.float32 else tiny_store("gpt_oss", dtype=dtype)
    want = plain_greedy(tiny.checkpoint, PROMPT, NEW_TOKENS, dtype)
    with resident_engine(tiny, tmp_path, daemon_extra) as (engine, client, manifest):
        calls = {"run_resident": [], "run_layer": []}
        for name, results in calls.items():
            original = getattr(client, name)

            def counted(*args, original=original, results=results, **kwargs):
                results.append(original(*args, **kwargs))
                return results[-1]

            setattr(client, name, counted)
        per_layer = []  # ExpertRuntime.resident_layer: the layer-by-layer way
        resident_layer = engine.runtime.resident_layer
        engine.runtime.resident_layer = lambda *args: per_layer.append(1) or resident_layer(*args)
        for _ in range(2):  # the second finds every expert resident
            for results in calls.values():
                results.clear()
            request = GenerationRequest(token_ids=tuple(PROMPT), max_new_tokens=NEW_TOKENS)
            events = list(engine.generate(engine.requests.prepare(request)))
            assert [e.token_id for e in events] == want
        resident = calls[path]
        top_k = json.loads((tiny.checkpoint / "config.json").read_text())["num_experts_per_tok"]
        if dtype == torch.bfloat16:  # one call a decode step: every layer of it, attention and experts
            assert len(resident) >= NEW_TOKENS - 1, calls
            assert set(resident) == {manifest.num_layers * top_k}, calls
        else:
            assert len(resident) >= (NEW_TOKENS - 1) * manifest.num_layers and all(resident), calls
        if path == "run_resident":
            assert not any(calls["run_layer"])  # tried, and refused: the daemon wants signals
        # bf16: the step's way only (the dense half's routing rows, bound once per step)
        assert (dtype == torch.bfloat16) == (not per_layer)
        assert all(e.cache.misses == 0 for e in events[1:])
        # Each decode token counts its layers' experts as hits, whichever call ran them.
        assert {e.cache.hits for e in events[1:]} == {manifest.num_layers * top_k}


@pytest.mark.parametrize("depth", [0, 2])
def test_spans_tell_a_daemon_that_wants_signals_each_layers_route_and_lookahead(tiny_store, tmp_path, depth):
    # bf16 GPT-OSS with every expert resident and a daemon that wants signals (ours): each decode
    # step's layers still run in one native span (DaemonClient.run_layer), which writes every
    # layer's route and, with layer-ahead on, its lookahead from the next layers' routers, as
    # ExpertRuntime.forward would send them: one route per layer and one lookahead per layer that
    # has a layer ahead, per decode token. The tokens equal transformers'.
    from compute_svc.experts.layer_ahead import LayerAheadPredictor

    tiny = tiny_store("gpt_oss", dtype=torch.bfloat16)
    want = plain_greedy(tiny.checkpoint, PROMPT, NEW_TOKENS, torch.bfloat16)
    with resident_engine(tiny, tmp_path, OURS) as (engine, client, manifest):
        if depth:
            engine.runtime.layer_ahead = LayerAheadPredictor(
                engine.loaded.model, engine.loaded.experts_modules, depth=depth
            )
        spans = []
        run_layer = client.run_layer
        client.run_layer = lambda layer, *args, **kw: (
            spans.append((layer, run_layer(layer, *args, **kw))) or spans[-1][1]
        )
        forwards = []
        forward = engine.runtime.forward
        engine.runtime.forward = lambda *args, **kw: forwards.append(1) or forward(*args, **kw)
        for _ in range(2):  # the second finds every expert resident
            spans.clear()
            forwards.clear()
            sent = client.signals_sent
            request = GenerationRequest(token_ids=tuple(PROMPT), max_new_tokens=NEW_TOKENS)
            events = list(engine.generate(engine.requests.prepare(request)))
            assert [e.token_id for e in events] == want
        layers = manifest.num_layers
        top_k = json.loads((tiny.checkpoint / "config.json").read_text())["num_experts_per_tok"]
        assert spans == [(0, layers * top_k)] * (NEW_TOKENS - 1), spans
        assert len(forwards) == layers  # the prefill's: no decode layer went through Python
        aheads = layers - 1 if depth else 0  # every layer but the last predicts
        # per decode token: a route per layer, a lookahead per layer with one ahead; the prefill
        # (Python's) sends the same, and the request's begin and end once each
        assert client.signals_sent - sent == NEW_TOKENS * (layers + aheads) + 2
        assert client.signals_dropped == 0


@pytest.mark.parametrize("span_demands", ["posted", "handed-back", "none"])
def test_a_steps_layers_in_one_call_demand_their_misses_or_hand_them_to_the_acquire(
    tiny_store, tmp_path, monkeypatch, span_demands
):
    # bf16 GPT-OSS, a quarter of the experts in the arena and a daemon that wants no signals: each
    # decode step's layers run in native spans (dense half and experts, DaemonClient.run_layer).
    # - "posted": a layer with a miss posts its demand and waits for it within the span, which goes
    #   on: one span per decode step, no layer left to ExpertRuntime.forward.
    # - "handed-back": every such wait ends at once (a time limit of 0), so the span hands the layer
    #   back with its hits pinned and its demand posted; the layer's acquire adopts them (one demand
    #   per such layer, no second) and the next span starts after it.
    # - "none" (no SpanDemand: no daemon thread serves the channel): the span stops at the miss and
    #   the acquire serves the layer.
    # A layer handed to forward goes straight to its acquire (trying it resident first would meet
    # the same miss). The tokens equal transformers' in every case.
    from compute_svc.daemon import transport

    make = transport.ChannelTransport.span_demand_locked
    if span_demands == "handed-back":
        monkeypatch.setattr(
            transport.ChannelTransport,
            "span_demand_locked",
            lambda self, timeout_s, deadline: make(self, 0.0, deadline),
        )
    elif span_demands == "none":
        monkeypatch.setattr(
            transport.ChannelTransport, "span_demand_locked", lambda self, timeout_s, deadline: None
        )
    tiny = tiny_store("gpt_oss", dtype=torch.bfloat16)
    want = plain_greedy(tiny.checkpoint, PROMPT, NEW_TOKENS, torch.bfloat16)
    quarter = quarter_of_experts(tiny.manifest)
    with resident_engine(tiny, tmp_path, PLAIN_LRU, quarter) as (engine, client, manifest):
        firsts = []
        run_layer = client.run_layer
        client.run_layer = lambda layer, *args, **kw: firsts.append(layer) or run_layer(layer, *args, **kw)
        missed = []  # per forward of a layer a span stopped at: whether it tried run_resident
        forward, run_resident = engine.runtime.forward, client.run_resident
        posted = []  # demands posted on the channel by Python (not by a span)
        post_locked = transport.ChannelTransport.post_locked
        monkeypatch.setattr(
            transport.ChannelTransport,
            "post_locked",
            lambda self, *a: posted.append(a[1]) or post_locked(self, *a),
        )

        posts = []  # per forward of a layer a span stopped at: the demands Python posted for it

        def forward_of_a_miss(*args, **kw):
            if not kw.get("missed"):
                return forward(*args, **kw)
            missed.append(False)
            before = len(posted)
            try:
                return forward(*args, **kw)
            finally:
                posts.append(len(posted) - before)

        def tried(*args):
            if missed:
                missed[-1] = True
            return run_resident(*args)

        engine.runtime.forward, client.run_resident = forward_of_a_miss, tried
        observed = []  # every layer's routing is observed once a forward, in order, whoever ran it
        engine.runtime.routing_observer = lambda layer, index, weights: observed.append(layer)
        events = list(
            engine.generate(
                engine.requests.prepare(GenerationRequest(token_ids=tuple(PROMPT), max_new_tokens=NEW_TOKENS))
            )
        )
        assert [e.token_id for e in events] == want
        assert sum(e.cache.misses for e in events[1:]) > 0
        if span_demands == "posted":
            assert firsts == [0] * (NEW_TOKENS - 1) and missed == [], (firsts, missed)  # one span a step
        else:
            assert 0 in firsts and any(first > 0 for first in firsts), firsts  # spans resumed past a miss
            assert missed and not any(missed), missed
            # Handed back: demanded once, by the span (the acquire adopts it); else by the acquire.
            assert posts == [0 if span_demands == "handed-back" else 1] * len(missed), posts
        assert observed == list(range(manifest.num_layers)) * NEW_TOKENS


@pytest.mark.parametrize("span_demands", ["posted", "handed-back"])
def test_a_span_that_stops_at_a_miss_has_told_the_daemon_that_layers_signals(
    tiny_store, tmp_path, monkeypatch, span_demands
):
    # bf16 GPT-OSS, a quarter of the experts in the arena, a daemon that wants signals (ours) and
    # layer-ahead on: a span demands a layer's misses having written that layer's route and
    # lookahead, and goes on ("posted"); where it hands the layer back ("handed-back": every wait
    # of a span ends at once), it stops there with them written, so ExpertRuntime.forward neither
    # predicts nor sends them for a decode layer (only the prefill, which runs no span, does); the
    # next span starts after it. The tokens equal transformers', and the daemon got every layer's
    # signals: one route per layer and one lookahead per layer with a layer ahead, per token.
    from compute_svc.daemon import transport
    from compute_svc.experts.layer_ahead import LayerAheadPredictor

    if span_demands == "handed-back":
        make = transport.ChannelTransport.span_demand_locked
        monkeypatch.setattr(
            transport.ChannelTransport,
            "span_demand_locked",
            lambda self, timeout_s, deadline: make(self, 0.0, deadline),
        )

    tiny = tiny_store("gpt_oss", dtype=torch.bfloat16)
    want = plain_greedy(tiny.checkpoint, PROMPT, NEW_TOKENS, torch.bfloat16)
    quarter = quarter_of_experts(tiny.manifest)
    with resident_engine(tiny, tmp_path, OURS, quarter) as (engine, client, manifest):
        runtime = engine.runtime
        runtime.layer_ahead = LayerAheadPredictor(engine.loaded.model, engine.loaded.experts_modules)
        firsts, predicted, sent_by_python = [], [], []
        run_layer = client.run_layer
        client.run_layer = lambda layer, *args, **kw: firsts.append(layer) or run_layer(layer, *args, **kw)
        predict_host = runtime.layer_ahead.predict_host
        runtime.layer_ahead.predict_host = lambda *args: predicted.append(1) or predict_host(*args)
        send_signals = runtime._send_signals
        runtime._send_signals = lambda *args: sent_by_python.append(1) or send_signals(*args)
        sent = client.signals_sent
        events = list(
            engine.generate(
                engine.requests.prepare(GenerationRequest(token_ids=tuple(PROMPT), max_new_tokens=NEW_TOKENS))
            )
        )
        assert [e.token_id for e in events] == want
        assert sum(e.cache.misses for e in events[1:]) > 0
        if span_demands == "posted":
            assert firsts == [0] * (NEW_TOKENS - 1), firsts  # one span a step
        else:
            assert any(first > 0 for first in firsts), firsts  # spans resumed past a miss
        layers = manifest.num_layers
        assert len(predicted) == len(sent_by_python) == layers  # the prefill's layers only
        assert client.signals_sent - sent == NEW_TOKENS * (layers + layers - 1) + 2
        assert client.signals_dropped == 0


def test_a_batch_of_resident_requests_runs_each_layer_in_one_call_and_decodes_as_each_alone(
    tiny_store, tmp_path
):
    # Two requests decoded in the same steps (2 rows a step: within the fused kernel's rows on every
    # SIMD path, which for GPT-OSS's bf16 experts, stored as [out, in] rows, is 2 on the avx512 and
    # amx paths) through the real daemon with every expert resident and no signals wanted: each
    # step's layers are one run_layer call over the two rows, and each request's tokens are what it
    # decodes alone.
    tiny = tiny_store("gpt_oss", dtype=torch.bfloat16)
    with resident_engine(tiny, tmp_path, PLAIN_LRU) as (engine, client, manifest):
        prompts = [PROMPT, [3, 8, 1, 44, 21, 6, 6, 9, 12, 30, 2]]
        alone = [greedy(engine, p, 6) for p in prompts]  # every expert they use is resident after
        runs = []
        run_layer = client.run_layer
        client.run_layer = lambda *args, **kw: runs.append(run_layer(*args, **kw)) or runs[-1]
        seqs = [engine.start(prepare(engine, p, 6)) for p in prompts]
        got = [[] for _ in prompts]
        for i, seq in enumerate(seqs):  # prefill each, then decode both in the same steps
            for _, event in engine.step([(seq, len(seq.pending))]):
                got[i].append(event.token_id)
        runs.clear()
        while not all(seq.done for seq in seqs):
            for s, event in engine.step([(seq, 1) for seq in seqs if not seq.done]):
                got[seqs.index(s)].append(event.token_id)
        for seq in seqs:
            engine.finish(seq, "length")
        assert got == alone
        assert len(runs) == 5 and all(runs), runs  # 5 steps of 2 rows
