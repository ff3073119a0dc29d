"""Forced routing (benchmark feature): the runtime computes the trace's experts, not the router's."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from compute_svc.engine.kv_cache import cache_keyword
from compute_svc.engine.requests import GenerationRequest
from compute_svc.errors import InvalidArgument
from compute_svc.experts.layer_ahead import Prediction
from compute_svc.experts.moe import StepSegment
from replay.forced_routing import ForcedRouting, load_trace, uniform, uniform_many
from tests.traces import write_trace

TOL = dict(rtol=1e-4, atol=1e-4)


def test_trace_shape_mismatch_names_both_shapes(tmp_path):
    trace = load_trace(write_trace(tmp_path / "t.npz", [4], layers=3, experts=8, top_k=2))
    with pytest.raises(
        InvalidArgument,
        match=r"has 3 MoE layers x 8 experts, top-2 but the model has 24 MoE layers x 32 experts, top-4",
    ):
        ForcedRouting(trace, list(range(24)), 32, 4)
    with pytest.raises(InvalidArgument, match=r"force_routing_request 5 is out of range \[0, 1\)"):
        ForcedRouting(trace, [0, 1, 2], 8, 2, first_request=5)


@pytest.mark.parametrize(
    ("write", "message"),
    [
        (None, "force_routing_path '.*bad.npz' does not exist"),
        (lambda path: path.write_bytes(b"not a zip"), "is not a routing trace"),
        (
            lambda path: np.savez(path, expert_ids=np.zeros((2, 3, 2), np.int8)),
            r"lacks \['req_offsets', 'meta_json'\]",
        ),
        (
            lambda path: np.savez(
                path,
                expert_ids=np.zeros((2, 3, 2), np.int8),
                req_offsets=[0, 2],
                meta_json=json.dumps({"num_experts": 8}),
            ),
            "lacks gate_weights: forced routing needs the router weights",
        ),
    ],
    ids=["missing", "junk", "partial", "unweighted"],
)
def test_bad_trace_files(tmp_path, write, message):
    path = tmp_path / "bad.npz"
    if write is not None:
        write(path)
    with pytest.raises(InvalidArgument, match=message):
        load_trace(path)


def test_requests_cycle_and_rows_wrap(tmp_path):
    # Request 1 is prefill only (no decode rows): skipped. Request 2 has one prefill row.
    trace = load_trace(write_trace(tmp_path / "t.npz", [3, 2, 4], decode_start=[0, 2, 1]))
    forced = ForcedRouting(trace, [0, 1, 2], 8, 2, first_request=2)
    assert forced.begin_request("a") == 2
    assert [forced.row("a", s) for s in range(5)] == [6, 7, 8, 6, 7]  # rows 5 (prefill) skipped, wrap after 3
    assert forced.begin_request("b") == 0
    assert forced.begin_request("c") == 2  # 1 has no decode rows
    assert forced.begin_request("d") == 0
    # Requests batched together each keep their own trace request.
    assert (forced.request_of("a"), forced.request_of("b"), forced.request_of("c")) == (2, 0, 2)
    assert forced.row("b", 1) == 1
    forced.end_request("a")
    assert forced.request_of("a") == 2  # a new request of that id takes the next one


def test_a_decode_steps_routing_at_once_is_what_each_layer_is_given(tmp_path):
    # step_routing: a one-request, one-token forward's rows of every MoE layer [L, 1, K], the
    # same values routing() gives layer by layer; None for several requests or several tokens.
    trace = load_trace(write_trace(tmp_path / "t.npz", [3, 2, 4], decode_start=[0, 2, 1]))
    forced = ForcedRouting(trace, [0, 1, 2], 8, 2)
    forced.begin_request("a")
    router_index = torch.zeros(1, 2, dtype=torch.int64)
    router_weights = torch.zeros(1, 2, dtype=torch.bfloat16)
    for step in range(4):
        seg = StepSegment("a", 0, 1, 10 + step, step)
        index, weights = forced.step_routing([seg], torch.device("cpu"), torch.bfloat16)
        assert tuple(index.shape) == tuple(weights.shape) == (3, 1, 2) and weights.dtype == torch.bfloat16
        for layer in range(3):
            want_index, want_weights = forced.routing([seg], layer, router_index, router_weights)
            assert torch.equal(index[layer], want_index) and torch.equal(weights[layer], want_weights)
        assert index[:, 0].tolist() == trace.expert_ids[forced.row("a", step)].tolist()
    forced.begin_request("b")
    two = [StepSegment("a", 0, 1, 20, 4), StepSegment("b", 1, 1, 5, 0)]
    assert forced.step_routing(two, torch.device("cpu"), torch.bfloat16) is None
    assert forced.step_routing([StepSegment("a", 0, 2, 20, 0)], torch.device("cpu"), torch.bfloat16) is None


def test_modelled_layer_ahead_keeps_the_stated_share(tmp_path):
    trace = load_trace(write_trace(tmp_path / "t.npz", [200], experts=8, top_k=2))
    router = Prediction(layer=1, experts=(0, 1), scores=(0.6, 0.4))
    for acc, lo, hi in ((1.0, 1.0, 1.0), (0.0, 0.0, 0.0), (0.5, 0.4, 0.6)):
        forced = ForcedRouting(trace, [0, 1, 2], 8, 2, layer_ahead_accuracy=acc)
        forced.begin_request("r")
        kept = []
        for step in range(200):
            p = forced.layer_ahead(StepSegment("r", 0, 1, step, step), router)
            truth = set(forced.experts("r", step, 1).tolist())
            assert len(set(p.experts)) == 2 and p.layer == 1
            kept.append(len(truth & set(p.experts)) / 2)
        assert lo <= np.mean(kept) <= hi
    with pytest.raises(InvalidArgument, match=r"accuracy 1.5 is out of range \[0, 1\]"):
        ForcedRouting(trace, [0, 1, 2], 8, 2, layer_ahead_accuracy=1.5)
    with pytest.raises(InvalidArgument, match=r"force_routing_accuracy_drop_per_depth -0.1 is out of range"):
        ForcedRouting(trace, [0, 1, 2], 8, 2, accuracy_drop_per_depth=-0.1)


def test_modelled_lookahead_loses_accuracy_by_depth(tmp_path):
    trace = load_trace(write_trace(tmp_path / "t.npz", [400], layers=3, experts=8, top_k=2))
    forced = ForcedRouting(trace, [0, 1, 2], 8, 2, layer_ahead_accuracy=0.9, accuracy_drop_per_depth=0.4)
    forced.begin_request("r")
    assert [forced.accuracy(d) for d in (1, 2, 3, 4)] == [0.9, pytest.approx(0.5), pytest.approx(0.1), 0.0]
    kept = {1: [], 2: []}
    for step in range(400):
        for depth in (1, 2):
            segment = StepSegment("r", 0, 1, step, step)
            p = forced.layer_ahead(
                segment, Prediction(layer=2, experts=(0, 1), scores=(0.6, 0.4), depth=depth)
            )
            assert p.depth == depth and p.layer == 2
            kept[depth].append(len(set(forced.experts("r", step, 2).tolist()) & set(p.experts)) / 2)
    assert 0.85 <= np.mean(kept[1]) <= 0.95 and 0.42 <= np.mean(kept[2]) <= 0.58


def test_uniform_many_draws_what_uniform_draws():
    rng = np.random.default_rng(1)
    fields = rng.integers(0, 1 << 62, size=(64, 3), dtype=np.int64)
    fields[0] = (0, 0, 0)
    fields[1] = ((1 << 62) + 5, 1, 7)
    prefix = (3, 1 << 63, 17)
    got = uniform_many(prefix, fields)
    want = [uniform((*prefix, *row[:-1]), row[-1]) for row in fields.tolist()]
    assert got.dtype == np.float64 and got.tolist() == want
    assert uniform_many((), fields[:, 2:]).tolist() == [uniform((), int(k)) for k in fields[:, 2]]


def modelled_reference(forced, trace, request, step, row, moe_index, layer, depth, seed):
    """The modelled prediction drawn one expert at a time, as the module doc states it."""
    truth = trace.expert_ids[row, moe_index].tolist()
    weights = trace.gate_weights[row, moe_index].tolist()
    key = (seed, request, step, layer, depth)
    others = [e for e in range(trace.num_experts) if e not in set(truth)]
    experts = []
    for k, expert in enumerate(truth):
        if uniform(key, k) < forced.accuracy(depth) or not others:
            experts.append(expert)
        else:
            experts.append(others.pop(int(uniform(key, len(truth) + k) * len(others))))
    scores = [min(1.0, max(0.0, w)) for w in weights]
    order = sorted(range(len(truth)), key=lambda i: -scores[i])
    return [experts[i] for i in order], [scores[i] for i in order]


@pytest.mark.parametrize("accuracy, drop", [(0.6, 0.2), (0.0, 0.0), (1.0, 0.0)])
def test_a_steps_lookahead_at_once_is_each_prediction_drawn_alone(tmp_path, accuracy, drop):
    layers, depth = 5, 3
    trace = load_trace(write_trace(tmp_path / "t.npz", [40, 30], layers=layers, experts=9, top_k=3, seed=4))
    moe_layers = [1, 3, 4, 6, 8]  # decoder layers; the trace's are MoE indices
    forced = ForcedRouting(
        trace, moe_layers, 9, 3, layer_ahead_accuracy=accuracy, accuracy_drop_per_depth=drop, seed=11
    )
    ahead = []
    for j in range(layers):
        ahead += [moe_layers[j + d] if j + d < layers else -1 for d in range(1, depth + 1)]
    wrong = 0
    for request_id in ("a", "b"):
        request = forced.begin_request(request_id)
        for step in range(0, 45, 4):
            segment = StepSegment(request_id, 0, 1, step, step)
            ids, scores = forced.step_lookahead([segment], ahead, depth)
            assert ids.shape == scores.shape == (layers, depth, 3) and scores.dtype == np.float32
            row = forced.row(request_id, step)
            for i, target in enumerate(ahead):
                got_ids, got_scores = ids[i // depth, i % depth], scores[i // depth, i % depth]
                if target < 0:
                    assert not got_ids.any() and not got_scores.any()
                    continue
                d = i % depth + 1
                want_ids, want_scores = modelled_reference(
                    forced, trace, request, step, row, moe_layers.index(target), target, d, 11
                )
                assert got_ids.tolist() == want_ids
                assert got_scores.tolist() == np.float32(want_scores).tolist()
                single = forced.layer_ahead(segment, Prediction(layer=target, experts=(), scores=(), depth=d))
                assert list(single.experts) == want_ids and list(single.scores) == want_scores
                wrong += len(set(want_ids) - set(trace.expert_ids[row, moe_layers.index(target)].tolist()))
    assert (wrong == 0) == (accuracy == 1.0)
    with pytest.raises(InvalidArgument, match="step_lookahead names layer 2, which is not a MoE layer"):
        forced.step_lookahead([StepSegment("a", 0, 1, 50, 50)], [3, 2, -1], 1)


def test_a_request_id_begun_again_draws_for_its_new_trace_request(tmp_path):
    trace = load_trace(write_trace(tmp_path / "t.npz", [10, 10], layers=3, experts=9, top_k=3, seed=5))
    forced = ForcedRouting(trace, [0, 1, 2], 9, 3, layer_ahead_accuracy=0.5, seed=2)
    segment = StepSegment("a", 0, 1, 4, 4)
    drawn = []
    for _ in range(2):  # the same id, step and layer, for trace requests 0 then 1
        request = forced.begin_request("a")
        got = forced.layer_ahead(segment, Prediction(layer=2, experts=(), scores=(), depth=1))
        want, _ = modelled_reference(forced, trace, request, 4, forced.row("a", 4), 2, 2, 1, 2)
        assert list(got.experts) == want
        drawn.append(want)
        forced.end_request("a")
    assert drawn[0] != drawn[1]


def plain_forced_logits(checkpoint, ids_per_step, trace, request, moe_layers):
    """The plain transformers model, its routers patched to return the trace's rows: the reference."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    start, _ = trace.decode_rows(request)
    state = {"step": 0}
    for j, layer in enumerate(moe_layers):
        block = model.model.layers[layer].mlp
        name = "router" if hasattr(block, "router") else "gate"
        router = getattr(block, name)
        original = router.forward

        def forward(hidden_states, original=original, j=j):
            logits, weights, _ = original(hidden_states)
            tokens = logits.shape[0]
            row = start + state["step"]
            index = torch.from_numpy(trace.expert_ids[row, j].astype(np.int64)).expand(tokens, -1)
            w = torch.from_numpy(trace.gate_weights[row, j].astype(np.float32)).to(weights.dtype)
            return logits, w.expand(tokens, -1), index

        router.forward = forward
    outputs, past, keyword = [], None, cache_keyword(model)
    with torch.no_grad():
        for step, ids in enumerate(ids_per_step):
            state["step"] = step
            out = model(input_ids=torch.tensor([ids]), use_cache=True, **{keyword: past})
            past = out[keyword]  # the output names the cache as the forward's keyword does
            outputs.append(out.logits[0, -1])
    return outputs


