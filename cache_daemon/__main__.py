"""``python -m cache_daemon``: serve one expert store on a unix socket.

Exit codes: 0 after SIGTERM/SIGINT, 2 when the configuration, the store or the budgets are
unusable (the message says which field or file), 1 on an unexpected error.

SIGHUP, a change of the ``--config-file`` (its directory is watched: a ConfigMap volume swaps a
``..data`` symlink), or a change of the ConfigMap ``config_map_name`` seen through the Kubernetes
API reloads the configuration (CLI > env > file, as at start) and applies its live fields
(``LIVE_FIELDS``: budgets, policy, prefetch, hint handling; ``expertcache.live_config``). An
invalid reload is refused whole with an ERROR log, and the old config stays; a changed
restart-only field is logged as a warning and not applied.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from pathlib import Path

from cache_daemon.config import ENV_PREFIX, DaemonConfig
from cache_daemon.daemon import DETACH_GRACE_S, CacheDaemon
from cache_daemon.metrics import registry as metrics_registry
from cache_daemon.server import SERVICE_NAME, create_server
from expertcache.errors import ExpertCacheError
from expertcache.paths import RUNTIME_DIR, ensure_private_dir
from expertcache.service_main import EXIT_START_FAILED, ServiceMain

logger = logging.getLogger("cache_daemon")

SERVICE = ServiceMain(
    name="cache_daemon",
    prog="expertcache-daemon",
    config_cls=DaemonConfig,
    env_prefix=ENV_PREFIX,
    description="ExpertCache daemon: serves moe.cache.v1.ExpertCache for one expert store on a unix socket.",
    config_map_key="daemon.yaml",
)
STOP_GRACE_S = 1.0  # Demand streams are open for a compute process's lifetime: waiting longer gains nothing


def main(argv: list[str] | None = None) -> int:
    return SERVICE.run(argv, serve)


def serve(config: DaemonConfig, args: argparse.Namespace) -> int:
    try:
        daemon = CacheDaemon.start(config)
    except (ExpertCacheError, OSError) as exc:
        return SERVICE.start_failed(exc)

    try:
        registry = metrics_registry(daemon.metrics, daemon.scrape_stats)
        metrics_server = SERVICE.serve_metrics(registry, config)
    except OSError as exc:
        return SERVICE.start_failed(exc, daemon.close)

    if config.predictor_address:
        daemon.subscribe_hints(config, config.pod_name or socket.gethostname())

    def apply(fresh: DaemonConfig, origin: str) -> None:
        update = daemon.reload(fresh, origin)
        logger.info("config reloaded from %s: %s", origin, ", ".join(update.changed) or "nothing changed")

    live = SERVICE.watch_config(args, config, apply)
    stop = SERVICE.stop_on_signals()

    socket_path = Path(config.socket_path)
    server = None
    try:
        try:
            if socket_path.parent == RUNTIME_DIR:
                # The default, in a shared temporary directory: it must be ours alone.
                ensure_private_dir(socket_path.parent)
            else:  # a directory the deployment chose (a pod's shared volume): create it if missing
                socket_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            server, health_servicer = create_server(daemon, str(socket_path), registry=registry)
        except (OSError, RuntimeError) as exc:  # grpc reports a failed bind as RuntimeError
            logger.error("cannot serve on unix://%s: %s", socket_path, exc)
            return EXIT_START_FAILED
        SERVICE.wait(stop)
        health_servicer.enter_graceful_shutdown()
    finally:
        live.close()
        # Wake Acquires blocked on slots first, so the server's grace period is not spent on them;
        # then let compute release what it still reads (its kernels finish) before its streams end.
        daemon.residency.shutdown()
        daemon.residency.drain(DETACH_GRACE_S)
        if server is not None:
            server.stop(STOP_GRACE_S).wait()
        daemon.close()
        if server is not None:  # a failed bind must not remove another process's socket
            socket_path.unlink(missing_ok=True)
        SERVICE.stopped(metrics_server, SERVICE_NAME)
    return 0


if __name__ == "__main__":
    sys.exit(main())
