"""Observability end to end: real compute, daemon and predictor processes.

Tracing is turned on by the standard OTEL_* environment alone and exported over OTLP/gRPC to an
in-process collector (a real gRPC server implementing the OTLP TraceService on a real port):
one Generate yields one trace holding spans of all three services, with the expected parent
links and attributes. Each service's /metrics, scraped over HTTP and parsed with
prometheus_client's parser, agrees with its GetStats.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import threading
import urllib.request
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from moe.cache.v1 import cache_pb2, cache_pb2_grpc
from moe.predictor.v1 import predictor_pb2, predictor_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from devtools.launch import free_port, start_compute, start_daemon, start_predictor
from tests import waiting
from tests.inference import greedy_tokens

pytestmark = pytest.mark.integration

PROMPT = list(range(5, 30))
NEW_TOKENS = 6
POD = "pod-obs"
REQUEST_ID = "obs-1"
REPO = Path(__file__).resolve().parents[2]
wait_for = functools.partial(waiting.wait_for, timeout_s=60.0, poll_s=0.2)


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP trace receiver: keeps every span it is sent, with its service's name."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spans: list[tuple[str, object]] = []  # (service.name, opentelemetry.proto Span)

    def Export(self, request, context):  # noqa: N802 - gRPC method name
        with self.lock:
            for resource_spans in request.resource_spans:
                service = next(
                    (
                        a.value.string_value
                        for a in resource_spans.resource.attributes
                        if a.key == "service.name"
                    ),
                    "",
                )
                for scope in resource_spans.scope_spans:
                    self.spans.extend((service, span) for span in scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace_of(self, request_id: str) -> list[tuple[str, object]]:
        """Every span of the trace whose Generate span has ``request_id``."""
        with self.lock:
            spans = list(self.spans)
        roots = [
            s for _, s in spans if s.name == "Generate" and attr(s, "expertcache.request_id") == request_id
        ]
        if not roots:
            return []
        return [(svc, s) for svc, s in spans if s.trace_id == roots[0].trace_id]


def attr(span, key: str):
    for a in span.attributes:
        if a.key == key:
            v = a.value
            return getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None
    return None


@pytest.fixture(scope="module")
def collector():
    receiver = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    receiver.endpoint = f"http://127.0.0.1:{port}"
    yield receiver
    server.stop(0)


@pytest.fixture(scope="module")
def stack(tiny_store, tmp_path_factory, collector):
    """The three services with tracing (every step's layers) and /metrics on, after one Generate."""
    tiny = tiny_store("mixtral")
    manifest = tiny.manifest
    work = tmp_path_factory.mktemp("obs")
    env = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
        "EXPERTCACHE_COMPUTE_TRACE_LAYER_RATIO": "1.0",
    }
    mp = pytest.MonkeyPatch()
    for key, value in env.items():
        mp.setenv(key, value)
    ports = {name: free_port() for name in ("compute", "daemon", "predictor")}
    procs = []
    try:
        predictor = start_predictor(work, extra=["--metrics-port", str(ports["predictor"])])
        procs.append(predictor)
        wiring = ["--predictor-address", predictor.address, "--pod-name", POD]
        daemon = start_daemon(
            tiny.store,
            work,
            device="cpu",
            device_budget_bytes=max(1, manifest.num_blobs // 4) * manifest.blob_bytes,
            extra=[*wiring, "--metrics-port", str(ports["daemon"])],
        )
        procs.append(daemon)
        compute = start_compute(
            tiny.store, daemon, work, extra=[*wiring, "--metrics-port", str(ports["compute"])]
        )
        procs.append(compute)
        with grpc.insecure_channel(compute.address) as channel:
            tokens = greedy_tokens(channel, PROMPT, NEW_TOKENS, timeout_s=120, request_id=REQUEST_ID)
        assert len(tokens) == NEW_TOKENS
        yield {"compute": compute, "daemon": daemon, "predictor": predictor, "ports": ports, "tiny": tiny}
    finally:
        for proc in reversed(procs):
            proc.stop()
        mp.undo()


def test_one_generate_is_one_trace_across_the_three_services(stack, collector):
    def complete():
        spans = collector.trace_of(REQUEST_ID)
        names = {(svc, s.name) for svc, s in spans}
        wanted = {
            ("expertcache-compute", "Generate"),
            ("expertcache-daemon", "acquire"),
            ("expertcache-daemon", "fetch"),
            ("expertcache-predictor", "observe"),
            ("expertcache-predictor", "publish_hints"),
            ("expertcache-daemon", "apply_hints"),
        }
        # Each service exports in its own batches: wait until every parent has arrived too.
        ids = {sp.span_id for _, sp in spans}
        orphans = [sp for _, sp in spans if sp.parent_span_id and sp.parent_span_id not in ids]
        roots = [sp for sp in orphans if sp.name == "/moe.inference.v1.Inference/Generate"]
        return wanted <= names and orphans == roots and spans

    spans = wait_for(complete, "one trace with spans of compute, daemon and predictor")
    by_id = {s.span_id: (svc, s) for svc, s in spans}
    assert {svc for svc, _ in spans} == {"expertcache-compute", "expertcache-daemon", "expertcache-predictor"}

    def parent(span):
        return by_id[span.parent_span_id][1] if span.parent_span_id in by_id else None

    def named(service, name):
        return [s for svc, s in spans if svc == service and s.name == name]

    # compute: the gRPC server span (opentelemetry-instrumentation-grpc) → Generate → step → moe_layer → acquire
    (generate,) = named("expertcache-compute", "Generate")
    assert parent(generate).name == "/moe.inference.v1.Inference/Generate"
    assert attr(generate, "expertcache.model") == stack["tiny"].manifest.model_id
    assert attr(generate, "expertcache.generated_tokens") == NEW_TOKENS
    steps = named("expertcache-compute", "step")
    assert len(steps) == NEW_TOKENS  # the prompt, then each fed-back token but the last
    assert all(parent(s) is generate for s in steps)
    assert sorted(attr(s, "expertcache.token_index") for s in steps) == list(range(NEW_TOKENS))
    layers = named("expertcache-compute", "moe_layer")
    assert len(layers) == NEW_TOKENS * len(stack["tiny"].manifest.moe_layers)
    assert all(parent(layer).name == "step" for layer in layers)
    compute_acquires = named("expertcache-compute", "acquire")
    assert all(parent(a).name == "moe_layer" for a in compute_acquires)

    # daemon: acquire under compute's acquire (Acquire.trace_context), fetch/wait under it
    daemon_acquires = named("expertcache-daemon", "acquire")
    assert daemon_acquires
    for a in daemon_acquires:
        up = by_id[a.parent_span_id]
        assert up[0] == "expertcache-compute" and up[1].name == "acquire"
        assert attr(a, "expertcache.layer") == attr(up[1], "expertcache.layer")
    fetches = named("expertcache-daemon", "fetch")
    assert all(parent(f).name == "acquire" for f in fetches)
    assert {attr(f, "expertcache.tier") for f in fetches} <= {"host", "store"}
    blob = stack["tiny"].manifest.blob_bytes
    assert all(attr(f, "expertcache.bytes") == blob for f in fetches)
    assert all(isinstance(attr(f, "expertcache.prefetch_hit"), bool) for f in fetches)
    assert all(attr(f, "expertcache.expert") is not None for f in fetches)
    assert all(attr(w, "expertcache.wait_s") >= 0 for w in named("expertcache-daemon", "wait"))

    # predictor: observe under the request's Generate span, and linked to it
    observes = named("expertcache-predictor", "observe")
    assert all(parent(o) is generate for o in observes)
    assert all(any(link.span_id == generate.span_id for link in o.links) for o in observes)
    assert all(attr(o, "expertcache.request_id") == REQUEST_ID for o in observes)
    publishes = named("expertcache-predictor", "publish_hints")
    assert all(parent(p).name == "observe" for p in publishes)
    # daemon again: the hints it applied, under the predictor's publish_hints
    applies = named("expertcache-daemon", "apply_hints")
    assert all(parent(a).name == "publish_hints" for a in applies)


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_agree_with_get_stats(stack):
    ports = stack["ports"]
    tier_names = {cache_pb2.TIER_DEVICE: "device", cache_pb2.TIER_HOST: "host", cache_pb2.TIER_STORE: "store"}

    def daemon_agrees():
        with grpc.insecure_channel(stack["daemon"].address) as channel:
            stats = cache_pb2_grpc.ExpertCacheStub(channel).GetStats(cache_pb2.GetStatsRequest(), timeout=10)
        got = scrape(ports["daemon"])
        for t in stats.tiers:
            tier = (("tier", tier_names[t.tier]),)
            for field, name in (
                ("hits", "hits"),
                ("misses", "misses"),
                ("bytes_in", "bytes_in"),
                ("evictions", "evictions"),
            ):
                if got.get((f"moe_cache_{name}_total", tier), 0) != getattr(t, field):
                    return None
        if (
            got[("moe_cache_demands_total", ())] != stats.demands
            or got[("moe_cache_pinned_slots", ())] != stats.pinned
        ):
            return None
        return stats, got

    stats, got = wait_for(daemon_agrees, "daemon /metrics = GetStats")
    device = next(t for t in stats.tiers if t.tier == cache_pb2.TIER_DEVICE)
    assert device.hits + device.misses > 0
    assert got[("moe_cache_resident_slots", (("tier", "device"),))] == device.resident
    assert got[("moe_cache_acquire_wait_seconds_count", ())] > 0

    def predictor_agrees():
        with grpc.insecure_channel(stack["predictor"].address) as channel:
            s = predictor_pb2_grpc.PredictorStub(channel).GetStats(
                predictor_pb2.GetStatsRequest(), timeout=10
            )
        got = scrape(ports["predictor"])
        pairs = (
            ("moe_predictor_observed_tokens_total", s.observed_tokens),
            ("moe_predictor_queries_total", s.queries),
            ("moe_predictor_requests_done_total", s.requests_done),
            ("moe_predictor_hint_batches_total", s.hint_batches_published),
            ("moe_predictor_live_requests", s.live_requests),
            ("moe_predictor_subscribers", s.subscribers),
        )
        if any(got.get((name, ()), 0) != value for name, value in pairs):
            return None
        return s, got

    pstats, pgot = wait_for(predictor_agrees, "predictor /metrics = GetStats")
    assert pstats.observed_tokens >= len(PROMPT)
    for model in pstats.models:
        assert pgot[("moe_predictor_eamc_entries", (("model", model.model_id),))] == model.eamc_entries

    cgot = scrape(ports["compute"])
    assert cgot[("moe_compute_tokens_total", ())] == NEW_TOKENS
    assert cgot[("moe_compute_requests_total", (("finish_reason", "length"),))] == 1
    assert cgot[("moe_compute_time_to_first_token_seconds_count", ())] == 1
    assert cgot[("moe_compute_request_duration_seconds_count", ())] == 1
    tiers = sum(v for (name, _), v in cgot.items() if name == "moe_compute_expert_acquires_total")
    assert tiers > 0


def test_compute_logs_one_json_line_per_request_with_its_trace(stack, collector):
    lines = [json.loads(line) for line in stack["compute"].log().splitlines() if line.startswith("{")]
    done = [entry for entry in lines if entry.get("request", {}).get("request_id") == REQUEST_ID]
    assert len(done) == 1
    (entry,) = done
    assert entry["level"] == "INFO"
    request = entry["request"]
    assert request["tokens"] == NEW_TOKENS and request["finish"] == "length"
    assert request["ttft_s"] > 0 and request["duration_s"] >= request["ttft_s"]
    assert request["hits"] + request["misses"] > 0
    generate = wait_for(
        lambda: next((s for _, s in collector.trace_of(REQUEST_ID) if s.name == "Generate"), None),
        "Generate span",
    )
    assert entry["trace_id"] == generate.trace_id.hex()
    assert entry["span_id"] == generate.span_id.hex()


def test_make_demo_exports_its_spans_from_the_environment_alone(collector, tmp_path):
    """``OTEL_EXPORTER_OTLP_ENDPOINT=… OTEL_TRACES_EXPORTER=otlp make demo``: nothing else set, the
    demo's generation reaches the collector as one trace of the three services."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(OTEL_TRACES_EXPORTER="otlp", OTEL_EXPORTER_OTLP_ENDPOINT=collector.endpoint)
    done = subprocess.run(
        [sys.executable, "-m", "devtools.demo", "--data-dir", str(tmp_path), "--max-new-tokens", "4"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]

    def demo_trace():
        spans = collector.trace_of("demo")
        services = {svc for svc, _ in spans}
        return services >= {"expertcache-compute", "expertcache-daemon", "expertcache-predictor"} and spans

    spans = wait_for(demo_trace, "the demo's trace with spans of compute, daemon and predictor")
    names = {s.name for _, s in spans}
    # Per-layer spans (moe_layer, acquire) follow the default trace_layer_ratio (0.05) and may be
    # absent from 4 tokens; the request's own spans are always there.
    assert {"Generate", "step", "observe", "publish_hints"} <= names, names
