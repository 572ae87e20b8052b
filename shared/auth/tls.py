"""TLS contexts from certificate files, one place for every service and client.

Servers: `tls_cert` + `tls_key` (PEM files) turn a service's port into TLS only (https / wss); both
empty is plain. Clients: `tls_ca` names the CA file to trust for outgoing https / wss; empty trusts
the system's default CAs. `tophat certs` (tophatctl/certs.py) makes a development CA and certificates.
"""

from __future__ import annotations

import ssl

from shared.settings import SettingsError


class TLSConfigError(SettingsError):
    """A TLS setting is incomplete or names a file that cannot be loaded."""


def check_server_files(cert: str, key: str) -> None:
    """Both or neither: a certificate without its key (or the reverse) is a mistake, never plain text."""
    if bool(cert) != bool(key):
        raise TLSConfigError("tls_cert and tls_key go together: set both (TLS) or neither (plain)")


def server_context(cert: str, key: str) -> ssl.SSLContext | None:
    """The server side's context (TLS 1.2+), or None when both files are empty (plain)."""
    check_server_files(cert, key)
    if not cert:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise TLSConfigError(f"cannot load TLS certificate {cert} / key {key}: {exc}") from exc
    return context


def client_context(ca: str = "") -> ssl.SSLContext:
    """The client side's context: verifies the server's certificate and host name against `ca`
    (a PEM file), or against the system's default CAs when `ca` is empty."""
    try:
        context = ssl.create_default_context(cafile=ca or None)
    except (OSError, ssl.SSLError) as exc:
        raise TLSConfigError(f"cannot load TLS CA file {ca}: {exc}") from exc
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


def websocket_ssl(url: str, ca: str = "") -> ssl.SSLContext | None:
    """What `websockets.connect(url, ssl=...)` takes: a verifying context for wss://, None for ws://."""
    return client_context(ca) if url.startswith("wss://") else None
