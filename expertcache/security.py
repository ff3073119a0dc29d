"""Transport security of the gRPC servers and of the clients of the predictor.

What is exposed: compute's ``moe.inference.v1.Inference`` (TCP), the predictor's
``moe.predictor.v1.Predictor`` (TCP) and the daemon's ``moe.cache.v1.ExpertCache`` (a unix socket
in a private directory, never TCP). By default the TCP servers bind loopback and speak plaintext;
a deployment turns on, per server:

- **TLS**: ``tls_cert_file`` + ``tls_key_file`` (PEM). The files are watched: every new
  connection's handshake checks their (inode, size, mtime) and a changed pair is loaded, so a
  rotated Kubernetes Secret is picked up without a restart. A half-written pair (a key that does
  not match its certificate) is refused and the previous pair kept until the files agree.
- **mTLS**: ``tls_client_ca_file`` as well: a client must present a certificate signed by that CA
  (reloaded on rotation like the pair).
- **Bearer token**: ``auth_token_file``. Every call must carry ``authorization: Bearer <token>``
  metadata; a missing or wrong token gets ``UNAUTHENTICATED``. The token is compared in constant
  time and re-read when the file changes. The gRPC health service stays open, so that probes need
  no secret (it tells nothing but SERVING / NOT_SERVING).

The clients of the predictor (compute's activation reporter, the daemon's hint subscriber) take
``predictor_tls_ca_file`` (TLS on, verifying the predictor against that CA),
``predictor_tls_cert_file`` + ``predictor_tls_key_file`` (the client certificate for mTLS) and
``predictor_auth_token_file``. Like the servers, the clients pick up rotated files without a
restart: the token file is re-read when it changes, and a changed CA or client certificate pair
makes the channel anew (``ReloadingChannel``) for the next call (calls in flight finish on the
previous one); a half-written pair is refused and the previous one kept.

``ServerSecurity.from_config`` / ``ClientSecurity.from_config`` read those fields from any
service config; their ``check`` (run by the configs' ``check``) refuses unreadable files,
malformed PEM and a key that does not match its certificate, naming the config field.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple
from urllib.parse import urlsplit, urlunsplit

import grpc

from expertcache.errors import InvalidArgument
from expertcache.logs import REFUSAL_LOG_INTERVAL_S, RateLimitedLog

logger = logging.getLogger(__name__)

AUTH_HEADER = "authorization"
BEARER = "bearer "
# Open without a token: liveness/readiness probes must not need the secret.
UNAUTHENTICATED_PREFIXES = ("/grpc.health.v1.Health/",)
MAX_TOKEN_BYTES = 4096

FileVersion = tuple[int, int, int, int]


def file_version(path: str) -> FileVersion:
    """What tells a changed file: (device, inode, size, mtime) through symlinks (a Secret update
    swaps the ``..data`` symlink to a new directory)."""
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _read(path: str, field: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise InvalidArgument(f"config field {field!r}: cannot read {path}: {exc.strerror or exc}") from exc


def _check_pair(cert_file: str, key_file: str, cert_field: str, key_field: str) -> None:
    """Refuse a certificate/key pair that OpenSSL cannot load together, naming both fields."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        ctx.load_cert_chain(cert_file, key_file)
    except FileNotFoundError as exc:
        raise InvalidArgument(
            f"config fields {cert_field!r} / {key_field!r}: {exc.filename or cert_file} does not exist"
        ) from exc
    except OSError as exc:  # ssl.SSLError is an OSError too
        raise InvalidArgument(
            f"config fields {cert_field!r} = {cert_file!r} / {key_field!r} = {key_file!r}: not a matching "
            f"PEM certificate and private key ({exc})"
        ) from exc


def check_ca_file(ca_file: str, field: str) -> None:
    """Refuse a CA bundle OpenSSL cannot load, naming the config field."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        ctx.load_verify_locations(cafile=ca_file)
    except FileNotFoundError as exc:
        raise InvalidArgument(f"config field {field!r}: {ca_file} does not exist") from exc
    except (OSError, ValueError) as exc:
        raise InvalidArgument(
            f"config field {field!r} = {ca_file!r}: not a PEM CA certificate bundle ({exc})"
        ) from exc


def read_secret(path: str, field: str) -> str:
    """A password file's content without its trailing newline; InvalidArgument when empty."""
    raw = _read(path, field)
    try:
        secret = raw.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError as exc:
        raise InvalidArgument(f"config field {field!r}: {path} is not UTF-8 text") from exc
    if not secret:
        raise InvalidArgument(f"config field {field!r}: the secret file {path} is empty")
    return secret


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for logs and error messages)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def read_token(path: str, field: str = "auth_token_file") -> bytes:
    """The token in ``path`` without surrounding whitespace; InvalidArgument when empty or huge."""
    token = _read(path, field).strip()
    if not token:
        raise InvalidArgument(f"config field {field!r}: the token file {path} is empty")
    if len(token) > MAX_TOKEN_BYTES:
        raise InvalidArgument(f"config field {field!r}: the token in {path} is over {MAX_TOKEN_BYTES} bytes")
    if any(c < 0x21 or c > 0x7E for c in token):
        raise InvalidArgument(
            f"config field {field!r}: the token in {path} must be printable ASCII without spaces"
        )
    return token


