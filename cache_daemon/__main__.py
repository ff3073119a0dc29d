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
import signal
import socket
import sys
import threading
from pathlib import Path

from cache_daemon.config import ENV_PREFIX, DaemonConfig
from cache_daemon.daemon import DETACH_GRACE_S, CacheDaemon
from cache_daemon.metrics import registry as metrics_registry
from cache_daemon.server import SERVICE_NAME, create_server
from expertcache import telemetry
from expertcache.config_loader import add_arguments, cli_values, load_config, print_config_schema
from expertcache.errors import ExpertCacheError
from expertcache.live_config import LiveConfig
from expertcache.logs import setup_logging
from expertcache.paths import RUNTIME_DIR, ensure_private_dir
from expertcache.prom import serve

logger = logging.getLogger("cache_daemon")

CONFIG_MAP_KEY = "daemon.yaml"  # the ConfigMap key holding this service's config file
STOP_GRACE_S = 1.0  # Demand streams are open for a compute process's lifetime: waiting longer gains nothing


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="expertcache-daemon",
        # No abbreviations: a flag the chart passes must be the exact name (a renamed flag fails).
        allow_abbrev=False,
        description="ExpertCache daemon: serves moe.cache.v1.ExpertCache for one expert store on a unix socket.",
        epilog=f"Every option can also be set as {ENV_PREFIX}<OPTION> or in --config-file (CLI > env > file).",
    )
    parser.add_argument("--config-file", default=None, help="YAML file of config fields (the ConfigMap).")
    add_arguments(parser, DaemonConfig)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.print_config_schema:
        print_config_schema(DaemonConfig, ENV_PREFIX)
        return 0
    try:
        config = load_config(
            DaemonConfig, cli=cli_values(args, DaemonConfig), env_prefix=ENV_PREFIX, file=args.config_file
        )
    except ExpertCacheError as exc:
        print(f"cache_daemon: invalid configuration: {exc}", file=sys.stderr)
        return 2
    setup_logging(config.log_level, config.log_format)
    try:
        telemetry.setup("expertcache-daemon")
    except ExpertCacheError as exc:
        print(f"cache_daemon: invalid tracing environment: {exc}", file=sys.stderr)
        return 2

    try:
        daemon = CacheDaemon.start(config)
    except (ExpertCacheError, OSError) as exc:
        logger.error("cannot start: %s", exc)
        return 2

    try:
        registry = metrics_registry(daemon)
        metrics_server = serve(registry, config.metrics_address, config.metrics_port, "daemon")
    except OSError as exc:
        logger.error("cannot start: %s", exc)
        daemon.close()
        return 2

    if config.predictor_address:
        daemon.subscribe_hints(config, config.pod_name or socket.gethostname())

    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        logger.info("received %s, stopping", signal.Signals(signum).name)
        stop.set()

    def apply(fresh: DaemonConfig, origin: str) -> None:
        update = daemon.reload(fresh, origin)
        logger.info("config reloaded from %s: %s", origin, ", ".join(update.changed) or "nothing changed")

    live = LiveConfig(
        DaemonConfig,
        cli=cli_values(args, DaemonConfig),
        env_prefix=ENV_PREFIX,
        config_file=args.config_file,
        apply=apply,
        config_map_name=config.config_map_name,
        config_map_key=CONFIG_MAP_KEY,
        service="expertcache-daemon",
    )

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # Applied by the reload thread, outside the signal handler.
    signal.signal(signal.SIGHUP, lambda *_: live.trigger(f"file {args.config_file} (SIGHUP)"))

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
            return 2
        while not stop.wait(1.0):  # wakes for the signal handlers; reloads run on their own thread
            pass
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
        if metrics_server is not None:
            metrics_server.close()
        telemetry.shutdown()
        logger.info("stopped %s", SERVICE_NAME)
    return 0


if __name__ == "__main__":
    sys.exit(main())
