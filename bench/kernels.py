"""Expert FFN kernels: one expert's whole FFN from its stored bytes, beside a memcpy of those bytes
(``make bench-kernels``).

    python -m bench.kernels [--shapes e2e,gpt-oss-20b] [--dtype bfloat16|float32] [--layouts plain,plain-t,mxfp4,fp8,fp8-t]
                            [--rows 1,4,16] [--threads 1] [--repeats 5] [--paths auto|avx512,avx2,...]
                            [--out bench/results/kernels.json]

A decode step reads every routed expert's weights once, so an expert's FFN is bound by memory
bandwidth, and the best a kernel can do is a memcpy of the same bytes on the same threads. Per
layout, shape and rows per expert, this prints the fused kernel's time per expert
(``expertcache._native.ExpertFfn``, as compute runs it for decode), its GB/s of stored bytes, a
memcpy of the same bytes (the slot into a reused buffer) and their ratio, and the torch path that
compute runs otherwise (decode into the compute dtype, then GEMMs and the activation as torch
ops), which fixes the crossover: the rows per expert up to which the fused kernel is faster.

Shapes (GPT-OSS's experts, x @ W with gate_up [H, 2I] and down [I, H]; -20b and -120b share theirs)::

    e2e           hidden 512, intermediate 1280 (bench.e2e's model)
    gpt-oss-20b   hidden 2880, intermediate 2880 (gpt-oss-120b's experts are the same shape)

Layouts: ``plain-t`` plain weights of the compute dtype stored transposed ([in, out], as GPT-OSS's
bf16 checkpoints), ``plain`` the same [out, in] (Mixtral, Qwen-MoE, DeepSeek), ``mxfp4`` (as GPT-OSS ships), ``fp8``
e4m3 with 128 x 128 blocks (DeepSeek-V3, Qwen3 FP8), ``fp8-t`` the same stored [in, out] (GPT-OSS's
projections in block FP8); compute in ``--dtype`` (bfloat16). The experts rotate
through at least 256 MiB of slots, so every expert comes from memory, not from a warm cache; each
round times every method in turn, rotated per round; figures are medians over ``--repeats``.
``--paths`` times the fused kernel on each of the named SIMD paths of this CPU
(``expertcache._native.FFN_PATHS``; ``auto``, the default, is the fastest, as compute runs it), a
line each, in the same rounds.

For MXFP4 on the avx512, avx512-bf16 and amx paths, a ``decode only`` line times the kernels' decode of the same
weights into bfloat16 words with nothing multiplied (``ExpertFfn.decode_only``), in the first rows'
rounds: a bound no kernel that decodes as they do can pass, whatever it computes.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from bench.report import MIB, RESULTS_DIR, fmt, say, write_json
from devtools.expert_ffn_cases import ExpertLayout, reference
from expertcache import native

SHAPES = {"e2e": (512, 1280), "gpt-oss-20b": (2880, 2880)}
LAYOUTS = {
    "plain-t": ("plain-axpy", "plain-axpy", "gpt_oss"),
    "plain": ("plain-dot", "plain-dot", "glu_halves"),
    "mxfp4": ("mxfp4", "mxfp4", "gpt_oss"),
    "fp8": ("fp8", "fp8", "glu_halves"),
    "fp8-t": ("fp8-axpy", "fp8-axpy", "gpt_oss"),
}
ROTATE_BYTES = 256 * MIB


DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def build(
    layout_name: str, shape: str, dtype: torch.dtype = torch.bfloat16
) -> tuple[ExpertLayout, np.ndarray, int]:
    hidden, inter = SHAPES[shape]
    first, down, gate = LAYOUTS[layout_name]
    gen = torch.Generator().manual_seed(0)
    layout = ExpertLayout(hidden, inter, first, down, gate, True, dtype, gen, fp8_block=(128, 128))
    one = layout.arena(slots=1)
    slots = max(8, -(-ROTATE_BYTES // layout.slot_bytes))
    return layout, np.tile(one, slots), slots


def stored_bytes(layout: ExpertLayout) -> int:
    """The bytes an expert's FFN reads (its parts, padding excluded)."""
    return sum(n for n in layout.part_bytes().values())


