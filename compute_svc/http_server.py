"""uvicorn serving the HTTP API (``compute_svc.http_api``) on a thread and event loop of its own,
started and stopped with the compute process (``ComputeServer.start``/``stop``).

The socket is bound when the server is made, so a bad or taken ``http_listen_address`` fails
start-up with the address in the message, like the gRPC port. uvicorn's own bounds: at most
``limit_concurrency`` connections (``http_max_requests`` plus room for probes and model listings;
beyond it uvicorn answers 503 at once), idle keep-alive connections closed after
``max_connection_idle_s``, headers within h11's 16 KiB. With ``tls_cert_file`` set the HTTP API
is served over TLS with the same files as gRPC (and ``tls_client_ca_file``: client certificates
required); unlike gRPC's, uvicorn's certificates are read once at start.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import threading

import uvicorn

from expertcache.errors import InvalidArgument
from expertcache.security import ServerSecurity

logger = logging.getLogger(__name__)

PROBE_CONNECTIONS = 64  # connections beyond http_max_requests: health probes, model listings
START_TIMEOUT_S = 30.0


def parse_address(address: str, field: str = "http_listen_address") -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) → (host, port); ``InvalidArgument`` naming ``field``."""
    host, sep, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise InvalidArgument(f"config field {field!r} = {address!r} is not HOST:PORT (e.g. 0.0.0.0:8080)")
    return host, int(port)


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

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.ready = threading.Event()

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            self.ready.set()


class HttpServer:
    """One uvicorn server of ``app`` on ``address``."""

    def __init__(
        self,
        app,
        address: str,
        *,
        max_requests: int,
        idle_timeout_s: float,
        security: ServerSecurity | None = None,
    ) -> None:
        self.address = address
        self._app = app
        self._sock = _bind(address)
        tls = {}
        if security is not None and security.tls:
            tls = {"ssl_certfile": security.tls_cert_file, "ssl_keyfile": security.tls_key_file}
            if security.tls_client_ca_file:
                tls |= {"ssl_ca_certs": security.tls_client_ca_file, "ssl_cert_reqs": ssl.CERT_REQUIRED}
        config = uvicorn.Config(
            app,
            http="h11",
            ws="none",
            lifespan="off",
            loop="asyncio",
            log_config=None,  # the process's logging as configured
            access_log=False,  # moe_compute_http_requests_total counts them
            limit_concurrency=max_requests + PROBE_CONNECTIONS,
            timeout_keep_alive=max(1, round(idle_timeout_s)) if idle_timeout_s > 0 else 5,
            timeout_graceful_shutdown=5,
            server_header=False,
            **tls,
        )
        self._server = _Server(config)
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
        close = getattr(self._app, "close", None)
        if close is not None:
            close()
