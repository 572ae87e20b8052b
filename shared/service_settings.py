"""What every service's settings share: the mesh's credentials, the log level and TLS.

Each service's `Settings` (services/*/settings.py) extends `ServiceSettings`, so these fields, their
defaults and their checks are written once; `shared.settings.from_env` reads them under the service's
own prefix like any other field (`TOPHAT_STREAMER_AUTH_CREDENTIAL`, `TOPHAT_VERIFIER_TLS_CERT`, ...).
A subclass's `validate()` calls `super().validate()` first, and writes its range checks as one table for
`reject_first`: (violated, message) pairs read in order, so a setting's condition and its message sit side by side.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.auth.tls import check_server_files


def reject_first(*checks: tuple[object, str]) -> None:
    """Raise ValueError with the message of the first (violated, message) pair whose `violated` is truthy
    (the `if` each pair replaces), in the order given. A check with an error of its own (a spec parser) runs
    between two tables, so that of several wrong settings the one reported first stays the same."""
    for violated, message in checks:
        if violated:
            raise ValueError(message)


@dataclass(frozen=True)
class ServiceSettings:
    # The mesh's credentials (shared/auth/verify.py). auth_issuer_url: the issuer (the state monitor) whose public keys
    # this service verifies callers with and which gives it tokens; empty: open, as before. auth_credential:
    # this service's own credential for the issuer (a service's from the operator; a device's BOOTSTRAP token);
    # repr=False: settings are never printed with it. auth_leeway_s: clock skew allowed on exp/nbf;
    # auth_refresh_s: how often the issuer's keys and revocation list are re-read (how fast a revocation lands).
    auth_issuer_url: str = ""
    auth_credential: str = field(default="", repr=False)
    auth_leeway_s: float = 30.0
    auth_refresh_s: float = 1.0
    log_level: str = "info"
    # TLS (shared/auth/tls.py). tls_cert + tls_key: PEM files; with both this service serves only TLS (https/wss),
    # with neither plain. tls_ca: the CA file trusted for outgoing https/wss (empty: the system's CAs).
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""

    @property
    def authenticated(self) -> bool:
        """Whether calls into this service need a credential."""
        return bool(self.auth_issuer_url)

    def validate(self) -> None:
        check_server_files(self.tls_cert, self.tls_key)  # a certificate goes with its key
        if not 0 <= self.auth_leeway_s <= 600 or self.auth_refresh_s <= 0:
            raise ValueError("auth_leeway_s must be in [0, 600] and auth_refresh_s > 0")
