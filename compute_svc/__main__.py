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
import sys
from functools import partial
from typing import TYPE_CHECKING

from compute_svc.config import ENV_PREFIX, ComputeConfig
from compute_svc.engine.prompt_text import one_malloc_arena
from expertcache.errors import ExpertCacheError
from expertcache.service_main import EXIT_START_FAILED, ServiceMain

if TYPE_CHECKING:
    from compute_svc.server import RoutingOverrideFactory

logger = logging.getLogger("compute_svc")

SERVICE = ServiceMain(
    name="compute_svc",
    prog="expertcache-compute",
    config_cls=ComputeConfig,
    env_prefix=ENV_PREFIX,
    description="ExpertCache compute service: serves moe.inference.v1.Inference from an expert store",
)


def main(argv: list[str] | None = None, *, routing_override: RoutingOverrideFactory | None = None) -> int:
    """``routing_override``: installed on the expert runtime before serving (a benchmark entry
    point's, ``replay.forced_compute``; the service itself never has one)."""
    one_malloc_arena()  # before any thread starts (compute_svc.engine.prompt_text)
    return SERVICE.run(argv, partial(serve, routing_override=routing_override))


def serve(
    config: ComputeConfig,
    _args: argparse.Namespace,
    *,
    routing_override: RoutingOverrideFactory | None = None,
) -> int:
    from compute_svc.server import ComputeServer  # torch and transformers load here, after the config

    try:
        server = ComputeServer(config, routing_override=routing_override)
    except (ExpertCacheError, OSError) as exc:  # OSError: the listen address cannot be bound
        print(f"compute_svc: cannot start: {exc}", file=sys.stderr)
        return EXIT_START_FAILED

    stop = SERVICE.stop_on_signals()
    try:
        server.start()
    except OSError as exc:  # the metrics port cannot be bound
        print(f"compute_svc: cannot start: {exc}", file=sys.stderr)
        server.stop()
        return EXIT_START_FAILED
    SERVICE.wait(stop)
    logger.info("stopping: draining the streams in progress (up to %gs)", config.drain_timeout_s)
    server.stop(drain_timeout_s=config.drain_timeout_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