@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss"])
def test_runtime_computes_the_forced_experts(arch, tiny_store, local_engine, tmp_path):
    engine, provider, tiny = local_engine(arch)
    manifest = tiny.manifest
    trace = load_trace(
        write_trace(
            tmp_path / "t.npz",
            [2, 6],
            layers=len(manifest.moe_layers),
            experts=manifest.num_experts,
            top_k=manifest.top_k,
        )
    )
    forced = ForcedRouting(trace, manifest.moe_layers, manifest.num_experts, manifest.top_k, first_request=1)
    engine.runtime.routing_override = forced
    prompt = (3, 4, 5)
    seen = []
    original_begin = forced.begin_request
    forced.begin_request = lambda rid: seen.append(original_begin(rid)) or seen[-1]
    events = list(
        engine.generate(
            engine.requests.prepare(GenerationRequest(token_ids=prompt, max_new_tokens=4, request_id="a"))
        )
    )
    assert seen == [1]
    # Every acquire asked exactly for the trace's experts of that forward and layer.
    per_forward = len(manifest.moe_layers)
    acquires = provider.acquires[-4 * per_forward :]
    start, _ = trace.decode_rows(1)
    for n, (layer, experts) in enumerate(acquires):
        step, j = divmod(n, per_forward)
        assert layer == manifest.moe_layers[j]
        assert sorted(experts) == sorted(trace.expert_ids[start + step, j].tolist())
    # The generated tokens are those of the plain model forced the same way (a direct computation).
    ids = [list(prompt)] + [[e.token_id] for e in events[:-1]]
    reference = plain_forced_logits(tiny.checkpoint, ids, trace, 1, manifest.moe_layers)
    assert [e.token_id for e in events] == [int(r.argmax()) for r in reference]
    # Each new Generate takes the next trace request (wrapping after the last).
    list(
        engine.generate(
            engine.requests.prepare(GenerationRequest(token_ids=prompt, max_new_tokens=1, request_id="b"))
        )
    )
    assert seen == [1, 0]
    first, _ = trace.decode_rows(0)
    assert sorted(provider.acquires[-1][1]) == sorted(
        trace.expert_ids[first, len(manifest.moe_layers) - 1].tolist()
    )


