"""``python -m compute_svc``: parse the config, start the server, stop on SIGTERM/SIGINT.

On SIGTERM health turns NOT_SERVING, new Generates are refused (UNAVAILABLE) and the streams in
progress get ``drain_timeout_s`` to finish before the process stops (a Kubernetes pod's
termination: the chart's terminationGracePeriodSeconds covers the preStop pause and the drain).

Exit status: 0 after a clean stop, 2 when the config is invalid or start-up fails (the daemon
cannot be reached, the store is incomplete...), with the reason on stderr.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from typing import TYPE_CHECKING

from compute_svc.config import ENV_PREFIX, ComputeConfig
from expertcache import telemetry
from expertcache.config_loader import add_arguments, cli_values, load_config, print_config_schema
from expertcache.errors import ExpertCacheError
from expertcache.logs import setup_logging

if TYPE_CHECKING:
    from compute_svc.server import RoutingOverrideFactory

EXIT_START_FAILED = 2
logger = logging.getLogger("compute_svc")


def main(argv: list[str] | None = None, *, routing_override: RoutingOverrideFactory | None = None) -> int:
    """``routing_override``: installed on the expert runtime before serving (a benchmark entry
    point's, ``replay.forced_compute``; the service itself never has one)."""
    parser = argparse.ArgumentParser(
        prog="expertcache-compute",
        # No abbreviations: a flag the chart passes must be the exact name (a renamed flag fails).
        allow_abbrev=False,
        description="ExpertCache compute service: serves moe.inference.v1.Inference from an expert store",
    )
    parser.add_argument("--config-file", help="YAML file of config fields (the ConfigMap)")
    add_arguments(parser, ComputeConfig)
    args = parser.parse_args(argv)
    if args.print_config_schema:
        print_config_schema(ComputeConfig, ENV_PREFIX)
        return 0
    try:
        config = load_config(
            ComputeConfig, cli=cli_values(args, ComputeConfig), env_prefix=ENV_PREFIX, file=args.config_file
        )
    except ExpertCacheError as exc:
        print(f"compute_svc: invalid configuration: {exc}", file=sys.stderr)
        return EXIT_START_FAILED
    setup_logging(config.log_level, config.log_format)
    try:
        telemetry.setup("expertcache-compute")
    except ExpertCacheError as exc:
        print(f"compute_svc: invalid tracing environment: {exc}", file=sys.stderr)
        return EXIT_START_FAILED

    from compute_svc.server import ComputeServer  # torch and transformers load here, after the config

    try:
        server = ComputeServer(config, routing_override=routing_override)
    except (ExpertCacheError, OSError) as exc:  # OSError: the listen address cannot be bound
        print(f"compute_svc: cannot start: {exc}", file=sys.stderr)
        return EXIT_START_FAILED

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        server.start()
    except OSError as exc:  # the metrics port cannot be bound
        print(f"compute_svc: cannot start: {exc}", file=sys.stderr)
        server.stop()
        return EXIT_START_FAILED
    stop.wait()
    logger.info("stopping: draining the streams in progress (up to %gs)", config.drain_timeout_s)
    server.stop(drain_timeout_s=config.drain_timeout_s)
    telemetry.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