class WatchedToken:
    """A token file, re-read when it changes; the last good token is kept when a new one is bad."""

    def __init__(self, path: str, field: str) -> None:
        self.path = path
        self.field = field
        self._lock = threading.Lock()
        self._version = file_version(path)
        self._token = read_token(path, field)

    def get(self) -> bytes:
        try:
            version = file_version(self.path)
        except OSError:
            return self._token  # mid-rotation: the old token until the file is back
        if version != self._version:
            with self._lock:
                if version != self._version:
                    try:
                        self._token = read_token(self.path, self.field)
                        logger.info("token file %s changed: new token in use", self.path)
                    except InvalidArgument as exc:
                        logger.error("keeping the previous token: %s", exc)
                    self._version = version
        return self._token


# -- servers ----------------------------------------------------------------------------------
class CertificateFiles:
    """The server's PEM files, loaded again whenever one of them changes.

    ``fetch`` is gRPC's certificate configuration fetcher: called at each new connection's
    handshake, it returns a new configuration when the files changed (None keeps the current).
    """

    def __init__(self, cert_file: str, key_file: str, client_ca_file: str = "") -> None:
        self.cert_file = cert_file
        self.key_file = key_file
        self.client_ca_file = client_ca_file
        self._lock = threading.Lock()
        self._version = self._versions()
        self.initial = self._load()
        self.reloads = 0

    def _paths(self) -> list[str]:
        return [p for p in (self.cert_file, self.key_file, self.client_ca_file) if p]

    def _versions(self) -> tuple[FileVersion, ...]:
        return tuple(file_version(p) for p in self._paths())

    def _load(self):
        _check_pair(self.cert_file, self.key_file, "tls_cert_file", "tls_key_file")
        if self.client_ca_file:
            check_ca_file(self.client_ca_file, "tls_client_ca_file")
        cert = _read(self.cert_file, "tls_cert_file")
        key = _read(self.key_file, "tls_key_file")
        ca = _read(self.client_ca_file, "tls_client_ca_file") if self.client_ca_file else None
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def fetch(self):
        """New configuration if the files changed since the last load, else None."""
        try:
            version = self._versions()
        except OSError:
            return None  # a file is being replaced: keep serving the current pair
        if version == self._version:
            return None
        with self._lock:
            if version == self._version:
                return None
            self._version = version  # a bad pair is reported once, retried when the files change
            try:
                config = self._load()
            except InvalidArgument as exc:
                logger.error("TLS files changed but cannot be used, keeping the previous ones: %s", exc)
                return None
            self.reloads += 1
            logger.info("TLS certificate files changed: reloaded %s", ", ".join(self._paths()))
            return config

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self.initial, self.fetch, require_client_authentication=bool(self.client_ca_file)
        )


