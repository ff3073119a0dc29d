"""The generation engine: requests validated, then advanced together, one packed forward per step.

The scheduler decides which requests each step holds; ``generate`` drives one request alone
through the same ``step`` (tests, the equivalence seam). Nothing here knows gRPC. A step's walk:
docs/compute.md."""

from __future__ import annotations

import enum
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from compute_svc.engine.decode_step import DecodeStep
from compute_svc.engine.graph_step import GraphStep
from compute_svc.engine.kv_cache import (
    Segment,
    SequenceKV,
    cache_keyword,
    packed_forward,
    use_packed_attention,
)
from compute_svc.engine.model_loader import LoadedModel, load_model
from compute_svc.engine.requests import GenerationRequest, PreparedRequest, RequestCheck, RequestLimits
from compute_svc.engine.sampling import Sampler
from compute_svc.errors import FailedPrecondition
from compute_svc.experts.arena import Arena, resolve_device
from compute_svc.experts.moe import CacheCounters, ExpertProvider, ExpertRuntime, StepSegment, attach
from compute_svc.metrics import ComputeMetrics
from expertcache import telemetry
from expertcache.manifest import read_manifest

if TYPE_CHECKING:
    from compute_svc.daemon.wire import Attachment
    from compute_svc.engine.activations import ActivationReporter, RoutingCapture
    from compute_svc.engine.trace_recorder import TraceRecorder

logger = logging.getLogger(__name__)


_DETOKENIZE_CONTEXT = 5  # prompt tokens kept as context so the first piece decodes like the rest


# -- domain types ---------------------------------------------------------------------------------
class FinishReason(enum.Enum):
    LENGTH = "length"  # max_new_tokens were generated
    EOS = "eos"  # an end-of-sequence or stop token id was generated
    STOP = "stop"  # a stop string was completed


@dataclass(frozen=True)
class TokenStats:
    """Expert cache activity of the step that produced the token (shared by the step's requests)."""

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
    logprob: float | None = None  # set when the request asked for logprobs


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
    max_prompt_tokens: int = 0
    max_total_tokens: int = 0


# -- pieces of a request's decode ------------------------------------------------------------------
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


@dataclass
class RequestStats:
    """For a request's log line and span: cache activity of the steps it took part in (a step's
    counters are shared by its requests, as in ``TokenStats``), and its time to first token."""

    hits: int = 0
    misses: int = 0
    stall_s: float = 0.0
    ttft_s: float | None = None

    def add_step(self, counters: CacheCounters) -> None:
        self.hits += counters.hits
        self.misses += counters.misses
        self.stall_s += counters.stall_s


class RunningRequest:
    """One running request: what it has fed, what it must still feed, how it chooses and stops.

    Made by ``GenerationEngine.start``; advanced by ``GenerationEngine.step``; owned by one thread
    (the scheduler's)."""

    def __init__(self, prepared: PreparedRequest, routing_id: str, sampler: Sampler, detok, stop_ids) -> None:
        self.prepared = prepared
        self.routing_id = routing_id  # the id the daemon, predictor and trace know it by
        self.kv = SequenceKV()
        self.sampler = sampler
        self.detok = detok
        self.stop_ids: frozenset[int] = stop_ids
        self.pending: list[int] = list(prepared.prompt_ids)  # input not fed yet
        self.generated = 0
        self.text = ""  # generated text, kept only when stop strings need it
        self.last_event_at = prepared.arrived_at
        self.finish: FinishReason | None = None
        self.stats = RequestStats()
        self.span = None  # its Generate span while tracing is on and the request is sampled

    @property
    def request(self) -> GenerationRequest:
        return self.prepared.request

    @property
    def prompt_tokens(self) -> int:
        return len(self.prepared.prompt_ids)

    @property
    def in_prefill(self) -> bool:
        return self.generated == 0

    @property
    def position(self) -> int:
        """Request position of the next token fed."""
        return self.kv.length

    @property
    def done(self) -> bool:
        return self.finish is not None


