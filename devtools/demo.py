"""`make demo`: the whole ExpertCache on this machine, from checkpoint to streamed tokens.

    checkpoint ──convert──▶ expert store ──▶ cache_daemon (arena: 25% of experts)
                                                   ▲ Demand (unix socket)   ▲ hints
    this script ──Generate (gRPC, streamed)──▶ compute_svc ──activations──▶ predictor_svc
                                                               (EAMC in an embedded store file)

Without ``--model`` it builds a small random-weight Mixtral checkpoint with transformers itself
(no download). With ``--model DIR`` it serves that checkpoint directory instead.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from devtools.launch import REPO, Proc, start_compute, start_daemon, start_predictor
from expertcache.manifest import read_manifest

DEFAULT_PROMPT = "Once upon a time there was a small model that"


def _say(msg: str) -> None:
    print(msg, flush=True)


def _ensure_checkpoint(data_dir: Path) -> Path:
    from devtools.tiny import make_checkpoint

    ckpt = data_dir / "checkpoint-mixtral-demo"
    if (ckpt / "config.json").is_file():
        _say(f"• checkpoint: {ckpt} (already built)")
        return ckpt
    _say(f"• building a random-weight Mixtral checkpoint with transformers → {ckpt}")
    make_checkpoint(
        "mixtral",
        ckpt,
        hidden_size=256,
        num_layers=4,
        num_experts=16,
        top_k=2,
        intermediate_size=512,
    )
    return ckpt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run ExpertCache end to end and stream one generation.")
    parser.add_argument("--model", help="a Hugging Face checkpoint directory (default: build a tiny one)")
    parser.add_argument("--data-dir", default=str(REPO / "demo-data"), help="where checkpoints and stores go")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--device", default="auto", help="the arena: auto (a GPU if there is one), cpu, cuda")
    parser.add_argument("--device-fraction", type=float, default=0.25, help="device arena / all experts")
    parser.add_argument("--host-fraction", type=float, default=0.5, help="host tier / all experts")
    args = parser.parse_args(argv)

    from moe.cache.v1 import cache_pb2, cache_pb2_grpc
    from moe.inference.v1 import inference_pb2, inference_pb2_grpc
    from moe.predictor.v1 import predictor_pb2, predictor_pb2_grpc

    data_dir = Path(args.data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    ckpt = Path(args.model) if args.model else _ensure_checkpoint(data_dir)
    store = data_dir / f"store-{ckpt.name}"
    _say(f"• converting {ckpt} → expert store {store}")
    # The converter is a service's tool: run as users run it (expertcache-convert), not imported.
    subprocess.run([sys.executable, "-m", "cache_daemon.convert", str(ckpt), str(store)], check=True)
    manifest = read_manifest(store)
    blob = manifest.blob_bytes
    device_slots = max(1, int(manifest.num_blobs * args.device_fraction))
    host_slots = int(manifest.num_blobs * args.host_fraction)
    _say(
        f"• {manifest.model_type}: {len(manifest.moe_layers)} MoE layers × {manifest.num_experts} experts "
        f"(top-{manifest.top_k}), {manifest.total_expert_bytes / 2**20:.1f} MiB of experts, "
        f"{blob / 2**20:.2f} MiB each"
    )
    _say(f"• device arena: {device_slots} slots ({args.device_fraction:.0%}), host tier: {host_slots} slots")

    procs: list[Proc] = []
    with tempfile.TemporaryDirectory(prefix="expertcache-demo-") as tmp:
        work = Path(tmp)
        try:
            eamc_path = data_dir / "predictor" / f"eamc-{ckpt.name}.bin"
            _say(f"• starting predictor_svc (embedded EAMC store {eamc_path}) …")
            predictor = start_predictor(work, embedded_path=eamc_path)
            procs.append(predictor)
            _say(f"  serving {predictor.address}")
            wiring = ["--predictor-address", predictor.address, "--pod-name", "demo"]
            _say("• starting cache_daemon …")
            daemon = start_daemon(
                store,
                work,
                device=args.device,
                device_budget_bytes=device_slots * blob,
                host_budget_bytes=host_slots * blob,
                extra=wiring,
            )
            procs.append(daemon)
            _say(f"  serving {daemon.address}")
            _say("• starting compute_svc …")
            compute = start_compute(store, daemon, work, extra=wiring)
            procs.append(compute)
            _say(f"  serving {compute.address}")

            with grpc.insecure_channel(compute.address) as channel:
                stub = inference_pb2_grpc.InferenceStub(channel)
                info = stub.GetModelInfo(inference_pb2.GetModelInfoRequest(), timeout=30)
                request = inference_pb2.GenerateRequest(
                    max_new_tokens=args.max_new_tokens,
                    sampling=inference_pb2.SamplingParams(temperature=0.0),
                    ignore_eos=True,
                    request_id="demo",
                )
                if info.has_tokenizer:
                    request.text = args.prompt
                    _say(f"\nprompt: {args.prompt!r}\n")
                else:
                    request.token_ids.extend([1, 2, 3, 4])
                    _say("\nprompt: token ids [1, 2, 3, 4] (the checkpoint has no tokenizer)\n")
                _say(f"{'#':>3} {'token':>6} {'latency':>9} {'hits':>5} {'miss':>5}  text")
                latencies = []
                hits = misses = 0
                text = []
                started = time.perf_counter()
                for event in stub.Generate(request, timeout=600):
                    if event.finish_reason and not event.token_id and not event.text and event.latency_s == 0:
                        continue
                    latencies.append(event.latency_s)
                    hits += event.cache.hits
                    misses += event.cache.misses
                    text.append(event.text)
                    _say(
                        f"{event.index:>3} {event.token_id:>6} {event.latency_s * 1e3:>7.1f}ms "
                        f"{event.cache.hits:>5} {event.cache.misses:>5}  {event.text!r}"
                    )
                elapsed = time.perf_counter() - started
            # Activations are reported asynchronously: wait (briefly) for the request's end to land.
            with grpc.insecure_channel(predictor.address) as channel:
                pstub = predictor_pb2_grpc.PredictorStub(channel)
                deadline = time.monotonic() + 10
                while True:
                    pstats = pstub.GetStats(predictor_pb2.GetStatsRequest(), timeout=10)
                    if pstats.requests_done >= 1 or time.monotonic() > deadline:
                        break
                    time.sleep(0.1)
            with grpc.insecure_channel(daemon.address) as channel:
                stats = cache_pb2_grpc.ExpertCacheStub(channel).GetStats(
                    cache_pb2.GetStatsRequest(), timeout=10
                )

            _say(f"\ngenerated: {''.join(text)!r}")
            if latencies:
                _say(
                    f"tokens: {len(latencies)} in {elapsed:.2f}s; per-token latency p50 "
                    f"{statistics.median(latencies) * 1e3:.1f} ms, max {max(latencies) * 1e3:.1f} ms"
                )
                total = hits + misses
                _say(f"expert acquires: {total}, hits {hits} ({hits / max(total, 1):.0%}), misses {misses}")
            for tier in stats.tiers:
                name = cache_pb2.Tier.Name(tier.tier).removeprefix("TIER_").lower()
                _say(
                    f"  {name:>6}: hits {tier.hits:>6} misses {tier.misses:>6} "
                    f"in {tier.bytes_in / 2**20:>8.1f} MiB  resident {tier.resident}/{tier.capacity_slots} "
                    f"evictions {tier.evictions}"
                )
            _say(f"  store reads: {stats.store_io_mode}, {stats.store_read_seconds:.3f}s")
            _say(
                f"  hints: {stats.hints.batches} batches, {stats.hints.hints} hints received from the predictor"
            )
            _say(
                f"predictor: EAMC entries {pstats.eamc_entries} ({pstats.store_kind} store), tokens observed "
                f"{pstats.observed_tokens}, requests done {pstats.requests_done}, hint batches published "
                f"{pstats.hint_batches_published}, mean match {pstats.mean_match_s * 1e6:.0f} µs"
            )
        finally:
            _say("• shutting down")
            for proc in reversed(procs):
                code = proc.stop()
                if code not in (0, -15):
                    _say(f"  {proc.address} exited with {code}; its log:\n{proc.log()[-4000:]}")
    _say("• done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
