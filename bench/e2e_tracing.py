"""``bench.e2e --tracing-costs``: what tracing costs ours. Three ``ours`` systems side by side,
tracing off, on at compute's default layer ratio and on at full sampling, exporting over
OTLP/gRPC to a receiver in this process that counts the spans."""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import grpc

from bench.report import fmt, say, write_json
from bench.stats import summarise
from bench.systems import ProcessSystem
from expertcache.manifest import StoreManifest

# Tracing off; on with the default trace_layer_ratio (ComputeConfig); on with every layer traced.
TRACING_MODES = (("off", None), ("on-default-ratio", None), ("on-full", "1.0"))


class _SpanSink:
    """An in-process OTLP trace receiver (a real gRPC server) that counts the spans it is sent."""

    def __init__(self) -> None:
        from concurrent import futures

        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        sink = self

        class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):  # noqa: N802 - gRPC method name
                sink.spans += sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
                return trace_service_pb2.ExportTraceServiceResponse()

        self.spans = 0
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), self.server)
        self.endpoint = f"http://127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()


def tracing_costs(store: Path, manifest: StoreManifest, args: argparse.Namespace, budget: int) -> int:
    """``ours`` three times side by side (tracing off, on at the default layer ratio, on at full
    sampling), started together and taking turns request by request, so that the machine's other
    load falls on all three alike."""
    sink = _SpanSink()
    keys = ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL",
            "EXPERTCACHE_COMPUTE_TRACE_LAYER_RATIO")  # fmt: skip
    saved = {k: os.environ.get(k) for k in keys}
    systems: dict[str, ProcessSystem] = {}
    results = {}
    try:
        with tempfile.TemporaryDirectory(prefix="e2e-tracing-", dir=args.data_dir) as tmp:
            try:
                for mode, ratio in TRACING_MODES:  # the environment at start decides a process's tracing
                    for key in keys:
                        os.environ.pop(key, None)
                    if mode != "off":
                        os.environ.update(
                            OTEL_TRACES_EXPORTER="otlp",
                            OTEL_EXPORTER_OTLP_ENDPOINT=sink.endpoint,
                            OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
                        )
                    if ratio is not None:
                        os.environ["EXPERTCACHE_COMPUTE_TRACE_LAYER_RATIO"] = ratio
                    systems[mode] = ProcessSystem("ours", store, manifest, Path(tmp) / mode, args, budget)
                for proc in systems.values():
                    proc.begin()
                before = sink.spans
                spans = dict.fromkeys(systems, 0)
                for r in range(args.requests):
                    for mode, proc in systems.items():
                        before = sink.spans
                        proc.measure(0, r)
                        spans[mode] += sink.spans - before  # exports lag a little: approximate
                for mode, proc in systems.items():
                    result = proc.finish()
                    result.update(summarise(result))
                    result["spans_exported"] = spans[mode]
                    results[mode] = result
                    say(f"[tracing {mode}] p50 {fmt(result['p50_s'] and result['p50_s'] * 1e3, '.1f')} ms")
            finally:
                for proc in systems.values():
                    proc.stop()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        sink.server.stop(0)
    off = results["off"]["p50_s"]
    say("")
    say(f"{'tracing':<18}{'p50 ms':>10}{'p99 ms':>10}{'vs off':>8}{'spans':>8}")
    for mode, _ in TRACING_MODES:
        r = results[mode]
        rel = r["p50_s"] / off if off and r["p50_s"] else None
        say(f"{mode:<18}{fmt(r['p50_s'] and r['p50_s'] * 1e3, '>10.2f'):>10}{fmt(r['p99_s'] and r['p99_s'] * 1e3, '>10.2f'):>10}"
            f"{fmt(rel, '>8.3f'):>8}{r['spans_exported']:>8}")  # fmt: skip
    out = args.out.with_name(args.out.stem + "-tracing.json")
    write_json(out, {"tokens": args.tokens, "requests": args.requests, "modes": results})
    say(f"wrote {out}")
    return 0
