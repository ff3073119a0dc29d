"""Config fields several services share, defined once: each group is a frozen dataclass that a
service's config inherits (``class ComputeConfig(ServerSecurityFields, ...)``), so the flag, the
environment variable, the ConfigMap key and the schema entry are the same in every service.

- ``ServerSecurityFields``: TLS / mTLS / bearer token / reflection of a gRPC server (compute,
  predictor); read by ``expertcache.security.ServerSecurity.from_config``.
- ``PredictorClientFields``: how a client reaches the predictor (compute, daemon); read by
  ``expertcache.security.ClientSecurity.from_config``.
- ``ObservabilityFields``: ``/metrics``, the log format and level (every service).
- ``ConfigMapFields``: the ConfigMap watched through the Kubernetes API (daemon, predictor); read
  by ``expertcache.live_config.LiveConfig``.
- ``TransportFields``: the bounds of a gRPC server's transport (every service); read by
  ``expertcache.transport.TransportLimits.from_config``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
# The kinds of device a service runs on: compute's ``device`` is one of them, the daemon's one of
# them or ``cuda:<ordinal>`` / ``cuda:<GPU UUID>``.
DEVICE_KINDS = ("auto", "cpu", "cuda")


def setting(default: Any, help: str, *, live: bool = False, **extra: Any) -> Any:
    """A config field: its ``help``, whether it applies ``live`` (without a restart) and its other
    metadata (``min``, ``max``, ``choices``, ``upper``), as the loader, the CLI and the schema read them."""
    metadata: dict[str, Any] = {"live": True} if live else {}
    return field(default=default, metadata={**metadata, "help": help, **extra})


@dataclass(frozen=True)
class ServerSecurityFields:
    tls_cert_file: str = setting(
        "",
        "PEM certificate chain of this server; with tls_key_file turns on TLS. "
        "Reloaded when the file changes (no restart)",
    )

    tls_key_file: str = setting("", "PEM private key of tls_cert_file (both or neither)")

    tls_client_ca_file: str = setting(
        "",
        "PEM CA bundle that client certificates must chain to (mTLS: others are refused at the "
        "handshake; needs tls_cert_file; reloaded when it changes); empty = no client certificates",
    )

    auth_token_file: str = setting(
        "",
        "file holding the bearer token every call but health checks must carry "
        "(authorization: Bearer <token>); re-read when it changes; empty = no token",
    )

    reflection: bool = setting(False, "serve gRPC reflection, for grpcurl and the like (off by default)")


@dataclass(frozen=True)
class PredictorClientFields:
    predictor_tls_ca_file: str = setting(
        "", "PEM CA bundle to verify the predictor's certificate; set = TLS to the predictor"
    )

    predictor_tls_cert_file: str = setting(
        "", "PEM client certificate presented to an mTLS predictor (with predictor_tls_key_file)"
    )

    predictor_tls_key_file: str = setting("", "PEM private key of predictor_tls_cert_file (both or neither)")

    predictor_auth_token_file: str = setting(
        "", "file holding the bearer token sent to the predictor; re-read when it changes"
    )


@dataclass(frozen=True)
class ObservabilityFields:
    metrics_port: int = setting(0, "port of the Prometheus /metrics endpoint; 0 = off", min=0, max=65535)

    metrics_address: str = setting("127.0.0.1", "address the /metrics endpoint binds (0.0.0.0 in a pod)")

    log_format: str = setting(
        "auto",
        "log format: json (lines carry the trace and span ids), text, or auto (json when "
        "stderr is not a terminal)",
        choices=("auto", "json", "text"),
    )

    log_level: str = setting("INFO", "level of the root logger, in any case", choices=LOG_LEVELS, upper=True)


@dataclass(frozen=True)
class ConfigMapFields:
    config_map_name: str = setting(
        "",
        "ConfigMap to watch through the Kubernetes API (namespace from POD_NAMESPACE; needs "
        "get/list/watch on ConfigMaps); this service's key of it (daemon.yaml, predictor.yaml) is "
        "applied live, a refused change posts a Warning Event on it. "
        "Empty: only --config-file is watched.",
    )


@dataclass(frozen=True)
class TransportFields:
    """The bounds of a service's gRPC transport (``expertcache.transport.TransportLimits``): what a
    hostile or broken client may hold open, and for how long. Read at start."""

    max_concurrent_streams: int = setting(
        100,
        "HTTP/2 streams one connection may have open at once (a client queues its calls beyond)",
        min=1,
        max=1 << 16,
    )

    max_streams_per_address: int = setting(
        256,
        "calls one client address may have open at once, all its connections together "
        "(RESOURCE_EXHAUSTED beyond)",
        min=1,
        max=1 << 20,
    )

    max_connections_per_address: int = setting(
        32,
        "connections with open calls one client address may have (idle ones are closed "
        "after max_connection_idle_s)",
        min=1,
        max=1 << 16,
    )

    max_streams: int = setting(
        1024,
        "calls the server holds open at once, all clients together (health checks excepted)",
        min=1,
        max=1 << 20,
    )

    request_timeout_s: float = setting(
        10.0,
        "seconds a call may wait for its request message after its headers "
        "(DEADLINE_EXCEEDED beyond); 0 = no limit",
        min=0.0,
        max=3600.0,
    )

    stream_stall_timeout_s: float = setting(
        30.0,
        "seconds a response may wait for the client to read it before its stream is "
        "cancelled (DEADLINE_EXCEEDED); 0 = no limit",
        min=0.0,
        max=3600.0,
    )

    keepalive_time_s: float = setting(
        60.0,
        "seconds between the server's keepalive pings on an idle connection (a peer not "
        "answering within keepalive_timeout_s is disconnected); 0 = none",
        min=0.0,
        max=86400.0,
    )

    keepalive_timeout_s: float = setting(
        20.0, "seconds a keepalive ping may wait for its answer", min=1.0, max=3600.0
    )

    min_ping_interval_s: float = setting(
        10.0,
        "shortest interval between a client's pings; faster pingers are disconnected",
        min=0.0,
        max=3600.0,
    )

    max_connection_idle_s: float = setting(
        300.0, "seconds a connection without calls stays open; 0 = forever", min=0.0, max=86400.0
    )

    max_connection_age_s: float = setting(
        0.0,
        "seconds after which a connection is asked to close (GOAWAY), spreading long-lived "
        "clients over replicas; 0 = never",
        min=0.0,
        max=604800.0,
    )

    max_connection_age_grace_s: float = setting(
        600.0, "seconds the calls of an aged connection get to finish", min=0.0, max=86400.0
    )
