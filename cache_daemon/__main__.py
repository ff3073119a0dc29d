"""``python -m cache_daemon``: serve one expert store on a unix socket.

Exit codes: 0 after SIGTERM/SIGINT, 2 when the configuration, the store or the budgets are
unusable (the message says which field or file), 1 on an unexpected error.

SIGHUP, or a change of the ``--config-file`` (checked every second: a Kubernetes ConfigMap volume
is updated in place, with no signal), reloads the configuration (CLI > env > file, as at start)
and applies its live fields (``LIVE_FIELDS``: policy,
prefetch, hint handling); a reload that is invalid or changes another field is logged and
refused whole, and the old config stays.
"""

from __future__ import annotations

import argparse
import logging
import os
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
from expertcache.config_loader import add_arguments, cli_values, load_config
from expertcache.errors import ExpertCacheError
from expertcache.logs import setup_logging
from expertcache.paths import RUNTIME_DIR, ensure_private_dir
from expertcache.prom import serve

logger = logging.getLogger("cache_daemon")

STOP_GRACE_S = 1.0  # Demand streams are open for a compute process's lifetime: waiting longer gains nothing


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="expertcache-daemon",
        description="ExpertCache daemon: serves moe.cache.v1.ExpertCache for one expert store on a unix socket.",
        epilog=f"Every option can also be set as {ENV_PREFIX}<OPTION> or in --config-file (CLI > env > file).",
    )
    parser.add_argument("--config-file", default=None, help="YAML file of config fields (the ConfigMap).")
    add_arguments(parser, DaemonConfig)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
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
        metrics_server = serve(
            metrics_registry(daemon), config.metrics_address, config.metrics_port, "daemon"
        )
    except OSError as exc:
        logger.error("cannot start: %s", exc)
        daemon.close()
        return 2

    if config.predictor_address:
        daemon.subscribe_hints(config, config.pod_name or socket.gethostname())

    stop = threading.Event()
    reload = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        logger.info("received %s, stopping", signal.Signals(signum).name)
        stop.set()

    def on_hangup(_signum: int, _frame: object) -> None:
        reload.set()  # applied by the loop below within a second, outside the signal handler

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, on_hangup)

    socket_path = Path(config.socket_path)
    server = None
    try:
        try:
            if socket_path.parent == RUNTIME_DIR:
                # The default, in a shared temporary directory: it must be ours alone.
                ensure_private_dir(socket_path.parent)
            else:  # a directory the deployment chose (a pod's shared volume): create it if missing
                socket_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            server, health_servicer = create_server(daemon, str(socket_path))
        except (OSError, RuntimeError) as exc:  # grpc reports a failed bind as RuntimeError
            logger.error("cannot serve on unix://%s: %s", socket_path, exc)
            return 2
        seen = _file_version(args.config_file)
        while not stop.wait(1.0):
            version = _file_version(args.config_file)
            if reload.is_set() or version != seen:
                reload.clear()
                seen = version
                _reload(daemon, args)
        health_servicer.enter_graceful_shutdown()
    finally:
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


def _file_version(path: str | None) -> tuple[int, int, int] | None:
    """What tells a changed config file: (inode, size, mtime) through symlinks (a ConfigMap
    update swaps a symlink to a new file), None without a file."""
    if path is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _reload(daemon: CacheDaemon, args: argparse.Namespace) -> None:
    """Load the config again and apply its live fields; any error keeps the old config."""
    try:
        fresh = load_config(
            DaemonConfig, cli=cli_values(args, DaemonConfig), env_prefix=ENV_PREFIX, file=args.config_file
        )
        update = daemon.reload(fresh)
    except ExpertCacheError as exc:
        logger.error("config reload refused, config unchanged: %s", exc)
        return
    logger.info("config reloaded: %s", ", ".join(update.changed) or "nothing changed")


if __name__ == "__main__":
    sys.exit(main())
