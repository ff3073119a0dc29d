"""OpenAI's request and response bodies ↔ the engine's ``GenerationRequest`` and ``TokenEvent``.

Pure functions, no HTTP. A field this service cannot honour is refused (``ApiError``, 400, naming
the field) rather than ignored. The field mapping: docs/compute.md."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from compute_svc.engine.generation import FinishReason, TokenEvent
from compute_svc.engine.requests import ChatMessage, GenerationRequest
from compute_svc.engine.sampling import SamplingParams

if TYPE_CHECKING:
    from expertcache.manifest import StoreManifest

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
OPENAI_MAX_TEMPERATURE = 2.0
OPENAI_MAX_STOP = 4
MAX_SEED = (1 << 63) - 1
MAX_SHOWN_CHARS = 40  # of a bad value in an error message
ZERO_SEED = 0x5EED  # what an OpenAI seed of 0 runs with (the engine's 0 draws a fresh seed)
# Fields that would change the answer in ways this service does not implement.
_UNSUPPORTED = (
    "tools",
    "functions",
    "tool_choice",
    "function_call",
    "logit_bias",
    "response_format",
    "suffix",
)
_FINISH = {FinishReason.LENGTH: "length", FinishReason.EOS: "stop", FinishReason.STOP: "stop"}


class ApiError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self, status: int, message: str, *, type_: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str | None, message: str, code: str | None = None) -> ApiError:
    return ApiError(400, message, type_="invalid_request_error", param=param, code=code)


@dataclass(frozen=True)
class ServedModel:
    """The served model's ``name`` (``served_model_name``, by default the checkpoint's) and its
    ``aliases``: the store's model id, the name before ``served_model_name`` existed, so that
    clients written against it go on working. ``/v1/models`` and error messages show the name."""

    name: str
    aliases: frozenset[str] = frozenset()

    def named_by(self, model: str) -> bool:
        """Whether a request's ``model`` names this model."""
        return model == self.name or model in self.aliases


def served_model(configured: str, manifest: StoreManifest) -> ServedModel:
    """The model as the HTTP API names it: ``configured`` (``served_model_name``), else the
    checkpoint's name, else the store's model id; the model id is always an alias. A checkpoint
    name that is not printable (a directory named in bytes that are not UTF-8) is passed over."""
    checkpoint = manifest.checkpoint_name if manifest.checkpoint_name.isprintable() else ""
    name = configured or checkpoint or manifest.model_id
    return ServedModel(name, frozenset({manifest.model_id}) - {name})


@dataclass(frozen=True)
class ApiRequest:
    """A parsed body: what the engine runs, and how the answer is to be written."""

    generation: GenerationRequest
    model: str
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk carrying usage
    logprobs: bool
    chat: bool


# -- parsing ----------------------------------------------------------------------------------------
def _shown(value: object) -> str:
    """``value`` for a message: a number of hundreds of digits as its head, tail and length."""
    text = repr(value)
    if len(text) <= MAX_SHOWN_CHARS:
        return text
    return f"{text[:8]}...{text[-8:]} ({len(text)} characters)"


