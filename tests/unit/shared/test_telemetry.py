"""Tracing (expertcache.telemetry): configured from OTEL_* only, off by default and then touching
no tracing code on the token path; on, the compute span tree of a real engine's generation."""

from __future__ import annotations

import random

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from compute_svc.engine.requests import GenerationRequest
from compute_svc.engine.sampling import SamplingParams
from expertcache import telemetry
from expertcache.errors import InvalidArgument

GREEDY = SamplingParams(temperature=0.0)


@pytest.mark.parametrize(
    ("environ", "on"),
    [
        ({}, False),  # off by default
        ({"OTEL_TRACES_EXPORTER": "none"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"}, True),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
        ({"OTEL_TRACES_EXPORTER": "console,otlp"}, True),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}, False),
    ],
)
def test_tracing_is_configured_from_the_environment_alone(environ, on):
    assert telemetry.tracing_requested(environ) is on


def test_malformed_environment_names_the_variable():
    with pytest.raises(InvalidArgument, match="OTEL_TRACES_EXPORTER='jaeger': unknown exporter 'jaeger'"):
        telemetry.tracing_requested({"OTEL_TRACES_EXPORTER": "jaeger"})
    with pytest.raises(InvalidArgument, match="OTEL_EXPORTER_OTLP_PROTOCOL='http/json': use one of grpc"):
        telemetry.setup("t", {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})
    assert not telemetry.ENABLED


def test_layer_sampler_ratio():
    with pytest.raises(InvalidArgument, match=r"trace_layer_ratio must be within \[0, 1\], got 1.5"):
        telemetry.LayerSampler(1.5)
    assert not any(telemetry.LayerSampler(0.0).sample() for _ in range(100))
    assert all(telemetry.LayerSampler(1.0).sample() for _ in range(100))
    sampler = telemetry.LayerSampler(0.05, random.Random(1))
    share = sum(sampler.sample() for _ in range(10_000)) / 10_000
    assert 0.04 < share < 0.06


@pytest.fixture
def mixtral(local_engine):
    engine, _provider, tiny = local_engine("mixtral", limit=64)
    return engine, tiny


def run(engine, request_id: str, n: int = 4) -> list[int]:
    prepared = engine.requests.prepare(
        GenerationRequest(token_ids=tuple(range(5, 17)), max_new_tokens=n, ignore_eos=True,
                          sampling=GREEDY, request_id=request_id)
    )  # fmt: skip
    return [e.token_id for e in engine.generate(prepared)]


def test_off_touches_no_tracing_on_the_token_path(mixtral, monkeypatch):
    engine, _ = mixtral
    assert not telemetry.ENABLED

    def forbidden(*_args, **_kwargs):
        raise AssertionError("tracing code ran while tracing is off")

    for name in ("tracer", "inject", "context_of", "extract"):
        monkeypatch.setattr(telemetry, name, forbidden)
    engine.layer_sampler = telemetry.LayerSampler(1.0)
    assert len(run(engine, "off-1")) == 4
    assert engine.runtime.trace_parent is None


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    telemetry.install(provider)
    try:
        yield exporter
    finally:
        telemetry.shutdown()


def test_on_the_engine_builds_the_span_tree(mixtral, spans):
    engine, tiny = mixtral
    engine.model_id = tiny.manifest.model_id
    engine.layer_sampler = telemetry.LayerSampler(1.0)
    off_tokens = run(engine, "tree-0", 3)
    spans.clear()
    assert run(engine, "tree-1", 3) == off_tokens  # tracing never changes the output
    finished = spans.get_finished_spans()
    by_name: dict[str, list] = {}
    for span in finished:
        by_name.setdefault(span.name, []).append(span)
    (generate,) = by_name["Generate"]
    assert generate.attributes["expertcache.request_id"] == "tree-1"
    assert generate.attributes["expertcache.model"] == tiny.manifest.model_id
    assert generate.attributes["expertcache.generated_tokens"] == 3
    steps = by_name["step"]
    assert len(steps) == 3  # the prompt, then 2 fed-back tokens
    assert all(s.parent.span_id == generate.context.span_id for s in steps)
    assert [s.attributes["expertcache.token_index"] for s in steps] == [0, 1, 2]
    step_ids = {s.context.span_id for s in steps}
    layers = by_name["moe_layer"]
    assert len(layers) == 3 * len(tiny.manifest.moe_layers)
    assert all(layer.parent.span_id in step_ids for layer in layers)
    layer_ids = {layer.context.span_id for layer in layers}
    acquires = by_name["acquire"]
    assert acquires and all(a.parent.span_id in layer_ids for a in acquires)
    assert all(a.attributes["expertcache.layer"] in tiny.manifest.moe_layers for a in acquires)
    assert {s.context.trace_id for s in finished} == {generate.context.trace_id}


def test_on_with_ratio_zero_has_no_layer_spans(mixtral, spans):
    engine, _ = mixtral
    engine.layer_sampler = telemetry.LayerSampler(0.0)
    run(engine, "ratio-0", 3)
    names = [s.name for s in spans.get_finished_spans()]
    assert names.count("step") == 3 and names.count("Generate") == 1
    assert "moe_layer" not in names and "acquire" not in names
