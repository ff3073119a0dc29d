"""The generation engine: one request at a time, prefill then a decode loop, token events out.

::

    GenerationRequest ─prepare─▶ PreparedRequest (validated prompt ids, limits)
        │
        ▼  generate()
    prefill: model(prompt [1, P]) ──▶ logits [V] + DynamicCache (made by the model itself)
    decode:  pick token (greedy argmax | temperature + top-p sampling with the request's
             torch.Generator) ─▶ detokenise incrementally ─▶ TokenEvent ─▶ stop? ─▶
             model(token [1, 1], cache) ──▶ logits [V] ─▶ …

Each forward runs the MoE layers through ``compute_svc.moe`` (experts from the daemon's arena);
the runtime's counters give each token its hits, misses and stall. Nothing here knows gRPC.
"""

from __future__ import annotations

import enum
import logging
import math
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from compute_svc.arena import Arena, resolve_device
from compute_svc.errors import FailedPrecondition, InvalidArgument
from compute_svc.metrics import ComputeMetrics
from compute_svc.model_loader import LoadedModel, load_model
from compute_svc.moe import ExpertProvider, ExpertRuntime, attach
from expertcache.manifest import read_manifest

if TYPE_CHECKING:
    from compute_svc.activations import ActivationReporter, RoutingCapture
    from compute_svc.cache_client import Attachment
    from compute_svc.trace_recorder import TraceRecorder

logger = logging.getLogger(__name__)

MAX_TEMPERATURE = 100.0
_DETOKENIZE_CONTEXT = 5  # prompt tokens kept as context so the first piece decodes like the rest


# -- domain types ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]; 0 is read as 1
    seed: int = 0  # 0 = draw a fresh seed


@dataclass(frozen=True)
class GenerationRequest:
    text: str = ""
    token_ids: tuple[int, ...] = ()
    max_new_tokens: int = 0
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    request_id: str = ""


class FinishReason(enum.Enum):
    LENGTH = "length"  # max_new_tokens were generated
    EOS = "eos"  # an end-of-sequence or stop token id was generated
    STOP = "stop"  # a stop string was completed


@dataclass(frozen=True)
class TokenStats:
    hits: int = 0
    misses: int = 0
    stall_s: float = 0.0


@dataclass(frozen=True)
class TokenEvent:
    index: int  # among generated tokens, from 0
    token_id: int
    text: str  # text added by this token ("" while a multi-byte character is incomplete)
    latency_s: float  # from the previous token, or from the request's arrival for the first
    cache: TokenStats
    finish_reason: FinishReason | None = None  # set on the last event only
    prompt_tokens: int | None = None  # set on the first event only


@dataclass(frozen=True)
class ModelInfo:
    model_type: str
    num_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    vocab_size: int
    expert_bytes: int
    total_expert_bytes: int
    device_slots: int
    has_tokenizer: bool
    max_new_tokens_limit: int
    dtype: str


@dataclass(frozen=True)
class PreparedRequest:
    """A validated request: prompt ids resolved, sampling normalised."""

    request: GenerationRequest
    prompt_ids: tuple[int, ...]
    top_p: float  # 1.0 when the request said 0
    arrived_at: float = field(default_factory=time.perf_counter)


# -- pieces of the decode loop --------------------------------------------------------------------
class IncrementalDetokenizer:
    """Text pieces from a growing id sequence, holding back incomplete UTF-8 characters.

    Decodes a short window (``ids[prefix:]`` against ``ids[prefix:read]``) instead of the whole
    text per token, and emits only once the window's text stops ending in U+FFFD.
    """

    def __init__(self, tokenizer, prompt_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._ids = list(prompt_ids[-_DETOKENIZE_CONTEXT:])
        self._prefix = 0
        self._read = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token_id: int, final: bool = False) -> str:
        if self._tokenizer is None:
            return ""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) > len(prefix_text) and (final or not new_text.endswith("\ufffd")):
            self._prefix, self._read = self._read, len(self._ids)
            return new_text[len(prefix_text) :]
        return ""