def test_config_fields_and_their_bounds():
    from compute_svc.config import ENV_PREFIX, ComputeConfig
    from expertcache.config_loader import load_config
    from replay.forced_compute import ForcedRoutingConfig

    config = load_config(ComputeConfig, cli={"store_dir": "s"}, env={}, env_prefix=ENV_PREFIX)
    assert config.layer_ahead is True and config.layer_ahead_depth == 1
    assert not any(name.startswith("force_routing") for name in vars(config))  # replay's, not compute's
    with pytest.raises(InvalidArgument, match="layer_ahead_depth.*below its minimum 1"):
        load_config(
            ComputeConfig, cli={"store_dir": "s", "layer_ahead_depth": "0"}, env={}, env_prefix=ENV_PREFIX
        )
    forced = load_config(ForcedRoutingConfig, env={}, env_prefix=ENV_PREFIX)
    assert (forced.force_routing_path, forced.force_routing_request) == ("", 0)
    assert forced.force_routing_layer_ahead_accuracy == 0.9
    assert forced.force_routing_accuracy_drop_per_depth == 0.1
    with pytest.raises(InvalidArgument, match="force_routing_layer_ahead_accuracy.*above its maximum 1.0"):
        load_config(
            ForcedRoutingConfig,
            cli={"force_routing_layer_ahead_accuracy": "1.5"},
            env={},
            env_prefix=ENV_PREFIX,
        )
    env = {ENV_PREFIX + "FORCE_ROUTING_REQUEST": "-1"}  # the environment names compute had
    with pytest.raises(InvalidArgument, match="force_routing_request.*below its minimum 0"):
        load_config(ForcedRoutingConfig, env=env, env_prefix=ENV_PREFIX)


def test_entry_point_refuses_bad_flags_before_starting_compute(capsys):
    from replay.forced_compute import main, parser

    args, rest = parser().parse_known_args(
        ["--store-dir", "s", "--force-routing", "t.npz", "--force-routing-request", "3", "--no-layer-ahead"]
    )
    assert (args.force_routing_path, args.force_routing_request) == ("t.npz", "3")
    assert rest == ["--store-dir", "s", "--no-layer-ahead"]  # compute's own flags, untouched
    assert main(["--store-dir", "s", "--force-routing", "t.npz", "--force-routing-request", "-1"]) == 2
    assert "invalid configuration: " in capsys.readouterr().err
    assert main(["--store-dir", "s"]) == 2
    assert "pass --force-routing TRACE" in capsys.readouterr().err


def test_compute_imports_nothing_from_replay():
    """Forced routing reaches compute only through its routing-override seam."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    found = []
    for path in sorted((root / "compute_svc").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            found += [f"{path.relative_to(root)}: {n}" for n in names if n.split(".")[0] == "replay"]
    assert not found
