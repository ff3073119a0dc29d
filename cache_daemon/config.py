"""The cache daemon's configuration: one frozen, validated ``DaemonConfig``.

Loaded once in ``__main__`` by ``expertcache.config_loader.load_config`` (CLI > env
``EXPERTCACHE_DAEMON_<FIELD>`` > ``--config-file`` YAML > default) and passed down explicitly.
A budget's ceiling is checked here; what depends on the store (at least one blob) is checked
when the daemon starts, where the manifest is known: both by ``cache_daemon.budget.Budget``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from cache_daemon.budget import Budget
from cache_daemon.decisions.policy import POLICIES
from cache_daemon.decisions.scheduler import PrefetchConfig
from expertcache.config_fields import (
    DEVICE_KINDS,
    ConfigMapFields,
    ObservabilityFields,
    PredictorClientFields,
    TransportFields,
    setting,
)
from expertcache.config_loader import live_fields
from expertcache.errors import InvalidArgument
from expertcache.paths import (
    DEFAULT_DAEMON_SOCKET,
    HANDOFF_SOCKET_SUFFIX,
    MAX_DAEMON_SOCKET_PATH_BYTES,
    MAX_UNIX_SOCKET_PATH_BYTES,
)
from expertcache.security import ClientSecurity

ENV_PREFIX = "EXPERTCACHE_DAEMON_"


@dataclass(frozen=True)
class DaemonConfig(PredictorClientFields, ObservabilityFields, ConfigMapFields, TransportFields):
    """Everything the daemon needs to serve one expert store."""

    store_dir: str = setting(
        "", "Expert store directory written by `python -m cache_daemon.convert` (required)."
    )

    socket_path: str = setting(
        DEFAULT_DAEMON_SOCKET,
        "Unix socket path the daemon serves moe.cache.v1.ExpertCache on (removed at exit, "
        "its directory created owner-only); the default is where compute looks.",
    )

    device_budget_bytes: int = setting(
        1 << 30,
        "Bytes of the device arena in use; slots = budget // blob_bytes (at least one). "
        "Live up to device_budget_max_bytes: shrinking evicts the experts the policy ranks last.",
        live=True,
        min=1,
    )

    device_budget_max_bytes: int = setting(
        0,
        "Ceiling of device_budget_bytes while running: the arena is allocated this large "
        "at start; 0 = the starting device_budget_bytes.",
        min=0,
    )

    host_budget_bytes: int = setting(
        0,
        "Bytes of the host tier below the arena (pinned with CUDA); 0 disables it. "
        "Live up to host_budget_max_bytes.",
        live=True,
        min=0,
    )

    host_budget_max_bytes: int = setting(
        0,
        "Ceiling of host_budget_bytes while running: the host pool is allocated this large "
        "at start (and must fit the memory limit); 0 = the starting host_budget_bytes.",
        min=0,
    )

    device: str = setting(
        "auto",
        "Where the arena lives: cuda, cuda:<ordinal>, cuda:<GPU UUID> (the same in every container "
        "of the pod), cpu (a memfd shared with compute), or auto (cuda if available).",
    )

    io_threads: int = setting(
        4, "Threads that read the store and copy experts into the arena.", min=1, max=256
    )

    store_chunk_bytes: int = setting(
        1 << 20,
        "Store reads are issued in chunks of this many bytes (a multiple of 4096): a demand waits "
        "behind at most the prefetch chunks already in flight, so smaller chunks let it overtake "
        "sooner, at more I/Os per expert.",
        min=4096,
        max=1 << 30,
    )

    acquire_timeout_s: float = setting(
        60.0,
        "Seconds an Acquire may wait for free slots and loads before DEADLINE_EXCEEDED.",
        min=0.001,
        max=86400.0,
    )

    eviction_policy: str = setting(
        "activation-aware",
        "Eviction policy of the device arena (live); the host tier below is LRU.",
        live=True,
        choices=tuple(sorted(POLICIES)),
    )

    next_visit_model: str = setting(
        "",
        "File of the learned next-visit model (python -m replay.learn_next_visit) the "
        "eviction and prefetch decisions use in place of the routing transitions; empty = none (live). "
        "A bad file stops the start; live, a new path is swapped in whole or refused keeping the old "
        "model (the same path is not read again: write a refitted model under a new name).",
        live=True,
    )

    prefetch: bool = setting(
        True,
        "Load experts ahead of demand from layer-ahead predictions, the request's history "
        "and predictor hints (live).",
        live=True,
    )

    max_inflight_bytes: int = setting(
        0,
        "Bytes of loads in flight beyond which no prefetch starts (demands are never bounded); "
        "0 = four experts (live).",
        live=True,
        min=0,
    )

    prefetch_horizon_layers: int = setting(
        2, "History/hint prefetch looks at most this many layers ahead (live).", live=True, min=1, max=1 << 16
    )

    prefetch_min_probability: float = setting(
        PrefetchConfig.min_probability,
        "A prefetch starts only for an expert estimated at least this likely to be used when its layer "
        "comes: a layer-ahead guess by the precision measured for guesses like it, history and hints "
        "by its use probability at its next visit. Higher reads fewer bytes, lower hides more misses "
        "(live).",
        live=True,
        min=0.0,
        max=1.0,
    )

    hint_ttl_tokens: int = setting(
        64,
        "Predictor hints older than this many tokens are ignored: never prefetched, never "
        "protecting a slot (live).",
        live=True,
        min=0,
    )

    predictor_address: str = setting(
        "",
        "gRPC address of the predictor (host:port) to take prefetch hints from, off the demand "
        "path (an absent predictor only means no hints); empty = none.",
    )

    pod_name: str = setting(
        "", "Pod name to subscribe hints for (compute's pod_name); empty = this host's name."
    )

    hint_stale_s: float = setting(
        30.0,
        "Seconds after which a request without new hints is forgotten (live).",
        live=True,
        min=0.001,
        max=86400.0,
    )

    def check(self) -> None:
        """Cross-field checks run by ``load_config`` after the per-field constraints."""
        ClientSecurity.from_config(self).check()
        kind, sep, gpu = self.device.partition(":")
        if kind not in DEVICE_KINDS or (sep and (kind != "cuda" or not gpu)):
            raise InvalidArgument(
                f"config field 'device' = {self.device!r} is not one of {', '.join(DEVICE_KINDS)}, "
                "cuda:<ordinal>, cuda:<GPU UUID>"
            )
        Budget.device(self).check_ceiling()
        Budget.host(self).check_ceiling()
        if not self.store_dir:
            raise InvalidArgument(
                f"config field 'store_dir' is required (--store-dir or {ENV_PREFIX}STORE_DIR)"
            )
        if self.store_chunk_bytes % 4096:
            raise InvalidArgument(
                f"config field 'store_chunk_bytes' = {self.store_chunk_bytes} is not a multiple of 4096 "
                "(O_DIRECT reads are aligned to it)"
            )
        if not self.socket_path:
            raise InvalidArgument("config field 'socket_path' must not be empty")
        # The handoff socket beside it ("<socket_path>.handoff") must fit too.
        limit = MAX_DAEMON_SOCKET_PATH_BYTES
        if len(os.fsencode(self.socket_path)) > limit:
            raise InvalidArgument(
                f"config field 'socket_path' is {len(os.fsencode(self.socket_path))} bytes long; it may be "
                f"at most {limit} bytes (unix socket paths are limited to {MAX_UNIX_SOCKET_PATH_BYTES} bytes, "
                f"and the handoff socket adds '{HANDOFF_SOCKET_SUFFIX}'): {self.socket_path}"
            )


# Fields UpdateConfig (and a config reload) may change while serving (``metadata["live"]``); the
# others size memory or name resources at start.
LIVE_FIELDS = live_fields(DaemonConfig)
