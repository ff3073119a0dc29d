"""Certificates made in the test (``cryptography``, a dev dependency): a CA, server and client pairs.

pki = Pki.create(tmp_path)                 # CA "test-ca", server for localhost/127.0.0.1, client
pki.ca_file, pki.server_cert, pki.server_key, pki.client_cert, pki.client_key
other = Pki.create(tmp_path / "other")     # an unrelated CA: its certificates must be refused
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _builder(subject: x509.Name, issuer: x509.Name, key, *, ca: bool) -> x509.CertificateBuilder:
    """A certificate valid from five minutes ago for a day, CA or not: what the CA and the leaves share."""
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )


def _write_key(path: Path, key) -> Path:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return path


def _write_cert(path: Path, cert: x509.Certificate) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


@dataclass
class Pki:
    dir: Path
    ca_file: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    ca_key: object
    ca_cert: x509.Certificate

    @classmethod
    def create(cls, directory: Path, ca_name: str = "test-ca") -> Pki:
        directory.mkdir(parents=True, exist_ok=True)
        ca_key = _key()
        ca_cert = (
            _builder(_name(ca_name), _name(ca_name), ca_key, ca=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(ca_key, hashes.SHA256())
        )
        pki = cls(
            directory,
            _write_cert(directory / "ca.crt", ca_cert),
            directory / "tls.crt",
            directory / "tls.key",
            directory / "client.crt",
            directory / "client.key",
            ca_key,
            ca_cert,
        )
        pki.issue("server", pki.server_cert, pki.server_key, server=True)
        pki.issue("client", pki.client_cert, pki.client_key, server=False)
        return pki

    def issue(self, cn: str, cert_path: Path, key_path: Path, *, server: bool) -> tuple[Path, Path]:
        """A certificate signed by this CA (server: for localhost and 127.0.0.1)."""
        key = _key()
        builder = _builder(_name(cn), self.ca_cert.subject, key, ca=False).add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        if server:
            builder = builder.add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                critical=False,
            )
        cert = builder.sign(self.ca_key, hashes.SHA256())
        _write_cert(cert_path, cert)
        _write_key(key_path, key)
        return cert_path, key_path
