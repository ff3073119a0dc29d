"""Lookahead: the next MoE layers' routers on the current MoE input, one prediction per depth, all
sent before the current layer's experts run."""

from __future__ import annotations

import pytest
import torch

from compute_svc.engine.generation import GenerationEngine
from compute_svc.engine.model_loader import load_model
from compute_svc.engine.requests import GenerationRequest
from compute_svc.errors import FailedPrecondition
from compute_svc.experts.arena import Arena
from compute_svc.experts.layer_ahead import LayerAheadPredictor, accuracy, find_router
from compute_svc.experts.moe import ExpertRuntime, attach
from tests.providers import LocalProvider


class SignalProvider(LocalProvider):
    """LocalProvider that also records the one-way signals compute sends the daemon."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.signals: list[tuple] = []
        self.request_ids: set[str] = set()  # named by routed / layer_ahead

    def begin_request(self, request_id):
        self.signals.append(("begin", request_id))

    def end_request(self, request_id):
        self.signals.append(("end", request_id))

    def routed(self, request_id, token, layer, experts, *, with_acquire=False):
        assert with_acquire  # the runtime acquires right after: the signals may ride with it
        self.request_ids.add(request_id)
        self.signals.append(("routed", token, layer, tuple(experts)))

    def layer_ahead(self, request_id, token, predictions, *, with_acquire=False):
        assert with_acquire
        self.request_ids.add(request_id)
        for p in predictions:
            assert len(p.experts) == len(p.scores)
            assert all(0.0 <= s <= 1.0 for s in p.scores)
            assert list(p.scores) == sorted(p.scores, reverse=True)
        self.signals.append(
            ("ahead", token, tuple((p.layer, p.depth, tuple(p.experts)) for p in predictions))
        )


def signal_engine(tiny, *, layer_ahead=True, depth=1):
    manifest = tiny.manifest
    arena = Arena(torch.zeros(manifest.num_blobs, manifest.blob_bytes, dtype=torch.uint8))
    provider = SignalProvider(tiny.store, manifest, arena)
    loaded = load_model(tiny.store, manifest, torch.device("cpu"))
    runtime = ExpertRuntime(provider, arena, manifest.tensors)
    attach(loaded.model, loaded.experts_modules, runtime)
    if layer_ahead:
        runtime.layer_ahead = LayerAheadPredictor(loaded.model, loaded.experts_modules, depth=depth)
    return GenerationEngine(loaded, runtime, max_new_tokens_limit=64), provider


def depth_two_predictor(tiny):
    """The tiny model loaded on the CPU, a predictor of depth 2 over it, and its MoE layers."""
    loaded = load_model(tiny.store, tiny.manifest, torch.device("cpu"))
    predictor = LayerAheadPredictor(loaded.model, loaded.experts_modules, depth=2)
    return loaded, predictor, [layer for layer, _ in loaded.experts_modules]


ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "gpt_oss")


@pytest.mark.parametrize("arch", ARCHS)
def test_prediction_is_the_next_layers_own_router(arch, tiny_store):
    # find_router picks the sibling with a [E, H] weight; the prediction must equal calling the
    # next block's router exactly as the model does (bias, correction bias, groups included).
    tiny = tiny_store(arch)
    loaded, predictor, layers = depth_two_predictor(tiny)
    assert predictor.layers == tuple(layers[:-1])
    assert predictor.next_layer(layers[-1]) is None
    assert predictor.ahead(layers[0]) == tuple(layers[1:3]) and predictor.ahead(layers[-2]) == (layers[-1],)
    torch.manual_seed(1)
    x = torch.randn(1, loaded.config.hidden_size)
    xs = torch.randn(5, loaded.config.hidden_size)
    with torch.inference_mode():
        predictions = predictor.predict(layers[0], x)
        unions = predictor.predict(layers[0], xs)
    assert [p.depth for p in predictions] == list(range(1, len(predictor.ahead(layers[0])) + 1))
    for depth, (prediction, union) in enumerate(zip(predictions, unions, strict=True), start=1):
        next_module = loaded.experts_modules[depth][1]
        block = next(m for m in loaded.model.modules() if any(c is next_module for c in m.children()))
        router = find_router(block, next_module)
        assert tuple(router.weight.shape) == (tiny.manifest.num_experts, loaded.config.hidden_size)
        with torch.inference_mode():
            _, weights, indices = router(x)
            _, _, idx = router(xs)
        assert prediction.layer == layers[depth] and prediction.depth == depth
        assert sorted(prediction.experts) == sorted(indices[0].tolist())
        assert sum(prediction.scores) == pytest.approx(1.0, abs=1e-5)
        # Prefill: the union over tokens.
        assert union.layer == layers[depth] and union.depth == depth
        assert set(union.experts) == set(idx.flatten().tolist())
        assert len(union.experts) == len(set(union.experts))
    assert predictor.predict(layers[-1], x) == ()
    with pytest.raises(ValueError, match="lookahead depth must be >= 1, got 0"):
        LayerAheadPredictor(loaded.model, loaded.experts_modules, depth=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_host_path_predicts_what_the_device_path_does(arch, tiny_store):
    # On a CPU device compute takes predict_host (no dense scores, no packing for a transfer):
    # per request and depth, the same experts in the same order with the same scores as
    # predict_device's finished predictions, for a decode step of 3 requests and for a step whose
    # requests have several rows (the union over their rows).
    tiny = tiny_store(arch)
    loaded, predictor, layers = depth_two_predictor(tiny)
    torch.manual_seed(2)
    for rows, segments in ((3, [(0, 1), (1, 1), (2, 1)]), (7, [(0, 4), (4, 1), (5, 2)])):
        x = torch.randn(rows, loaded.config.hidden_size)
        for layer in layers:
            with torch.inference_mode():
                host = predictor.predict_host(layer, x, segments)
                pending = predictor.predict_device(layer, x, segments)
            if pending is None:
                assert host is None and layer == layers[-1]
                continue
            device = pending.finish(pending.scores.numpy())
            assert len(host) == len(device) == len(segments)
            for got, want in zip(host, device, strict=True):
                assert [(p.layer, p.depth, p.experts) for p in got] == [
                    (p.layer, p.depth, p.experts) for p in want
                ]
                for p, q in zip(got, want, strict=True):
                    assert p.scores == pytest.approx(q.scores, rel=1e-6, abs=1e-7)


def test_two_router_candidates_are_refused():
    experts = torch.nn.Module()
    experts.num_experts = 4
    block = torch.nn.Module()
    block.experts = experts
    block.gate = torch.nn.Linear(8, 4, bias=False)
    block.other = torch.nn.Linear(8, 4, bias=False)
    with pytest.raises(
        FailedPrecondition, match=r"has 2 router candidates \['gate', 'other'\].*--no-layer-ahead"
    ):
        find_router(block, experts)
    del block.other
    del block.gate
    with pytest.raises(FailedPrecondition, match="has 0 router candidates"):
        find_router(block, experts)


def test_a_router_that_breaks_the_contract_is_refused():
    class Gate(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(4, 8))

        def forward(self, x):
            return x @ self.weight.T  # logits only

    class Experts(torch.nn.Module):
        num_experts = 4

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = Gate()
            self.experts = Experts()

    model = torch.nn.Module()
    model.a = Block()
    model.b = Block()
    with pytest.raises(
        FailedPrecondition, match=r"does not return \(logits, weights \[T, K\], indices \[T, K\]\)"
    ):
        LayerAheadPredictor(model, [(0, model.a.experts), (1, model.b.experts)])


def test_accuracy_is_recall_of_the_true_set():
    assert accuracy([1, 2, 3, 4], [4, 3, 9, 8]) == 0.5
    assert accuracy([], [1]) == 0.0
    assert accuracy([5], []) == 1.0


@pytest.mark.parametrize("arch", ["gpt_oss", "deepseek_v2"])
def test_runtime_sends_routing_and_layer_ahead_before_each_layer(arch, tiny_store):
    tiny = tiny_store(arch)
    engine, provider = signal_engine(tiny, depth=2)
    moe_layers = list(tiny.manifest.moe_layers)
    prompt = [3, 4, 5, 6]
    # Capture each MoE layer's input and routing to check the predictions against.
    seen: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    for layer, module in engine.loaded.experts_modules:
        module.register_forward_pre_hook(
            lambda m, args, layer=layer: seen.append((layer, args[0].clone(), args[1].clone()))
        )
    events = list(
        engine.generate(engine.requests.prepare(GenerationRequest(token_ids=tuple(prompt), max_new_tokens=3)))
    )
    assert len(events) == 3
    assert provider.signals[0][0] == "begin" and provider.signals[-1] == ("end", provider.signals[0][1])
    assert provider.request_ids == {provider.signals[0][1]}  # every message names the request
    body = provider.signals[1:-1]
    routed = [s for s in body if s[0] == "routed"]
    ahead = [s for s in body if s[0] == "ahead"]
    # Three forwards (prefill + 2 decode), every MoE layer routed once per forward.
    assert len(routed) == 3 * len(moe_layers)
    assert len(ahead) == 3 * (len(moe_layers) - 1)
    positions = [len(prompt) - 1, len(prompt), len(prompt) + 1]
    assert [s[1] for s in routed] == [p for p in positions for _ in moe_layers]
    for (_, _token, layer, experts), (seen_layer, _, index) in zip(routed, seen, strict=True):
        assert layer == seen_layer
        assert experts == tuple(sorted(set(index.flatten().tolist())))
    # Layer l's one message predicts l+1 (depth 1) and l+2 (depth 2), before l+1 is routed, and
    # equals those layers' routers on l's input.
    predictor = engine.runtime.layer_ahead
    inputs = {(i // len(moe_layers), layer): x for i, (layer, x, _) in enumerate(seen)}
    for n, (_, token, preds) in enumerate(ahead):
        forward, i = divmod(n, len(moe_layers) - 1)
        assert token == positions[forward]
        assert [(layer, depth) for layer, depth, _ in preds] == [
            (moe_layers[i + d], d) for d in (1, 2) if i + d < len(moe_layers)
        ]
        with torch.inference_mode():
            expected = predictor.predict(moe_layers[i], inputs[(forward, moe_layers[i])])
        assert [experts for _, _, experts in preds] == [p.experts for p in expected]
        assert body.index(("ahead", token, preds)) < body.index(
            next(s for s in routed if s[1] == token and s[2] == moe_layers[i + 1])
        )
    assert engine.runtime.counters.layer_ahead_s >= 0.0


def test_no_layer_ahead_still_reports_routing(tiny_store):
    engine, provider = signal_engine(tiny_store("mixtral"), layer_ahead=False)
    list(engine.generate(engine.requests.prepare(GenerationRequest(token_ids=(3, 4), max_new_tokens=2))))
    kinds = {s[0] for s in provider.signals}
    assert kinds == {"begin", "end", "routed"}
