"""Expert decode: the time to turn one encoded expert into compute-dtype weights (``make bench-decode``).

    python -m bench.decode_bench [--shapes e2e,gpt-oss-20b] [--encodings mxfp4,fp8] [--repeats 7]
                                 [--dtype bfloat16] [--out bench/results/decode.json]
    make bench-decode [BENCH_DECODE_ARGS="--repeats 15"]

Compute decodes every encoded expert at every use (``expertcache.encodings``), so an expert's
decode is paid per routed expert per token. One expert is its ``gate_up_proj`` and ``down_proj``
(gpt-oss: x @ W), of two shapes::

    e2e           bench.e2e's model, hidden 512, expert intermediate 1280: gate_up [512, 2560],
                  down [1280, 512] (MXFP4 blocks [2560, 16, 16] + [512, 40, 16])
    gpt-oss-20b   hidden = intermediate = 2880: gate_up [2880, 5760], down [2880, 2880]
                  (MXFP4 blocks [5760, 90, 16] + [2880, 90, 16])

each stored MXFP4 (as gpt-oss ships it) and block FP8 (e4m3, 128 x 128 blocks), decoded into
``--dtype`` by each method:

    torch       the torch ops on the CPU (``native=False``: what decoded on CPU before the native
                decode, and what CUDA runs), on torch's intra-op threads
    native      the native decode on the CPU as compute calls it (``dequantize_*``: its default
                SIMD path, Python overhead included), one thread
    native:P    the native kernel forced onto SIMD path P (each other path this CPU has), called
                directly
    torch-cuda  the torch ops on a CUDA device (only when one is there), synchronised

Like compute, each decode writes into one reused scratch buffer while its inputs come from a
different expert each time (the experts rotate through at least 64 MiB of encoded bytes, so they
are read from memory, not from a warm cache). A round times back-to-back decodes of every method
in turn (rotated per round, so that the machine's drift hits all alike); the figure is the
median over ``--repeats`` rounds, in ms per expert. Results go to bench/results/decode.json.

``decode_times(shape, ...)`` gives the same figures to other benchmarks.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from expertcache import native  # noqa: E402
from expertcache.encodings import (  # noqa: E402
    BLOCKS_SUFFIX,
    SCALE_INV_SUFFIX,
    SCALES_SUFFIX,
    ExpertTensor,
    Scratch,
    dequantize_fp8,
    dequantize_mxfp4,
    get_encoding,
)

RESULTS = REPO / "bench" / "results" / "decode.json"
FP8_BLOCK = (128, 128)
ROTATE_BYTES = 64 << 20  # encoded bytes the rotating experts span: past this machine's caches
MAX_EXPERTS = 64
ROUND_S = 0.05  # wall time a method's back-to-back decodes take per round, about


@dataclass(frozen=True)
class ExpertShape:
    """An expert's two weights, as gpt-oss holds them: gate_up_proj [H, 2I], down_proj [I, H]."""

    name: str
    hidden: int
    intermediate: int

    def tensors(self, encoding: str, dtype: str) -> tuple[ExpertTensor, ...]:
        enc = get_encoding(encoding)
        block = {"block_size": FP8_BLOCK} if encoding == "fp8" else {}
        return (
            enc.plan("gate_up_proj", dtype, (self.hidden, 2 * self.intermediate), **block),
            enc.plan("down_proj", dtype, (self.intermediate, self.hidden), **block),
        )

    def describe(self) -> str:
        return f"h{self.hidden}/i{self.intermediate}"


SHAPES = {
    "e2e": ExpertShape("e2e", 512, 1280),
    "gpt-oss-20b": ExpertShape("gpt-oss-20b", 2880, 2880),
}
ENCODINGS = ("mxfp4", "fp8")


