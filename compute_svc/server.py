"""The gRPC edge of compute: ``moe.inference.v1.Inference`` converts and delegates, nothing else.

Every wire ↔ domain conversion lives in the ``*_from_pb`` / ``*_to_pb`` functions below; the
servicer hands domain requests to the ``Scheduler`` and domain errors travel back through
``expertcache.grpc_server.ErrorInterceptor`` as status codes. ``ComputeServer`` assembles the
process: daemon client → engine → scheduler → gRPC server with health and reflection.
"""

from __future__ import annotations

import logging
import math
import socket
import time
from collections.abc import Callable
from typing import TypeVar

from moe.inference.v1 import inference_pb2, inference_pb2_grpc

from compute_svc.config import ComputeConfig
from compute_svc.daemon.client import DaemonClient
from compute_svc.engine.activations import ActivationReporter, RoutingCapture
from compute_svc.engine.generation import FinishReason, ModelInfo, TokenEvent, build_engine
from compute_svc.engine.model_loader import LoadedModel
from compute_svc.engine.requests import ChatMessage, GenerationRequest, RequestLimits
from compute_svc.engine.sampling import SamplingParams
from compute_svc.engine.scheduler import BatchLimits, Scheduler
from compute_svc.engine.trace_recorder import TraceRecorder
from compute_svc.experts.arena import Arena
from compute_svc.experts.layer_ahead import LayerAheadPredictor
from compute_svc.experts.moe import RoutingOverride
from compute_svc.metrics import ComputeMetrics
from expertcache import telemetry
from expertcache.aio_bridge import NOT_SERVING, SERVING
from expertcache.grpc_server import build_server, set_serving
from expertcache.prom import serve
from expertcache.security import ClientSecurity, ServerSecurity, WatchedToken
from expertcache.transport import TransportLimits, peer_address

logger = logging.getLogger(__name__)

SERVICE_NAME = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name
_EXTRA_RPC_THREADS = 8  # GetModelInfo, health and reflection next to the queued Generate calls
_Limits = TypeVar("_Limits")

# Makes the routing override from the loaded model (its shape); raising stops the start-up.
RoutingOverrideFactory = Callable[[LoadedModel], RoutingOverride]

_FINISH_TO_PB = {
    FinishReason.LENGTH: inference_pb2.FINISH_REASON_LENGTH,
    FinishReason.EOS: inference_pb2.FINISH_REASON_EOS,
    FinishReason.STOP: inference_pb2.FINISH_REASON_STOP,
}


# -- wire ↔ domain --------------------------------------------------------------------------------
def request_from_pb(pb: inference_pb2.GenerateRequest, deadline: float | None = None) -> GenerationRequest:
    """``deadline``: the call's, on the ``time.monotonic()`` clock (None: the call has none)."""
    return GenerationRequest(
        text=pb.text,
        token_ids=tuple(pb.token_ids),
        messages=tuple(ChatMessage(m.role, m.content) for m in pb.messages),
        max_new_tokens=pb.max_new_tokens,
        sampling=SamplingParams(
            temperature=pb.sampling.temperature,
            top_p=pb.sampling.top_p,
            seed=pb.sampling.seed,
            top_k=pb.sampling.top_k,
            repetition_penalty=pb.sampling.repetition_penalty,
            presence_penalty=pb.sampling.presence_penalty,
        ),
        stop=tuple(pb.stop),
        stop_token_ids=tuple(pb.stop_token_ids),
        ignore_eos=pb.ignore_eos,
        request_id=pb.request_id,
        logprobs=pb.logprobs,
        deadline=deadline,
    )


def event_to_pb(event: TokenEvent) -> inference_pb2.GenerateResponse:
    pb = inference_pb2.GenerateResponse(
        index=event.index,
        token_id=event.token_id,
        text=event.text,
        latency_s=event.latency_s,
        cache=inference_pb2.TokenCacheStats(
            hits=event.cache.hits, misses=event.cache.misses, stall_s=event.cache.stall_s
        ),
    )
    if event.finish_reason is not None:
        pb.finish_reason = _FINISH_TO_PB[event.finish_reason]
    if event.prompt_tokens is not None:
        pb.prompt_tokens = event.prompt_tokens
    if event.logprob is not None:
        pb.logprob = event.logprob
    return pb


def model_info_to_pb(info: ModelInfo) -> inference_pb2.ModelInfo:
    return inference_pb2.ModelInfo(
        model_type=info.model_type,
        num_layers=info.num_layers,
        moe_layers=list(info.moe_layers),
        num_experts=info.num_experts,
        top_k=info.top_k,
        vocab_size=info.vocab_size,
        expert_bytes=info.expert_bytes,
        total_expert_bytes=info.total_expert_bytes,
        device_slots=info.device_slots,
        has_tokenizer=info.has_tokenizer,
        max_new_tokens_limit=info.max_new_tokens_limit,
        dtype=info.dtype,
        max_prompt_tokens=info.max_prompt_tokens,
        max_total_tokens=info.max_total_tokens,
    )


