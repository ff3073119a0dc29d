"""Tracing for the three services: OpenTelemetry, configured from the standard ``OTEL_*`` environment only.

Off unless the environment asks for it, and then nearly free: ``ENABLED`` is a plain module
flag the hot path tests before doing anything (no span objects, no dicts per token), and the
tracer is OpenTelemetry's no-op one.

On when ``OTEL_TRACES_EXPORTER`` names an exporter (``otlp``, ``console``; ``none`` = off) or,
with it unset, when an OTLP endpoint is set (``OTEL_EXPORTER_OTLP_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``); ``OTEL_SDK_DISABLED=true`` wins over both. The OTLP
protocol is ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_PROTOCOL``: ``grpc``
(the default, as in OpenTelemetry's Python distribution) or ``http/protobuf``. Everything else is
read by the SDK itself: endpoint, headers, timeout, ``OTEL_TRACES_SAMPLER`` /
``OTEL_TRACES_SAMPLER_ARG``, ``OTEL_BSP_*``, ``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``,
``OTEL_PROPAGATORS``.

The span tree of one request (``name`` [service]: attributes)::

    Generate [compute]                         model, request id, prompt/generated tokens
      step [compute]                           token index, batch size, request ids
        moe_layer [compute]                    layer, experts (1 in ``trace_layer_ratio`` steps)
          acquire [compute]                    layer, experts, device hits, wait
            acquire [daemon]                   (parent from Acquire.trace_context)
              fetch [daemon]                   expert, tier, bytes, prefetch hit, prefetch kind
              wait [daemon]                    wait time until the last expert was ready
      observe [predictor]                      token index (parent from Activation.trace_context)
        publish_hints [predictor]              hints; HintBatch.trace_context carries it on
          apply_hints [daemon]                 hints applied to the prefetch queue

Context crosses processes as W3C trace context: in gRPC metadata (the inference API, through
``opentelemetry-instrumentation-grpc``) and in ``trace_context`` map fields of the messages on
the long-lived streams (``Acquire`` on the daemon's Demand stream, ``Activation`` to the
predictor, ``HintBatch`` from it), where one stream carries many requests. The predictor's
spans are children of the request's Generate span and also link to it.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Mapping
from contextlib import AbstractContextManager

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, NoOpTracer, Span, SpanKind, Tracer

from expertcache.errors import InvalidArgument

logger = logging.getLogger(__name__)

__all__ = [
    "ENABLED",
    "Link",
    "SpanKind",
    "LayerSampler",
    "context_of",
    "extract",
    "inject",
    "install",
    "link_to",
    "span_from_message",
    "server_interceptors",
    "setup",
    "shutdown",
    "tracer",
    "tracing_requested",
]

ENABLED = False  # read by the hot path before anything else: keep it a plain module global
_tracer: Tracer = NoOpTracer()
_provider = None

EXPORTERS = ("otlp", "console", "none")
PROTOCOLS = ("grpc", "http/protobuf")
# Long-lived streams carry many requests: a span per stream would last the process's life and
# say nothing. Their messages carry trace context instead (see the module docstring).
UNTRACED_METHODS = ("Demand", "Observe", "SubscribeHints", "Check", "Watch", "ServerReflectionInfo")


def _exporter_names(environ: Mapping[str, str]) -> list[str]:
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    raw = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if not raw:
        has_endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get(
            "OTEL_EXPORTER_OTLP_ENDPOINT"
        )
        return ["otlp"] if has_endpoint else []
    names = [n.strip() for n in raw.split(",") if n.strip()]
    for name in names:
        if name not in EXPORTERS:
            raise InvalidArgument(
                f"OTEL_TRACES_EXPORTER={raw!r}: unknown exporter {name!r}; use one of {', '.join(EXPORTERS)}"
            )
    return [n for n in names if n != "none"]


def tracing_requested(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``environ`` (default ``os.environ``) turns tracing on; ``InvalidArgument`` if malformed."""
    return bool(_exporter_names(os.environ if environ is None else environ))


def _protocol(environ: Mapping[str, str]) -> str:
    for var in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        value = environ.get(var, "").strip().lower()
        if value:
            if value not in PROTOCOLS:
                raise InvalidArgument(f"{var}={value!r}: use one of {', '.join(PROTOCOLS)}")
            return value
    return "grpc"


