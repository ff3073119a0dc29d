"""The generation engine: validation, greedy equivalence, sampling, stopping, detokenisation."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from compute_svc.errors import InvalidArgument
from compute_svc.generation import (
    FinishReason,
    GenerationRequest,
    IncrementalDetokenizer,
    SamplingParams,
    TokenPicker,
)

PROMPT = tuple(range(5, 25))


@pytest.fixture(scope="module")
def mixtral(local_engine):
    engine, provider, tiny = local_engine("mixtral", limit=64)
    return engine, tiny


def run(engine, **kwargs):
    kwargs.setdefault("token_ids", PROMPT)
    kwargs.setdefault("max_new_tokens", 8)
    return list(engine.generate(engine.prepare(GenerationRequest(**kwargs))))


@pytest.mark.parametrize(
    ("request_kwargs", "message"),
    [
        (dict(max_new_tokens=4), "prompt is empty: set text or token_ids"),
        (dict(text="hi", token_ids=(1,), max_new_tokens=4), "set only one of text and token_ids"),
        (dict(token_ids=(1,), max_new_tokens=0), "max_new_tokens 0 is out of range [1, 64]"),
        (dict(token_ids=(1,), max_new_tokens=65), "max_new_tokens 65 is out of range [1, 64]"),
        (dict(token_ids=(1, 320), max_new_tokens=4), "token_ids[1] = 320 is out of range [0, 320)"),
        (dict(token_ids=(1,), max_new_tokens=4, stop_token_ids=(999,)), "stop_token_ids[0] = 999"),
        (
            dict(token_ids=(1,), max_new_tokens=4, sampling=SamplingParams(temperature=-1)),
            "sampling.temperature -1 is out of range [0, 100]",
        ),
        (
            dict(token_ids=(1,), max_new_tokens=4, sampling=SamplingParams(temperature=1, top_p=1.5)),
            "sampling.top_p 1.5 is out of range",
        ),
        (dict(token_ids=(1,), max_new_tokens=4, stop=("",)), "stop holds an empty string"),
    ],
)
def test_prepare_rejects_bad_requests(mixtral, request_kwargs, message):
    engine, _ = mixtral
    with pytest.raises(InvalidArgument) as info:
        engine.prepare(GenerationRequest(**request_kwargs))
    assert message in str(info.value)


def test_greedy_matches_model_generate(mixtral):
    engine, tiny = mixtral
    events = run(engine, max_new_tokens=16)
    plain = AutoModelForCausalLM.from_pretrained(tiny.checkpoint).eval()
    with torch.no_grad():
        want = plain.generate(torch.tensor([PROMPT]), max_new_tokens=16, do_sample=False)
    assert [e.token_id for e in events] == want[0, len(PROMPT) :].tolist()
    assert [e.index for e in events] == list(range(16))  # no EOS in this prompt's continuation
    assert events[0].prompt_tokens == len(PROMPT) and all(e.prompt_tokens is None for e in events[1:])
    assert events[-1].finish_reason is FinishReason.LENGTH
    assert all(e.finish_reason is None for e in events[:-1])
    assert all(e.latency_s > 0 for e in events)
    assert events[0].cache.hits + events[0].cache.misses > 0


def test_text_prompt_and_pieces_concatenate_to_the_decoded_text(mixtral):
    engine, _ = mixtral
    tokenizer = engine.loaded.tokenizer
    events = run(engine, token_ids=(), text="The quick brown fox", max_new_tokens=24, ignore_eos=True)
    ids = [e.token_id for e in events]
    assert "".join(e.text for e in events) == tokenizer.decode(ids, skip_special_tokens=True)
    assert events[0].prompt_tokens == len(tokenizer.encode("The quick brown fox"))


def test_sampling_is_reproducible_per_seed(mixtral):
    engine, _ = mixtral
    hot = dict(max_new_tokens=16, ignore_eos=True)
    a = [e.token_id for e in run(engine, sampling=SamplingParams(temperature=1.5, seed=7), **hot)]
    b = [e.token_id for e in run(engine, sampling=SamplingParams(temperature=1.5, seed=7), **hot)]
    c = [e.token_id for e in run(engine, sampling=SamplingParams(temperature=1.5, seed=8), **hot)]
    greedy = [e.token_id for e in run(engine, **hot)]
    assert a == b
    assert a != c
    # A nucleus so small that only the top token survives is greedy decoding.
    tiny_p = [
        e.token_id for e in run(engine, sampling=SamplingParams(temperature=1.5, top_p=1e-6, seed=3), **hot)
    ]
    assert tiny_p == greedy


def test_stop_token_ids_and_eos(mixtral):
    engine, _ = mixtral
    free = run(engine, max_new_tokens=8, ignore_eos=True)
    target = free[3].token_id
    stopped = run(engine, max_new_tokens=8, ignore_eos=True, stop_token_ids=(target,))
    first = next(i for i, e in enumerate(free) if e.token_id == target)
    assert [e.token_id for e in stopped] == [e.token_id for e in free[: first + 1]]
    assert stopped[-1].finish_reason is FinishReason.EOS


def test_stop_string_ends_generation_and_is_included(mixtral):
    engine, _ = mixtral
    free = run(engine, token_ids=(), text="Once upon a time", max_new_tokens=24, ignore_eos=True)
    text = "".join(e.text for e in free)
    # A stop string taken from the middle of the free-running text.
    pieces = [e.text for e in free]
    k = next(i for i, p in enumerate(pieces) if i >= 2 and p.strip())
    stop = pieces[k].strip()[:2]
    stopped = run(
        engine, token_ids=(), text="Once upon a time", max_new_tokens=24, ignore_eos=True, stop=(stop,)
    )
    out = "".join(e.text for e in stopped)
    assert stopped[-1].finish_reason is FinishReason.STOP
    assert stop in out and text.startswith(out)
    assert stop not in out[: len(out) - len(stopped[-1].text)]  # it was completed by the last token


def test_cancel_stops_before_the_next_token(mixtral):
    engine, _ = mixtral
    seen = []
    prepared = engine.prepare(GenerationRequest(token_ids=PROMPT, max_new_tokens=20, ignore_eos=True))
    for event in engine.generate(prepared, should_stop=lambda: len(seen) >= 3):
        seen.append(event)
    assert len(seen) == 3


def test_token_picker_top_p_keeps_the_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    pick = TokenPicker(SamplingParams(temperature=1.0, seed=1), top_p=0.75, device=torch.device("cpu"))
    drawn = {pick(logits) for _ in range(200)}
    assert drawn == {0, 1}  # 0.5 + 0.3 reaches 0.75; tokens 2 and 3 are cut
    greedy = TokenPicker(SamplingParams(), top_p=1.0, device=torch.device("cpu"))
    assert greedy(logits) == 0


def test_detokenizer_holds_back_incomplete_characters(mixtral):
    engine, _ = mixtral
    tokenizer = engine.loaded.tokenizer
    text = "fox é ü 😀 done"
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, [])
    pieces = [detok.add(t) for t in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
