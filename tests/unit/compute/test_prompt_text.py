"""The prompt-text bound (longest token × max_prompt_tokens) and tokenising without keeping memory."""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap
import tracemalloc

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from compute_svc.engine.prompt_text import TooManyTokens, encode_text, longest_token_bytes
from devtools.launch import REPO
from devtools.tiny import build_tokenizer


def test_no_text_yields_fewer_tokens_than_its_bytes_over_the_longest_token():
    tokenizer = build_tokenizer()
    longest = longest_token_bytes(tokenizer)
    assert longest == 13  # '<|endoftext|>'
    rng = random.Random(7)
    alphabet = "abc xyz<|endoftext|> éü漢字🙂\n\t" + "".join(
        chr(rng.randrange(32, 0x2FFF)) for _ in range(200)
    )
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 400)))
        ids = tokenizer.encode(text)
        assert len(text.encode()) <= len(ids) * longest, text


def _fast(model, normalizer=None, pre_tokenizer=None) -> PreTrainedTokenizerFast:
    tok = Tokenizer(model)
    if normalizer is not None:
        tok.normalizer = normalizer
    if pre_tokenizer is not None:
        tok.pre_tokenizer = pre_tokenizer
    return PreTrainedTokenizerFast(tokenizer_object=tok)


VOCAB = {"a": 0, "b": 1, "ab": 2, "?": 3}


@pytest.mark.parametrize(
    ("tokenizer", "bound"),
    [
        (_fast(models.BPE(VOCAB, [("a", "b")])), 2),
        (_fast(models.BPE(VOCAB, [("a", "b")], unk_token="?")), 4),  # an unknown token: one character
        (_fast(models.BPE(VOCAB, [("a", "b")]), normalizers.NFC()), 2 * 4),
        (_fast(models.BPE(VOCAB, [("a", "b")]), normalizers.Replace("  ", " ")), 2 * 2),
        # Text may vanish before the model: no bound.
        (_fast(models.BPE(VOCAB, [("a", "b")]), normalizers.Strip()), None),
        (_fast(models.BPE(VOCAB, [("a", "b")]), normalizers.Replace(" ", "")), None),
        (_fast(models.BPE(VOCAB, [("a", "b")]), None, pre_tokenizers.Whitespace()), None),
        (_fast(models.BPE(VOCAB, [("a", "b")], unk_token="?", fuse_unk=True)), None),
        (_fast(models.WordLevel(VOCAB, unk_token="?")), None),
    ],
    ids=[
        "bpe",
        "bpe-unk",
        "nfc",
        "replace-shrinks",
        "strip",
        "replace-deletes",
        "whitespace",
        "fused-unk",
        "wordlevel",
    ],
)
def test_the_bound_holds_only_where_the_tokenizer_keeps_the_text(tokenizer, bound):
    assert longest_token_bytes(tokenizer) == bound


def test_tokenising_a_large_text_leaves_no_heap_behind():
    """RSS of a fresh process after tokenising 1 MB three times (the tokenizer's Encoding and
    transformers' lists freed): without the trim, 100 to 300 MiB stay in glibc's arenas."""
    script = textwrap.dedent(
        """
        from pathlib import Path
        from compute_svc.engine.prompt_text import tokenize
        from devtools.tiny import build_tokenizer

        def rss():
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) >> 10

        tokenizer = build_tokenizer()
        tokenizer.encode("warm up")
        text = ("The quick brown fox jumps over the lazy dog. " * 23000)[:1_000_000]
        start = rss()
        for _ in range(3):
            ids = tokenize(lambda: tokenizer.encode(text), len(text))
            assert len(ids) > 100_000
            del ids
        print(rss() - start)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300, check=True
    )
    grown_mib = int(out.stdout.split()[-1])
    assert grown_mib < 50, f"RSS grew by {grown_mib} MiB after tokenising 1 MB three times"


@pytest.mark.parametrize("split_special_tokens", [False, True])
def test_encode_text_gives_what_the_tokenizer_encodes(split_special_tokens):
    """Counted on the backend or not, the ids are ``tokenizer.encode(text)``'s, special tokens
    and all (written in the text, or split when the tokenizer says so)."""
    tokenizer = build_tokenizer()
    tokenizer.split_special_tokens = split_special_tokens
    rng = random.Random(11)
    alphabet = "abc xyz<|endoftext|> éü漢字🙂\n\t"
    for _ in range(100):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 300)))
        assert encode_text(tokenizer, text, len(text.encode()), 10_000) == tuple(tokenizer.encode(text)), text
    text = "<|endoftext|>" * 11
    with pytest.raises(TooManyTokens) as info:
        encode_text(tokenizer, text, len(text), 10)
    assert info.value.count == len(tokenizer.encode(text)) == (121 if split_special_tokens else 11)


def test_a_refused_large_text_makes_no_python_objects_of_its_ids():
    """A 1 MB text over the token limit is counted on the tokenizer's ``Encoding`` (native
    memory) and refused: the ~475,000 ids never become Python ints. Made into ints, they take
    pymalloc arenas that other threads' objects then pin (``prompt_text``'s docstring); traced
    here, ``tokenizer.encode`` of the same text peaks at ~15 MiB of Python memory."""
    tokenizer = build_tokenizer()
    sentence = "Mixture of experts models route every token to a few experts in a tiered cache. "
    text = (sentence * (1_000_000 // len(sentence) + 1))[:1_000_000]
    encode_text(tokenizer, "warm up", 7, 100_000)
    tracemalloc.start()
    try:
        with pytest.raises(TooManyTokens) as info:
            encode_text(tokenizer, text, len(text), 100_000)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        ids = tokenizer.encode(text)
        _, ids_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert info.value.count == len(ids) > 400_000
    assert peak < 1 << 20, f"refusing the text traced {peak >> 10} KiB of Python memory"
    assert ids_peak > 8 << 20  # what the count spared
