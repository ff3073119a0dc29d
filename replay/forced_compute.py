"""``python -m replay.forced_compute``: the compute service with routing forced from a trace.

A benchmark mode (``replay.forced_routing``), kept out of the service: this entry point takes
the forced-routing flags, hands every other argument to ``python -m compute_svc`` unchanged, and
installs the trace's routing on the expert runtime once the model is loaded (the service's
``routing_override`` seam), so the trace's shape is checked against the model's before serving::

    python -m replay.forced_compute --force-routing TRACE [--force-routing-request N]
        [--force-routing-layer-ahead-accuracy A] [--force-routing-accuracy-drop-per-depth D]
        <every flag of python -m compute_svc>

The flags keep the names, environment variables (``EXPERTCACHE_COMPUTE_FORCE_ROUTING_*``) and
bounds they had as compute config fields; exit status and messages are compute's (2 when the
flags are invalid, the trace is missing or its shape is not the model's).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from compute_svc.__main__ import EXIT_START_FAILED
from compute_svc.__main__ import main as compute_main
from compute_svc.config import ENV_PREFIX
from expertcache.config_fields import setting
from expertcache.config_loader import cli_values, flag_name, load_config
from expertcache.errors import ExpertCacheError

if TYPE_CHECKING:
    from compute_svc.engine.model_loader import LoadedModel
    from replay.forced_routing import ForcedRouting

logger = logging.getLogger("compute_svc")


@dataclass(frozen=True)
class ForcedRoutingConfig:
    """The forced-routing flags (validated like compute's config fields, with the same names)."""

    force_routing_path: str = setting(
        "",
        "BENCHMARK ONLY: take expert choices from this routing trace (.npz); outputs are then "
        "not the model's, and the trace's layers, experts and top-k must be the model's",
    )

    force_routing_request: int = setting(
        0,
        "trace request the first Generate replays (each next Generate takes the next, "
        "wrapping after the last)",
        min=0,
    )

    force_routing_layer_ahead_accuracy: float = setting(
        0.9,
        "under forced routing: modelled layer-ahead accuracy at depth 1 (share of the trace's "
        "next-layer experts kept, the rest replaced by the router's best other pick)",
        min=0.0,
        max=1.0,
    )

    force_routing_accuracy_drop_per_depth: float = setting(
        0.1,
        "under forced routing: modelled lookahead accuracy lost per MoE layer of depth beyond the first",
        min=0.0,
        max=1.0,
    )


def forced_routing(config: ForcedRoutingConfig, loaded: LoadedModel) -> ForcedRouting:
    """The trace's routing for ``loaded``'s shape (``InvalidArgument`` names both shapes when
    they differ, or what is wrong with the trace file)."""
    from replay.forced_routing import ForcedRouting, load_trace  # torch loads with the model, after the flags

    manifest = loaded.manifest
    forced = ForcedRouting(
        load_trace(config.force_routing_path),
        manifest.moe_layers,
        manifest.num_experts,
        manifest.top_k,
        first_request=config.force_routing_request,
        layer_ahead_accuracy=config.force_routing_layer_ahead_accuracy,
        accuracy_drop_per_depth=config.force_routing_accuracy_drop_per_depth,
    )
    logger.warning(
        "BENCHMARK MODE: expert routing forced from %s (first request %d, modelled lookahead "
        "accuracy %.2f at depth 1, %.2f less per depth): outputs are not the model's",
        config.force_routing_path,
        config.force_routing_request,
        config.force_routing_layer_ahead_accuracy,
        config.force_routing_accuracy_drop_per_depth,
    )
    return forced


def parser() -> argparse.ArgumentParser:
    """The forced-routing flags only; what it does not know goes to compute's own parser."""
    out = argparse.ArgumentParser(
        prog="python -m replay.forced_compute",
        allow_abbrev=False,
        add_help=False,  # --help goes on to compute's parser, after this one's
        description="compute_svc with routing forced from a trace (benchmarks only)",
    )
    for f in dataclasses.fields(ForcedRoutingConfig):
        out.add_argument(
            flag_name(f.name), dest=f.name, default=None, help=f"{f.metadata['help']} (default: {f.default})"
        )
    out.add_argument(
        "--force-routing", dest="force_routing_path", metavar="TRACE", help="same as --force-routing-path"
    )
    return out


def main(argv: list[str] | None = None) -> int:
    args, rest = parser().parse_known_args(sys.argv[1:] if argv is None else argv)
    if "-h" in rest or "--help" in rest:
        parser().print_help()
        return compute_main(rest)
    try:
        config = load_config(
            ForcedRoutingConfig, cli=cli_values(args, ForcedRoutingConfig), env_prefix=ENV_PREFIX
        )
    except ExpertCacheError as exc:
        print(f"compute_svc: invalid configuration: {exc}", file=sys.stderr)
        return EXIT_START_FAILED
    if not config.force_routing_path:
        print("compute_svc: invalid configuration: pass --force-routing TRACE", file=sys.stderr)
        return EXIT_START_FAILED
    return compute_main(rest, routing_override=partial(forced_routing, config))


if __name__ == "__main__":
    sys.exit(main())
