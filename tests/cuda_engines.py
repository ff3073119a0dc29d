"""The real engine on a GPU with its experts in a CUDA arena, and the plain model beside it, for
the GPU tests (``pytest -m gpu``)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from compute_svc.engine.generation import GenerationEngine
from compute_svc.engine.model_loader import load_model
from compute_svc.experts.arena import Arena
from compute_svc.experts.moe import ExpertRuntime, attach
from tests.providers import LocalProvider

PROMPT = list(range(5, 40))
NEW_TOKENS = 8
TOL = dict(rtol=1e-4, atol=1e-4)
DEVICE = torch.device("cuda:0")


def cuda_engine(tiny, slots: int) -> tuple[GenerationEngine, LocalProvider]:
    """The real engine on the GPU, experts in a CUDA arena filled by the in-process provider."""
    manifest = tiny.manifest
    arena = Arena(torch.zeros(slots, manifest.blob_bytes, dtype=torch.uint8, device=DEVICE))
    provider = LocalProvider(tiny.store, manifest, arena)
    loaded = load_model(tiny.store, manifest, DEVICE)
    runtime = ExpertRuntime(provider, arena, manifest.tensors)
    attach(loaded.model, loaded.experts_modules, runtime)
    return GenerationEngine(loaded, runtime, max_new_tokens_limit=64), provider


def plain(tiny):
    model = AutoModelForCausalLM.from_pretrained(tiny.checkpoint).to(DEVICE).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([PROMPT], device=DEVICE)).logits[0]
        tokens = model.generate(
            torch.tensor([PROMPT], device=DEVICE), max_new_tokens=NEW_TOKENS, do_sample=False
        )
    return logits, tokens[0, len(PROMPT) :].tolist()
