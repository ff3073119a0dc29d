"""The cache daemon's configuration: one frozen, validated ``DaemonConfig``.

Loaded once in ``__main__`` by ``expertcache.config_loader.load_config`` (CLI > env
``EXPERTCACHE_DAEMON_<FIELD>`` > ``--config-file`` YAML > default) and passed down explicitly.
A budget's ceiling is checked here; what depends on the store (at least one blob) is checked
when the daemon starts, where the manifest is known: both by ``cache_daemon.budget.Budget``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from cache_daemon.budget import Budget
from cache_daemon.decisions.policy import POLICIES
from expertcache.config_fields import (
    DEVICE_KINDS,
    ConfigMapFields,
    ObservabilityFields,
    PredictorClientFields,
    TransportFields,
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

    store_dir: str = field(
        default="",
        metadata={"help": "Expert store directory written by `python -m cache_daemon.convert` (required)."},
    )
    """Expert store directory (holds manifest.json and experts/). Required."""

    socket_path: str = field(
        default=DEFAULT_DAEMON_SOCKET,
        metadata={"help": "Unix socket path the daemon serves moe.cache.v1.ExpertCache on."},
    )
    """Unix socket the gRPC server listens on (``unix://<socket_path>``); removed at exit. Its
    directory is created owner-only. The default (``expertcache.paths``) is writable without root
    and is where compute looks by default."""

    device_budget_bytes: int = field(
        default=1 << 30,
        metadata={
            "live": True,
            "help": "Bytes of the device arena in use; slots = budget // blob_bytes (at least one). "
            "Live up to device_budget_max_bytes.",
            "min": 1,
        },
    )
    """Bytes of the device arena the cache may fill: ``device_budget_bytes // blob_bytes`` slots,
    at least one. Live: shrinking evicts the experts the policy ranks last (pinned ones as soon
    as they are released), growing lets more stay resident; the arena itself is sized at start
    for ``device_budget_max_bytes``."""

    device_budget_max_bytes: int = field(
        default=0,
        metadata={
            "help": "Ceiling of device_budget_bytes while running: the arena is allocated this large "
            "at start; 0 = the starting device_budget_bytes.",
            "min": 0,
        },
    )
    """Memory reserved for the arena at start (restart-only): a live ``device_budget_bytes``
    above it is refused. 0: the starting budget is the ceiling (no growth without a restart)."""

    host_budget_bytes: int = field(
        default=0,
        metadata={
            "live": True,
            "help": "Bytes of the host tier below the arena (pinned with CUDA); 0 disables it. "
            "Live up to host_budget_max_bytes.",
            "min": 0,
        },
    )
    """Bytes of the host-memory tier in use; ``host_budget_bytes // blob_bytes`` slots, 0 = none.
    Live like ``device_budget_bytes``, within ``host_budget_max_bytes``."""

    host_budget_max_bytes: int = field(
        default=0,
        metadata={
            "help": "Ceiling of host_budget_bytes while running: the host pool is allocated this large "
            "at start (and must fit the memory limit); 0 = the starting host_budget_bytes.",
            "min": 0,
        },
    )
    """Host memory reserved at start (restart-only); 0: the starting budget is the ceiling."""

    device: str = field(
        default="auto",
        metadata={
            "help": "Where the arena lives: cuda, cuda:<ordinal>, cuda:<GPU UUID>, cpu (a memfd shared with compute), "
            "or auto (cuda if available).",
        },
    )
    """Arena device: ``cuda`` / ``cuda:<ordinal>`` / ``cuda:<GPU UUID>`` (CUDA IPC), ``cpu`` (a sealed
    memfd) or ``auto``. A UUID names the GPU the same way in every container of the pod."""

    io_threads: int = field(
        default=4,
        metadata={
            "help": "Threads that read the store and copy experts into the arena.",
            "min": 1,
            "max": 256,
        },
    )
    """Size of the I/O thread pool: concurrent store reads and tier copies."""

    acquire_timeout_s: float = field(
        default=60.0,
        metadata={
            "help": "Seconds an Acquire may wait for free slots and loads before DEADLINE_EXCEEDED.",
            "min": 0.001,
            "max": 86400.0,
        },
    )
    """Upper bound on one Acquire (waiting for slots pinned by others, then for loads)."""

    eviction_policy: str = field(
        default="activation-aware",
        metadata={
            "live": True,
            "help": "Eviction policy of the device arena (live).",
            "choices": tuple(sorted(POLICIES)),
        },
    )
    """Name of the device tier's eviction policy (a key of ``cache_daemon.decisions.policy.POLICIES``:
    the policies a daemon can run; the replay's references that need the future are not among
    them). The host tier below is an LRU cache."""

    next_visit_model: str = field(
        default="",
        metadata={
            "live": True,
            "help": "File of the learned next-visit model (python -m replay.learn_next_visit) the "
            "eviction and prefetch decisions use in place of the routing transitions; empty = none (live).",
        },
    )
    """A model fitted on recorded routing of the served model (``cache_daemon.decisions.next_visit``:
    each layer's experts at a request's next token from every layer's latest routing). At start, a
    file that is unreadable, malformed or fitted for another model shape stops the start with a
    message naming it. Live: a new path is read and swapped in whole, or refused with the old model
    kept (to roll out a refitted model, write it under a new name and point this at it; the same
    path is not read again). Empty: each layer's next visit is estimated from its own last routing
    (``transitions``), learned online."""

    prefetch: bool = field(
        default=True,
        metadata={"live": True, "help": "Load experts ahead of demand from predictions (live)."},
    )
    """Prefetch from layer-ahead predictions, the request's history and predictor hints."""

    max_inflight_bytes: int = field(
        default=0,
        metadata={
            "live": True,
            "help": "Bytes of loads in flight a prefetch may add to; 0 = four experts (live).",
            "min": 0,
        },
    )
    """Bound on bytes of loads in flight beyond which no prefetch starts (demands are never
    bounded), so prefetch never hogs the link a demand needs. 0 = ``4 * blob_bytes``."""

    prefetch_horizon_layers: int = field(
        default=2,
        metadata={
            "live": True,
            "help": "History/hint prefetch looks at most this many layers ahead (live).",
            "min": 1,
            "max": 1 << 16,
        },
    )
    """How far ahead (in layers) the EAMC / history class prefetches."""

    hint_ttl_tokens: int = field(
        default=64,
        metadata={
            "live": True,
            "help": "Predictor hints older than this many tokens are ignored (live).",
            "min": 0,
        },
    )
    """A hint is stale (never prefetched, never protects a slot) after this many tokens."""

    predictor_address: str = field(
        default="",
        metadata={
            "help": "gRPC address of the predictor (host:port) to take prefetch hints from; empty = none."
        },
    )
    """Where ``moe.predictor.v1.Predictor.SubscribeHints`` is served. The subscription never
    touches the demand path: an absent predictor only means no hints."""

    pod_name: str = field(
        default="",
        metadata={"help": "Pod name to subscribe hints for (compute's pod_name); empty = this host's name."},
    )
    """Matches the ``pod`` compute reports with its activations: hints of those requests come here."""

    hint_stale_s: float = field(
        default=30.0,
        metadata={
            "live": True,
            "help": "Seconds after which a request without new hints is forgotten.",
            "min": 0.001,
            "max": 86400.0,
        },
    )
    """A request whose hints have not changed for this long is dropped from the board (live)."""

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
