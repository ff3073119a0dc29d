"""The predictor's configuration: one frozen, validated ``PredictorConfig``.

Loaded once in ``__main__`` by ``expertcache.config_loader.load_config`` (CLI > env
``EXPERTCACHE_PREDICTOR_<FIELD>`` > ``--config-file`` YAML > default) and passed down explicitly.

Decisions recorded here (the fields' docstrings repeat them):

- ``redis_url`` empty → the embedded store, loaded from and saved to ``embedded_path``.
- Redis unreachable at start → the predictor starts anyway, *degraded*: it serves Observe and
  hints from what it has in memory, counts and logs the store errors, and catches up when Redis
  answers (a Deployment should come up and report, not crash-loop on its dependency).
- A live request quiet for ``live_request_ttl_s`` (its compute process vanished without
  ``request_done``) is dropped and its partial EAM is **not** inserted: a truncated EAM would
  enter the EAMC looking like a short request and replace a complete, more similar one.
- A finished EAM whose insert fails with the store down is kept in a bounded retry queue
  (``max_pending_inserts``) and retried on every sync tick; the oldest is dropped when full.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from expertcache.errors import InvalidArgument
from expertcache.paths import DEFAULT_EAMC_PATH

ENV_PREFIX = "EXPERTCACHE_PREDICTOR_"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
_SHAPE_RE = re.compile(r"^(?P<model>[^=\s]+)=(?P<layers>\d+)x(?P<experts>\d+)x(?P<top_k>\d+)$")


@dataclass(frozen=True)
class ModelShape:
    """A model's routing geometry given in configuration (``model_id=LAYERSxEXPERTSxTOP_K``)."""

    model_id: str
    layers: int
    experts: int
    top_k: int


def parse_model_shape(text: str) -> ModelShape:
    """``"gpt-oss-20b=24x32x4"`` → ModelShape; InvalidArgument naming the field otherwise."""
    match = _SHAPE_RE.match(text.strip())
    if not match:
        raise InvalidArgument(
            f"config field 'model_shapes' entry {text!r} is not MODEL_ID=LAYERSxEXPERTSxTOP_K "
            "(e.g. gpt-oss-20b=24x32x4)"
        )
    shape = ModelShape(match["model"], int(match["layers"]), int(match["experts"]), int(match["top_k"]))
    if min(shape.layers, shape.experts, shape.top_k) < 1 or shape.top_k > shape.experts:
        raise InvalidArgument(
            f"config field 'model_shapes' entry {text!r}: layers, experts and top_k must be >= 1 "
            "and top_k <= experts"
        )
    return shape


