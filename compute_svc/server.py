"""The gRPC edge of compute: ``moe.inference.v1.Inference`` converts and delegates, nothing else.

Every wire ↔ domain conversion lives in the ``*_from_pb`` / ``*_to_pb`` functions below; the
servicer hands domain requests to the ``Scheduler`` and domain errors travel back through
``expertcache.grpc_server.ErrorInterceptor`` as status codes. ``ComputeServer`` assembles the
process: daemon client → engine → scheduler → gRPC server with health and reflection.
"""

from __future__ import annotations

import logging
import socket

from grpc_health.v1 import health_pb2
from moe.inference.v1 import inference_pb2, inference_pb2_grpc

from compute_svc.activations import ActivationReporter, RoutingCapture
from compute_svc.cache_client import DaemonClient
from compute_svc.config import ComputeConfig
from compute_svc.forced_routing import ForcedRouting, load_trace
from compute_svc.generation import (
    FinishReason,
    GenerationRequest,
    ModelInfo,
    SamplingParams,
    TokenEvent,
    build_engine,
)
from compute_svc.layer_ahead import LayerAheadPredictor
from compute_svc.metrics import ComputeMetrics
from compute_svc.scheduler import Scheduler
from compute_svc.trace_recorder import TraceRecorder
from expertcache.grpc_server import build_server, set_serving

logger = logging.getLogger(__name__)

SERVICE_NAME = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name
_EXTRA_RPC_THREADS = 8  # GetModelInfo, health and reflection next to the queued Generate calls

_FINISH_TO_PB = {
    FinishReason.LENGTH: inference_pb2.FINISH_REASON_LENGTH,
    FinishReason.EOS: inference_pb2.FINISH_REASON_EOS,
    FinishReason.STOP: inference_pb2.FINISH_REASON_STOP,
}


# -- wire ↔ domain --------------------------------------------------------------------------------
def request_from_pb(pb: inference_pb2.GenerateRequest) -> GenerationRequest:
    return GenerationRequest(
        text=pb.text,
        token_ids=tuple(pb.token_ids),
        max_new_tokens=pb.max_new_tokens,
        sampling=SamplingParams(
            temperature=pb.sampling.temperature, top_p=pb.sampling.top_p, seed=pb.sampling.seed
        ),
        stop=tuple(pb.stop),
        stop_token_ids=tuple(pb.stop_token_ids),
        ignore_eos=pb.ignore_eos,
        request_id=pb.request_id,
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
    )


# -- the servicer ---------------------------------------------------------------------------------
class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler

    def Generate(self, request, context):  # noqa: N802 - gRPC method name
        handle = self._scheduler.submit(request_from_pb(request))
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

    def __init__(self, config: ComputeConfig) -> None:
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
                max_new_tokens_limit=config.max_new_tokens_limit,
                metrics=self.metrics,
            )
        except BaseException:
            self.client.close()
            raise
        try:
            self._enable_prediction(config)
        except BaseException:
            self.client.close()
            raise
        self.reporter, self.recorder = self._enable_routing(config)
        self.scheduler = Scheduler(self.engine, max_queue=config.max_queue, metrics=self.metrics)
        servicer = InferenceServicer(self.scheduler)
        self.server, self._health = build_server(
            config.listen_address,
            [lambda server: inference_pb2_grpc.add_InferenceServicer_to_server(servicer, server)],
            [SERVICE_NAME],
            # Every queued Generate holds a server thread while it waits for its turn.
            max_workers=config.max_queue + 1 + _EXTRA_RPC_THREADS,
        )
        # A restarted daemon leaves this process with a stale arena: report NOT_SERVING so the
        # pod's probe restarts it.
        self.client.on_stale = self._not_serving

    def _enable_prediction(self, config: ComputeConfig) -> None:
        """Layer-ahead prediction and forced routing (a benchmark feature), as configured."""
        loaded = self.engine.loaded
        runtime = self.engine.runtime
        if config.layer_ahead:
            runtime.layer_ahead = LayerAheadPredictor(
                loaded.model, loaded.experts_modules, depth=config.layer_ahead_depth
            )
        if config.force_routing_path:
            manifest = loaded.manifest
            runtime.forced = ForcedRouting(
                load_trace(config.force_routing_path),
                manifest.moe_layers,
                manifest.num_experts,
                manifest.top_k,
                first_request=config.force_routing_request,
                layer_ahead_accuracy=config.force_routing_layer_ahead_accuracy,
                accuracy_drop_per_depth=config.force_routing_accuracy_drop_per_depth,
            )
            logger.warning(
                "BENCHMARK MODE: expert routing forced from %s (first request %d, modelled lookahead "
                "accuracy %.2f at depth 1, %.2f less per depth): outputs are not the model's",
                config.force_routing_path,
                config.force_routing_request,
                config.force_routing_layer_ahead_accuracy,
                config.force_routing_accuracy_drop_per_depth,
            )

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

    def _not_serving(self, reason: str) -> None:
        logger.error("no longer serving: %s", reason)
        for name in (SERVICE_NAME, ""):
            self._health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    def start(self) -> None:
        self.scheduler.start()
        self.server.start()
        set_serving(self._health, [SERVICE_NAME])
        logger.info("serving %s on %s", SERVICE_NAME, self.config.listen_address)

    def wait(self) -> None:
        self.server.wait_for_termination()

    def stop(self, grace_s: float = 5.0) -> None:
        self._health.enter_graceful_shutdown()
        self.scheduler.stop()
        self.server.stop(grace_s).wait()
        if self.reporter is not None:
            self.reporter.close()
            logger.info("activation reporter:\n%s", self.reporter.render())
        if self.recorder is not None:
            self.recorder.close()
        self.client.close()
        logger.info("stopped; metrics:\n%s", self.metrics.render())
