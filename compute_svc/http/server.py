"""uvicorn serving the HTTP API (``compute_svc.http.api``) on a thread and event loop of its own,
started and stopped with the compute process (``ComputeServer.start``/``stop``).

Binding, connection bounds and TLS reloads: docs/compute.md."""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import threading
from collections.abc import Callable

import uvicorn

from compute_svc.config import parse_address
from compute_svc.http.guard import ConnectionGuard, ConnectionLimits, GuardedH11Protocol
from compute_svc.metrics import ComputeMetrics
from expertcache.logs import RateLimitedLog
from expertcache.security import ServerSecurity, file_version

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 30.0
LOG_INTERVAL_S = 10.0
TLS_RELOAD_CHECK_S = 5.0


class _TlsFiles:
    """The HTTP server's certificate files, loaded again into its live ``SSLContext`` when they
    change: new connections get the new pair (a bad one is reported once and the previous kept).
    A new client CA is added to those trusted; one removed stays trusted until a restart."""

    def __init__(self, security: ServerSecurity) -> None:
        self.cert_file = security.tls_cert_file
        self.key_file = security.tls_key_file
        self.ca_file = security.tls_client_ca_file
        self._version = self._versions()
        self.reloads = 0

    def _versions(self) -> tuple:
        return tuple(file_version(p) for p in (self.cert_file, self.key_file, self.ca_file) if p)

    def check(self, context: ssl.SSLContext) -> bool:
        """Reload into ``context`` if a file changed; True when reloaded."""
        try:
            version = self._versions()
        except OSError:
            return False  # a file is being replaced: keep the current pair
        if version == self._version:
            return False
        self._version = version
        try:
            trial = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)  # never half-load the live context
            trial.load_cert_chain(self.cert_file, self.key_file)
            if self.ca_file:
                trial.load_verify_locations(self.ca_file)
        except (OSError, ssl.SSLError) as exc:
            logger.error(
                "TLS files of the HTTP API changed but cannot be used, keeping the previous ones: %s", exc
            )
            return False
        context.load_cert_chain(self.cert_file, self.key_file)
        if self.ca_file:
            context.load_verify_locations(self.ca_file)
        self.reloads += 1
        logger.info("TLS files of the HTTP API changed: reloaded %s", self.cert_file)
        return True

    async def watch(self, context: ssl.SSLContext) -> None:
        while True:
            await asyncio.sleep(TLS_RELOAD_CHECK_S)
            self.check(context)


class _RateLimited(logging.Filter):
    """Lets one record of each message through per ``LOG_INTERVAL_S`` (uvicorn's own lines about
    clients: "Invalid HTTP request received.", ...)."""

    def __init__(self) -> None:
        super().__init__()
        self._log = RateLimitedLog(logging.getLogger("uvicorn.error"), LOG_INTERVAL_S)
        self._passing = False

    def filter(self, record: logging.LogRecord) -> bool:
        if self._passing or record.levelno < logging.WARNING:
            return True
        self._passing = True
        try:
            self._log.log(record.levelno, str(record.msg), record.getMessage())
        finally:
            self._passing = False
        return False


_UVICORN_FILTER = _RateLimited()


