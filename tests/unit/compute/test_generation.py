"""The generation engine: validation, greedy equivalence, sampling, stopping, detokenisation."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

from compute_svc.engine.generation import FinishReason, IncrementalDetokenizer
from compute_svc.engine.requests import ChatMessage, GenerationRequest
from compute_svc.engine.sampling import Sampler, SamplingParams
from compute_svc.errors import InvalidArgument

PROMPT = tuple(range(5, 25))


@pytest.fixture(scope="module")
def mixtral(local_engine):
    engine, provider, tiny = local_engine("mixtral", limit=64)
    engine.requests.limits = type(engine.requests.limits)(
        max_new_tokens=64,
        max_prompt_tokens=min(engine.requests.limits.max_prompt_tokens, 256),
        max_total_tokens=min(engine.requests.limits.max_total_tokens, 256),
        max_prompt_bytes=4096,
    )
    return engine, tiny


def run(engine, **kwargs):
    kwargs.setdefault("token_ids", PROMPT)
    kwargs.setdefault("max_new_tokens", 8)
    return list(engine.generate(engine.requests.prepare(GenerationRequest(**kwargs))))


@pytest.mark.parametrize(
    ("request_kwargs", "message"),
    [
        (dict(max_new_tokens=4), "prompt is empty: set text, token_ids or messages"),
        (dict(text="hi", token_ids=(1,), max_new_tokens=4), "set only one of text, token_ids and messages"),
        (
            dict(text="hi", messages=(ChatMessage("user", "hi"),), max_new_tokens=4),
            "set only one of text, token_ids and messages",
        ),
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
        (dict(token_ids=(1,), max_new_tokens=4, stop=("x",) * 17), "stop holds 17 strings; at most 16"),
        (
            dict(token_ids=(1,), max_new_tokens=4, sampling=SamplingParams(temperature=1, top_k=1 << 21)),
            "sampling.top_k 2097152 is out of range [0, 1048576]",
        ),
        (
            dict(token_ids=(1,), max_new_tokens=4, sampling=SamplingParams(repetition_penalty=-1)),
            "sampling.repetition_penalty -1 is out of range (0, 10]",
        ),
        (
            dict(token_ids=(1,), max_new_tokens=4, sampling=SamplingParams(presence_penalty=float("nan"))),
            "sampling.presence_penalty nan is out of range [-2, 2]",
        ),
        (dict(token_ids=(1,), max_new_tokens=4, request_id="r" * 257), "request_id is 257 characters long"),
        (
            dict(messages=(ChatMessage("", "hi"),), max_new_tokens=4),
            "messages[0].role must be 1 to 64 characters",
        ),
        # Limits: the model's positions (tiny mixtral: 256 here) and the configured sizes.
        (
            dict(token_ids=(1,) * 300, max_new_tokens=4),
            "token_ids holds 300 ids; this service takes at most 256",
        ),
        (
            dict(token_ids=(1,) * 250, max_new_tokens=10),
            "prompt (250 tokens) + max_new_tokens (10) = 260 exceeds 256 (max_total_tokens",
        ),
        (dict(text="x" * 5000, max_new_tokens=4), "text is 5000 bytes; this service takes at most 4096"),
    ],
)
def test_prepare_rejects_bad_requests(mixtral, request_kwargs, message):
    engine, _ = mixtral
    with pytest.raises(InvalidArgument) as info:
        engine.requests.prepare(GenerationRequest(**request_kwargs))
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


def test_forward_uses_the_installed_transformers_cache_keyword(mixtral):
    # transformers 5.24 renamed the KV cache argument (``cache``) and the keyword ``Cache.update``
    # passes (``kwargs=``); the packed forward must run on either release without a deprecation.
    engine, _ = mixtral
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        events = run(engine, max_new_tokens=3)
    assert len(events) == 3


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
    prepared = engine.requests.prepare(
        GenerationRequest(token_ids=PROMPT, max_new_tokens=20, ignore_eos=True)
    )
    for event in engine.generate(prepared, should_stop=lambda: len(seen) >= 3):
        seen.append(event)
    assert len(seen) == 3


def test_sampler_top_p_keeps_the_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    pick = Sampler(SamplingParams(temperature=1.0, seed=1, top_p=0.75), (), 4, torch.device("cpu"))
    drawn = {pick.pick(logits)[0] for _ in range(200)}
    assert drawn == {0, 1}  # 0.5 + 0.3 reaches 0.75; tokens 2 and 3 are cut
    greedy = Sampler(SamplingParams(), (), 4, torch.device("cpu"))
    assert greedy.pick(logits)[0] == 0


def test_sampler_top_k_and_logprobs():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    pick = Sampler(SamplingParams(temperature=1.0, seed=2, top_k=2), (), 4, torch.device("cpu"))
    drawn = {pick.pick(logits)[0] for _ in range(200)}
    assert drawn == {0, 1}
    token, logprob = Sampler(SamplingParams(), (), 4, torch.device("cpu")).pick(logits, want_logprob=True)
    assert token == 0 and logprob == pytest.approx(torch.log(torch.tensor(0.5)).item(), abs=1e-6)


def test_sampler_penalties_follow_their_definitions():
    logits = torch.tensor([2.0, -1.0, 1.5, 0.0])
    rep = Sampler(SamplingParams(repetition_penalty=2.0), (0, 1), 4, torch.device("cpu"))
    # Seen tokens 0 and 1: 2.0 / 2 = 1.0 and -1.0 * 2 = -2.0; token 2 (1.5) now wins.
    assert rep.penalised(logits).tolist() == [1.0, -2.0, 1.5, 0.0]
    assert rep.pick(logits)[0] == 2
    presence = Sampler(SamplingParams(presence_penalty=1.0), (0,), 4, torch.device("cpu"))
    assert presence.penalised(logits).tolist() == logits.tolist()  # the prompt does not count
    assert presence.pick(logits)[0] == 0
    assert presence.penalised(logits).tolist() == [1.0, -1.0, 1.5, 0.0]  # generated once: penalised


def test_penalties_and_logprobs_through_the_engine(mixtral):
    engine, _ = mixtral
    plain = run(engine, max_new_tokens=12, ignore_eos=True, logprobs=True)
    assert all(e.logprob is not None and e.logprob <= 0 for e in plain)
    assert all(e.logprob is None for e in run(engine, max_new_tokens=3, ignore_eos=True))
    # A strong repetition penalty never repeats a token of the prompt or its own output greedily.
    penalised = run(
        engine, max_new_tokens=12, ignore_eos=True, sampling=SamplingParams(repetition_penalty=10.0)
    )
    ids = [e.token_id for e in penalised]
    assert len(set(ids)) == len(ids) and not set(ids) & set(PROMPT)


def test_chat_messages_use_the_models_template(mixtral):
    engine, _ = mixtral
    tokenizer = engine.loaded.tokenizer
    messages = (ChatMessage("system", "Be brief."), ChatMessage("user", "Hello there"))
    events = run(engine, token_ids=(), messages=messages, max_new_tokens=4, ignore_eos=True)
    want = tokenizer.apply_chat_template(
        [{"role": m.role, "content": m.content} for m in messages],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    assert events[0].prompt_tokens == len(want)
    text_run = run(engine, token_ids=tuple(want), max_new_tokens=4, ignore_eos=True)
    assert [e.token_id for e in events] == [e.token_id for e in text_run]


def test_chunked_prefill_gives_the_same_tokens(mixtral):
    engine, _ = mixtral
    whole = [e.token_id for e in run(engine, max_new_tokens=8, ignore_eos=True)]
    prepared = engine.requests.prepare(GenerationRequest(token_ids=PROMPT, max_new_tokens=8, ignore_eos=True))
    chunked = [e.token_id for e in engine.generate(prepared, prefill_chunk_tokens=3)]
    assert chunked == whole


def test_detokenizer_holds_back_incomplete_characters(mixtral):
    engine, _ = mixtral
    tokenizer = engine.loaded.tokenizer
    text = "fox é ü 😀 done"
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, [])
    pieces = [detok.add(t) for t in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


class _CountingTokenizer:
    """The engine's tokenizer, counting the calls that tokenise."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.tokenised = 0

    def encode(self, *args, **kwargs):
        self.tokenised += 1
        return self._tokenizer.encode(*args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        if kwargs.get("tokenize", True):
            self.tokenised += 1
        return self._tokenizer.apply_chat_template(*args, **kwargs)

    @property
    def backend_tokenizer(self):
        return _CountingBackend(self, self._tokenizer.backend_tokenizer)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


class _CountingBackend:
    """The fast tokenizer's backend, counting its encodes on the wrapper's count."""

    def __init__(self, counter: _CountingTokenizer, backend) -> None:
        self._counter = counter
        self._backend = backend

    def encode(self, *args, **kwargs):
        self._counter.tokenised += 1
        return self._backend.encode(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._backend, name)


@pytest.fixture
def counting(mixtral, monkeypatch):
    engine, _ = mixtral
    counter = _CountingTokenizer(engine.loaded.tokenizer)
    monkeypatch.setattr(engine.requests, "loaded", dataclasses.replace(engine.loaded, tokenizer=counter))
    return engine, counter


def test_text_that_cannot_fit_the_token_limit_is_refused_before_tokenising(counting):
    engine, counter = counting
    # The tiny tokenizer's longest token is '<|endoftext|>', 13 bytes: 256 tokens hold 3328 at most.
    assert engine.requests.longest_token_bytes == 13
    assert engine.requests.prompt_text_limit == 256 * 13 < engine.requests.limits.max_prompt_bytes
    with pytest.raises(InvalidArgument) as info:
        engine.requests.prepare(GenerationRequest(text="x" * 3329, max_new_tokens=4))
    assert "text is 3329 bytes: more than any prompt of at most 256 tokens (max_prompt_tokens) can be" in str(
        info.value
    )
    assert counter.tokenised == 0
    # As long as the limit: tokenised, and taken when it fits (255 tokens + 1 new).
    prepared = engine.requests.prepare(GenerationRequest(text="<|endoftext|>" * 255, max_new_tokens=1))
    assert len(prepared.prompt_ids) == 255 and counter.tokenised == 1


def test_messages_are_measured_after_the_chat_template(counting):
    engine, counter = counting
    # The content alone (3300 bytes) is under the limit; the template's role headers put it over.
    messages = tuple(ChatMessage("user", "y" * 1100) for _ in range(3))
    with pytest.raises(InvalidArgument) as info:
        engine.requests.prepare(GenerationRequest(messages=messages, max_new_tokens=4))
    rendered = 3 * len("<|user|>\n" + "y" * 1100 + "<|endoftext|>\n") + len("<|assistant|>\n")
    assert f"messages after the chat template is {rendered} bytes" in str(info.value)
    assert counter.tokenised == 0


def test_a_megabyte_prompt_is_refused_at_once(counting, monkeypatch):
    engine, counter = counting
    monkeypatch.setattr(
        engine.requests, "limits", dataclasses.replace(engine.requests.limits, max_prompt_bytes=2 << 20)
    )
    with pytest.raises(InvalidArgument, match="max_prompt_tokens"):
        engine.requests.prepare(GenerationRequest(text="The quick brown fox. " * 50_000, max_new_tokens=4))
    assert counter.tokenised == 0  # at once: refused on its size, the tokenizer never ran
