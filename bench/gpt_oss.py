"""The benchmarks' model: a random gpt-oss-shaped checkpoint written by transformers' own
``save_pretrained`` and its expert store, converted once with the real converter
(``cache_daemon.convert``), both cached under ``--data-dir``. ``bench.e2e``, ``bench.overhead``
and ``bench.serve`` run on it, with the same flags for its shape."""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

from bench.report import DATA_DIR, say
from expertcache.manifest import MANIFEST_NAME, StoreManifest, read_manifest

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = REPO.parent / "shared" / "traces" / "gpt-oss-20b_decode_703req.npz"
# --precision → devtools.tiny's quantization of the checkpoint (bf16: none).
PRECISIONS = {"bf16": None, "mxfp4": "mxfp4", "fp8": "fp8"}
FP8_BLOCK = (128, 128)  # DeepSeek-V3's and Qwen3-FP8's blocks
PROMPT = (5, 9, 17, 33, 2, 8, 1, 12)  # every system's prompt, token ids


def build(
    data_dir: Path,
    *,
    hidden: int,
    intermediate: int,
    layers: int,
    experts: int,
    top_k: int,
    precision: str = "bf16",
) -> tuple[Path, Path, StoreManifest]:
    """A gpt-oss-shaped checkpoint (save_pretrained; experts at ``precision``) and its store,
    built once and reused."""
    import torch

    from cache_daemon.convert import run_conversion
    from cache_daemon.convert.__main__ import expert_bytes_line
    from devtools.tiny import make_checkpoint
    from expertcache.errors import DataLoss

    suffix = "" if precision == "bf16" else f"-{precision}"
    root = data_dir / f"e2e-gpt_oss-h{hidden}-i{intermediate}-e{experts}-k{top_k}-l{layers}{suffix}"
    checkpoint, store = root / "checkpoint", root / "store"
    if (store / MANIFEST_NAME).exists() and (checkpoint / "config.json").exists():
        try:
            manifest = read_manifest(store)
        except DataLoss as exc:  # e.g. a store of an older format: build it again
            say(f"model: {exc}; rebuilding the store")
        else:
            say(f"model: reusing {root}")
            return checkpoint, store, manifest
    if not (checkpoint / "config.json").exists():
        shutil.rmtree(root, ignore_errors=True)
        say(
            f"model: writing a random gpt_oss checkpoint ({layers} layers x {experts} experts, top-{top_k}, "
            f"hidden {hidden}, expert intermediate {intermediate}, bf16, experts {precision}) to {checkpoint}"
        )
    started = time.perf_counter()
    if not (checkpoint / "config.json").exists():
        make_checkpoint(
            "gpt_oss",
            checkpoint,
            hidden_size=hidden,
            num_layers=layers,
            num_experts=experts,
            top_k=top_k,
            dtype=torch.bfloat16,
            intermediate_size=intermediate,
            max_shard_size="1GB",
            quantization=PRECISIONS[precision],
            fp8_block_size=FP8_BLOCK,
        )
    say(f"model: converting with cache_daemon.convert into {store}")
    result = run_conversion(checkpoint, store, progress=False, force=True)
    say(f"model: {expert_bytes_line(result)}")
    say(f"model: built in {time.perf_counter() - started:.0f} s")
    return checkpoint, store, result.manifest


def add_model_arguments(
    parser: argparse.ArgumentParser, *, hidden: int, intermediate: int, precision: str | None = None
) -> None:
    """The model's shape and where it is cached: ``--hidden``, ``--intermediate``, ``--layers``,
    ``--experts``, ``--top-k``, ``--data-dir``, and ``--precision`` where ``precision`` is its
    default (None: no flag, the experts are bf16)."""
    if precision is not None:
        parser.add_argument(
            "--precision",
            choices=tuple(PRECISIONS),
            default=precision,
            help="the experts' precision in the checkpoint, the store and every tier (gpt-oss ships mxfp4)",
        )
    parser.add_argument("--hidden", type=int, default=hidden)
    parser.add_argument("--intermediate", type=int, default=intermediate, help="expert intermediate size")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--data-dir", type=Path, default=DATA_DIR)


def build_from_args(args: argparse.Namespace) -> tuple[Path, Path, StoreManifest]:
    """``build`` with the shape ``add_model_arguments`` parsed."""
    return build(
        args.data_dir,
        hidden=args.hidden,
        intermediate=args.intermediate,
        layers=args.layers,
        experts=args.experts,
        top_k=args.top_k,
        precision=getattr(args, "precision", "bf16"),
    )


def use_torch_threads(threads: int) -> None:
    """Every process started from here on runs ``threads`` torch (OpenMP, MKL) threads. On a
    2-core machine shared with the daemon's I/O, more than one OpenMP thread per process makes
    each small matmul wait for a descheduled thread (measured: 14x slower decode with 2 threads
    under load than with 1)."""
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ["MKL_NUM_THREADS"] = str(threads)
