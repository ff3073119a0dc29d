"""A hostile client against the predictor: how far can it grow the predictor's and Redis's memory?

Starts a real redis-server and a real predictor (``python -m predictor_svc``), records the
predictor's RSS (``/proc/<pid>/status`` VmRSS) and Redis ``used_memory``, then, as a client:

1. ``models``: declares (or registers, where the predictor has ``RegisterModel``) ``--models``
   models of ``--layers`` x ``--experts`` and finishes ``--done-per-model`` one-token requests
   on each (each finished EAM enters the EAMC, in memory and in Redis);
2. ``live``: opens ``--live`` requests of the first model that never finish (live EAMs);
3. ``ids``: streams tokens for ``--fake-ids`` request ids of a small model, never finished;
4. ``range``: one activation with a layer count and an expert index far beyond any model.

Each phase prints what the predictor answered (OK or the status code and message) and the
memory after it. Nothing here is mocked: real sockets, real processes.

    .venv/bin/python -m bench.predictor_attack            # defaults: the issue's 1024 x 1024
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
from moe.predictor.v1 import predictor_pb2, predictor_pb2_grpc

from bench.usage import MIB, redis_memory, rss_mib
from devtools.launch import Proc, free_port, start
from devtools.redis_server import RedisServer


def tokens(model: str, request_id: str, layers: int, experts: int, top_k: int, n: int, done: bool):
    for t in range(n):
        yield predictor_pb2.Activation(
            request_id=request_id,
            model_id=model,
            pod="attacker",
            token_index=t,
            experts=[(t + j + layer) % experts for layer in range(layers) for j in range(top_k)],
            top_k=top_k,
            num_moe_layers=layers,
            num_experts=experts,
            request_done=done and t == n - 1,
        )


def chain(*streams: Iterator) -> Iterator:
    for s in streams:
        yield from s


class Attack:
    def __init__(self, proc: Proc, redis_url: str) -> None:
        self.proc = proc
        self.redis_url = redis_url
        self.channel = grpc.insecure_channel(proc.address, options=[("grpc.max_send_message_length", -1)])
        self.stub = predictor_pb2_grpc.PredictorStub(self.channel)
        self.can_register = hasattr(predictor_pb2, "RegisterModelRequest")

    def memory(self, label: str) -> tuple[float, float]:
        time.sleep(1.5)  # let the predictor's background thread insert and sync
        rss, used = rss_mib(self.proc.popen.pid), redis_memory(self.redis_url)["used_memory"] / MIB
        print(f"  [{label}] predictor RSS {rss:8.1f} MB   redis used_memory {used:8.1f} MB", flush=True)
        return rss, used

    def call(self, what: str, fn) -> bool:
        try:
            out = fn()
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED or "Method not implemented" in (
                exc.details() or ""
            ):
                # a predictor from before RegisterModel (the baseline)
                self.can_register = False
                return True
            print(f"  {what}: {exc.code().name}: {exc.details()}", flush=True)
            return False
        print(f"  {what}: OK {str(out).strip().replace(chr(10), ' ')[:100]}", flush=True)
        return True

    def register(self, model: str, layers: int, experts: int, top_k: int) -> bool:
        if not self.can_register:
            return True
        return self.call(
            f"RegisterModel {model} {layers}x{experts}x{top_k}",
            lambda: self.stub.RegisterModel(
                predictor_pb2.RegisterModelRequest(
                    model_id=model, num_moe_layers=layers, num_experts=experts, top_k=top_k
                ),
                timeout=30,
            ),
        )

    def observe(self, what: str, stream) -> bool:
        return self.call(what, lambda: self.stub.Observe(stream, timeout=300))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", type=int, default=20)
    p.add_argument("--layers", type=int, default=1024)
    p.add_argument("--experts", type=int, default=1024)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--done-per-model", type=int, default=3)
    p.add_argument("--live", type=int, default=60)
    p.add_argument("--fake-ids", type=int, default=20000)
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    p.add_argument("predictor_args", nargs="*", help="extra predictor flags (after --)")
    args = p.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="predictor-attack-"))
    with RedisServer(work / "redis") as server:
        address = f"127.0.0.1:{free_port()}"
        proc = start(
            "predictor_svc",
            ["--listen-address", address, "--redis-url", server.url, *args.predictor_args],
            address,
            work / "predictor.log",
        )
        attack = Attack(proc, server.url)
        try:
            print(f"predictor {address} (pid {proc.popen.pid}), redis {server.url}; log {work}/predictor.log")
            start_rss, start_redis = attack.memory("start")

            print(
                f"phase models: {args.models} models of {args.layers}x{args.experts}, "
                f"{args.done_per_model} finished requests each"
            )
            for m in range(args.models):
                model = f"attack-{m}"
                if not attack.register(model, args.layers, args.experts, args.top_k):
                    continue
                streams = [
                    tokens(model, f"{model}-r{r}", args.layers, args.experts, args.top_k, 1, True)
                    for r in range(args.done_per_model)
                ]
                attack.observe(f"Observe {model}", chain(*streams))
            attack.memory("after models")

            print(f"phase live: {args.live} unfinished requests of attack-0")
            streams = [
                tokens("attack-0", f"live-{r}", args.layers, args.experts, args.top_k, 1, False)
                for r in range(args.live)
            ]
            attack.observe("Observe live", chain(*streams))
            attack.memory("after live")

            print(f"phase ids: {args.fake_ids} fake request ids of a 24x32x4 model")
            attack.register("small", 24, 32, 4)
            streams = [tokens("small", f"fake-{r}", 24, 32, 4, 1, False) for r in range(args.fake_ids)]
            attack.observe("Observe fake ids", chain(*streams))
            attack.memory("after ids")

            print("phase range: 100000 layers / expert index 10^9 on an unregistered model")
            huge = predictor_pb2.Activation(
                request_id="x",
                model_id="never-registered",
                token_index=0,
                experts=[1_000_000_000] * 100_000,
                top_k=1,
                num_experts=1_000_000_001,
            )
            attack.observe("Observe out of range", iter([huge]))
            end_rss, end_redis = attack.memory("end")
            stats = attack.stub.GetStats(predictor_pb2.GetStatsRequest(), timeout=10)
            print(
                f"GetStats: models {len(stats.models)}, eamc_entries {stats.eamc_entries}, "
                f"live_requests {stats.live_requests}, requests_expired {stats.requests_expired}"
            )
            for name in ("live_bytes", "eamc_bytes"):
                if hasattr(stats, name):
                    print(f"  {name} {getattr(stats, name)}")
            if hasattr(stats, "refused"):
                print(f"  refused {dict(stats.refused)}")
            print(
                f"SUMMARY predictor RSS {start_rss:.1f} -> {end_rss:.1f} MB, "
                f"redis used_memory {start_redis:.1f} -> {end_redis:.1f} MB"
            )
        finally:
            attack.channel.close()
            proc.stop()
    if not args.keep:
        import shutil  # noqa: PLC0415

        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
