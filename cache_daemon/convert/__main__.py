"""CLI: ``python -m cache_daemon.convert SRC DST [--dequantize] [--force] [--no-progress] [--log-level LEVEL]``.

Experts keep the checkpoint's encoding (MXFP4, block-scaled FP8, bf16/fp16/fp32); the summary
line gives the store's expert bytes beside the checkpoint's.

Exit codes: 0 converted or already up to date; 2 a problem with the input or destination
(message on stderr); 1 an unexpected error (traceback logged).
"""

from __future__ import annotations

import argparse
import logging
import sys

from cache_daemon.convert.converter import run_conversion
from cache_daemon.convert.sources import SUPPORTED_MODEL_TYPES
from expertcache.errors import ExpertCacheError

logger = logging.getLogger("cache_daemon.convert")

EXIT_OK, EXIT_UNEXPECTED, EXIT_BAD_INPUT = 0, 1, 2
MIB = 1 << 20


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="expertcache-convert",
        # No abbreviations: a flag the chart passes must be the exact name (a renamed flag fails).
        allow_abbrev=False,
        description="Convert a transformers MoE checkpoint directory (safetensors) into an expert store.",
        epilog=f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}",
    )
    parser.add_argument("src", metavar="SRC", help="checkpoint directory written by save_pretrained")
    parser.add_argument("dst", metavar="DST", help="expert store directory to create")
    parser.add_argument(
        "--dequantize",
        action="store_true",
        help="store MXFP4/FP8 experts decoded into the model's dtype (about 3.8x / 2x the bytes to move)",
    )
    parser.add_argument("--force", action="store_true", help="replace whatever DST holds")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        result = run_conversion(
            args.src, args.dst, force=args.force, progress=not args.no_progress, dequantize=args.dequantize
        )
    except ExpertCacheError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("interrupted: no store was written", file=sys.stderr)
        return 130
    except Exception:
        logger.exception("conversion of %s failed unexpectedly", args.src)
        return EXIT_UNEXPECTED
    m = result.manifest
    if not result.converted:
        print(f"{args.dst} is up to date (model_id {m.model_id[:12]}); nothing to do")
    else:
        print(
            f"wrote {args.dst}: {m.model_type}, {len(m.moe_layers)} MoE layers × {m.num_experts} experts, "
            f"{m.total_expert_bytes / MIB:.1f} MiB experts, {m.dense_bytes / MIB:.1f} MiB dense (model_id {m.model_id[:12]})"
        )
    print(expert_bytes_line(result))
    return EXIT_OK


def expert_bytes_line(result) -> str:
    """The store's expert bytes beside the checkpoint's, and how each tensor is stored."""
    m = result.manifest
    ckpt = result.checkpoint_expert_bytes
    ratio = f" = {m.total_expert_bytes / ckpt:.3f}x" if ckpt else ""
    tensors = "; ".join(t.describe() for t in m.tensors)
    return (
        f"expert bytes: store {m.total_expert_bytes} ({m.total_expert_bytes / MIB:.1f} MiB, {m.num_blobs} blobs "
        f"of {m.blob_bytes}) vs checkpoint {ckpt} ({ckpt / MIB:.1f} MiB){ratio}; {tensors}"
    )


if __name__ == "__main__":
    sys.exit(main())