def _exporter(name: str, environ: Mapping[str, str]):
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if _protocol(environ) == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


def setup(service_name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Configure tracing for this process from ``environ`` (default ``os.environ``); True if on.

    Called once at service start. Off: nothing is imported beyond the API and the tracer stays
    the no-op one. ``InvalidArgument`` names a malformed variable."""
    environ = os.environ if environ is None else environ
    names = _exporter_names(environ)
    if not names:
        return False
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    attributes = {} if environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: service_name}
    provider = TracerProvider(resource=Resource.create(attributes))  # sampler: OTEL_TRACES_SAMPLER
    for name in names:
        provider.add_span_processor(BatchSpanProcessor(_exporter(name, environ)))
    install(provider)
    logger.info(
        "tracing on: exporter %s%s, sampler %s",
        ",".join(names),
        f" ({_protocol(environ)})" if "otlp" in names else "",
        environ.get("OTEL_TRACES_SAMPLER", "parentbased_always_on"),
    )
    return True


def install(provider) -> None:
    """Trace with ``provider`` (an SDK ``TracerProvider``) from now on: what ``setup`` does once
    it has built one from the environment; tests pass one with an in-memory exporter."""
    global ENABLED, _tracer, _provider
    if not isinstance(trace.get_tracer_provider(), type(provider)):
        trace.set_tracer_provider(provider)  # global, once per process: instrumentation-grpc finds it
    _provider = provider
    _tracer = provider.get_tracer("expertcache")
    ENABLED = True


def shutdown() -> None:
    """Flush and stop the exporters (at service stop); a no-op when off."""
    global ENABLED, _tracer, _provider
    provider, _provider = _provider, None
    ENABLED = False
    _tracer = NoOpTracer()
    if provider is not None and hasattr(provider, "shutdown"):
        provider.shutdown()


def tracer() -> Tracer:
    return _tracer


def inject(span: Span | None = None) -> dict[str, str]:
    """W3C trace context of ``span`` (default: the current one) for a message's ``trace_context``."""
    carrier: dict[str, str] = {}
    ctx = trace.set_span_in_context(span) if span is not None else None
    propagate.inject(carrier, context=ctx)
    return carrier


def extract(carrier: Mapping[str, str]) -> Context | None:
    """The context a message's ``trace_context`` carries; None when it carries none (or tracing is off)."""
    if not ENABLED or not carrier:
        return None
    ctx = propagate.extract(dict(carrier))
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def context_of(span: Span) -> Context:
    return trace.set_span_in_context(span)


def link_to(ctx: Context | None) -> list[Link]:
    if ctx is None:
        return []
    return [Link(trace.get_current_span(ctx).get_span_context())]


def span_from_message(
    name: str, carrier: Mapping[str, str], kind: SpanKind, attributes: Mapping
) -> AbstractContextManager[Span]:
    """A current span ``name`` in the trace a message's ``trace_context`` (``carrier``) carries: its
    span is the parent and is linked too (so a backend shows the hop either way); a new trace when
    the message carries none."""
    parent = extract(carrier)
    return tracer().start_as_current_span(
        name, context=parent, kind=kind, links=link_to(parent), attributes=dict(attributes)
    )


class LayerSampler:
    """Which steps get per-layer spans (``moe_layer``, ``acquire``): a share ``ratio`` of them.

    A whole step's layers are sampled together, so a sampled step's tree is complete."""

    def __init__(self, ratio: float, rng: random.Random | None = None) -> None:
        if not 0.0 <= ratio <= 1.0:
            raise InvalidArgument(f"trace_layer_ratio must be within [0, 1], got {ratio}")
        self.ratio = ratio
        self._random = (rng or random.Random()).random

    def sample(self) -> bool:
        return self.ratio >= 1.0 or (self.ratio > 0.0 and self._random() < self.ratio)


def _method_filter():
    from opentelemetry.instrumentation.grpc import filters

    return filters.negate(filters.any_of(*(filters.method_name(m) for m in UNTRACED_METHODS)))


def server_interceptors() -> list:
    """``opentelemetry-instrumentation-grpc``'s server interceptor for a service's unary and
    short streaming RPCs (Generate, GetStats, ...), or nothing when tracing is off."""
    if not ENABLED:
        return []
    from opentelemetry.instrumentation.grpc import server_interceptor

    return [server_interceptor(tracer_provider=_provider, filter_=_method_filter())]