# -- the engine -----------------------------------------------------------------------------------
class GenerationEngine:
    """Runs steps of many requests on the loaded model (driven by the scheduler's one thread)."""

    def __init__(
        self,
        loaded: LoadedModel,
        runtime: ExpertRuntime,
        *,
        max_new_tokens_limit: int = 4096,
        limits: RequestLimits | None = None,
        metrics: ComputeMetrics | None = None,
        native_decode: bool = True,
        graph_step: bool | None = None,
        graph_kv_rows: int = 4,
        graph_kv_tokens: int = 2048,
    ) -> None:
        self.loaded = loaded
        self._cache_keyword = cache_keyword(loaded.model)
        self.runtime = runtime
        # Validation against the limits (which never exceed the model's positions).
        self.requests = RequestCheck(loaded, limits or RequestLimits(max_new_tokens=max_new_tokens_limit))
        self.metrics = metrics or ComputeMetrics()
        self.model_id = ""  # names the model in spans and logs (set by build_engine)
        # Steps whose MoE layers get spans (moe_layer, acquire) while tracing: trace_layer_ratio.
        self.layer_sampler = telemetry.LayerSampler(0.05)
        # Routing capture (off unless enable_routing): each step's routing goes to the predictor's
        # reporter and/or the trace recorder, per request.
        self.routing_capture: RoutingCapture | None = None
        self.reporter: ActivationReporter | None = None
        self.recorder: TraceRecorder | None = None
        self.attention = use_packed_attention(loaded.model)
        # Steps that feed one token per request skip transformers' per-op overhead where it can
        # (compute_svc.engine.decode_step); None: every step is a transformers forward.
        self.decode_step = DecodeStep.build(loaded.model, self.attention.original) if native_decode else None
        # On a GPU such steps are replayed as CUDA graphs over a KV pool (compute_svc.engine.graph_step;
        # ``graph_step``: None = on a GPU, True = also elsewhere, eagerly). A request holds a pool
        # row when one is free and long enough (``graph_kv_tokens`` covers prompt + new tokens).
        self.graph_step: GraphStep | None = None
        if graph_step if graph_step is not None else loaded.device.type == "cuda":
            tokens = min(graph_kv_tokens, self.requests.limits.max_total_tokens)
            self.graph_step = GraphStep.build(
                loaded.model, self.attention.original, rows=graph_kv_rows, tokens=tokens
            )
        # Routing ids of the running requests: a client's request_id is only unique per client
        # (a retry reuses it), and the daemon, the reporter and the trace key requests by it.
        self._routing_ids: set[str] = set()
        self._routing_lock = threading.Lock()

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

    # -- running requests -------------------------------------------------------------------------
    def start(self, prepared: PreparedRequest) -> RunningRequest:
        """A request's running state; the daemon and the reporter learn of it."""
        request = prepared.request
        # Reports need an id even when the client gave none; ids of concurrent requests must differ:
        # a request_id already running (a client's retry, or two clients' ids) gets a suffix.
        routing_id = request.request_id or f"anon-{secrets.token_hex(8)}"
        with self._routing_lock:
            while routing_id in self._routing_ids:
                routing_id = f"{request.request_id}#{secrets.token_hex(4)}"
            self._routing_ids.add(routing_id)
        eos = frozenset() if request.ignore_eos else self.loaded.eos_token_ids
        try:
            seq = RunningRequest(
                prepared,
                routing_id,
                Sampler(request.sampling, prepared.prompt_ids, self.loaded.vocab_size, self.loaded.device),
                IncrementalDetokenizer(self.loaded.tokenizer, prepared.prompt_ids),
                eos | frozenset(request.stop_token_ids),
            )
        except BaseException:
            with self._routing_lock:
                self._routing_ids.discard(routing_id)
            raise
        if self.graph_step is not None:
            seq.kv = self.graph_step.new_kv(seq.prompt_tokens + request.max_new_tokens)
        if telemetry.ENABLED:
            self._start_span(seq, routing_id)
        self.runtime.begin_request(routing_id)
        logger.debug("request %r: %d prompt tokens", request.request_id, seq.prompt_tokens)
        return seq

    def finish(self, seq: RunningRequest, outcome: str) -> None:
        """``seq`` leaves (``outcome``: a finish reason, cancelled, expired or error): its KV goes,
        the daemon and the predictor are told (a cancelled request too: the predictor closes its
        EAM)."""
        self.runtime.end_request(seq.routing_id)
        with self._routing_lock:
            self._routing_ids.discard(seq.routing_id)
        if self.reporter is not None:
            self.reporter.on_request_end(seq.routing_id)
        if self.recorder is not None:
            self.recorder.on_request_end(seq.routing_id, outcome)
        seq.kv.close()  # a pool row goes back to its pool
        seq.kv = SequenceKV()
        duration_s = time.perf_counter() - seq.prepared.arrived_at
        self.metrics.record_finish(outcome, duration_s if seq.generated else None)
        span, seq.span = seq.span, None
        stats = seq.stats
        if span is not None:
            span.set_attributes(
                {
                    "expertcache.generated_tokens": seq.generated,
                    "expertcache.finish": outcome,
                    "expertcache.hits": stats.hits,
                    "expertcache.misses": stats.misses,
                    "expertcache.stall_s": stats.stall_s,
                }
            )
            span.end()
        # One line per finished request (fields also as structured extras for JSON logs).
        fields = {
            "request_id": seq.routing_id,
            "prompt_tokens": seq.prompt_tokens,
            "tokens": seq.generated,
            "ttft_s": round(stats.ttft_s, 6) if stats.ttft_s is not None else None,
            "duration_s": round(duration_s, 6),
            "hits": stats.hits,
            "misses": stats.misses,
            "stall_s": round(stats.stall_s, 6),
            "finish": outcome,
        }
        logger.info(
            "request %s: %d prompt + %d generated tokens in %.3fs (ttft %s), hits %d, misses %d, finish %s",
            seq.routing_id,
            seq.prompt_tokens,
            seq.generated,
            duration_s,
            f"{stats.ttft_s:.3f}s" if stats.ttft_s is not None else "-",
            stats.hits,
            stats.misses,
            outcome,
            extra={"request": fields, "span": span},
        )

    def _start_span(self, seq: RunningRequest, routing_id: str) -> None:
        started_ns = time.time_ns() - int((time.perf_counter() - seq.prepared.arrived_at) * 1e9)
        span = telemetry.tracer().start_span(
            "Generate",
            context=seq.prepared.trace_parent,
            kind=telemetry.SpanKind.INTERNAL,
            start_time=started_ns,
            attributes={
                "expertcache.model": self.model_id,
                "expertcache.request_id": routing_id,
                "expertcache.prompt_tokens": seq.prompt_tokens,
            },
        )
        if span.is_recording():
            seq.span = span
            if self.reporter is not None:  # the predictor's spans join this request's trace
                self.reporter.set_trace_context(routing_id, telemetry.inject(span))

    @torch.inference_mode()
    def step(
        self,
        plan: Sequence[tuple[RunningRequest, int]],
        *,
        deadline: float | None = None,
        before_layers: Callable[[], None] | None = None,
    ) -> list[tuple[RunningRequest, TokenEvent]]:
        """One forward over ``plan`` (each request with how many of its pending tokens to feed:
        all of a decode token, or a chunk of its prompt); returns a token event for every request
        whose input is then all fed. A failure leaves every request's KV as it was. ``deadline``
        (``time.monotonic()``): no wait for experts goes beyond it (``DeadlineExceeded``).
        ``before_layers`` is called once the step's inputs are made, just before its layers run
        (the scheduler hands the last step's tokens to their readers there)."""
        device = self.loaded.device
        ids: list[int] = []
        positions: list[int] = []
        segments: list[Segment] = []
        step_segments: list[StepSegment] = []
        logits_rows: list[int] = []
        emitting: list[RunningRequest] = []
        for seq, n in plan:
            if not 0 < n <= len(seq.pending):
                raise ValueError(
                    f"plan feeds {n} of the {len(seq.pending)} pending tokens of {seq.routing_id}"
                )
            chunk = seq.pending[:n]
            first = seq.position
            step_segments.append(StepSegment(seq.routing_id, len(ids), n, first, seq.generated))
            ids += chunk
            positions += range(first, first + n)
            segments.append(Segment(seq.kv, n))
            if n == len(seq.pending):  # its input is all fed: this forward chooses its next token
                logits_rows.append(len(ids) - 1)
                emitting.append(seq)
        # One host→device transfer for the step's three index tensors (a non-blocking one from
        # page-locked memory on a GPU: the host does not wait for it).
        uploaded = upload(ids + positions + logits_rows, device)
        t = len(ids)
        input_ids = uploaded[:t].view(1, t)  # [1, T]
        position_ids = uploaded[t : 2 * t].view(1, t)  # [1, T]
        keep = uploaded[2 * t :]
        if self.routing_capture is not None:
            self.routing_capture.begin()
        self.runtime.begin_step(step_segments, deadline=deadline)
        step_span = self._start_step_span(plan) if telemetry.ENABLED else None
        failed = True
        try:
            caches = [s.kv for s in segments]
            graph = self.graph_step is not None and t == len(plan) and self.graph_step.covers(caches)
            native = not graph and self.decode_step is not None and t == len(plan)  # one token per request
            if before_layers is not None and not native:  # the native step calls it at its first layer
                before_layers()
            if graph:
                step_logits = self.graph_step.forward(input_ids, position_ids, caches)
                logits = step_logits.index_select(0, keep) if logits_rows else None  # [rows, V]
            elif native:
                step_logits = self.decode_step.forward(input_ids, position_ids, caches, before_layers)
                logits = step_logits.index_select(0, keep) if logits_rows else None  # [rows, V]
            else:
                with packed_forward(segments) as cache:
                    out = self.loaded.model(
                        input_ids=input_ids,
                        position_ids=position_ids,
                        use_cache=True,
                        **{self._cache_keyword: cache},
                        logits_to_keep=keep if logits_rows else 1,
                    )
                logits = out.logits[0] if logits_rows else None  # [rows, V]
            failed = False
        finally:
            if failed:
                self.runtime.end_step(failed=True)
                if step_span is not None:
                    self.runtime.trace_parent = None
                    step_span.end()
        for seq, n in plan:
            seq.kv.commit(n)
            del seq.pending[:n]
        if self.routing_capture is not None:
            self._report_routing(step_segments, {seq.routing_id: seq.prompt_tokens for seq, _ in plan})
        events = []
        for row, seq in enumerate(emitting):
            events.append((seq, self._emit(seq, logits[row])))
        # Token picks waited for the device: the step's last experts may be released.
        self.runtime.end_step()
        counters = self.runtime.reset_counters()
        stats = TokenStats(counters.hits, counters.misses, counters.stall_s)
        events = [(seq, _with_stats(event, stats)) for seq, event in events]
        self.metrics.record_step(counters, len(plan), sum(n for _, n in plan))
        for seq, _ in plan:
            seq.stats.add_step(counters)
        for seq, event in events:
            self.metrics.record_token(event.latency_s, first=event.index == 0)
            if event.index == 0:
                seq.stats.ttft_s = event.latency_s
        if step_span is not None:
            self.runtime.trace_parent = None
            step_span.set_attributes(
                {
                    "expertcache.hits": counters.hits,
                    "expertcache.misses": counters.misses,
                    "expertcache.stall_s": counters.stall_s,
                }
            )
            step_span.end()
        return events

    def _start_step_span(self, plan: Sequence[tuple[RunningRequest, int]]):
        """The step's span, under the Generate span of its first traced request and linked to the
        others' (a batched step serves several requests); None when none of them is traced. A
        share ``layer_sampler.ratio`` of the steps also get their MoE layers traced."""
        traced = [seq for seq, _ in plan if seq.span is not None]
        if not traced:
            return None
        first = traced[0]
        span = telemetry.tracer().start_span(
            "step",
            context=telemetry.context_of(first.span),
            links=[telemetry.Link(seq.span.get_span_context()) for seq in traced[1:]],
            attributes={
                "expertcache.model": self.model_id,
                "expertcache.request_id": first.routing_id,
                "expertcache.token_index": first.generated,
                "expertcache.batch_requests": len(plan),
                "expertcache.batch_tokens": sum(n for _, n in plan),
                "expertcache.prefill": first.in_prefill,
            },
        )
        if self.layer_sampler.sample():
            self.runtime.trace_parent = telemetry.context_of(span)
        return span

    def _emit(self, seq: RunningRequest, logits: torch.Tensor) -> TokenEvent:
        """Choose ``seq``'s next token from ``logits`` [V] and advance its text and stop state."""
        request = seq.request
        token, logprob = seq.sampler.pick(logits, want_logprob=request.logprobs)
        index = seq.generated
        seq.generated += 1
        finish = None
        if token in seq.stop_ids:
            finish = FinishReason.EOS
        elif seq.generated == request.max_new_tokens:
            finish = FinishReason.LENGTH
        piece = seq.detok.add(token, final=finish is not None)
        if request.stop and finish is None:
            seq.text += piece
            window = seq.text[-(len(piece) + max(map(len, request.stop))) :]
            if any(s in window for s in request.stop):
                finish = FinishReason.STOP
        now = time.perf_counter()
        event = TokenEvent(
            index=index,
            token_id=token,
            text=piece,
            latency_s=now - seq.last_event_at,
            cache=TokenStats(),
            finish_reason=finish,
            prompt_tokens=seq.prompt_tokens if index == 0 else None,
            logprob=logprob,
        )
        seq.last_event_at = now
        seq.finish = finish
        if finish is None:
            seq.pending.append(token)  # fed back by its next step
        return event

    def _report_routing(self, segments: Sequence[StepSegment], prompt_tokens: dict[str, int]) -> None:
        for step in self.routing_capture.take(segments, with_weights=self.recorder is not None):
            if self.reporter is not None:
                self.reporter.on_step(step)
            if self.recorder is not None:
                self.recorder.on_step(step, prompt_tokens[step.request_id])

    # -- one request alone (tests, the equivalence seam) ------------------------------------------
    def generate(
        self,
        prepared: PreparedRequest,
        should_stop: Callable[[], bool] = lambda: False,
        *,
        prefill_chunk_tokens: int = 0,
    ) -> Iterator[TokenEvent]:
        """Token events of ``prepared`` run alone; stops early (quietly) once ``should_stop()`` is
        true. ``prefill_chunk_tokens`` feeds the prompt in chunks of that many tokens (0: whole)."""
        seq = self.start(prepared)
        outcome = "error"
        try:
            while not seq.done:
                if should_stop():
                    outcome = "cancelled"
                    logger.info("request %r cancelled after %d tokens", seq.request.request_id, seq.generated)
                    return
                n = len(seq.pending)
                if prefill_chunk_tokens and seq.in_prefill:
                    n = min(n, prefill_chunk_tokens)
                for _, event in self.step([(seq, n)]):
                    yield event
            outcome = seq.finish.value
        finally:
            self.finish(seq, outcome)

    @torch.inference_mode()
    def forward_logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Logits [P, V] of one forward pass over ``token_ids`` (no cache): the equivalence seam."""
        input_ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.loaded.device)
        self.runtime.begin_step([StepSegment("", 0, len(token_ids), 0, 0)])
        failed = True
        try:
            logits = self.loaded.model(input_ids=input_ids, use_cache=False).logits[0]
            failed = False
        finally:
            self.runtime.end_step(failed=failed)
        return logits

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
            max_new_tokens_limit=self.requests.limits.max_new_tokens,
            dtype=str(self.loaded.dtype).removeprefix("torch."),
            max_prompt_tokens=self.requests.limits.max_prompt_tokens,
            max_total_tokens=self.requests.limits.max_total_tokens,
        )


def upload(values: list[int], device: torch.device) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device``. To a GPU through page-locked memory (torch's
    caching host allocator reuses the buffer once the copy is done) without blocking the host: a
    plain ``torch.tensor(..., device=cuda)`` copies from pageable memory and waits."""
    host = torch.tensor(values, dtype=torch.long)
    if device.type != "cuda":
        return host if device.type == "cpu" else host.to(device)
    staged = torch.empty(host.shape, dtype=torch.long, pin_memory=True)
    staged.copy_(host)
    return staged.to(device, non_blocking=True)


