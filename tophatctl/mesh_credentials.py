"""What a local mesh's processes trust each other with: one auth secret and, with TLS, a development CA.

Every service of one mesh gets the same secret as its `TOPHAT_*_AUTH_SECRET` and mints its own
short-lived tokens from it (shared/auth.py); with TLS every service serves the same certificate and
trusts the same CA (tophatctl/certs.py). The operator's own calls into the mesh (tests, `tophat up`'s
output) use `client_verify` and `operator_auth`.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterable
from pathlib import Path

from shared.auth import BearerAuth, client_auth
from shared.tls import client_context
from tophatctl.certs import DEFAULT_HOSTS, DevCerts, make_dev_certs
from tophatctl.mesh_secrets import SERVICE_PREFIXES, new_secret


class MeshCredentials:
    """The mesh secret (empty: the mesh runs open) and, once made, its certificates."""

    def __init__(self, auth: bool, secret: str = ""):
        self._secret = (secret or new_secret()) if auth else ""
        # Every service's setting, though each reads only its own prefix: one env serves every process.
        self.auth_env: dict[str, str] = ({f"{prefix}AUTH_SECRET": self._secret for prefix in SERVICE_PREFIXES}
                                         if auth else {})
        self.certs: DevCerts | None = None
        self.tls_env: dict[str, str] = {}  # every service's TOPHAT_*_TLS_* settings (empty: plain)

    def make_certs(self, out_dir: Path, host: str, more_hosts: Iterable[str] = ()) -> DevCerts:
        """A dev CA and one server certificate for every address a service is reached by (the mesh's host,
        loopback and `more_hosts`), and every service's tls_* settings pointing at them."""
        self.certs = make_dev_certs(out_dir, list(dict.fromkeys([host, *DEFAULT_HOSTS, *more_hosts])))
        files = {"TLS_CERT": self.certs.server_cert, "TLS_KEY": self.certs.server_key, "TLS_CA": self.certs.ca_cert}
        self.tls_env = {f"{prefix}{name}": str(path) for prefix in SERVICE_PREFIXES for name, path in files.items()}
        return self.certs

    def client_verify(self) -> ssl.SSLContext | bool:
        """httpx's `verify` for talking to this mesh: a context trusting its CA with TLS, the default without."""
        return client_context(str(self.certs.ca_cert)) if self.certs is not None else True

    def operator_auth(self, role: str = "service", subject: str = "tophat-operator") -> BearerAuth | None:
        """httpx `auth` for calling this mesh's internal endpoints directly (a device's /generate, the planner):
        a token minted from the mesh secret; None when the mesh runs open."""
        return client_auth(self._secret, subject, role)
