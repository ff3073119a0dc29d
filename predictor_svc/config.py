"""The predictor's configuration: one frozen, validated ``PredictorConfig``.

Loaded once in ``__main__`` by ``expertcache.config_loader.load_config`` (CLI > env
``EXPERTCACHE_PREDICTOR_<FIELD>`` > ``--config-file`` YAML > default) and passed down explicitly.

Decisions recorded here:

- ``redis_url`` empty → the embedded store, loaded from and saved to ``embedded_path``.
- Redis unreachable at start → the predictor starts anyway, *degraded*: it serves Observe and
  hints from what it has in memory, counts and logs the store errors, and catches up when Redis
  answers (a Deployment should come up and report, not crash-loop on its dependency).
- A live request quiet for ``live_request_ttl_s`` (its compute process vanished without
  ``request_done``) is dropped and its partial EAM is **not** inserted: a truncated EAM would
  enter the EAMC looking like a short request and replace a complete, more similar one.
- A finished EAM whose insert fails with the store down is kept in a bounded retry queue
  (``max_pending_inserts`` EAMs and ``max_pending_insert_bytes``) and retried on every sync tick;
  the oldest is dropped when full.
- Model shapes are *registered* (RegisterModel, or ``model_shapes``), never inferred from an
  activation: a client cannot make the predictor allocate for a shape it merely claims. The
  limits ``max_layers``/``max_experts`` (INVALID_ARGUMENT beyond) and ``max_models`` /
  ``max_eamc_bytes`` (RESOURCE_EXHAUSTED beyond) bound what registration may reserve:
  ``eamc_capacity`` full entries per model, in memory and in the store alike.
- A client (the peer's address without its port, or its certificate's common name under mTLS)
  holds at most ``max_client_live_requests`` live requests and ``max_client_live_bytes`` of
  their state: opening one more fails its Observe stream with RESOURCE_EXHAUSTED. All clients
  together are bounded by ``max_live_requests`` and ``max_live_bytes`` (the least recently
  active request is dropped beyond, as before).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from expertcache.config_fields import (
    ConfigMapFields,
    ObservabilityFields,
    ServerSecurityFields,
    TransportFields,
    setting,
)
from expertcache.errors import InvalidArgument
from expertcache.paths import DEFAULT_EAMC_PATH
from expertcache.security import ServerSecurity, check_ca_file, read_secret, redact_url
from predictor_svc.eam import HEADER_BYTES as EAM_HEADER_BYTES
from predictor_svc.eam import SHAPE_PATTERN, EamShape

ENV_PREFIX = "EXPERTCACHE_PREDICTOR_"
GIB = 1 << 30
MIB = 1 << 20
MODEL_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")
_ENTRY_RE = re.compile(rf"^(?P<model>[^=\s]+)=(?P<shape>{SHAPE_PATTERN})$")


def parse_model_shape(text: str) -> tuple[str, EamShape]:
    """``"gpt-oss-20b=24x32x4"`` → (model id, EamShape); InvalidArgument naming the field otherwise."""
    match = _ENTRY_RE.match(text.strip())
    if not match or not MODEL_ID_RE.match(match["model"]):
        raise InvalidArgument(
            f"config field 'model_shapes' entry {text!r} is not MODEL_ID=LAYERSxEXPERTSxTOP_K "
            "(e.g. gpt-oss-20b=24x32x4)"
        )
    try:
        return match["model"], EamShape.parse(match["shape"])
    except ValueError as exc:
        raise InvalidArgument(
            f"config field 'model_shapes' entry {text!r}: layers, experts and top_k must be >= 1 "
            f"and top_k <= experts ({exc})"
        ) from None


@dataclass(frozen=True)
class PredictorConfig(ServerSecurityFields, ObservabilityFields, ConfigMapFields, TransportFields):
    """Everything one predictor replica needs."""

    listen_address: str = setting(
        "127.0.0.1:50070", "host:port the gRPC server listens on (0.0.0.0:50070 in a pod)."
    )

    redis_url: str = setting(
        "", "Redis URL of the shared EAMC (redis://host:port/db); empty = embedded store."
    )

    redis_username: str = setting("", "Redis ACL user name; empty = the default user.")

    redis_password_file: str = setting(
        "",
        "File holding the Redis password (a mounted Secret; never logged, unlike a password in "
        "redis_url, which shows in the process's arguments); empty = none.",
    )

    redis_tls_ca_file: str = setting(
        "", "PEM CA bundle to verify Redis's certificate (rediss:// URLs only); empty = the system's roots."
    )

    embedded_path: str = setting(
        DEFAULT_EAMC_PATH,
        "File the embedded store (redis_url empty) is loaded from at start and saved to, atomically, "
        "at shutdown.",
    )

    eamc_capacity: int = setting(
        512,
        "Entries per model in the EAMC; when full a new EAM replaces the most similar.",
        live=True,
        min=1,
        max=1_000_000,
    )

    hint_top_n: int = setting(
        8, "Hinted experts per layer and token (highest scores first).", live=True, min=1, max=4096
    )

    min_score: float = setting(0.05, "Hints scoring below this are not sent.", live=True, min=0.0, max=1.0)

    match_top_n: int = setting(
        16, "EAMC entries (most similar first) that a prediction mixes.", live=True, min=1, max=100_000
    )

    max_live_requests: int = setting(
        4096,
        "Live requests tracked; the least recently active is dropped beyond it (its EAM not inserted).",
        live=True,
        min=1,
        max=10_000_000,
    )

    live_request_ttl_s: float = setting(
        600.0,
        "Seconds without activity after which a live request is dropped (EAM not inserted).",
        live=True,
        min=0.1,
        max=86400.0 * 7,
    )

    min_request_tokens: int = setting(
        1, "Finished requests with fewer tokens are not inserted into the EAMC.", live=True, min=1
    )

    sync_interval_s: float = setting(
        1.0,
        "Seconds between EAMC syncs with the store (and retries of failed inserts).",
        live=True,
        min=0.01,
        max=3600.0,
    )

    max_pending_inserts: int = setting(
        1024,
        "Finished EAMs kept for retry while the store is down; oldest dropped beyond.",
        live=True,
        min=1,
        max=1_000_000,
    )

    subscriber_queue_requests: int = setting(
        256, "Requests with unsent hints per subscriber; the oldest is dropped beyond.", min=1, max=1_000_000
    )

    subscriber_queue_bytes: int = setting(
        8 * MIB,
        "Bytes of unsent hints per subscriber (about 96 per hint, 128 per request and layer); the "
        "oldest request's are dropped beyond.",
        min=1,
    )

    model_shapes: tuple[str, ...] = setting(
        (),
        "Comma-separated MODEL_ID=LAYERSxEXPERTSxTOP_K registered at start (counted against "
        "max_models); other models need RegisterModel.",
    )

    allow_registration: bool = setting(
        True,
        "Accept RegisterModel for models not in model_shapes (false: only those and the store's "
        "catalog; PERMISSION_DENIED for others).",
    )

    max_layers: int = setting(
        256, "Largest num_moe_layers a model may register (INVALID_ARGUMENT beyond).", min=1, max=4096
    )

    max_experts: int = setting(
        1024, "Largest num_experts a model may register (INVALID_ARGUMENT beyond).", min=1, max=65536
    )

    max_models: int = setting(
        16,
        "Most models registered, shared by replicas, configured ones included (RESOURCE_EXHAUSTED beyond).",
        min=1,
        max=4096,
    )

    max_client_models: int = setting(
        4, "Models one client may register (new ones, counted per replica; re-registering is free).", min=1
    )

    max_eamc_bytes: int = setting(
        2 * GIB,
        "Bytes the registered models' EAMCs may reserve (eamc_capacity entries of 24 + 4 x layers x experts "
        "bytes each; memory holds about 1.25x that, the store at most 2x).",
        min=1,
    )

    max_live_bytes: int = setting(
        1 * GIB, "Bytes of live request state in all; the least recently active is dropped beyond.", min=1
    )

    max_client_live_requests: int = setting(
        1024,
        "Live requests one client (address without port, or mTLS common name) may hold; one more is "
        "refused (its reporting ends).",
        min=1,
    )

    max_client_live_bytes: int = setting(
        256 * MIB, "Bytes of live request state one client may hold; a request beyond is refused.", min=1
    )

    max_pending_insert_bytes: int = setting(
        256 * MIB,
        "Bytes of finished EAMs kept for retry while the store is down; oldest dropped beyond.",
        min=1,
    )

    max_subscribers: int = setting(
        128, "Open SubscribeHints streams; one more gets RESOURCE_EXHAUSTED.", min=1
    )

    grpc_max_workers: int = setting(
        32, "gRPC worker threads (each open Observe/SubscribeHints stream holds one).", min=2, max=4096
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "model_shapes", tuple(s.strip() for s in self.model_shapes if s.strip()))

    def shapes(self) -> dict[str, EamShape]:
        """The configured ``model_shapes`` by model id."""
        return dict(map(parse_model_shape, self.model_shapes))

    def check(self) -> None:
        """Cross-field checks run by ``load_config`` after the per-field constraints."""
        host, sep, port = self.listen_address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise InvalidArgument(f"config field 'listen_address' = {self.listen_address!r} is not host:port")
        if self.redis_url and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise InvalidArgument(
                f"config field 'redis_url' = {self.redis_url!r} must start with redis://, rediss:// or unix://"
            )
        ServerSecurity.from_config(self).check()
        if self.redis_tls_ca_file and not self.redis_url.startswith("rediss://"):
            raise InvalidArgument(
                "config field 'redis_tls_ca_file' is set but 'redis_url' does not start with rediss:// "
                f"(it is {redact_url(self.redis_url)!r}): use rediss:// for TLS to Redis"
            )
        if (self.redis_password_file or self.redis_username) and not self.redis_url:
            raise InvalidArgument(
                "config fields 'redis_password_file' / 'redis_username' are set but 'redis_url' is empty"
            )
        if self.redis_password_file:
            read_secret(self.redis_password_file, "redis_password_file")
        if self.redis_tls_ca_file:
            check_ca_file(self.redis_tls_ca_file, "redis_tls_ca_file")
        if not self.redis_url and not self.embedded_path:
            raise InvalidArgument("config field 'embedded_path' must not be empty when 'redis_url' is empty")
        shapes = self.shapes()  # raises naming the bad entry
        if len(shapes) != len(self.model_shapes):
            raise InvalidArgument("config field 'model_shapes' names a model twice")
        if len(shapes) > self.max_models:
            raise InvalidArgument(
                f"config field 'model_shapes' names {len(shapes)} models, more than max_models={self.max_models}"
            )
        reserved = 0
        for model_id, shape in shapes.items():
            if shape.layers > self.max_layers:
                raise InvalidArgument(
                    f"config field 'model_shapes': model {model_id!r} has {shape.layers} layers, "
                    f"more than max_layers={self.max_layers}"
                )
            if shape.experts > self.max_experts:
                raise InvalidArgument(
                    f"config field 'model_shapes': model {model_id!r} has {shape.experts} experts, "
                    f"more than max_experts={self.max_experts}"
                )
            reserved += self.eamc_reservation(shape.layers, shape.experts)
        if reserved > self.max_eamc_bytes:
            raise InvalidArgument(
                f"config field 'model_shapes' reserves {reserved} EAMC bytes (eamc_capacity={self.eamc_capacity} "
                f"entries per model), more than max_eamc_bytes={self.max_eamc_bytes}"
            )

    def eamc_reservation(self, layers: int, experts: int) -> int:
        """Bytes one model's full EAMC holds: ``eamc_capacity`` entries of header + uint32 cells."""
        return self.eamc_capacity * (EAM_HEADER_BYTES + 4 * layers * experts)

    @property
    def store_kind(self) -> str:
        return "redis" if self.redis_url else "embedded"
