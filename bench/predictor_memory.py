"""``python -m bench.predictor_memory``: the predictor and Redis under the chart's default bounds.

What it does, with a real redis-server and a real predictor (``python -m predictor_svc``) run with
the ``predictor.yaml`` the chart renders (``helm template``, the project's Helm from ``make helm``
or one on PATH):

1. registers 3 models of the largest shape the chart allows (``max_layers`` x ``max_experts``,
   top_k 8), as one unauthenticated client could; prints which were refused and why;
2. fills every registered model's EAMC to ``eamc_capacity`` (random EAMs written into Redis as
   another replica would: entries and change log) and waits until the predictor holds them all;
3. prints the predictor's RSS (``/proc/<pid>/status`` VmRSS, VmHWM) and redis-server's INFO
   ``used_memory`` / ``used_memory_rss`` / ``used_memory_peak`` against the chart's limits;
4. restarts the predictor over that EAMC and prints its peak RSS while loading (VmHWM) against
   its RSS once loaded (steady state), and the time from start to health SERVING.

Exit status 1 when a figure is beyond its bound (RSS or Redis beyond the chart's limit, a
restart peak beyond 1.2x the steady state, SERVING before the EAMC was loaded).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from moe.predictor.v1 import predictor_pb2, predictor_pb2_grpc

from bench.usage import MIB, memory_status, redis_memory
from devtools.launch import REPO, free_port
from devtools.redis_server import RedisServer
from predictor_svc.eam import encode_eam
from predictor_svc.store.redis_store import RedisStore

CHART = REPO / "helm" / "expertcache"
# make helm's Helm 4, or its npm fallback (Helm 3.6)
LOCAL_HELMS = (REPO / ".tools/helm/bin/helm", REPO / ".tools/helm/node_modules/.bin/helm")
UNITS = {
    "": 1,
    "Ki": 1 << 10,
    "Mi": 1 << 20,
    "Gi": 1 << 30,
    "Ti": 1 << 40,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
}
PEAK_FACTOR = 1.2


def quantity(text: str) -> int:
    """A Kubernetes memory quantity ("2Gi") in bytes."""
    text = str(text)
    number = text.rstrip("KMGTikm")
    return int(float(number) * UNITS[text[len(number) :]])


def helm_binary() -> str:
    for local in LOCAL_HELMS:
        if local.exists():
            return str(local)
    found = shutil.which("helm")
    if not found:
        sys.exit("bench.predictor_memory: no Helm: run `make helm` (or put helm 3 or 4 on PATH)")
    return found


def render_chart() -> tuple[dict, int, int]:
    """(the predictor config the chart renders, predictor memory limit, Redis memory limit)."""
    out = subprocess.run(
        [helm_binary(), "template", "bench", str(CHART), "--kube-version", "1.30.0"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    (config_map,) = [d for d in docs if d["kind"] == "ConfigMap" and "predictor.yaml" in d.get("data", {})]
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    return (
        yaml.safe_load(config_map["data"]["predictor.yaml"]),
        quantity(values["predictor"]["resources"]["limits"]["memory"]),
        quantity(values["redis"]["resources"]["limits"]["memory"]),
    )


def health(address: str) -> int | None:
    with grpc.insecure_channel(address) as channel:
        try:
            return (
                health_pb2_grpc.HealthStub(channel)
                .Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
                .status
            )
        except grpc.RpcError:
            return None


def stats(address: str) -> predictor_pb2.PredictorStats:
    with grpc.insecure_channel(address) as channel:
        return predictor_pb2_grpc.PredictorStub(channel).GetStats(predictor_pb2.GetStatsRequest(), timeout=10)


def start_predictor(config_file: Path, redis_url: str, address: str, log: Path) -> subprocess.Popen:
    args = ["--config-file", str(config_file), "--redis-url", redis_url, "--listen-address", address]
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "predictor_svc", *args], stdout=out, stderr=out, cwd=REPO
        )


def wait_serving(popen: subprocess.Popen, address: str, timeout_s: float, log: Path) -> tuple[float, int]:
    """Seconds until health SERVING and the highest VmRSS sampled meanwhile."""
    started, sampled = time.monotonic(), 0
    while True:
        if popen.poll() is not None:
            sys.exit(f"the predictor exited with {popen.returncode}:\n{log.read_text()[-3000:]}")
        sampled = max(sampled, memory_status(popen.pid)["VmRSS"])
        if health(address) == health_pb2.HealthCheckResponse.SERVING:
            return time.monotonic() - started, sampled
        if time.monotonic() - started > timeout_s:
            sys.exit(f"the predictor was not SERVING within {timeout_s}s:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)


def mib(n: float) -> str:
    return f"{n / MIB:,.0f} MiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.predictor_memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=int, default=3, help="Registrations at the largest shape.")
    parser.add_argument("--top-k", type=int, default=8)
    args = parser.parse_args(argv)

    config, predictor_limit, redis_limit = render_chart()
    layers, experts, capacity = config["max_layers"], config["max_experts"], config["eamc_capacity"]
    print(f"chart: predictor limit {mib(predictor_limit)}, Redis limit {mib(redis_limit)}")
    print(
        f"chart: max_eamc_bytes {config['max_eamc_bytes']:,} ({mib(config['max_eamc_bytes'])}), largest shape "
        f"{layers}x{experts}, eamc_capacity {capacity}"
    )
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="bench-predictor-memory-") as tmp_name:
        tmp = Path(tmp_name)
        config_file = tmp / "predictor.yaml"
        config_file.write_text(yaml.safe_dump({**config, "sync_interval_s": 0.2}))
        log = tmp / "predictor.log"
        with RedisServer(tmp / "redis") as server:
            address = f"127.0.0.1:{free_port()}"
            popen = start_predictor(config_file, server.url, address, log)
            try:
                wait_serving(popen, address, 120, log)
                registered = []
                with grpc.insecure_channel(address) as channel:
                    stub = predictor_pb2_grpc.PredictorStub(channel)
                    for i in range(args.models):
                        model = f"largest-{i}"
                        try:
                            stub.RegisterModel(
                                predictor_pb2.RegisterModelRequest(
                                    model_id=model,
                                    num_moe_layers=layers,
                                    num_experts=experts,
                                    top_k=args.top_k,
                                ),
                                timeout=10,
                            )
                            registered.append(model)
                            print(f"RegisterModel {model} {layers}x{experts}x{args.top_k}: registered")
                        except grpc.RpcError as exc:
                            print(f"RegisterModel {model}: refused, {exc.code().name}: {exc.details()}")
                store = RedisStore(server.url, log_len=capacity, socket_timeout_s=60)
                rng = np.random.default_rng(0)
                try:
                    for model in registered:  # as another replica's inserts would fill it
                        for _ in range(capacity):
                            eam = rng.integers(0, 40, size=(layers, experts), dtype=np.uint32)
                            store.insert(model, encode_eam(eam, 100), capacity, None)
                finally:
                    store.close()
                total = capacity * len(registered)
                deadline = time.monotonic() + 600
                while stats(address).eamc_entries < total:
                    if time.monotonic() > deadline:
                        sys.exit(f"the predictor never held {total} entries:\n{log.read_text()[-3000:]}")
                    time.sleep(0.2)
                time.sleep(1.0)
                full = memory_status(popen.pid)
                s = stats(address)
                r = redis_memory(server.url)
                print(
                    f"full EAMC: {s.eamc_entries} entries, {mib(s.eamc_bytes)} of entries, "
                    f"{mib(s.eamc_reserved_bytes)} reserved"
                )
                print(
                    f"predictor: VmRSS {mib(full['VmRSS'])}, VmHWM {mib(full['VmHWM'])} (limit {mib(predictor_limit)})"
                )
                print(
                    f"redis-server: used_memory {mib(r['used_memory'])}, used_memory_rss {mib(r['used_memory_rss'])}, "
                    f"used_memory_peak {mib(r['used_memory_peak'])} (limit {mib(redis_limit)})"
                )
                if full["VmHWM"] > predictor_limit:
                    failures.append("the predictor's peak RSS is beyond its limit")
                if max(r["used_memory_peak"], r["used_memory_rss"]) > redis_limit:
                    failures.append("Redis is beyond its limit")
            finally:
                popen.terminate()
                popen.wait(30)

            # A restart over the full EAMC: the load is streamed in bounded batches.
            address = f"127.0.0.1:{free_port()}"
            started = time.monotonic()
            popen = start_predictor(config_file, server.url, address, log)
            try:
                ready_s, _sampled = wait_serving(popen, address, 600, log)
                s = stats(address)
                loaded_at_serving = s.eamc_entries
                time.sleep(2.0)
                after = memory_status(popen.pid)
                steady, peak = after["VmRSS"], after["VmHWM"]
                print(
                    f"restart: SERVING after {ready_s:.1f}s with {loaded_at_serving} of {total} entries loaded "
                    f"({time.monotonic() - started:.1f}s in all)"
                )
                print(
                    f"restart: peak RSS (VmHWM) {mib(peak)}, steady RSS once loaded {mib(steady)}, "
                    f"peak / steady = {peak / steady:.3f} (bound {PEAK_FACTOR})"
                )
                if peak > PEAK_FACTOR * steady:
                    failures.append(f"the restart peaked beyond {PEAK_FACTOR}x the steady state")
                if loaded_at_serving < total:
                    failures.append("SERVING before the EAMC was loaded")
                if peak > predictor_limit:
                    failures.append("the restart's peak RSS is beyond the predictor's limit")
                r = redis_memory(server.url)
                print(
                    f"redis-server after the restart: used_memory {mib(r['used_memory'])}, used_memory_rss "
                    f"{mib(r['used_memory_rss'])}, used_memory_peak {mib(r['used_memory_peak'])}"
                )
                if max(r["used_memory_peak"], r["used_memory_rss"]) > redis_limit:
                    failures.append("Redis went beyond its limit serving the restart's load")
            finally:
                popen.terminate()
                popen.wait(30)
    for failure in failures:
        print(f"FAIL: {failure}")
    print("OK: within the chart's bounds" if not failures else "")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