def _with_stats(event: TokenEvent, stats: TokenStats) -> TokenEvent:
    return replace(event, cache=stats)


def build_engine(
    store_dir: str,
    attachment: Attachment,
    provider: ExpertProvider,
    *,
    device: str = "auto",
    max_new_tokens_limit: int = 4096,
    limits: RequestLimits | None = None,
    metrics: ComputeMetrics | None = None,
    graph_kv_rows: int = 4,
    graph_kv_tokens: int = 2048,
) -> GenerationEngine:
    """Map the arena, load the dense model and wire the experts forward to ``provider``."""
    local = read_manifest(store_dir)
    if local.model_id != attachment.manifest.model_id:
        raise FailedPrecondition(
            f"store {store_dir} holds model {local.model_id} but the cache daemon serves "
            f"{attachment.manifest.model_id}: point both at the same store"
        )
    torch_device = resolve_device(device, attachment.arena.kind)
    arena = Arena.open(
        attachment.arena, attachment.num_slots, attachment.slot_bytes, torch_device, attachment.arena_memory
    )
    # The arena decides the exact device (its GPU index); the dense weights go next to it.
    loaded = load_model(store_dir, attachment.manifest, arena.device)
    runtime = ExpertRuntime(provider, arena, attachment.manifest.tensors)
    attach(loaded.model, loaded.experts_modules, runtime)
    return GenerationEngine(
        loaded,
        runtime,
        max_new_tokens_limit=max_new_tokens_limit,
        limits=limits,
        metrics=metrics,
        graph_kv_rows=graph_kv_rows,
        graph_kv_tokens=graph_kv_tokens,
    )