def _loop_errors(log: RateLimitedLog):
    """The event loop's exception handler: what it reports about sockets (an accept that failed
    for want of descriptors, a connection reset mid-handshake) once per kind per interval."""

    def handle(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        exc = context.get("exception")
        key = f"{context.get('message', '')}:{type(exc).__name__}"
        log.log(logging.ERROR, key, "HTTP API event loop: %s: %r", context.get("message"), exc)

    return handle


def _bind(address: str) -> socket.socket:
    host, port = parse_address(address)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family = infos[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(infos[0][4])
        except BaseException:
            sock.close()
            raise
    except OSError as exc:
        raise OSError(f"cannot bind the HTTP API to {address} (http_listen_address): {exc}") from exc
    sock.setblocking(False)
    return sock


class _Server(uvicorn.Server):
    """uvicorn's server, with an event set once it has started, or its loop has ended without
    starting (``start`` waits on it; ``started`` tells which)."""

    def __init__(self, config: uvicorn.Config, tls_files: _TlsFiles | None = None) -> None:
        super().__init__(config)
        self.ready = threading.Event()
        self.tls_files = tls_files
        self._watch: asyncio.Task | None = None

    async def startup(self, sockets=None) -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(_loop_errors(RateLimitedLog(logger, LOG_INTERVAL_S)))
        await super().startup(sockets=sockets)
        if self.started and self.tls_files is not None and self.config.ssl is not None:
            self._watch = loop.create_task(self.tls_files.watch(self.config.ssl))
        if self.started:
            self.ready.set()

    async def shutdown(self, sockets=None) -> None:
        if self._watch is not None:
            self._watch.cancel()
        await super().shutdown(sockets=sockets)


class HttpServer:
    """One uvicorn server of ``app`` on ``address``; ``on_stop`` (the app's own clean-up, e.g.
    ``HttpApi.close``) runs once it has stopped."""

    def __init__(
        self,
        app,
        address: str,
        *,
        max_requests: int,
        idle_timeout_s: float,
        header_timeout_s: float = 10.0,
        client_share: float = 1.0,
        max_connections: int = 0,
        metrics: ComputeMetrics | None = None,
        security: ServerSecurity | None = None,
        on_stop: Callable[[], None] | None = None,
    ) -> None:
        self.address = address
        self._on_stop = on_stop
        self.limits = ConnectionLimits.derive(
            max_requests=max_requests,
            client_share=client_share,
            header_timeout_s=header_timeout_s,
            configured_max=max_connections,
        )
        self.guard = ConnectionGuard(self.limits, metrics or ComputeMetrics())
        self._sock = _bind(address)
        tls = {}
        if security is not None and security.tls:
            tls = {"ssl_certfile": security.tls_cert_file, "ssl_keyfile": security.tls_key_file}
            if security.tls_client_ca_file:
                tls |= {"ssl_ca_certs": security.tls_client_ca_file, "ssl_cert_reqs": ssl.CERT_REQUIRED}
        logging.getLogger("uvicorn.error").addFilter(_UVICORN_FILTER)
        config = uvicorn.Config(
            app,
            http=GuardedH11Protocol.guarded(self.guard),
            ws="none",
            lifespan="off",
            loop="asyncio",
            log_config=None,  # the process's logging as configured
            access_log=False,  # moe_compute_http_requests_total counts them
            proxy_headers=False,  # a client is the address it connects from
            limit_concurrency=None,  # http.guard bounds connections; http.api bounds requests
            backlog=self.limits.backlog,
            timeout_keep_alive=max(1, round(idle_timeout_s)) if idle_timeout_s > 0 else 5,
            timeout_graceful_shutdown=5,
            server_header=False,
            **tls,
        )
        self._server = _Server(config, _TlsFiles(security) if tls else None)
        self._thread: threading.Thread | None = None
        self._failed: BaseException | None = None

    @property
    def port(self) -> int:
        return self._sock.getsockname()[1]

    def _run(self) -> None:
        try:
            asyncio.run(self._server.serve(sockets=[self._sock]))
        except BaseException as exc:  # noqa: BLE001 - reported by start, or logged once serving
            self._failed = exc
            logger.exception("the HTTP API server stopped on an error")
        finally:
            self._server.ready.set()  # a start still waiting learns that the loop is over

    def start(self) -> None:
        """Serve; ``OSError`` when uvicorn cannot (e.g. unreadable TLS files)."""
        self._thread = threading.Thread(target=self._run, name="compute-http-loop", daemon=True)
        self._thread.start()
        if not self._server.ready.wait(START_TIMEOUT_S):
            raise OSError(f"the HTTP API on {self.address} did not start within {START_TIMEOUT_S:g} s")
        if not self._server.started:
            raise OSError(f"the HTTP API on {self.address} did not start: {self._failed}")
        logger.info("serving the OpenAI-compatible HTTP API on %s", self.address)

    def stop(self, grace_s: float = 5.0) -> None:
        """Close the listener and idle connections; answers in progress get ``grace_s`` to end."""
        if self._thread is None:
            self._sock.close()
            return
        self._server.config.timeout_graceful_shutdown = max(1, round(grace_s))
        self._server.should_exit = True
        self._thread.join(grace_s + 5.0)
        self._sock.close()
        if self._on_stop is not None:
            self._on_stop()
