"""``python -m predictor_svc``: serve ``moe.predictor.v1.Predictor`` on a TCP address.

Exit codes: 0 after SIGTERM/SIGINT, 2 when the configuration is invalid (the message names the
field) or the address cannot be bound, 1 on an unexpected error. An unreachable Redis at start is
not fatal (the predictor starts degraded); start, reload and stop: docs/predictor.md.
"""

from __future__ import annotations

import os

# One EAMC query is one small matrix-vector product: BLAS threads only add hand-off cost (measured:
# ~15 ms instead of ~65 µs per query at 1 K entries with OpenBLAS's default threading). Set before
# numpy is imported; an explicit setting by the operator wins.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse
import logging
import sys
from pathlib import Path

from expertcache.errors import ExpertCacheError
from expertcache.security import ServerSecurity, redact_url
from expertcache.service_main import EXIT_START_FAILED, ServiceMain
from expertcache.transport import TransportLimits
from predictor_svc.config import ENV_PREFIX, PredictorConfig
from predictor_svc.metrics import registry as metrics_registry
from predictor_svc.server import SERVICE_NAME, create_server
from predictor_svc.service import PredictorService
from predictor_svc.store import RedisOptions, open_store

logger = logging.getLogger("predictor_svc")

SERVICE = ServiceMain(
    name="predictor_svc",
    prog="expertcache-predictor",
    config_cls=PredictorConfig,
    env_prefix=ENV_PREFIX,
    description="ExpertCache predictor: traces EAMs, keeps the EAMC (Redis or embedded) and streams "
    "prefetch hints (moe.predictor.v1.Predictor).",
    config_flags=("--config", "--config-file"),
    config_map_key="predictor.yaml",
)
STOP_GRACE_S = 1.0  # Observe/SubscribeHints streams live as long as their clients: waiting gains nothing


def main(argv: list[str] | None = None) -> int:
    return SERVICE.run(argv, serve)


def serve(config: PredictorConfig, args: argparse.Namespace) -> int:
    try:
        embedded_path = None if config.redis_url else Path(config.embedded_path)
        if embedded_path is not None:
            embedded_path.parent.mkdir(parents=True, exist_ok=True)
        # The change log keeps eamc_capacity records per model: with the entries, a model's
        # collection in the store holds at most twice its reservation (max_eamc_bytes).
        store = open_store(
            config.redis_url or None,
            embedded_path,
            log_len=config.eamc_capacity,
            redis=RedisOptions.from_config(config),
        )
    except (ExpertCacheError, OSError, ValueError) as exc:
        # A corrupt embedded file or an unusable path: starting would silently lose the EAMC.
        logger.error("cannot open the EAMC store: %s", exc)
        return EXIT_START_FAILED
    service = PredictorService(config, store)
    try:
        registry = metrics_registry(service.metrics, service.gauge_stats)
        metrics_server = SERVICE.serve_metrics(registry, config)
    except OSError as exc:
        return SERVICE.start_failed(exc, service.close, store.close)

    live = SERVICE.watch_config(args, config, lambda fresh, origin: service.reload(fresh, origin))
    stop = SERVICE.stop_on_signals()

    server = None
    try:
        try:
            server, health_servicer = create_server(
                service,
                config.listen_address,
                max_workers=config.grpc_max_workers,
                security=ServerSecurity.from_config(config),
                reflection_enabled=config.reflection,
                limits=TransportLimits.from_config(config),
                registry=registry,
            )
        except (OSError, RuntimeError) as exc:  # grpc reports a failed bind as RuntimeError
            logger.error("cannot serve on %s: %s", config.listen_address, exc)
            return EXIT_START_FAILED
        logger.info(
            "predictor on %s, store %s%s, eamc_capacity %d",
            config.listen_address,
            config.store_kind,
            f" at {redact_url(config.redis_url)}"
            if config.redis_url
            else f" saved to {config.embedded_path}",
            config.eamc_capacity,
        )
        SERVICE.wait(stop)
        health_servicer.enter_graceful_shutdown()
    finally:
        live.close()
        service.close()  # ends hint streams, last insert attempt
        if server is not None:
            server.stop(STOP_GRACE_S).wait()
        try:
            store.close()  # the embedded store saves itself to embedded_path here
        except (ExpertCacheError, OSError) as exc:
            logger.error("closing the EAMC store failed: %s", exc)
        else:
            if embedded_path is not None:
                logger.info("embedded EAMC saved to %s", embedded_path)
        SERVICE.stopped(metrics_server, SERVICE_NAME)
    return 0


if __name__ == "__main__":
    sys.exit(main())
