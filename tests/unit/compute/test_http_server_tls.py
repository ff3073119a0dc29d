"""The HTTP API's TLS files reloaded on rotation, as gRPC's are: new connections get the new
certificate; a pair that does not match is reported and the previous one kept."""

from __future__ import annotations

import shutil
import socket
import ssl

from cryptography import x509
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

import compute_svc.http.server as http_server
from compute_svc.http.server import HttpServer
from expertcache.security import ServerSecurity
from tests.certs import Pki
from tests.waiting import wait_for


def served_serial(port: int, ca_file) -> int:
    """The serial number of the certificate a new TLS connection to ``port`` is shown."""
    context = ssl.create_default_context(cafile=str(ca_file))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with context.wrap_socket(raw, server_hostname="localhost") as tls:
            return x509.load_der_x509_certificate(tls.getpeercert(binary_form=True)).serial_number


def test_rotated_certificate_files_serve_new_connections(tmp_path, monkeypatch):
    monkeypatch.setattr(http_server, "TLS_RELOAD_CHECK_S", 0.05)
    pki = Pki.create(tmp_path / "pki")

    async def health(_request):
        return JSONResponse({"status": "serving"})

    security = ServerSecurity(tls_cert_file=str(pki.server_cert), tls_key_file=str(pki.server_key))
    server = HttpServer(
        Starlette(routes=[Route("/health", health)]),
        "127.0.0.1:0",
        max_requests=4,
        idle_timeout_s=5,
        security=security,
    )
    server.start()
    try:
        first = served_serial(server.port, pki.ca_file)
        # A mismatched pair (another key): refused, the current certificate still served.
        other_cert, other_key = pki.issue(
            "other", tmp_path / "other.crt", tmp_path / "other.key", server=True
        )
        files = server._server.tls_files
        seen = files._version
        shutil.copy(other_key, pki.server_key)
        wait_for(lambda: files._version != seen, "the changed key file looked at", timeout_s=10)
        assert files.reloads == 0
        assert served_serial(server.port, pki.ca_file) == first
        # The matching certificate arrives: the rotation completes.
        shutil.copy(other_cert, pki.server_cert)
        wait_for(lambda: files.reloads == 1, "the rotated pair loaded", timeout_s=10)
        rotated = served_serial(server.port, pki.ca_file)
        assert rotated != first
        assert rotated == x509.load_pem_x509_certificate(other_cert.read_bytes()).serial_number
    finally:
        server.stop()