def _number(
    body: dict, name: str, default: float, low: float, high: float, *, low_open: bool = False
) -> float:
    """A float field within [low, high] (``low_open``: (low, high]). Integers are compared as
    they are (exactly, whatever their size: ``math.isfinite`` would overflow on a 400-digit one)."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise invalid(name, f"'{name}' must be a number, got {_shown(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise invalid(name, f"'{name}' must be a number, got {value!r}")
    if value < low or value > high or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise invalid(name, f"'{name}' {_shown(value)} is out of range {bracket}{low:g}, {high:g}]")
    return float(value)


def _integer(body: dict, name: str, default: int | None, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(name, f"'{name}' must be an integer, got {_shown(value)}")
    if not low <= value <= high:
        raise invalid(name, f"'{name}' {_shown(value)} is out of range [{low}, {high}]")
    return value


def _unicode(value: str, param: str) -> str:
    """``value``, refused (400 naming ``param``) when it holds a lone surrogate: JSON's
    ``"\\ud800"`` escape decodes to one, which is no character and has no UTF-8 (tokenising it,
    or writing it into an answer, would fail)."""
    try:
        value.encode()
    except UnicodeEncodeError as exc:
        raise invalid(
            param,
            f"'{param}' is not valid Unicode: it holds a lone surrogate "
            f"(U+{ord(value[exc.start]):04X} at character {exc.start})",
        ) from None
    return value


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise invalid("stop", "'stop' must be a string or a list of strings")
    if len(stop) > OPENAI_MAX_STOP:
        raise invalid("stop", f"'stop' holds {len(stop)} strings; at most {OPENAI_MAX_STOP}")
    if any(not s for s in stop):
        raise invalid("stop", "'stop' holds an empty string")
    return tuple(_unicode(s, "stop") for s in stop)


def _seed(body: dict) -> int:
    """OpenAI's seed, where 0 is a seed like any other; the engine's 0 means "draw a fresh one"."""
    seed = _integer(body, "seed", None, 0, MAX_SEED)
    if seed is None:
        return 0
    return seed or ZERO_SEED


def _common(body: object) -> dict:
    """The fields completions and chat share, checked; the keyword arguments of the request."""
    if not isinstance(body, dict):
        raise invalid(None, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model", "'model' is required: a model id from GET /v1/models")
    _unicode(model, "model")
    for name in _UNSUPPORTED:
        if body.get(name) not in (None, [], {}, ""):
            raise invalid(name, f"'{name}' is not supported by this service")
    if body.get("n") not in (None, 1):
        raise invalid("n", "'n' must be 1: this service generates one choice")
    if body.get("best_of") not in (None, 1):
        raise invalid("best_of", "'best_of' must be 1: this service generates one choice")
    if body.get("echo"):
        raise invalid("echo", "'echo' is not supported by this service")
    if _number(body, "frequency_penalty", 0.0, -2.0, 2.0) != 0.0:
        raise invalid("frequency_penalty", "'frequency_penalty' is not supported: use presence_penalty")
    stream = body.get("stream", False)
    if not isinstance(stream, bool | None):
        raise invalid("stream", f"'stream' must be a boolean, got {stream!r}")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise invalid("stream_options", "'stream_options' must be an object")
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise invalid("stream_options", "'stream_options.include_usage' must be a boolean")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise invalid("ignore_eos", f"'ignore_eos' must be a boolean, got {ignore_eos!r}")
    return {
        "ignore_eos": ignore_eos,
        "model": model,
        "stream": bool(stream),
        "include_usage": include_usage,
        "sampling": SamplingParams(
            temperature=_number(body, "temperature", 1.0, 0.0, OPENAI_MAX_TEMPERATURE),
            top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
            seed=_seed(body),
            presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        ),
        "stop": _stop(body),
    }


def _max_tokens(body: dict, names: tuple[str, ...], default: int, limit: int) -> dict:
    """The ``GenerationRequest`` fields of the count asked for under the first of ``names``
    given: that count exactly, or without one ``default`` as a ceiling the engine lowers to what
    the prompt leaves of the total-token limit (``fit_max_new_tokens``)."""
    for name in names:
        value = _integer(body, name, None, 1, limit)
        if value is not None:
            return {"max_new_tokens": value, "fit_max_new_tokens": False}
    return {"max_new_tokens": min(default, limit), "fit_max_new_tokens": True}


def completion_request(body: object, *, max_new_tokens_limit: int, request_id: str) -> ApiRequest:
    """A ``POST /v1/completions`` body; ``ApiError`` (400) naming the bad field."""
    common = _common(body)
    prompt = body.get("prompt")
    text, token_ids = "", ()
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        if not prompt:
            raise invalid("prompt", "'prompt' is empty")
        text = _unicode(prompt, "prompt")
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        token_ids = tuple(prompt)
    else:
        raise invalid("prompt", "'prompt' must be a non-empty string or a list of token ids (one prompt)")
    logprobs = _integer(body, "logprobs", None, 0, 5)
    if logprobs:
        raise invalid(
            "logprobs",
            "'logprobs' > 0 (alternative tokens) is not supported: use 0 for the chosen tokens' logprobs",
        )
    default = COMPLETIONS_DEFAULT_MAX_TOKENS
    return ApiRequest(
        generation=GenerationRequest(
            text=text,
            token_ids=token_ids,
            **_max_tokens(body, ("max_tokens",), default, max_new_tokens_limit),
            sampling=common["sampling"],
            stop=common["stop"],
            ignore_eos=common["ignore_eos"],
            request_id=request_id,
            logprobs=logprobs is not None,
        ),
        model=common["model"],
        stream=common["stream"],
        include_usage=common["include_usage"],
        logprobs=logprobs is not None,
        chat=False,
    )


def _content(message: dict, i: int) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return _unicode(content, f"messages[{i}].content")
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise invalid(f"messages[{i}].content[{j}]", "only text content parts are supported")
            parts.append(_unicode(part["text"], f"messages[{i}].content[{j}]"))
        return "".join(parts)
    raise invalid(f"messages[{i}].content", "'content' must be a string or a list of text parts")


def chat_request(body: object, *, max_new_tokens_limit: int, request_id: str) -> ApiRequest:
    """A ``POST /v1/chat/completions`` body; ``ApiError`` (400) naming the bad field."""
    common = _common(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "'messages' must be a non-empty list of {role, content} objects")
    parsed = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise invalid(f"messages[{i}]", "each message must be an object with a string 'role'")
        role = _unicode(message["role"], f"messages[{i}].role")
        parsed.append(ChatMessage(role, _content(message, i)))
    logprobs = body.get("logprobs", False)
    if not isinstance(logprobs, bool | None):
        raise invalid("logprobs", f"'logprobs' must be a boolean, got {logprobs!r}")
    if _integer(body, "top_logprobs", 0, 0, 20):
        raise invalid("top_logprobs", "'top_logprobs' > 0 is not supported: the chosen tokens' logprobs only")
    return ApiRequest(
        generation=GenerationRequest(
            messages=tuple(parsed),
            **_max_tokens(
                body, ("max_completion_tokens", "max_tokens"), max_new_tokens_limit, max_new_tokens_limit
            ),
            sampling=common["sampling"],
            stop=common["stop"],
            ignore_eos=common["ignore_eos"],
            request_id=request_id,
            logprobs=bool(logprobs),
        ),
        model=common["model"],
        stream=common["stream"],
        include_usage=common["include_usage"],
        logprobs=bool(logprobs),
        chat=True,
    )


# -- answers ----------------------------------------------------------------------------------------
def model_list(name: str, created: int) -> dict:
    """``GET /v1/models``: the served model, by its name (its aliases are not listed)."""
    return {
        "object": "list",
        "data": [{"id": name, "object": "model", "created": created, "owned_by": "expertcache"}],
    }


@dataclass
class Completion:
    """One request's answer, built from its token events: SSE chunks as they come, or the whole
    object at the end."""

    request: ApiRequest
    id: str
    created: int = field(default_factory=lambda: int(time.time()))
    text: list[str] = field(default_factory=list)
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None

    @property
    def object(self) -> str:
        if self.request.chat:
            return "chat.completion.chunk" if self.request.stream else "chat.completion"
        return "text_completion"

    def add(self, event: TokenEvent) -> None:
        if event.prompt_tokens is not None:
            self.prompt_tokens = event.prompt_tokens
        self.completion_tokens += 1
        self.text.append(event.text)
        if self.request.logprobs:
            self.tokens.append(event.text)
            self.token_logprobs.append(event.logprob if event.logprob is not None else 0.0)
        if event.finish_reason is not None:
            self.finish_reason = _FINISH[event.finish_reason]

    def usage(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }

    def _logprobs(self, start: int, end: int) -> dict | None:
        if not self.request.logprobs:
            return None
        tokens, values = self.tokens[start:end], self.token_logprobs[start:end]
        if self.request.chat:
            return {
                "content": [
                    {"token": t, "logprob": v, "bytes": list(t.encode()), "top_logprobs": []}
                    for t, v in zip(tokens, values, strict=True)
                ]
            }
        offset = sum(len(t) for t in self.tokens[:start])
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": None, "text_offset": offsets}

    def _envelope(self, choices: list, usage: dict | None) -> dict:
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.request.model,
            "choices": choices,
            "usage": usage,
        }

    def chunk(self, event: TokenEvent) -> dict:
        """The SSE chunk of the event just ``add``ed."""
        end = self.completion_tokens
        finish = _FINISH[event.finish_reason] if event.finish_reason is not None else None
        if self.request.chat:
            delta = {"content": event.text}
            if end == 1:
                delta = {"role": "assistant", **delta}
            choice = {
                "index": 0,
                "delta": delta,
                "logprobs": self._logprobs(end - 1, end),
                "finish_reason": finish,
            }
        else:
            choice = {
                "index": 0,
                "text": event.text,
                "logprobs": self._logprobs(end - 1, end),
                "finish_reason": finish,
            }
        return self._envelope([choice], None)

    def usage_chunk(self) -> dict:
        """The last chunk when ``stream_options.include_usage``: no choices, the usage."""
        return self._envelope([], self.usage())

    def whole(self) -> dict:
        text = "".join(self.text)
        logprobs = self._logprobs(0, self.completion_tokens)
        if self.request.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": logprobs,
                "finish_reason": self.finish_reason,
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": self.finish_reason}
        return self._envelope([choice], self.usage())
