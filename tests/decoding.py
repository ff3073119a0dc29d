"""Greedy decoding through the engine and through transformers, for the decode-step tests
(compute_svc.decode_step on the CPU, compute_svc.graph_step)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from compute_svc.requests import GenerationRequest

PROMPT = [5, 17, 33, 2, 9, 41, 7]
TOL = dict(rtol=1e-4, atol=1e-4)


def prepare(engine, prompt, n):
    return engine.requests.prepare(
        GenerationRequest(token_ids=tuple(prompt), max_new_tokens=n, ignore_eos=True)
    )


def greedy(engine, prompt, n):
    return [e.token_id for e in engine.generate(prepare(engine, prompt, n))]


def plain_model(checkpoint, dtype=None):
    kwargs = {"dtype": dtype} if dtype is not None else {}
    return AutoModelForCausalLM.from_pretrained(checkpoint, **kwargs).eval()


def plain_greedy(checkpoint, prompt, n, dtype=None):
    with torch.no_grad():
        out = plain_model(checkpoint, dtype).generate(
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False
        )
    return out[0, len(prompt) :].tolist()


def counting(step):
    """The logits of each later call of ``step.forward`` (an engine's decode_step or graph_step),
    cloned, in a list that grows as they come."""
    calls = []
    original = step.forward

    def forward(*args, **kwargs):
        logits = original(*args, **kwargs)
        calls.append(logits.clone())
        return logits

    step.forward = forward
    return calls
