"""What a local mesh's processes are given to trust each other: credentials and, with TLS, a development CA.

With auth, the launcher acts as the operator: it makes the mesh's Ed25519 signing key ring (shared/auth/signing.py)
in its log directory and hands the directory to the state monitor alone (the issuer); each cloud-side
service gets a service credential for the issuer (`TOPHAT_*_AUTH_CREDENTIAL`) and the issuer's URL, and
each device agent a BOOTSTRAP token only (its own id's: the issuer refuses a fleet's `*`), with which it
enrolls. No service but the monitor sees a signing key. With TLS every service serves the same
certificate and trusts the same CA (tophatctl/certs.py). The operator's own calls into the mesh (tests,
`tophat serve`'s output) use `client_verify` and `operator_auth`.
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Generator, Iterable, Mapping
from pathlib import Path

import httpx

from shared.auth import verify as auth
from shared.auth.signing import KeyRing
from shared.auth.tls import client_context
from shared.device_registry import url_origin
from tophatctl.certs import DEFAULT_HOSTS, DevCerts, make_dev_certs
from tophatctl.mesh_secrets import SERVICE_PREFIXES

KEY_FILE = "auth-signing-keys.json"
SERVICE_CREDENTIAL_TTL_S = 7 * 86_400.0  # renewed by each service at the issuer long before
BOOTSTRAP_TTL_S = 86_400.0
OPERATOR_TTL_S = 600.0
# The cloud-side services' prefixes, subjects and whether they call out with a credential.
CLOUD_SERVICES = {
    "TOPHAT_VERIFIER_": auth.VERIFIER_SUBJECT,
    "TOPHAT_STREAMER_": auth.STREAMER_SUBJECT,
    "TOPHAT_CHUNK_PLANNER_": auth.PLANNER_SUBJECT,
}

# Which settings prefix each service module reads (a process is given only its own service's credentials).
SETTINGS_PREFIX = {
    "services.verifier_cloud": "TOPHAT_VERIFIER_",
    "services.device_agent": "TOPHAT_DEVICE_",
    "services.token_streamer": "TOPHAT_STREAMER_",
    "services.chunk_planner": "TOPHAT_CHUNK_PLANNER_",
    "services.state_monitor": "TOPHAT_STATE_MONITOR_",
}
AUTH_KEYS = ("_AUTH_CREDENTIAL", "_AUTH_KEY_FILE")  # the settings that are secrets


class OperatorAuth(httpx.Auth):
    """httpx auth for the operator's direct calls: a token minted with the mesh's key for `role`/`subject`, for
    `audience`, or for the audience the request's URL maps to in `audiences` (ISSUER for any other URL)."""

    def __init__(
        self, ring: KeyRing, role: str, subject: str, audience: str = "", audiences: Mapping[str, str] | None = None
    ) -> None:
        self.ring, self.role, self.subject, self.audience = ring, role, subject, audience
        self.audiences = {url_origin(url): aud for url, aud in (audiences or {}).items()}

    def __repr__(self) -> str:  # no token
        return f"OperatorAuth(role={self.role!r}, subject={self.subject!r})"

    def token(self, audience: str) -> str:
        return self.ring.mint(self.subject, self.role, audience, OPERATOR_TTL_S, time.time())

    def header(self, audience: str = "") -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token(audience or self.audience or auth.ISSUER)}"}

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        audience = self.audience or self.audiences.get(url_origin(str(request.url)), auth.ISSUER)
        request.headers["Authorization"] = f"Bearer {self.token(audience)}"
        yield request


class MeshCredentials:
    """The mesh's key ring (None: the mesh runs open) and, once made, its certificates."""

    def __init__(self, auth_on: bool) -> None:
        self.auth_on = auth_on
        self.ring: KeyRing | None = None
        self.key_file: Path | None = None
        self.auth_env: dict[str, str] = {}  # the cloud side's auth settings (devices get theirs from `device_env`)
        self.audiences: dict[str, str] = {}  # the mesh's URLs -> their audience (operator_auth)
        self.certs: DevCerts | None = None
        self.tls_env: dict[str, str] = {}  # every service's TOPHAT_*_TLS_* settings (empty: plain)

    def make_keys(self, out_dir: Path, monitor_url: str, audiences: Mapping[str, str]) -> None:
        """A fresh key ring in out_dir for the issuer, and the cloud side's settings (`auth_env`)."""
        if not self.auth_on:
            return
        self.ring = KeyRing.generate()
        self.key_file = out_dir / KEY_FILE
        self.ring.save(self.key_file)
        self.audiences = dict(audiences)
        now = time.time()
        self.auth_env = {"TOPHAT_STATE_MONITOR_AUTH_KEY_FILE": str(self.key_file)}
        for prefix, subject in CLOUD_SERVICES.items():
            self.auth_env[f"{prefix}AUTH_ISSUER_URL"] = monitor_url
            self.auth_env[f"{prefix}AUTH_CREDENTIAL"] = self.ring.mint(
                subject, "service", auth.ISSUER, SERVICE_CREDENTIAL_TTL_S, now
            )

    def device_env(self, monitor_url: str, device_id: str) -> dict[str, str]:
        """A device agent's auth settings: the issuer's URL and a bootstrap token for `device_id` alone."""
        if self.ring is None:
            return {}
        bootstrap = self.ring.mint(device_id, "bootstrap", auth.ISSUER, BOOTSTRAP_TTL_S, time.time())
        return {"TOPHAT_DEVICE_AUTH_ISSUER_URL": monitor_url, "TOPHAT_DEVICE_AUTH_CREDENTIAL": bootstrap}

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

    def operator_auth(
        self, role: str = "service", subject: str = "tophat-operator", audience: str = ""
    ) -> OperatorAuth | None:
        """httpx `auth` for calling this mesh's internal endpoints directly (a device's /generate, the planner):
        tokens minted with the mesh's key, each for the service its URL names; None when the mesh runs open."""
        if self.ring is None:
            return None
        return OperatorAuth(self.ring, role, subject, audience, self.audiences)