def _limits_of(config: ComputeConfig, limits_cls: type[_Limits], **config_names: str) -> _Limits:
    """``limits_cls`` (a dataclass) with each field the config field of the same name, or of the
    name ``config_names`` gives it (as ``TransportLimits.from_config``)."""
    return limits_cls(
        **{name: getattr(config, config_names.get(name, name)) for name in limits_cls.__dataclass_fields__}
    )


# -- the servicer ---------------------------------------------------------------------------------
class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler

    def Generate(self, request, context):  # noqa: N802 - gRPC method name
        remaining = context.time_remaining()
        deadline = time.monotonic() + remaining if remaining is not None else None
        client, _ = peer_address(context.peer())
        handle = self._scheduler.submit(request_from_pb(request, deadline), client=client)
        # Fires when the RPC ends for any reason; for a finished request it changes nothing.
        context.add_callback(handle.cancel)
        try:
            for event in handle:
                yield event_to_pb(event)
        finally:
            handle.cancel()

    def GetModelInfo(self, request, context):  # noqa: N802 - gRPC method name
        return model_info_to_pb(self._scheduler.engine.model_info())


# -- the process ----------------------------------------------------------------------------------
class ComputeServer:
    """The assembled compute process. ``start`` serves; ``stop`` drains and closes."""

    def __init__(
        self, config: ComputeConfig, *, routing_override: RoutingOverrideFactory | None = None
    ) -> None:
        """``routing_override``: made from the loaded model and installed on the expert runtime
        before serving (``moe.RoutingOverride``; a benchmark entry point's, never the service's)."""
        self.config = config
        self.metrics = ComputeMetrics()
        # The daemon first: without it nothing can run, and it decides the device.
        self.client = DaemonClient.connect(
            config.daemon_address,
            connect_timeout_s=config.daemon_connect_timeout_s,
            acquire_timeout_s=config.acquire_timeout_s,
            fast_path=config.shm_fast_path,
        )
        try:
            self.engine = build_engine(
                config.store_dir,
                self.client.attachment,
                self.client,
                device=config.device,
                limits=_limits_of(config, RequestLimits, max_new_tokens="max_new_tokens_limit"),
                metrics=self.metrics,
                graph_kv_rows=config.graph_kv_rows,
                graph_kv_tokens=config.graph_kv_tokens,
            )
        except BaseException:
            self.client.close()
            raise
        self.engine.model_id = self.engine.loaded.manifest.model_id
        self.engine.layer_sampler = telemetry.LayerSampler(config.trace_layer_ratio)
        self.metrics_server = None
        try:
            self._enable_prediction(config, routing_override)
        except BaseException:
            self.client.close()
            raise
        self.reporter, self.recorder = self._enable_routing(config)
        if self.reporter is not None:
            self.metrics.watch_activations(self.reporter.counter_values)
        self.scheduler = Scheduler(
            self.engine,
            limits=_limits_of(config, BatchLimits),
            metrics=self.metrics,
            recover=self._reattach,
            on_serving=self._set_serving,
            interrupt=self.client.interrupt,
        )
        servicer = InferenceServicer(self.scheduler)
        self.server, self._health = build_server(
            config.listen_address,
            [lambda server: inference_pb2_grpc.add_InferenceServicer_to_server(servicer, server)],
            [SERVICE_NAME],
            # A running or waiting Generate's generator holds a handler thread while it waits for
            # its tokens (never while its request or its reader is awaited).
            max_workers=config.max_batch_size + config.max_waiting_requests + _EXTRA_RPC_THREADS,
            security=ServerSecurity.from_config(config),
            reflection_enabled=config.reflection,
            limits=TransportLimits.from_config(config),
            registry=self.metrics.registry,
            name="compute-grpc",
        )
        # The daemon's stream ending while idle (it died): stop serving now and re-attach.
        self.client.on_stream_end = self.scheduler.daemon_lost
        self.http = self._http_server(config) if config.http_listen_address else None

    def _http_server(self, config: ComputeConfig):
        """The OpenAI-compatible HTTP API over the same scheduler (``compute_svc.http.api``)."""
        from compute_svc.http.api import HttpApi, HttpLimits
        from compute_svc.http.openai_schema import served_model
        from compute_svc.http.server import HttpServer

        limits = self.engine.requests.limits
        security = ServerSecurity.from_config(config)
        api = HttpApi(
            self.scheduler,
            model=served_model(config.served_model_name, self.engine.loaded.manifest),
            limits=HttpLimits(
                max_body_bytes=HttpLimits.body_bytes(limits.max_prompt_bytes, limits.max_prompt_tokens),
                max_requests=config.http_max_requests,
                max_requests_per_client=max(
                    1, math.ceil(config.max_client_share * config.http_max_requests - 1e-9)
                ),
                request_timeout_s=config.request_timeout_s,
                stream_stall_timeout_s=config.stream_stall_timeout_s,
            ),
            metrics=self.metrics,
            token=WatchedToken(config.auth_token_file, "auth_token_file") if config.auth_token_file else None,
            pool_threads=config.max_batch_size + config.max_waiting_requests + _EXTRA_RPC_THREADS,
        )
        return HttpServer(
            api,
            config.http_listen_address,
            max_requests=config.http_max_requests,
            idle_timeout_s=config.max_connection_idle_s,
            header_timeout_s=config.http_header_timeout_s,
            client_share=config.max_client_share,
            max_connections=config.http_max_connections,
            metrics=self.metrics,
            security=security,
            on_stop=api.close,
        )

    def _enable_prediction(
        self, config: ComputeConfig, routing_override: RoutingOverrideFactory | None
    ) -> None:
        """Layer-ahead prediction as configured, and the routing override given."""
        loaded = self.engine.loaded
        runtime = self.engine.runtime
        if config.layer_ahead:
            runtime.layer_ahead = LayerAheadPredictor(
                loaded.model, loaded.experts_modules, depth=config.layer_ahead_depth
            )
        if routing_override is not None:
            runtime.routing_override = routing_override(loaded)

    def _enable_routing(
        self, config: ComputeConfig
    ) -> tuple[ActivationReporter | None, TraceRecorder | None]:
        """Report routing to the predictor and/or record it, as configured (both off by default)."""
        if not config.predictor_address and not config.record_trace_path:
            return None, None
        manifest = self.engine.loaded.manifest
        reporter = recorder = None
        if config.predictor_address:
            reporter = ActivationReporter(
                config.predictor_address,
                manifest.model_id,
                config.pod_name or socket.gethostname(),
                manifest.top_k,
                config.report_queue_tokens,
                num_experts=manifest.num_experts,
                num_moe_layers=len(manifest.moe_layers),
                security=ClientSecurity.from_config(config),
            )
            logger.info("reporting routing to the predictor at %s", config.predictor_address)
        if config.record_trace_path:
            recorder = TraceRecorder(
                config.record_trace_path,
                {
                    "model": manifest.model_id,
                    "model_type": manifest.model_type,
                    "num_layers": len(manifest.moe_layers),
                    "moe_layer_ids": list(manifest.moe_layers),
                    "num_experts": manifest.num_experts,
                    "top_k": manifest.top_k,
                    "phases": "prefill rows 0..decode_start-1, then one row per generated token fed back "
                    "(the last generated token is never fed back)",
                    "gate_weights": "router weights as the model's router returned them",
                    "expert_id_order": "as the model's router returned them (top-k order)",
                    "source": "expertcache compute_svc record_trace_path",
                },
                every_requests=config.record_trace_every_requests,
            )
            logger.info("recording routing traces to %s", config.record_trace_path)
        self.engine.enable_routing(RoutingCapture(manifest.moe_layers), reporter, recorder)
        return reporter, recorder

    def _reattach(self) -> None:
        """Attach to the (restarted) cache daemon and read experts from its new arena."""
        attachment = self.client.reattach()
        runtime = self.engine.runtime
        arena = Arena.open(
            attachment.arena,
            attachment.num_slots,
            attachment.slot_bytes,
            runtime.arena.device,
            attachment.arena_memory,
        )
        runtime.remap(arena)

    def _set_serving(self, serving: bool, reason: str) -> None:
        status = SERVING if serving else NOT_SERVING
        if not serving:
            logger.error("not serving until the cache daemon is back: %s", reason)
        for name in (SERVICE_NAME, ""):
            self._health.set(name, status)

    def start(self) -> None:
        """Serve; ``OSError`` when the metrics port cannot be bound."""
        self.metrics_server = serve(
            self.metrics.registry, self.config.metrics_address, self.config.metrics_port, "compute"
        )
        self.scheduler.start()
        self.server.start()
        if self.http is not None:
            self.http.start()
        set_serving(self._health, [SERVICE_NAME])
        logger.info("serving %s on %s", SERVICE_NAME, self.config.listen_address)

    def wait(self) -> None:
        self.server.wait_for_termination()

    def stop(self, grace_s: float = 5.0, drain_timeout_s: float = 0.0) -> None:
        """NOT_SERVING at once; the streams in progress get ``drain_timeout_s`` to finish (new
        Generates are refused meanwhile), then whatever still runs is stopped."""
        self._health.enter_graceful_shutdown()
        if drain_timeout_s > 0:
            drained = self.scheduler.drain(drain_timeout_s)
            logger.info("drain %s", "complete" if drained else f"cut off after {drain_timeout_s:g}s")
        self.scheduler.stop()
        if self.http is not None:
            self.http.stop(grace_s)
        self.server.stop(grace_s).wait()
        if self.reporter is not None:
            self.reporter.close()
        if self.recorder is not None:
            self.recorder.close()
        self.client.close()
        if self.metrics_server is not None:
            self.metrics_server.close()
        logger.info("stopped; %d tokens generated", int(self.metrics.value("moe_compute_tokens_total")))
