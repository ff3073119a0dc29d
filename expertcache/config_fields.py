"""Config fields several services share, defined once: each group is a frozen dataclass that a
service's config inherits (``class ComputeConfig(ServerSecurityFields, ...)``), so the flag, the
environment variable, the ConfigMap key and the schema entry are the same in every service.

- ``ServerSecurityFields``: TLS / mTLS / bearer token / reflection of a gRPC server (compute,
  predictor); read by ``expertcache.security.ServerSecurity.from_config``.
- ``PredictorClientFields``: how a client reaches the predictor (compute, daemon); read by
  ``expertcache.security.ClientSecurity.from_config``.
- ``ObservabilityFields``: ``/metrics`` and the log format (every service).
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
