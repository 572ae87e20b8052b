"""A development CA and one server certificate for the whole mesh (`tophat certs`, `tophat serve --tls`).

For trying TLS on one machine or a lab network, not for production: the CA's key sits on disk beside
the certificates. Every service presents the same server certificate, whose subject alternative names
list every host name and address the services are reached by; clients trust the CA file (`tls_ca`).
Keys are written 0600 (owner only), certificates 0644.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_HOSTS = ("127.0.0.1", "localhost", "::1")
CA_CERT = "ca.pem"
CA_KEY = "ca-key.pem"
SERVER_CERT = "server.pem"
SERVER_KEY = "server-key.pem"


@dataclass(frozen=True)
class DevCerts:
    """Where `make_dev_certs` wrote its files: what `tls_ca`, `tls_cert` and `tls_key` are set to."""

    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path


def parse_hosts(spec: str) -> list[str]:
    """`127.0.0.1,localhost,verifier` -> the list, stripped, empties and duplicates dropped (order kept)."""
    return list(dict.fromkeys(h.strip() for h in spec.split(",") if h.strip()))


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    # Created 0600 rather than chmod-ed after: the key is never readable by others, not even briefly.
    if path.exists():
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(pem)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    path.chmod(0o644)


def make_dev_certs(out_dir: Path, hosts: list[str] | tuple[str, ...] = DEFAULT_HOSTS, days: int = 365) -> DevCerts:
    """Write a CA (ca.pem, ca-key.pem) and a server certificate it signs for `hosts` (server.pem,
    server-key.pem) into `out_dir`; existing files there are replaced."""
    if not hosts:
        raise ValueError("a server certificate needs at least one host name or address")
    out_dir.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    not_before = now - datetime.timedelta(minutes=5)  # a little slack for clocks a bit behind
    not_after = now + datetime.timedelta(days=days)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tophat development CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    server_key = ec.generate_private_key(ec.SECP256R1())
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.SubjectAlternativeName([_san(h) for h in hosts]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_encipherment=False,
                key_cert_sign=False,
                crl_sign=False,
                content_commitment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    certs = DevCerts(out_dir / CA_CERT, out_dir / CA_KEY, out_dir / SERVER_CERT, out_dir / SERVER_KEY)
    _write_key(certs.ca_key, ca_key)
    _write_cert(certs.ca_cert, ca_cert)
    _write_key(certs.server_key, server_key)
    _write_cert(certs.server_cert, server_cert)
    return certs
