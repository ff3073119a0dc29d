"""How long a prompt's text may be before it is tokenised, and tokenising it without keeping memory.

A text that cannot fit the token limit is refused before the tokenizer sees it, and the memory a
large one took is handed back. Why, and what was measured: docs/compute.md."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import logging
import math
import os
from collections.abc import Callable, Sequence

logger = logging.getLogger(__name__)

# Text at least this long is followed by a heap trim (a few ms; the tokenisation took far more).
TRIM_AFTER_BYTES = 64 << 10
# How much a unicode normalizer or lowercasing may shrink UTF-8 text: 3 at most (conjoining
# Hangul jamo, 9 bytes, compose to one 3-byte syllable; fullwidth 'Ａ', 3 bytes, becomes 'A'),
# with a margin.
_UNICODE_SHRINK = 4
_UTF8_MAX = 4  # bytes of one character
_KEEPS_TEXT_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"}


def _normalizer_shrink(spec: dict | None) -> int | None:
    """By how much the normalizer ``spec`` (tokenizer.json) may shrink text; None: unbounded."""
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind in ("NFC", "NFD", "NFKC", "NFKD", "Lowercase"):
        return _UNICODE_SHRINK
    if kind in ("Prepend", "ByteLevel"):
        return 1  # they only add
    if kind == "Replace":
        pattern = (spec.get("pattern") or {}).get("String")
        content = spec.get("content") or ""
        if pattern is None or not content:
            return None  # a regex, or a deletion
        return max(1, math.ceil(len(pattern.encode()) / len(content.encode())))
    if kind == "Sequence":
        factor = 1
        for part in spec.get("normalizers") or ():
            shrink = _normalizer_shrink(part)
            if shrink is None:
                return None
            factor *= shrink
        return factor
    return None


def _keeps_text(spec: dict | None) -> bool:
    """Whether the pre-tokenizer ``spec`` hands every byte of the text on (no dropped whitespace)."""
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_keeps_text(part) for part in spec.get("pretokenizers") or ())
    if kind in ("Split", "Punctuation") and str(spec.get("behavior", "")).lower() == "removed":
        return False
    return kind in _KEEPS_TEXT_PRE_TOKENIZERS


def _unknown_bytes(model: dict) -> int | None:
    """The most text one unknown token may stand for (0: the model has none); None: unbounded."""
    kind = model.get("type")
    if kind == "BPE":
        if model.get("unk_token") is None or model.get("byte_fallback"):
            return 0
        return None if model.get("fuse_unk") else _UTF8_MAX
    if kind == "WordPiece":
        return _UTF8_MAX * int(model.get("max_input_chars_per_word") or 100)
    if kind == "Unigram":
        return 0 if model.get("unk_id") is None or model.get("byte_fallback") else None
    return None


def longest_token_bytes(tokenizer) -> int | None:
    """An upper bound on the UTF-8 bytes of text one token of ``tokenizer`` stands for, scaled by
    how much its normalizer may shrink text; None when no bound holds (see the module's doc).

    A token's string over-counts its text where it differs (byte-level BPE writes a byte as a
    character of 1 or 2 UTF-8 bytes, sentencepiece a space as the 3-byte '▁', byte fallback a
    byte as '<0x41>'), which only loosens the bound."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None  # a slow (Python) tokenizer: its pieces cannot be inspected
    spec = json.loads(backend.to_str())
    shrink = _normalizer_shrink(spec.get("normalizer"))
    unknown = _unknown_bytes(spec.get("model") or {})
    if shrink is None or unknown is None or not _keeps_text(spec.get("pre_tokenizer")):
        return None
    vocab = backend.get_vocab(with_added_tokens=True)
    longest = max([len(piece.encode()) for piece in vocab] + [unknown, 1])
    return longest * shrink


def _load_libc():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


_libc = _load_libc()
_malloc_trim = getattr(_libc, "malloc_trim", None)  # glibc's; None elsewhere (musl has none, and keeps less)
_mallopt = getattr(_libc, "mallopt", None)
_M_ARENA_MAX = -8  # mallopt's parameter (glibc's malloc.h)


def one_malloc_arena() -> bool:
    """Every thread started after this allocates from glibc's main arena, whose free top
    ``malloc_trim`` hands back (a thread arena's it cannot): called before compute starts any
    thread. The environment's MALLOC_ARENA_MAX, where set, is left to decide. True when set."""
    if _mallopt is None or "MALLOC_ARENA_MAX" in os.environ:
        return False
    return bool(_mallopt(_M_ARENA_MAX, 1))


def release_free_heap() -> None:
    """Hand the free memory of every malloc arena back to the kernel (glibc's ``malloc_trim``)."""
    if _malloc_trim is not None:
        _malloc_trim(0)


def tokenize(call: Callable[[], Sequence[int]], nbytes: int) -> tuple[int, ...]:
    """``call()`` (a tokenizer's encode of ``nbytes`` of text) as a tuple of ids; after a large
    text the heap it freed (the tokenizer's, the list it returned) goes back to the kernel."""
    try:
        return tuple(int(t) for t in call())
    finally:
        if nbytes >= TRIM_AFTER_BYTES:
            release_free_heap()


class TooManyTokens(Exception):
    """The text encodes to ``count`` tokens, more than the caller takes."""

    def __init__(self, count: int) -> None:
        super().__init__(count)
        self.count = count


def _counting_backend(tokenizer):
    """The fast tokenizer's backend when encoding with it equals ``tokenizer.encode(text)``: no
    truncation or padding set on it, special tokens treated as transformers would; else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.truncation is not None or backend.padding is not None:
        return None
    if bool(getattr(backend, "encode_special_tokens", False)) != bool(
        getattr(tokenizer, "split_special_tokens", False)
    ):
        return None
    return backend


def encode_text(
    tokenizer, text: str, nbytes: int, max_tokens: int, *, add_special_tokens: bool = True
) -> tuple[int, ...]:
    """``tokenizer.encode(text, add_special_tokens=...)`` (``nbytes`` of UTF-8) as a tuple of ids,
    or ``TooManyTokens`` when it holds more than ``max_tokens``: counted on the backend's
    ``Encoding`` before any id becomes a Python int. After a large text the freed heap goes back
    to the kernel. A rendered chat template is encoded without special tokens (the template
    writes them), as ``apply_chat_template(tokenize=True)`` does."""
    # Whatever is refused is dropped before the raise: the exception's traceback keeps this
    # frame, and with it the locals, for as long as the caller's error lives.
    backend = _counting_backend(tokenizer)
    try:
        if backend is None:
            ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
        else:
            encoding = backend.encode(text, add_special_tokens=add_special_tokens)
            count = len(encoding)
            if count > max_tokens:
                del encoding
                raise TooManyTokens(count)
            ids = encoding.ids
            del encoding
        count = len(ids)
        if count > max_tokens:
            del ids
            raise TooManyTokens(count)
        return tuple(int(t) for t in ids)
    finally:
        if nbytes >= TRIM_AFTER_BYTES:
            release_free_heap()
