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

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
# The kinds of device a service runs on: compute's ``device`` is one of them, the daemon's one of
# them or ``cuda:<ordinal>`` / ``cuda:<GPU UUID>``.
DEVICE_KINDS = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class ServerSecurityFields:
    tls_cert_file: str = field(
        default="", metadata={"help": "PEM certificate chain of this server; with tls_key_file turns on TLS"}
    )
    """TLS server certificate (a Secret's ``tls.crt``, /etc/expertcache/tls/tls.crt in a pod). The
    file is watched: a rotated certificate is used from the next connection on, no restart."""

    tls_key_file: str = field(default="", metadata={"help": "PEM private key of tls_cert_file"})
    """The key of ``tls_cert_file`` (``tls.key``); both or neither."""

    tls_client_ca_file: str = field(
        default="",
        metadata={
            "help": "PEM CA bundle that client certificates must chain to (mTLS); empty = no client certificates"
        },
    )
    """Set: mutual TLS, a client without a certificate signed by this CA is refused at the
    handshake. Needs ``tls_cert_file``. Reloaded on rotation like the pair."""

    auth_token_file: str = field(
        default="", metadata={"help": "file holding the bearer token every call must carry; empty = no token"}
    )
    """Set: every call but the health checks needs metadata ``authorization: Bearer <token>``,
    else UNAUTHENTICATED. Re-read when the file changes."""

    reflection: bool = field(default=False, metadata={"help": "serve gRPC reflection (off by default)"})
    """gRPC server reflection, for grpcurl and the like; off unless asked for."""


@dataclass(frozen=True)
class PredictorClientFields:
    predictor_tls_ca_file: str = field(
        default="",
        metadata={"help": "PEM CA bundle to verify the predictor's certificate; set = TLS to the predictor"},
    )
    """Turns TLS on for the channel to the predictor (``ca.crt`` of the Secret)."""

    predictor_tls_cert_file: str = field(
        default="", metadata={"help": "PEM client certificate presented to the predictor (mTLS)"}
    )
    """With ``predictor_tls_key_file``: the client certificate an mTLS predictor asks for."""

    predictor_tls_key_file: str = field(
        default="", metadata={"help": "PEM private key of predictor_tls_cert_file"}
    )
    """The key of ``predictor_tls_cert_file``; both or neither."""

    predictor_auth_token_file: str = field(
        default="", metadata={"help": "file holding the bearer token sent to the predictor"}
    )
    """Sent as ``authorization: Bearer <token>`` on every predictor call; re-read when it changes."""


@dataclass(frozen=True)
class ObservabilityFields:
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
        default="INFO", metadata={"help": "logging level", "choices": LOG_LEVELS, "upper": True}
    )
    """Level of the root logger; any case is accepted ("info" from an env or a ConfigMap)."""


@dataclass(frozen=True)
class ConfigMapFields:
    config_map_name: str = field(
        default="",
        metadata={
            "help": "ConfigMap to watch through the Kubernetes API (namespace from POD_NAMESPACE); "
            "this service's key of it (daemon.yaml, predictor.yaml) is applied live. "
            "Empty: only --config-file is watched."
        },
    )
    """With permission to get/list/watch ConfigMaps, changes arrive at once (the kubelet refreshes
    a mounted ConfigMap only every minute or so). A refused change posts a Warning Event on it."""


@dataclass(frozen=True)
class TransportFields:
    """The bounds of a service's gRPC transport (``expertcache.transport.TransportLimits``): what a
    hostile or broken client may hold open, and for how long. Read at start."""

    max_concurrent_streams: int = field(
        default=100,
        metadata={"help": "HTTP/2 streams one connection may have open at once", "min": 1, "max": 1 << 16},
    )
    """Sent in the server's SETTINGS; a client queues its calls beyond it."""

    max_streams_per_address: int = field(
        default=256,
        metadata={
            "help": "calls one client address may have open at once (RESOURCE_EXHAUSTED beyond)",
            "min": 1,
            "max": 1 << 20,
        },
    )
    """All connections of one host together (a unix socket's callers count as one address)."""

    max_connections_per_address: int = field(
        default=32,
        metadata={
            "help": "connections with open calls one client address may have",
            "min": 1,
            "max": 1 << 16,
        },
    )
    """Counted while a connection carries a call; idle ones are closed after max_connection_idle_s."""

    max_streams: int = field(
        default=1024,
        metadata={
            "help": "calls the server holds open at once, all clients together",
            "min": 1,
            "max": 1 << 20,
        },
    )
    """Health checks have a budget of their own and always answer."""

    request_timeout_s: float = field(
        default=10.0,
        metadata={
            "help": "seconds a call may wait for its request message after its headers; 0 = no limit",
            "min": 0.0,
            "max": 3600.0,
        },
    )
    """A call whose request never arrives ends with DEADLINE_EXCEEDED (it holds no thread meanwhile)."""

    stream_stall_timeout_s: float = field(
        default=30.0,
        metadata={
            "help": "seconds a response may wait for the client to read it; 0 = no limit",
            "min": 0.0,
            "max": 3600.0,
        },
    )
    """A stream its client does not read is cancelled (DEADLINE_EXCEEDED), releasing its batch place and pins."""

    keepalive_time_s: float = field(
        default=60.0,
        metadata={
            "help": "seconds between the server's keepalive pings on an idle connection; 0 = none",
            "min": 0.0,
            "max": 86400.0,
        },
    )
    """A peer that does not answer within keepalive_timeout_s is disconnected."""

    keepalive_timeout_s: float = field(
        default=20.0,
        metadata={"help": "seconds a keepalive ping may wait for its answer", "min": 1.0, "max": 3600.0},
    )

    min_ping_interval_s: float = field(
        default=10.0,
        metadata={
            "help": "shortest interval between a client's pings; faster pingers are disconnected",
            "min": 0.0,
            "max": 3600.0,
        },
    )

    max_connection_idle_s: float = field(
        default=300.0,
        metadata={
            "help": "seconds a connection without calls stays open; 0 = forever",
            "min": 0.0,
            "max": 86400.0,
        },
    )

    max_connection_age_s: float = field(
        default=0.0,
        metadata={
            "help": "seconds after which a connection is asked to close (GOAWAY); 0 = never",
            "min": 0.0,
            "max": 604800.0,
        },
    )
    """Spreads long-lived clients over replicas; its calls get max_connection_age_grace_s to finish."""

    max_connection_age_grace_s: float = field(
        default=600.0,
        metadata={
            "help": "seconds the calls of an aged connection get to finish",
            "min": 0.0,
            "max": 86400.0,
        },
    )