class Methods:
    """The three ways to run one expert for ``rows`` rows, each rotating through the slots."""

    def __init__(
        self, layout: ExpertLayout, arena: np.ndarray, slots: int, rows: int, threads: int, path: str = "auto"
    ) -> None:
        self.layout, self.arena, self.slots, self.rows = layout, arena, slots, rows
        self.ffn = native.expert_ffn({**layout.spec, "path": path}, threads=threads)
        hidden = layout.hidden
        self.x = np.random.default_rng(0).standard_normal((rows, hidden)).astype(np.float32)
        self.x = torch.from_numpy(self.x).to(layout.dtype).float().numpy()
        self.out = np.zeros((rows, hidden), dtype=np.float32)
        self.rows_ix = np.arange(rows, dtype=np.int64)
        self.weights = np.full(rows, 0.5, dtype=np.float32)
        self.bounds = np.array([0, rows], dtype=np.int64)
        self.buffer = np.empty(layout.slot_bytes, dtype=np.uint8)
        self.threads = threads
        self.at = 0

    def _next(self) -> int:
        self.at = (self.at + 1) % self.slots
        return self.at

    def fused(self, n: int) -> None:
        for _ in range(n):
            slot = np.array([self._next()], dtype=np.int64)
            self.ffn.run(
                self.arena, slot, self.bounds, self.rows_ix, self.rows_ix, self.weights, self.x, self.out
            )

    def decode(self, n: int) -> None:
        """The MXFP4 weights decoded as the avx512 and amx kernels decode them, nothing computed."""
        for _ in range(n):
            self.ffn.decode_only(self.arena, self._next())

    def memcpy(self, n: int) -> None:
        size = self.layout.slot_bytes
        for _ in range(n):
            at = self._next() * size
            np.copyto(self.buffer, self.arena[at : at + size])

    def torch(self, n: int) -> None:
        x = torch.from_numpy(self.x).to(self.layout.dtype)
        w = torch.full((self.rows, 1), 0.5)
        with torch.no_grad():
            for _ in range(n):
                reference(self.layout, self.arena, self._next(), x, w)