class TokenPicker:
    """Greedy argmax, or temperature + top-p sampling from the request's own generator."""

    def __init__(self, sampling: SamplingParams, top_p: float, device: torch.device) -> None:
        self.temperature = sampling.temperature
        self.top_p = top_p
        self.generator: torch.Generator | None = None
        if self.temperature > 0:
            seed = sampling.seed or secrets.randbits(63)
            self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor) -> int:
        """logits [V] → token id."""
        if self.generator is None:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.float() / self.temperature, dim=-1)  # [V] float32
        if self.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)  # [V], [V] int64
            # Drop a token when the mass before it already reaches top_p (the first always stays).
            drop = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= self.top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=self.generator))


# -- the engine -----------------------------------------------------------------------------------
class GenerationEngine:
    """Runs one request at a time on the loaded model (driven by the scheduler's worker)."""

    def __init__(
        self,
        loaded: LoadedModel,
        runtime: ExpertRuntime,
        *,
        max_new_tokens_limit: int,
        metrics: ComputeMetrics | None = None,
    ) -> None:
        self.loaded = loaded
        self.runtime = runtime
        self.max_new_tokens_limit = max_new_tokens_limit
        self.metrics = metrics or ComputeMetrics()
        # Routing capture (off unless enable_routing): each forward's routing goes to the
        # predictor's reporter and/or the trace recorder.
        self.routing_capture: RoutingCapture | None = None
        self.reporter: ActivationReporter | None = None
        self.recorder: TraceRecorder | None = None
        self._routing_id = ""  # id the running request is reported under

    def enable_routing(
        self,
        capture: RoutingCapture,
        reporter: ActivationReporter | None = None,
        recorder: TraceRecorder | None = None,
    ) -> None:
        """Capture every forward's routing and hand it to ``reporter`` and ``recorder``."""
        self.routing_capture = capture
        self.reporter = reporter
        self.recorder = recorder
        self.runtime.routing_observer = capture

    # -- validation -------------------------------------------------------------------------------
    def prepare(self, request: GenerationRequest) -> PreparedRequest:
        """Validate ``request``; ``InvalidArgument`` names the bad field and value."""
        if request.text and request.token_ids:
            raise InvalidArgument("set only one of text and token_ids, not both")
        if not request.text and not request.token_ids:
            raise InvalidArgument("prompt is empty: set text or token_ids")
        limit = self.max_new_tokens_limit
        if not 1 <= request.max_new_tokens <= limit:
            raise InvalidArgument(f"max_new_tokens {request.max_new_tokens} is out of range [1, {limit}]")
        sampling = request.sampling
        if not (math.isfinite(sampling.temperature) and 0.0 <= sampling.temperature <= MAX_TEMPERATURE):
            raise InvalidArgument(
                f"sampling.temperature {sampling.temperature} is out of range [0, {MAX_TEMPERATURE:g}]"
            )
        if not (math.isfinite(sampling.top_p) and 0.0 <= sampling.top_p <= 1.0):
            raise InvalidArgument(f"sampling.top_p {sampling.top_p} is out of range (0, 1] (0 means 1)")
        tokenizer = self.loaded.tokenizer
        if request.text:
            if tokenizer is None:
                raise InvalidArgument("text was given but the model has no tokenizer: send token_ids instead")
            prompt_ids = tuple(tokenizer.encode(request.text))
            if not prompt_ids:
                raise InvalidArgument("prompt is empty: text encodes to no tokens")
        else:
            prompt_ids = tuple(int(t) for t in request.token_ids)
        vocab = self.loaded.vocab_size
        for field_name, ids in (("token_ids", prompt_ids), ("stop_token_ids", request.stop_token_ids)):
            for i, token in enumerate(ids):
                if not 0 <= token < vocab:
                    raise InvalidArgument(f"{field_name}[{i}] = {token} is out of range [0, {vocab})")
        if request.stop and tokenizer is None:
            raise InvalidArgument("stop strings need a tokenizer, which this model lacks: use stop_token_ids")
        if any(not s for s in request.stop):
            raise InvalidArgument("stop holds an empty string")
        return PreparedRequest(request=request, prompt_ids=prompt_ids, top_p=sampling.top_p or 1.0)

    # -- generation -------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward_logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Logits [P, V] of one forward pass over ``token_ids`` (no cache): the equivalence seam."""
        input_ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.loaded.device)
        failed = True
        try:
            logits = self.loaded.model(input_ids=input_ids, use_cache=False).logits[0]
            failed = False
        finally:
            self.runtime.end_step(failed=failed)
        return logits

    def generate(
        self, prepared: PreparedRequest, should_stop: Callable[[], bool] = lambda: False
    ) -> Iterator[TokenEvent]:
        """Token events of ``prepared``; stops early (quietly) once ``should_stop()`` is true."""
        if self.routing_capture is None:
            yield from self._generate(prepared, should_stop)
            return
        # Reports need an id even when the client gave none.
        self._routing_id = prepared.request.request_id or f"anon-{secrets.token_hex(8)}"
        outcome = "error"
        try:
            for event in self._generate(prepared, should_stop):
                if event.finish_reason is not None:
                    outcome = event.finish_reason.value
                yield event
            if outcome == "error":
                outcome = "cancelled"
        finally:
            # Also for cancelled and failed requests: the predictor closes the request's EAM.
            if self.reporter is not None:
                self.reporter.on_request_end(self._routing_id)
            if self.recorder is not None:
                self.recorder.on_request_end(self._routing_id, outcome)

    def _routed(self, index: int, prompt_tokens: int) -> None:
        """Hand the forward of generation step ``index`` to the reporter and the recorder."""
        first = 0 if index == 0 else prompt_tokens + index - 1  # position of the fed tokens
        step = self.routing_capture.take(self._routing_id, first, with_weights=self.recorder is not None)
        if step is None:
            logger.warning("a forward did not route every MoE layer: its routing is not reported")
            return
        if self.reporter is not None:
            self.reporter.on_step(step)
        if self.recorder is not None:
            self.recorder.on_step(step, prompt_tokens)

    def _generate(self, prepared: PreparedRequest, should_stop: Callable[[], bool]) -> Iterator[TokenEvent]:
        request = prepared.request
        pick = TokenPicker(request.sampling, prepared.top_p, self.loaded.device)
        detok = IncrementalDetokenizer(self.loaded.tokenizer, prepared.prompt_ids)
        eos = frozenset() if request.ignore_eos else self.loaded.eos_token_ids
        stop_ids = eos | frozenset(request.stop_token_ids)
        last = prepared.arrived_at
        self.runtime.reset_counters()
        logger.debug("request %r: %d prompt tokens", request.request_id, len(prepared.prompt_ids))
        # The daemon keys its per-request routing history by this id (the reported one if any).
        signal_id = self._routing_id if self.routing_capture is not None else request.request_id
        self.runtime.begin_request(signal_id or f"anon-{secrets.token_hex(8)}")
        try:
            yield from self._decode_loop(prepared, should_stop, pick, detok, stop_ids, last)
        finally:
            # After a failure or a cancellation, the last forward's pins (if any) go now.
            self.runtime.end_step(failed=True)
            self.runtime.end_request(self.runtime.request_id)

    def _decode_loop(
        self,
        prepared: PreparedRequest,
        should_stop: Callable[[], bool],
        pick: TokenPicker,
        detok: IncrementalDetokenizer,
        stop_ids: frozenset[int],
        last: float,
    ) -> Iterator[TokenEvent]:
        request = prepared.request
        model = self.loaded.model
        device = self.loaded.device
        text = ""
        with torch.inference_mode():
            input_ids = torch.tensor([prepared.prompt_ids], dtype=torch.long, device=device)  # [1, P]
            cache = None
            for index in range(request.max_new_tokens):
                if should_stop():
                    logger.info("request %r cancelled after %d tokens", request.request_id, index)
                    return
                # The model builds its own DynamicCache on the first call (sliding-window layers
                # included), exactly as model.generate does.
                if self.routing_capture is not None:
                    self.routing_capture.begin()
                prompt_tokens = len(prepared.prompt_ids)
                # Position of the forward's last token: the prompt's last, then each fed-back token.
                self.runtime.begin_step(index, prompt_tokens - 1 if index == 0 else prompt_tokens + index - 1)
                out = model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
                cache = out.past_key_values
                if self.routing_capture is not None:
                    self._routed(index, len(prepared.prompt_ids))
                token = pick(out.logits[0, -1])  # logits [V]
                # The pick waited for the device: the step's last experts may be released.
                self.runtime.end_step()
                counters = self.runtime.reset_counters()
                finish = None
                if token in stop_ids:
                    finish = FinishReason.EOS
                elif index == request.max_new_tokens - 1:
                    finish = FinishReason.LENGTH
                piece = detok.add(token, final=finish is not None)
                if request.stop and finish is None:
                    text += piece
                    window = text[-(len(piece) + max(map(len, request.stop))) :]
                    if any(s in window for s in request.stop):
                        finish = FinishReason.STOP
                now = time.perf_counter()
                event = TokenEvent(
                    index=index,
                    token_id=token,
                    text=piece,
                    latency_s=now - last,
                    cache=TokenStats(counters.hits, counters.misses, counters.stall_s),
                    finish_reason=finish,
                    prompt_tokens=len(prepared.prompt_ids) if index == 0 else None,
                )
                last = now
                self.metrics.record_token(event.latency_s, counters)
                yield event
                if finish is not None:
                    self.metrics.record_finish(finish.value)
                    logger.info(
                        "request %r: %d prompt + %d generated tokens in %.3fs, finish %s",
                        request.request_id,
                        len(prepared.prompt_ids),
                        index + 1,
                        now - prepared.arrived_at,
                        finish.value,
                    )
                    return
                input_ids = torch.tensor([[token]], dtype=torch.long, device=device)  # [1, 1]

    def model_info(self) -> ModelInfo:
        manifest = self.loaded.manifest
        return ModelInfo(
            model_type=manifest.model_type,
            num_layers=manifest.num_layers,
            moe_layers=tuple(manifest.moe_layers),
            num_experts=manifest.num_experts,
            top_k=manifest.top_k,
            vocab_size=self.loaded.vocab_size,
            expert_bytes=manifest.blob_bytes,
            total_expert_bytes=manifest.total_expert_bytes,
            device_slots=self.runtime.num_slots,
            has_tokenizer=self.loaded.tokenizer is not None,
            max_new_tokens_limit=self.max_new_tokens_limit,
            dtype=str(self.loaded.dtype).removeprefix("torch."),
        )


def build_engine(
    store_dir: str,
    attachment: Attachment,
    provider: ExpertProvider,
    *,
    device: str = "auto",
    max_new_tokens_limit: int = 4096,
    metrics: ComputeMetrics | None = None,
) -> GenerationEngine:
    """Map the arena, load the dense model and wire the experts forward to ``provider``."""
    local = read_manifest(store_dir)
    if local.model_id != attachment.manifest.model_id:
        raise FailedPrecondition(
            f"store {store_dir} holds model {local.model_id} but the cache daemon serves "
            f"{attachment.manifest.model_id}: point both at the same store"
        )
    torch_device = resolve_device(device, attachment.arena.kind)
    arena = Arena.open(attachment.arena, attachment.num_slots, attachment.slot_bytes, torch_device)
    # The arena decides the exact device (its GPU index); the dense weights go next to it.
    loaded = load_model(store_dir, attachment.manifest, arena.device)
    runtime = ExpertRuntime(provider, arena, attachment.manifest.tensors)
    attach(loaded.model, loaded.experts_modules, runtime)
    return GenerationEngine(loaded, runtime, max_new_tokens_limit=max_new_tokens_limit, metrics=metrics)
