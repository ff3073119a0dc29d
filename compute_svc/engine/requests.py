"""A generation request: what a client may ask (``GenerationRequest``), the limits it is held
to (``RequestLimits``), and the check that turns it into a ``PreparedRequest`` (prompt ids
resolved, every limit checked) or refuses it with ``InvalidArgument`` naming the field (in its
message and as its ``field``), its value and the limit. Sizes are checked before any work that
grows with them (tokenisation, id conversion), so a huge prompt is refused at once.
``compute_svc.engine.generation`` runs what passes.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from compute_svc.engine.prompt_text import (
    TooManyTokens,
    encode_text,
    longest_token_bytes,
)
from compute_svc.engine.sampling import SamplingParams, check_sampling
from compute_svc.errors import InvalidArgument
from expertcache import telemetry

if TYPE_CHECKING:
    from compute_svc.engine.model_loader import LoadedModel

logger = logging.getLogger(__name__)

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024
MAX_MESSAGES = 1024
MAX_ROLE_CHARS = 64
MAX_REQUEST_ID_CHARS = 256


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True)
class GenerationRequest:
    text: str = ""
    token_ids: tuple[int, ...] = ()
    messages: tuple[ChatMessage, ...] = ()  # instead of text: the model's chat template applies
    max_new_tokens: int = 0
    # max_new_tokens is a ceiling, lowered to what the prompt leaves of max_total_tokens (a client
    # that named no count: the HTTP API's default); False: exactly max_new_tokens, or refused.
    fit_max_new_tokens: bool = False
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    request_id: str = ""
    logprobs: bool = False  # report the chosen token's log-probability
    deadline: float | None = None  # time.monotonic() by which the request must be over


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for (the service's configuration; ``ModelInfo`` reports them)."""

    max_new_tokens: int = 4096
    max_prompt_tokens: int = 0  # 0: the model's maximum positions
    max_total_tokens: int = 0  # prompt + new tokens; 0: the model's maximum positions
    max_prompt_bytes: int = 1 << 20  # text (or messages) before tokenisation


@dataclass(frozen=True)
class PreparedRequest:
    """A validated request: prompt ids resolved, every limit checked."""

    request: GenerationRequest
    prompt_ids: tuple[int, ...]
    arrived_at: float = field(default_factory=time.perf_counter)
    # The caller's trace context (the Generate RPC's span) when tracing is on; else None.
    trace_parent: object = field(default=None, compare=False, repr=False)

    @property
    def request_id(self) -> str:
        return self.request.request_id