def time_per_call(fn, n: int) -> float:
    """Seconds a call of ``fn``'s ``n``, the cyclic collector off meanwhile (as ``timeit`` times):
    a collection walks torch's whole heap, a pause that belongs to no kernel."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        started = time.perf_counter()
        fn(n)
        return (time.perf_counter() - started) / n
    finally:
        if enabled:
            gc.enable()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated: {', '.join(SHAPES)}")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated: {', '.join(LAYOUTS)}")
    parser.add_argument("--rows", default="1,4,16", help="rows per expert, comma-separated (1 .. 64)")
    parser.add_argument(
        "--threads", type=int, default=1, help="threads of the kernel and of the memcpy's torch"
    )
    parser.add_argument("--repeats", type=int, default=5, help="rounds; the figures are medians")
    parser.add_argument(
        "--no-torch", action="store_true", help="skip the torch path (it is slow at big shapes)"
    )
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=list(DTYPES),
        help="compute dtype (plain weights are stored in it)",
    )
    parser.add_argument(
        "--paths",
        default="auto",
        help=f"the fused kernel's SIMD paths, comma-separated: auto or of {', '.join(native.FFN_PATHS)} (this CPU's)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "kernels.json")
    args = parser.parse_args(argv)
    paths = [p for p in args.paths.split(",") if p]
    bad_paths = sorted(set(paths) - {"auto", *native.FFN_PATHS})
    if bad_paths or not paths:
        parser.error(
            f"--paths: {', '.join(bad_paths) or 'empty list'} not a path of this CPU; choose from auto, "
            f"{', '.join(native.FFN_PATHS)}"
        )
    shapes = [s for s in args.shapes.split(",") if s]
    layouts = [s for s in args.layouts.split(",") if s]
    try:
        rows_list = [int(r) for r in args.rows.split(",") if r]
    except ValueError:
        parser.error(f"--rows {args.rows!r}: integers, comma-separated")
    for name, valid in ((shapes, SHAPES), (layouts, LAYOUTS)):
        bad = sorted(set(name) - set(valid))
        if bad or not name:
            parser.error(f"unknown {', '.join(bad) or 'empty list'}; choose from {', '.join(valid)}")
    if not all(1 <= r <= 64 for r in rows_list) or not rows_list:
        parser.error("--rows: each between 1 and 64")
    if not 1 <= args.threads <= 256 or args.repeats < 1:
        parser.error("--threads 1 .. 256 and --repeats >= 1")
    torch.set_num_threads(args.threads)
    say(
        f"expert FFN kernels: {args.threads} thread(s), compute {args.dtype}, experts rotating through "
        f"{ROTATE_BYTES // MIB} MiB, median of {args.repeats} rounds"
    )
    say(
        f"{'shape':12} {'layout':7} {'rows':>4} {'path':8} {'MiB':>6} {'fused ms':>9} {'GB/s':>6} {'memcpy ms':>9} "
        f"{'GB/s':>6} {'vs memcpy':>9} {'torch ms':>9} {'fused x torch':>13}"
    )
    results = []
    floors = []
    for shape in shapes:
        for layout_name in layouts:
            layout, arena, slots = build(layout_name, shape, DTYPES[args.dtype])
            nbytes = stored_bytes(layout)
            for rows in rows_list:
                # One Methods per path (each its own ExpertFfn), the memcpy and torch of the first.
                ms = {p: Methods(layout, arena, slots, rows, args.threads, p) for p in paths}
                m = ms[paths[0]]
                calls_of = {f"fused:{p}": ms[p].fused for p in paths}
                calls_of["memcpy"] = m.memcpy
                decode_path = next(
                    (p for p in paths if ms[p].ffn.path in ("avx512", "avx512-bf16", "amx")), None
                )
                decodes = layout_name == "mxfp4" and decode_path is not None and rows == rows_list[0]
                if decodes:
                    calls_of["decode"] = ms[decode_path].decode
                if not args.no_torch:
                    calls_of["torch"] = m.torch
                names = list(calls_of)
                times: dict[str, list[float]] = {n: [] for n in names}
                calls = max(4, min(slots, int(2e9 // max(nbytes, 1)) // 64))
                for each in ms.values():
                    each.fused(2)  # warm the scratch
                for repeat in range(args.repeats):
                    order = names[repeat % len(names) :] + names[: repeat % len(names)]
                    for name in order:
                        n = calls if name != "torch" else max(2, calls // 8)
                        times[name].append(time_per_call(calls_of[name], n))
                med = {n: statistics.median(v) for n, v in times.items()}
                for p in paths:
                    fused = med[f"fused:{p}"]
                    row = dict(
                        shape=shape,
                        layout=layout_name,
                        rows=rows,
                        stored_bytes=nbytes,
                        path=ms[p].ffn.path,
                        fused_ms=fused * 1e3,
                        fused_gbps=nbytes / fused / 1e9,
                        memcpy_ms=med["memcpy"] * 1e3,
                        memcpy_gbps=nbytes / med["memcpy"] / 1e9,
                        torch_ms=med["torch"] * 1e3 if "torch" in med else None,
                    )
                    row["vs_memcpy"] = row["fused_gbps"] / row["memcpy_gbps"]
                    row["fused_x_torch"] = row["torch_ms"] / row["fused_ms"] if row["torch_ms"] else None
                    results.append(row)
                    say(
                        f"{shape:12} {layout_name:7} {rows:4d} {row['path']:8} {nbytes / MIB:6.2f} "
                        f"{row['fused_ms']:9.3f} {row['fused_gbps']:6.1f} {row['memcpy_ms']:9.3f} "
                        f"{row['memcpy_gbps']:6.1f} {row['vs_memcpy']:9.2f} {fmt(row['torch_ms'], '9.3f'):>9} "
                        f"{fmt(row['fused_x_torch'], '13.1f'):>13}"
                    )
                if decodes:
                    floor = dict(
                        shape=shape,
                        path=ms[decode_path].ffn.path,
                        stored_bytes=nbytes,
                        decode_ms=med["decode"] * 1e3,
                        decode_gbps=nbytes / med["decode"] / 1e9,
                        memcpy_gbps=nbytes / med["memcpy"] / 1e9,
                    )
                    floor["vs_memcpy"] = floor["decode_gbps"] / floor["memcpy_gbps"]
                    floors.append(floor)
                    say(
                        f"{shape:12} {layout_name:7} {'-':>4} {'decode':8} {nbytes / MIB:6.2f} "
                        f"{floor['decode_ms']:9.3f} {floor['decode_gbps']:6.1f} {med['memcpy'] * 1e3:9.3f} "
                        f"{floor['memcpy_gbps']:6.1f} {floor['vs_memcpy']:9.2f}   (decode only, nothing multiplied: "
                        f"the bound of the {floor['path']} kernels)"
                    )
    fastest = native.FFN_PATHS[0]
    goal = [
        r
        for r in results
        if r["layout"] in ("plain", "plain-t", "mxfp4") and r["rows"] in (1, 4) and r["path"] == fastest
    ]
    if goal and args.dtype == "bfloat16":
        worst = min(goal, key=lambda r: r["vs_memcpy"])
        ok = worst["vs_memcpy"] >= 0.7
        say(
            f"goal: bf16 and MXFP4 at 1 and 4 rows >= 0.7x memcpy bandwidth: worst {worst['vs_memcpy']:.2f} "
            f"({worst['shape']} {worst['layout']} {worst['rows']} rows) {'PASS' if ok else 'FAIL'}"
        )
    for floor in floors:
        say(
            f"MXFP4 decode alone ({floor['shape']}, {floor['path']}): {floor['vs_memcpy']:.2f}x memcpy bandwidth, "
            "before any multiply"
        )
    write_json(
        args.out,
        dict(
            threads=args.threads, repeats=args.repeats, dtype=args.dtype, results=results, decode_only=floors
        ),
    )
    say(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