def _deny(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that fails every call with ``code``."""

    def abort(_request, context):
        context.abort(code, message)

    # The asyncio edge (``expertcache.aio_bridge``) answers such a call at its headers, without
    # waiting for a request it would refuse anyway.
    abort.refusal = (code, message)

    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(
            abort, handler.request_deserializer, handler.response_serializer
        )
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(
            abort, handler.request_deserializer, handler.response_serializer
        )
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(
            abort, handler.request_deserializer, handler.response_serializer
        )
    return grpc.stream_stream_rpc_method_handler(
        abort, handler.request_deserializer, handler.response_serializer
    )


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Refuses calls without ``authorization: Bearer <token>`` (the health service excepted)."""

    def __init__(self, token: WatchedToken | Callable[[], bytes]) -> None:
        self._token = token.get if isinstance(token, WatchedToken) else token
        # A client retrying a bad token in a loop writes one line per reason per interval.
        self._refusals = RateLimitedLog(logger, REFUSAL_LOG_INTERVAL_S)

    def check(self, metadata: Any) -> str | None:
        """None when ``metadata`` carries the right token, else the reason it does not."""
        values = [v for k, v in (metadata or ()) if k == AUTH_HEADER]
        if not values:
            return "missing bearer token: send metadata 'authorization: Bearer <token>' (this server has auth_token_file set)"
        value = values[0] if isinstance(values[0], str) else values[0].decode("latin-1")
        if len(values) > 1 or value[: len(BEARER)].lower() != BEARER:
            return "malformed authorization metadata: expected one 'Bearer <token>'"
        given = value[len(BEARER) :].strip().encode("latin-1", errors="replace")
        if not hmac.compare_digest(given, self._token()):
            return "invalid bearer token"
        return None

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(UNAUTHENTICATED_PREFIXES):
            return handler
        problem = self.check(handler_call_details.invocation_metadata)
        if problem is None:
            return handler
        self._refusals.log(logging.WARNING, problem, "refused %s: %s", handler_call_details.method, problem)
        return _deny(handler, grpc.StatusCode.UNAUTHENTICATED, problem)


def _is_loopback(address: str) -> bool:
    if address.startswith("unix:"):
        return True
    host = address.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class ServerSecurity:
    """A server's TLS and token settings (the config fields of the same names)."""

    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_client_ca_file: str = ""
    auth_token_file: str = ""

    @classmethod
    def from_config(cls, config: Any) -> ServerSecurity:
        return cls(**{name: getattr(config, name, "") or "" for name in cls.__dataclass_fields__})

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert_file)

    def check(self) -> None:
        """Refuse incomplete or unusable settings, naming the config field."""
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            given, missing = (
                ("tls_cert_file", "tls_key_file") if self.tls_cert_file else ("tls_key_file", "tls_cert_file")
            )
            raise InvalidArgument(f"config field {given!r} is set but {missing!r} is not: TLS needs both")
        if self.tls_client_ca_file and not self.tls:
            raise InvalidArgument(
                "config field 'tls_client_ca_file' (mTLS) needs TLS: set tls_cert_file and tls_key_file too"
            )
        if self.tls:
            _check_pair(self.tls_cert_file, self.tls_key_file, "tls_cert_file", "tls_key_file")
        if self.tls_client_ca_file:
            check_ca_file(self.tls_client_ca_file, "tls_client_ca_file")
        if self.auth_token_file:
            read_token(self.auth_token_file, "auth_token_file")

    def interceptors(self) -> list[grpc.ServerInterceptor]:
        if not self.auth_token_file:
            return []
        return [TokenAuthInterceptor(WatchedToken(self.auth_token_file, "auth_token_file"))]

    def add_port(self, server: grpc.Server, address: str) -> int:
        """Bind ``address`` with TLS when configured; the bound port (0 on failure)."""
        if self.tls:
            files = CertificateFiles(self.tls_cert_file, self.tls_key_file, self.tls_client_ca_file)
            port = server.add_secure_port(address, files.credentials())
            logger.info(
                "%s on %s (certificates reloaded when %s change)",
                "mTLS" if self.tls_client_ca_file else "TLS",
                address,
                ", ".join(files._paths()),
            )
            return port
        if not _is_loopback(address):
            logger.warning(
                "serving PLAINTEXT on %s, which is not loopback: set tls_cert_file/tls_key_file "
                "(and tls_client_ca_file for mTLS) to encrypt it",
                address,
            )
        if self.auth_token_file and not _is_loopback(address):
            logger.warning("the bearer token travels in clear text on %s without TLS", address)
        return server.add_insecure_port(address)


# -- clients ----------------------------------------------------------------------------------
class _CallDetails(NamedTuple):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: Any
    compression: Any


class BearerTokenClientInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds ``authorization: Bearer <token>`` to every call."""

    def __init__(self, token: WatchedToken | Callable[[], bytes]) -> None:
        self._token = token.get if isinstance(token, WatchedToken) else token

    def _details(self, details) -> _CallDetails:
        metadata = list(details.metadata or ())
        metadata.append((AUTH_HEADER, "Bearer " + self._token().decode("ascii")))
        return _CallDetails(
            details.method,
            details.timeout,
            metadata,
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


class _ReloadingMultiCallable:
    """A multicallable of ``ReloadingChannel``: each invocation takes the channel current then."""

    def __init__(self, owner: ReloadingChannel, kind: str, args: tuple, kwargs: dict) -> None:
        self._owner, self._kind, self._args, self._kwargs = owner, kind, args, kwargs

    def _target(self):
        return getattr(self._owner.current(), self._kind)(*self._args, **self._kwargs)

    def __call__(self, *args, **kwargs):
        return self._target()(*args, **kwargs)

    def with_call(self, *args, **kwargs):
        return self._target().with_call(*args, **kwargs)

    def future(self, *args, **kwargs):
        return self._target().future(*args, **kwargs)


class ReloadingChannel(grpc.Channel):
    """A TLS channel made anew when its certificate files change (checked at each call).

    A rotated client certificate or CA reaches the next call (a stream opened before keeps the
    previous channel until it ends: a rotation never cuts a call). A changed set that does not
    load (a key that does not match its certificate: half-written) is logged once and the
    previous channel kept until the files change again.
    """

    def __init__(self, security: ClientSecurity, address: str, options: list) -> None:
        self._security = security
        self._address = address
        self._options = options
        self._lock = threading.Lock()
        self._version = self._versions()
        self._channel = grpc.secure_channel(address, security.channel_credentials(), options=options)
        self._previous: list[grpc.Channel] = []  # closed with this one (calls may still use them)
        self._subscribed: dict = {}
        self.reloads = 0

    def _versions(self) -> tuple[FileVersion, ...]:
        s = self._security
        return tuple(file_version(p) for p in (s.tls_ca_file, s.tls_cert_file, s.tls_key_file) if p)

    def current(self) -> grpc.Channel:
        """The channel for a new call: made again first when the files changed."""
        try:
            version = self._versions()
        except OSError:
            return self._channel  # a file is being replaced: the current files until it is back
        if version == self._version:
            return self._channel
        with self._lock:
            if version != self._version:
                self._version = version  # a bad set is reported once, retried when files change
                try:
                    self._security.check()
                    credentials = self._security.channel_credentials()
                except InvalidArgument as exc:
                    logger.error(
                        "TLS client files changed but cannot be used, keeping the previous ones: %s", exc
                    )
                    return self._channel
                self._previous.append(self._channel)
                self._channel = grpc.secure_channel(self._address, credentials, options=self._options)
                self.reloads += 1
                logger.info("TLS client files changed: new channel to %s", self._address)
            return self._channel

    def unary_unary(self, *args, **kwargs):
        return _ReloadingMultiCallable(self, "unary_unary", args, kwargs)

    def unary_stream(self, *args, **kwargs):
        return _ReloadingMultiCallable(self, "unary_stream", args, kwargs)

    def stream_unary(self, *args, **kwargs):
        return _ReloadingMultiCallable(self, "stream_unary", args, kwargs)

    def stream_stream(self, *args, **kwargs):
        return _ReloadingMultiCallable(self, "stream_stream", args, kwargs)

    def subscribe(self, callback, try_to_connect=False):
        channel = self.current()
        self._subscribed[callback] = channel
        channel.subscribe(callback, try_to_connect=try_to_connect)

    def unsubscribe(self, callback):
        self._subscribed.pop(callback, self._channel).unsubscribe(callback)

    def close(self):
        with self._lock:
            channels, self._previous = [*self._previous, self._channel], []
        for channel in channels:
            channel.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc_val, exc_tb):
        self.close()
        return False


@dataclass(frozen=True)
class ClientSecurity:
    """How a client reaches a server: TLS roots, client certificate, bearer token (PEM files)."""

    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    auth_token_file: str = ""
    field_prefix: str = ""  # names the config fields in error messages ("predictor_")

    @classmethod
    def from_config(cls, config: Any, prefix: str = "predictor_") -> ClientSecurity:
        def get(name: str) -> str:
            return getattr(config, prefix + name, "") or ""

        return cls(
            get("tls_ca_file"), get("tls_cert_file"), get("tls_key_file"), get("auth_token_file"), prefix
        )

    @property
    def tls(self) -> bool:
        return bool(self.tls_ca_file or self.tls_cert_file)

    def _field(self, name: str) -> str:
        return self.field_prefix + name

    def check(self) -> None:
        cert, key = self._field("tls_cert_file"), self._field("tls_key_file")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            given, missing = (cert, key) if self.tls_cert_file else (key, cert)
            raise InvalidArgument(
                f"config field {given!r} is set but {missing!r} is not: a client certificate needs both"
            )
        if self.tls_cert_file:
            _check_pair(self.tls_cert_file, self.tls_key_file, cert, key)
        if self.tls_ca_file:
            check_ca_file(self.tls_ca_file, self._field("tls_ca_file"))
        if self.auth_token_file:
            read_token(self.auth_token_file, self._field("auth_token_file"))

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """TLS credentials: roots from ``tls_ca_file`` (the system's when empty), the client pair."""
        ca = _read(self.tls_ca_file, self._field("tls_ca_file")) if self.tls_ca_file else None
        key = _read(self.tls_key_file, self._field("tls_key_file")) if self.tls_key_file else None
        cert = _read(self.tls_cert_file, self._field("tls_cert_file")) if self.tls_cert_file else None
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    def channel(self, address: str, options: list | None = None) -> grpc.Channel:
        """A channel to ``address``: TLS when configured, the token added to every call."""
        options = list(options or [])
        if self.tls:
            channel = ReloadingChannel(self, address, options)
        else:
            channel = grpc.insecure_channel(address, options=options)
        if self.auth_token_file:
            token = WatchedToken(self.auth_token_file, self._field("auth_token_file"))
            channel = grpc.intercept_channel(channel, BearerTokenClientInterceptor(token))
        return channel


def client_channel(
    address: str, security: ClientSecurity | None = None, options: list | None = None
) -> grpc.Channel:
    """``security.channel`` or a plaintext channel without security settings."""
    return (security or ClientSecurity()).channel(address, options)