class RequestCheck:
    """Turns a ``GenerationRequest`` into a ``PreparedRequest`` or refuses it (``prepare``).

    Owns the service's request limits, brought within the model's maximum positions, and the
    bound on prompt text before it is tokenised (``compute_svc.engine.prompt_text``)."""

    def __init__(self, loaded: LoadedModel, limits: RequestLimits) -> None:
        self.loaded = loaded
        max_positions = int(getattr(loaded.config, "max_position_embeddings", 0) or 0) or (1 << 31)
        # Configured limits never exceed what the model's positions allow.
        self.limits = RequestLimits(
            max_new_tokens=limits.max_new_tokens,
            max_prompt_tokens=min(limits.max_prompt_tokens or max_positions, max_positions),
            max_total_tokens=min(limits.max_total_tokens or max_positions, max_positions),
            max_prompt_bytes=limits.max_prompt_bytes,
        )
        # Bytes of text one token may stand for (from the vocabulary, once); None: no bound.
        self.longest_token_bytes = (
            longest_token_bytes(loaded.tokenizer) if loaded.tokenizer is not None else None
        )
        if loaded.tokenizer is not None and self.longest_token_bytes is None:
            logger.info(
                "the tokenizer may shorten text before it splits it: prompts are bounded by max_prompt_bytes "
                "only, not by max_prompt_tokens before tokenising"
            )

    def prepare(self, request: GenerationRequest) -> PreparedRequest:
        """Validate ``request``; ``InvalidArgument`` names the bad field, its value and the limit.

        Sizes are checked before any work that grows with them (tokenisation, id conversion), so
        a huge prompt is refused at once. The prepared request's ``max_new_tokens`` is the one
        asked for, or with ``fit_max_new_tokens`` what fits after the prompt."""
        limits = self.limits
        given = sum(bool(x) for x in (request.text, request.token_ids, request.messages))
        if given > 1:
            raise InvalidArgument("set only one of text, token_ids and messages")
        if given == 0:
            raise InvalidArgument("prompt is empty: set text, token_ids or messages")
        if not 1 <= request.max_new_tokens <= limits.max_new_tokens:
            raise InvalidArgument(
                f"max_new_tokens {request.max_new_tokens} is out of range [1, {limits.max_new_tokens}]",
                field="max_new_tokens",
            )
        problems = check_sampling(request.sampling)
        if problems:
            raise InvalidArgument("; ".join(problems))
        if len(request.request_id) > MAX_REQUEST_ID_CHARS:
            raise InvalidArgument(
                f"request_id is {len(request.request_id)} characters long; at most {MAX_REQUEST_ID_CHARS}",
                field="request_id",
            )
        self._check_stops(request)
        prompt_ids = self._prompt_ids(request)
        vocab = self.loaded.vocab_size
        for field_name, ids in (("token_ids", prompt_ids), ("stop_token_ids", request.stop_token_ids)):
            for i, token in enumerate(ids):
                if not 0 <= token < vocab:
                    raise InvalidArgument(
                        f"{field_name}[{i}] = {token} is out of range [0, {vocab})", field=field_name
                    )
        if len(prompt_ids) > limits.max_prompt_tokens:
            raise self._too_many_tokens(len(prompt_ids), _prompt_field(request))
        request = self._with_new_tokens(request, len(prompt_ids))
        if telemetry.ENABLED:  # the Generate RPC's span (opentelemetry-instrumentation-grpc)
            from opentelemetry import context as otel_context

            return PreparedRequest(
                request=request, prompt_ids=prompt_ids, trace_parent=otel_context.get_current()
            )
        return PreparedRequest(request=request, prompt_ids=prompt_ids)

    def _check_stops(self, request: GenerationRequest) -> None:
        """Stop strings and stop token ids within their counts and sizes."""
        if len(request.stop) > MAX_STOP_STRINGS:
            raise InvalidArgument(
                f"stop holds {len(request.stop)} strings; at most {MAX_STOP_STRINGS}", field="stop"
            )
        if any(not s for s in request.stop):
            raise InvalidArgument("stop holds an empty string", field="stop")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in request.stop):
            raise InvalidArgument(
                f"stop holds a string longer than {MAX_STOP_STRING_CHARS} characters", field="stop"
            )
        if len(request.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidArgument(
                f"stop_token_ids holds {len(request.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS}",
                field="stop_token_ids",
            )
        if request.stop and self.loaded.tokenizer is None:
            raise InvalidArgument(
                "stop strings need a tokenizer, which this model lacks: use stop_token_ids", field="stop"
            )

    def _with_new_tokens(self, request: GenerationRequest, prompt_tokens: int) -> GenerationRequest:
        """``request`` once its prompt is known to be ``prompt_tokens`` long: its max_new_tokens
        must fit max_total_tokens with the prompt, or (``fit_max_new_tokens``, the count being a
        ceiling) is lowered to what fits, as vLLM does for a client that names none. Refused when
        the prompt leaves no room for even one new token."""
        limit = self.limits.max_total_tokens
        room = limit - prompt_tokens
        if request.fit_max_new_tokens:
            if room < 1:
                raise InvalidArgument(
                    f"the prompt ({prompt_tokens} tokens) leaves no room for a new token within {limit} "
                    "(max_total_tokens, and the model's maximum positions): shorten the prompt",
                    field=_prompt_field(request),
                )
            return dataclasses.replace(request, max_new_tokens=min(request.max_new_tokens, room))
        if request.max_new_tokens > room:
            raise InvalidArgument(
                f"prompt ({prompt_tokens} tokens) + max_new_tokens ({request.max_new_tokens}) = "
                f"{prompt_tokens + request.max_new_tokens} exceeds {limit} (max_total_tokens, and the model's "
                "maximum positions): ask for fewer tokens",
                field="max_new_tokens",
            )
        return request

    def _prompt_ids(self, request: GenerationRequest) -> tuple[int, ...]:
        limits = self.limits
        if request.token_ids:
            if len(request.token_ids) > limits.max_prompt_tokens:
                raise InvalidArgument(
                    f"token_ids holds {len(request.token_ids)} ids; this service takes at most "
                    f"{limits.max_prompt_tokens} prompt tokens (max_prompt_tokens)",
                    field="token_ids",
                )
            return tuple(int(t) for t in request.token_ids)
        if self.loaded.tokenizer is None:
            raise InvalidArgument(
                "text or messages were given but the model has no tokenizer: send token_ids instead",
                field=_prompt_field(request),
            )
        ids = self._message_ids(request.messages) if request.messages else self._text_ids(request.text)
        if not ids:
            raise InvalidArgument("prompt is empty: text encodes to no tokens", field=_prompt_field(request))
        return ids

    def _message_ids(self, messages: tuple[ChatMessage, ...]) -> tuple[int, ...]:
        """The ids of ``messages`` rendered by the checkpoint's chat template."""
        limits = self.limits
        tokenizer = self.loaded.tokenizer
        if len(messages) > MAX_MESSAGES:
            raise InvalidArgument(
                f"messages holds {len(messages)} messages; at most {MAX_MESSAGES}", field="messages"
            )
        size = sum(
            _utf8_bytes(m.content, f"messages[{i}].content") + len(m.role) for i, m in enumerate(messages)
        )
        if size > limits.max_prompt_bytes:
            raise InvalidArgument(
                f"messages hold {size} bytes; this service takes at most {limits.max_prompt_bytes} (max_prompt_bytes)",
                field="messages",
            )
        for i, m in enumerate(messages):
            if not m.role or len(m.role) > MAX_ROLE_CHARS:
                raise InvalidArgument(
                    f"messages[{i}].role must be 1 to {MAX_ROLE_CHARS} characters",
                    field=f"messages[{i}].role",
                )
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidArgument(
                "the model has no chat template: send text or token_ids instead of messages", field="messages"
            )
        chat = [{"role": m.role, "content": m.content} for m in messages]
        try:
            rendered = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            rendered_size = len(rendered.encode())
            self._check_text_size(rendered_size, "messages after the chat template", "messages")
            # The rendered text, encoded as apply_chat_template(tokenize=True) would (the template
            # writes the special tokens): counted before any id becomes a Python int, so a refused
            # prompt leaves nothing behind, as with text prompts.
            return encode_text(
                tokenizer, rendered, rendered_size, limits.max_prompt_tokens, add_special_tokens=False
            )
        except TooManyTokens as exc:
            raise self._too_many_tokens(exc.count, "messages") from None
        except InvalidArgument:
            raise
        except Exception as exc:  # noqa: BLE001 - a template error is the request's fault
            raise InvalidArgument(
                f"messages: the chat template failed on them: {exc}", field="messages"
            ) from None

    def _text_ids(self, text: str) -> tuple[int, ...]:
        """The ids of prompt ``text``."""
        limits = self.limits
        size = _utf8_bytes(text, "text")
        if size > limits.max_prompt_bytes:
            raise InvalidArgument(
                f"text is {size} bytes; this service takes at most {limits.max_prompt_bytes} (max_prompt_bytes)",
                field="text",
            )
        self._check_text_size(size, "text", "text")
        try:
            return encode_text(self.loaded.tokenizer, text, size, limits.max_prompt_tokens)
        except TooManyTokens as exc:
            raise self._too_many_tokens(exc.count, "text") from None

    def _too_many_tokens(self, count: int, field_name: str) -> InvalidArgument:
        return InvalidArgument(
            f"the prompt has {count} tokens; this service takes at most {self.limits.max_prompt_tokens} "
            "(max_prompt_tokens, and the model's maximum positions)",
            field=field_name,
        )

    @property
    def prompt_text_limit(self) -> int:
        """Bytes of prompt text (or messages after the chat template) taken: longer text cannot
        fit max_prompt_tokens, and is refused before it is tokenised."""
        limit = self.limits.max_prompt_bytes
        if self.longest_token_bytes is not None:
            limit = min(limit, self.limits.max_prompt_tokens * self.longest_token_bytes)
        return limit

    def _check_text_size(self, size: int, what: str, field_name: str) -> None:
        """Refuse text that cannot fit max_prompt_tokens, before it is tokenised."""
        if size > self.prompt_text_limit:
            raise InvalidArgument(
                f"{what} is {size} bytes: more than any prompt of at most {self.limits.max_prompt_tokens} tokens "
                f"(max_prompt_tokens) can be; this service takes at most {self.prompt_text_limit} bytes",
                field=field_name,
            )


def _prompt_field(request: GenerationRequest) -> str:
    """The field that holds ``request``'s prompt: ``token_ids``, ``messages`` or ``text``."""
    if request.token_ids:
        return "token_ids"
    return "messages" if request.messages else "text"


def _utf8_bytes(text: str, field_name: str) -> int:
    """The UTF-8 size of ``text``; ``InvalidArgument`` when it holds a lone surrogate (no
    character, so no UTF-8 and no tokens: a JSON ``\\ud800`` escape decodes to one)."""
    try:
        return len(text.encode())
    except UnicodeEncodeError as exc:
        raise InvalidArgument(
            f"{field_name} is not valid Unicode: it holds a lone surrogate "
            f"(U+{ord(text[exc.start]):04X} at character {exc.start})",
            field=field_name,
        ) from None