@dataclass(frozen=True)
class PredictorConfig:
    """Everything one predictor replica needs."""

    listen_address: str = field(
        default="127.0.0.1:50070",
        metadata={"help": "host:port the gRPC server listens on (0.0.0.0:50070 in a pod)."},
    )
    """Address of ``moe.predictor.v1.Predictor`` (TCP; the predictor is its own Deployment)."""

    redis_url: str = field(
        default="",
        metadata={"help": "Redis URL of the shared EAMC (redis://host:port/db); empty = embedded store."},
    )
    """The EAMC store. Empty: the embedded in-process store saved to ``embedded_path``."""

    embedded_path: str = field(
        default=DEFAULT_EAMC_PATH,
        metadata={"help": "File the embedded store is loaded from at start and saved to at shutdown."},
    )
    """Only used when ``redis_url`` is empty. Written atomically (tmp + rename) on SIGTERM."""

    eamc_capacity: int = field(
        default=512,
        metadata={
            "help": "Entries per model in the EAMC; when full a new EAM replaces the most similar.",
            "min": 1,
            "max": 1_000_000,
        },
    )
    """Bound of each model's collection (the paper found a few hundred enough)."""

    hint_top_n: int = field(
        default=8,
        metadata={
            "help": "Hinted experts per layer and token (highest scores first).",
            "min": 1,
            "max": 4096,
        },
    )
    """At most this many ``(layer, expert)`` hints per layer in a batch."""

    min_score: float = field(
        default=0.05,
        metadata={"help": "Hints scoring below this are not sent.", "min": 0.0, "max": 1.0},
    )
    """Score threshold in [0, 1]: a hint below it is noise to the prefetcher."""

    match_top_n: int = field(
        default=16,
        metadata={
            "help": "EAMC entries (most similar first) that a prediction mixes.",
            "min": 1,
            "max": 100_000,
        },
    )
    """How many best matches feed the EAMC part of a prediction."""

    max_live_requests: int = field(
        default=4096,
        metadata={
            "help": "Live requests tracked; the least recently active is dropped beyond it.",
            "min": 1,
            "max": 10_000_000,
        },
    )
    """Bound on in-memory live EAMs: a flood of request ids never exhausts memory. The dropped
    request's EAM is not inserted (counted as expired); Observe never fails for this."""

    live_request_ttl_s: float = field(
        default=600.0,
        metadata={
            "help": "Seconds without activity after which a live request is dropped (EAM not inserted).",
            "min": 0.1,
            "max": 86400.0 * 7,
        },
    )
    """A request whose compute vanished without ``request_done`` is dropped; partial EAMs are not
    inserted (they would look like short requests and displace complete ones)."""

    min_request_tokens: int = field(
        default=1,
        metadata={"help": "Finished requests with fewer tokens are not inserted into the EAMC.", "min": 1},
    )
    """A request of fewer observed tokens carries too little routing to be a useful entry."""

    sync_interval_s: float = field(
        default=1.0,
        metadata={
            "help": "Seconds between EAMC syncs with the store (and retries of failed inserts).",
            "min": 0.01,
            "max": 3600.0,
        },
    )
    """How stale another replica's inserts may look here; also the insert retry period."""

    max_pending_inserts: int = field(
        default=1024,
        metadata={
            "help": "Finished EAMs kept for retry while the store is down; oldest dropped beyond.",
            "min": 1,
            "max": 1_000_000,
        },
    )
    """Bound of the retry queue of inserts that failed with the store unavailable."""

    subscriber_queue_requests: int = field(
        default=256,
        metadata={
            "help": "Requests with unsent hints per subscriber; the oldest is dropped beyond.",
            "min": 1,
            "max": 1_000_000,
        },
    )
    """Per subscriber, unsent hints are coalesced per (request, layer); this bounds the number of
    requests pending, so a stalled subscriber never grows an unbounded backlog."""

    model_shapes: tuple[str, ...] = field(
        default=(),
        metadata={"help": "Comma-separated MODEL_ID=LAYERSxEXPERTSxTOP_K known before any activation."},
    )
    """Models whose geometry is fixed by configuration; others take it from their first
    activation (``layers``/``num_experts``/``top_k`` fields)."""

    grpc_max_workers: int = field(
        default=32,
        metadata={
            "help": "gRPC worker threads (each open Observe/SubscribeHints stream holds one).",
            "min": 2,
            "max": 4096,
        },
    )
    """Thread pool of the server: open streams hold a thread each."""

    metrics_port: int = field(
        default=0,
        metadata={"help": "port of the Prometheus /metrics endpoint; 0 = off", "min": 0, "max": 65535},
    )
    """Prometheus ``/metrics`` over HTTP (``expertcache.prom``); 0 serves none."""

    metrics_address: str = field(
        default="127.0.0.1", metadata={"help": "address the /metrics endpoint binds (0.0.0.0 in a pod)"}
    )
    """Loopback by default: only what runs beside the service can scrape it."""

    log_format: str = field(
        default="auto",
        metadata={
            "help": "log format: json, text, or auto (json when stderr is not a terminal)",
            "choices": ("auto", "json", "text"),
        },
    )
    """JSON lines carry the trace and span ids of the current span (``expertcache.logs``)."""

    log_level: str = field(
        default="INFO",
        metadata={"help": "Logging level.", "choices": LOG_LEVELS},
    )
    """Level of the root logger."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "log_level", str(self.log_level).upper())
        object.__setattr__(self, "model_shapes", tuple(s.strip() for s in self.model_shapes if s.strip()))

    def shapes(self) -> dict[str, ModelShape]:
        """The configured ``model_shapes`` by model id."""
        return {s.model_id: s for s in map(parse_model_shape, self.model_shapes)}

    def check(self) -> None:
        """Cross-field checks run by ``load_config`` after the per-field constraints."""
        host, sep, port = self.listen_address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise InvalidArgument(f"config field 'listen_address' = {self.listen_address!r} is not host:port")
        if self.redis_url and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise InvalidArgument(
                f"config field 'redis_url' = {self.redis_url!r} must start with redis://, rediss:// or unix://"
            )
        if not self.redis_url and not self.embedded_path:
            raise InvalidArgument("config field 'embedded_path' must not be empty when 'redis_url' is empty")
        shapes = self.shapes()  # raises naming the bad entry
        if len(shapes) != len(self.model_shapes):
            raise InvalidArgument("config field 'model_shapes' names a model twice")

    @property
    def store_kind(self) -> str:
        return "redis" if self.redis_url else "embedded"
