"""Layer-ahead prediction on the tiny random models: accuracy and cost, per architecture.

    python -m bench.e2e_layer_ahead [--tokens 32] [--hidden 64]

For each architecture of ``devtools.tiny`` (random weights, transformers' own model code),
greedy-decodes ``--tokens`` tokens with the plain model and, at every MoE layer l of every decode
step, applies layer l+1's router to layer l's MoE input (``compute_svc.experts.layer_ahead``) and compares
with what layer l+1 then really routed: accuracy = share of the true top-k named by the
prediction. Also times one prediction (router product + top-k) against the layer's experts time.

Random weights say little about real models: their routers are noise and their residual streams
have no learned structure, so this checks the mechanism and its cost, not the accuracy a trained
model would give (published figures for trained MoEs are far higher).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from compute_svc.engine.kv_cache import cache_keyword  # noqa: E402
from compute_svc.experts.layer_ahead import LayerAheadPredictor, accuracy  # noqa: E402
from devtools.tiny import SUPPORTED_ARCHS, make_config  # noqa: E402
from expertcache.model_structure import find_experts_sites  # noqa: E402


def measure(
    arch: str,
    tokens: int,
    hidden: int,
    num_layers: int,
    *,
    experts: int | None = None,
    top_k: int | None = None,
) -> dict:
    """Accuracy and per-prediction cost of layer-ahead on a random ``arch`` model."""
    config = make_config(arch, hidden_size=hidden, num_layers=num_layers, num_experts=experts, top_k=top_k)
    seed = 0
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2 and "norm" not in name:
                param.normal_(0.0, 2.0 / param.shape[-1] ** 0.5)  # as devtools.tiny.make_checkpoint
    sites = [(s.layer, model.get_submodule(s.path)) for s in find_experts_sites(model)]
    predictor = LayerAheadPredictor(model, sites)
    inputs: dict[int, torch.Tensor] = {}
    routed: dict[int, torch.Tensor] = {}

    def hook(layer):
        def capture(module, args, kwargs):
            hidden_states = args[0] if args else kwargs["hidden_states"]
            top_k_index = args[1] if len(args) > 1 else kwargs["top_k_index"]
            inputs[layer] = hidden_states[-1:].detach().clone()
            routed[layer] = top_k_index[-1].detach().clone()

        return capture

    for layer, module in sites:
        module.register_forward_pre_hook(hook(layer), with_kwargs=True)
    scores, costs = [], []
    ids = torch.tensor([[5, 9, 17, 33, 2]])
    past, keyword = None, cache_keyword(model)
    with torch.no_grad():
        for _ in range(tokens):
            out = model(input_ids=ids, use_cache=True, **{keyword: past})
            past = out[keyword]  # the output names the cache as the forward's keyword does
            ids = out.logits[:, -1:].argmax(-1)
            for layer in predictor.layers:
                started = time.perf_counter()
                predictions = predictor.predict(layer, inputs[layer])  # depth 1 first
                costs.append(time.perf_counter() - started)
                nearest = predictions[0]  # the next MoE layer's
                scores.append(accuracy(nearest.experts, routed[nearest.layer].tolist()))
    top_k = int(routed[sites[0][0]].numel())
    num_experts = int(sites[0][1].num_experts)
    return {
        "arch": arch,
        "accuracy": statistics.fmean(scores),
        "chance": top_k / num_experts,
        "predict_us_p50": statistics.median(costs) * 1e6,
        "predictions": len(scores),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, help="experts per layer (default: the family's tiny value)")
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--archs", default=",".join(SUPPORTED_ARCHS))
    args = parser.parse_args(argv)
    archs = [a for a in args.archs.split(",") if a]
    unknown = sorted(set(archs) - set(SUPPORTED_ARCHS))
    if unknown or not archs:
        parser.error(
            f"--archs: {', '.join(unknown) or 'empty list'}; choose from {', '.join(SUPPORTED_ARCHS)}"
        )
    if args.tokens < 1 or args.layers < 2:
        parser.error("--tokens must be >= 1 and --layers >= 2 (a layer predicts the next one)")
    torch.set_num_threads(1)
    print(f"{'arch':<12}{'accuracy':>10}{'chance':>8}{'predict p50 us':>16}{'n':>6}", flush=True)
    for arch in archs:
        r = measure(arch, args.tokens, args.hidden, args.layers, experts=args.experts, top_k=args.top_k)
        print(
            f"{r['arch']:<12}{r['accuracy']:>10.3f}{r['chance']:>8.3f}{r['predict_us_p50']:>16.1f}{r['predictions']:>6}",
            flush=True,
        )
    print("random weights: routers are noise, so accuracy here says little about a trained model")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
