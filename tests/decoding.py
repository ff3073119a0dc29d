"""Greedy decoding through the engine and through transformers, for the decode-step tests
(compute_svc.engine.decode_step on the CPU, compute_svc.engine.graph_step)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from compute_svc.engine.requests import GenerationRequest

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


def check_a_failed_step_changes_nothing(engine, checkpoint) -> None:
    """The second MoE layer of a decode step fails (the daemon went away): the step raises, and the
    request then decodes on to the plain model's tokens, as if that step had never run."""
    runtime = engine.runtime
    original = runtime.forward
    seq = engine.start(prepare(engine, PROMPT, 8))
    tokens = [e.token_id for _, e in engine.step([(seq, len(seq.pending))])]
    failures = iter([False, True])

    def flaky(*args, **kwargs):
        if next(failures, False):
            raise RuntimeError("the daemon went away")
        return original(*args, **kwargs)

    runtime.forward = flaky
    try:
        with pytest.raises(RuntimeError, match="went away"):
            engine.step([(seq, 1)])
    finally:
        del runtime.forward
    while not seq.done:
        tokens += [e.token_id for _, e in engine.step([(seq, 1)])]
    engine.finish(seq, "length")
    assert tokens == plain_greedy(checkpoint, PROMPT, 8)


def check_decode_logits(calls, checkpoint, prompt, tokens, dtype, ulps: int) -> None:
    """``tokens`` (greedy after ``prompt``) and the logits of each decode step after the first
    (``calls``) against transformers' own decode steps (generate, with its KV cache): float32
    within TOL, bf16 within ``ulps`` units in the last place of the largest logit."""
    with torch.no_grad():
        out = plain_model(checkpoint, dtype).generate(
            torch.tensor([prompt]),
            max_new_tokens=len(tokens),
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    assert out.sequences[0, len(prompt) :].tolist() == tokens
    for got, want in zip(calls, out.logits[1:], strict=True):
        got, want = got[0].float(), want[0].float()
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, **TOL)
            continue
        ulp = 2.0 ** (torch.floor(torch.log2(want.abs().max())).item() - 7)  # bf16: 8 significant bits
        assert (got - want).abs().max().item() <= ulps * ulp
