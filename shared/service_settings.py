"""What every service's settings share: the mesh secret, the log level and TLS.

Each service's `Settings` (services/*/settings.py) extends `ServiceSettings`, so these fields, their
defaults and their checks are written once; `shared.settings.from_env` reads them under the service's
own prefix like any other field (`TOPHAT_STREAMER_AUTH_SECRET`, `TOPHAT_VERIFIER_TLS_CERT`, ...).
A subclass's `validate()` calls `super().validate()` first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.tls import check_server_files


@dataclass(frozen=True)
class ServiceSettings:
    # Mesh secret (shared/auth.py): with one, calls need `Authorization: Bearer <signed token>` (probes stay
    # open); empty: open, as before. repr=False: settings are never printed with it.
    auth_secret: str = field(default="", repr=False)
    log_level: str = "info"
    # TLS (shared/tls.py). tls_cert + tls_key: PEM files; with both this service serves only TLS (https/wss),
    # with neither plain. tls_ca: the CA file trusted for outgoing https/wss (empty: the system's CAs).
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""

    def validate(self) -> None:
        check_server_files(self.tls_cert, self.tls_key)  # a certificate goes with its key
