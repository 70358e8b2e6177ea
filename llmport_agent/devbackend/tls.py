"""
Test TLS material for the stand-in backend: a self-signed CA and a server certificate for
C{127.0.0.1}, C{::1} and C{localhost}, written as PEM files.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmport_agent.core.values import frozen


@frozen
class TLSFiles:
    """Paths of PEM files: the CA certificate, the server certificate and its private key."""

    ca_pem: str
    cert_pem: str
    key_pem: str

    def exists(self) -> bool:
        return all(os.path.isfile(p) for p in (self.ca_pem, self.cert_pem, self.key_pem))


def tls_files_in(directory: str | os.PathLike[str]) -> TLSFiles:
    """The file names L{make_test_tls} uses in C{directory}."""
    base = Path(directory)
    return TLSFiles(
        ca_pem=str(base / "ca.pem"),
        cert_pem=str(base / "server.pem"),
        key_pem=str(base / "server-key.pem"),
    )


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "llmport-agent devbackend"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def make_test_tls(directory: str | os.PathLike[str], days: int = 30) -> TLSFiles:
    """
    Create a CA and a server certificate signed by it in C{directory} (created if needed).
    The key file is written with mode 0600. Blocking (key generation and file writes): call
    it off the reactor thread in long-running code; tests and the CLI may call it directly.
    """
    files = tls_files_in(directory)
    Path(directory).mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    start = now - datetime.timedelta(minutes=5)
    end = now + datetime.timedelta(days=days)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("llmport-agent devbackend test CA")
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
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
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )

    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("localhost"))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.SubjectAlternativeName(
                [
                    x509.DNSName("localhost"),
                    x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                    x509.IPAddress(ipaddress.ip_address("::1")),
                ]
            ),
            critical=False,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
        )
        .sign(ca_key, hashes.SHA256())
    )

    Path(files.ca_pem).write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    Path(files.cert_pem).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_bytes = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.open(files.key_pem, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(key_bytes)
    os.chmod(files.key_pem, 0o600)
    return files