def random_parts(tensor: ExpertTensor, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Realistic stored parts of ``tensor``: MXFP4 codes uniform, scales 2**-10 .. 2**7 (as
    gpt-oss's); FP8 values of a weight's spread (no NaN codes), scales ~1e-3."""
    parts = {}
    for part in tensor.parts:
        if part.name.endswith(SCALES_SUFFIX):
            parts[part.name] = torch.randint(117, 135, part.shape, dtype=torch.uint8, generator=gen)
        elif part.name.endswith(BLOCKS_SUFFIX):
            parts[part.name] = torch.randint(0, 256, part.shape, dtype=torch.uint8, generator=gen)
        elif part.name.endswith(SCALE_INV_SUFFIX):
            parts[part.name] = torch.rand(part.shape, generator=gen) * 2e-3 + 1e-4
        else:
            parts[part.name] = (torch.randn(part.shape, generator=gen) * 60).to(torch.float8_e4m3fn)
    return parts


def decoder(tensors: tuple[ExpertTensor, ...], method: str, scratch: Scratch) -> Callable[[dict], None]:
    """One expert's decode by ``method`` (module docstring), writing into ``scratch``."""
    path = method.split(":", 1)[1] if method.startswith("native:") else None
    use_native = method.startswith("native")

    def one(t: ExpertTensor, parts: dict) -> None:
        dtype = getattr(torch, t.dtype)
        if t.encoding == "mxfp4":
            blocks, scales = parts[t.name + BLOCKS_SUFFIX], parts[t.name + SCALES_SUFFIX]
            if path is None:
                dequantize_mxfp4(blocks, scales, dtype, scratch, t.name, native=use_native)
                return
            _, array = scratch.get_numpy(t.name + ".values", (blocks.shape[0], blocks.shape[1] * 32), dtype)
            native.decode_mxfp4(blocks.numpy(), scales.numpy(), array, t.dtype, path)
        else:
            values, scale_inv = parts[t.name], parts[t.name + SCALE_INV_SUFFIX]
            if path is None:
                dequantize_fp8(values, scale_inv, t.block_size, dtype, scratch, t.name, native=use_native)
                return
            _, array = scratch.get_numpy(t.name + ".values", tuple(values.shape), dtype)
            bm, bn = t.block_size
            native.decode_fp8(
                values.view(torch.uint8).numpy(), scale_inv.numpy(), bm, bn, array, t.dtype, path
            )

    def expert(parts: dict) -> None:
        for t in tensors:
            one(t, parts)

    return expert


def methods_here(device_ok: bool = True) -> list[str]:
    """The methods this machine can run, torch first."""
    found = ["torch", "native"] + [f"native:{p}" for p in native.DECODE_PATHS[1:]]
    if device_ok and torch.cuda.is_available():
        found.append("torch-cuda")
    return found


def decode_times(
    shape: str | ExpertShape = "e2e",
    encodings: tuple[str, ...] = ENCODINGS,
    methods: list[str] | None = None,
    dtype: str = "bfloat16",
    repeats: int = 5,
    seed: int = 0,
) -> dict[str, dict[str, float]]:
    """Median ms per expert of ``shape`` (a name of ``SHAPES`` or an ExpertShape), per encoding
    and method (default: every method this machine has): ``{"mxfp4": {"torch": 1.9, ...}}``."""
    shape = SHAPES[shape] if isinstance(shape, str) else shape
    methods = methods or methods_here()
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, dict[str, float]] = {}
    for encoding in encodings:
        tensors = shape.tensors(encoding, dtype)
        expert_bytes = sum(t.nbytes for t in tensors)
        count = max(2, min(MAX_EXPERTS, math.ceil(ROTATE_BYTES / expert_bytes)))
        experts = [{k: v for t in tensors for k, v in random_parts(t, gen).items()} for _ in range(count)]
        runs = {}
        for method in methods:
            if method == "torch-cuda":
                device = torch.device("cuda")
                parts = [{k: v.to(device) for k, v in e.items()} for e in experts]
                runs[method] = (decoder(tensors, method, Scratch(device)), parts, torch.cuda.synchronize)
            else:
                runs[method] = (decoder(tensors, method, Scratch("cpu")), experts, lambda: None)
        out[encoding] = time_methods(runs, repeats)
        del experts, runs
    return out


def time_methods(runs: dict[str, tuple], repeats: int) -> dict[str, float]:
    """Median over ``repeats`` rounds of each method's ms per expert; a round runs every method's
    back-to-back decodes (about ROUND_S each) in turn, the order rotated per round."""
    per_round: dict[str, int] = {}
    for method, (run, experts, sync) in runs.items():  # warm up (tables, buffers) and calibrate
        run(experts[0])
        sync()
        started = time.perf_counter()
        for parts in experts[:2]:
            run(parts)
        sync()
        per_round[method] = max(2, round(ROUND_S / ((time.perf_counter() - started) / 2)))
    samples: dict[str, list[float]] = {m: [] for m in runs}
    names = list(runs)
    for r in range(repeats):
        for method in names[r % len(names) :] + names[: r % len(names)]:
            run, experts, sync = runs[method]
            n = per_round[method]
            sync()
            started = time.perf_counter()
            for i in range(n):
                run(experts[i % len(experts)])
            sync()
            samples[method].append((time.perf_counter() - started) / n * 1e3)
    return {m: statistics.median(s) for m, s in samples.items()}


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if line.startswith("model name")), cpu)  # fmt: skip
    return {
        "cpu": cpu,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "native_paths": list(native.DECODE_PATHS),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--encodings", default=",".join(ENCODINGS), help="comma-separated, of mxfp4, fp8")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--repeats", type=int, default=7, help="timed rounds; the median is reported")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    encodings = tuple(e for e in args.encodings.split(",") if e)
    for s in shapes:
        if s not in SHAPES:
            ap.error(f"unknown shape {s!r}; valid: {', '.join(SHAPES)}")
    for e in encodings:
        if e not in ENCODINGS:
            ap.error(f"unknown encoding {e!r}; valid: {', '.join(ENCODINGS)}")
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")

    info = machine()
    methods = methods_here()
    print(
        f"expert decode into {args.dtype} on {info['cpu']} (torch ops on {info['torch_threads']} threads, the "
        f"native decode on one; its paths here: {', '.join(info['native_paths'])})"
        + (f"; CUDA: {info['cuda']}" if info["cuda"] else "; no CUDA device")
        + f"\nms per expert (gate_up_proj + down_proj), median of {args.repeats} rounds:"
    )
    header = f"{'shape':<26}{'encoding':<10}" + "".join(f"{m:>16}" for m in methods) + f"{'torch/native':>14}"
    print(header)
    results = {}
    for s in shapes:
        shape = SHAPES[s]
        times = decode_times(shape, encodings, methods, args.dtype, args.repeats)
        results[s] = {
            "hidden": shape.hidden,
            "intermediate": shape.intermediate,
            "tensors": {
                e: {
                    t.name: {p.name: [p.dtype, list(p.shape)] for p in t.parts}
                    for t in shape.tensors(e, args.dtype)
                }
                for e in encodings
            },
            "ms_per_expert": times,
        }
        for e in encodings:
            row = times[e]
            print(
                f"{s + ' ' + shape.describe():<26}{e:<10}"
                + "".join(f"{row[m]:>13.3f} ms" for m in methods)
                + f"{row['torch'] / row['native']:>13.1f}x"
            )
    result = {
        "command": "python -m bench.decode_bench " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": info,
        "dtype": args.dtype,
        "fp8_block": list(FP8_BLOCK),
        "repeats": args.repeats,
        "methods": methods,
        "shapes": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
