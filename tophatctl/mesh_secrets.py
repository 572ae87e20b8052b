"""The secrets a container deployment mounts (`tophat mesh-secrets`, `make secrets`).

`tophat-mesh.env`: `KEY=VALUE` lines every service reads through `TOPHAT_SETTINGS_FILE` — one random
mesh secret as each service's `AUTH_SECRET` (shared/auth.py: each service mints its own tokens from it),
the Redis password for the state monitor, and optionally the OpenAI endpoint's API key.
`redis.conf`: `requirepass` for the Redis container (a config file, so the password never sits on a
command line). With `tls_hosts`, a development CA and a server certificate for those names
(tophatctl/certs.py) and the settings lines that make the cloud-side services serve TLS and every service
trust the CA, at the paths Compose mounts them (`/run/secrets/`). Secret files are written 0600; when run
as root they are handed to the images' user (uid 10001), because Compose bind-mounts file secrets with
their host owner and mode.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

MESH_ENV = "tophat-mesh.env"
REDIS_CONF = "redis.conf"
IMAGE_UID = 10001
# Served with TLS in a container deployment; device agents are reached at addresses no fixed certificate
# names (their containers' own), so they serve plain HTTP to callers that must hold a token.
TLS_SERVERS = ("TOPHAT_VERIFIER_", "TOPHAT_STREAMER_", "TOPHAT_CHUNK_PLANNER_", "TOPHAT_STATE_MONITOR_")
MOUNTED = Path("/run/secrets")
# Every service's settings prefix: each takes the mesh secret and the CA under its own (and reads only its own).
SERVICE_PREFIXES = ("TOPHAT_VERIFIER_", "TOPHAT_DEVICE_", "TOPHAT_STREAMER_", "TOPHAT_CHUNK_PLANNER_",
                    "TOPHAT_STATE_MONITOR_")
SECRET_BYTES = 32  # 256 bits of randomness per secret


def new_secret() -> str:
    """A fresh random secret, URL-safe (it travels in env files and settings)."""
    return secrets.token_urlsafe(SECRET_BYTES)


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as handle:
        handle.write(text)
    os.chmod(path, 0o600)  # an existing file keeps its old mode through O_CREAT
    if os.geteuid() == 0:
        os.chown(path, IMAGE_UID, IMAGE_UID)


def make_mesh_secrets(out_dir: Path, api_key: str = "", tls_hosts: list[str] | None = None) -> tuple[Path, Path]:
    """Write fresh secrets; returns (tophat-mesh.env, redis.conf). Existing files are replaced."""
    from tophatctl.certs import CA_CERT, SERVER_CERT, SERVER_KEY, make_dev_certs

    out_dir.mkdir(parents=True, exist_ok=True)
    mesh_secret = new_secret()
    redis_password = new_secret()
    lines = ["# written by `tophat mesh-secrets`: mounted as a secret, never committed"]
    lines += [f"{prefix}AUTH_SECRET={mesh_secret}" for prefix in SERVICE_PREFIXES]
    lines.append(f"TOPHAT_STATE_MONITOR_REDIS_PASSWORD={redis_password}")
    if api_key:
        lines.append(f"TOPHAT_STREAMER_API_KEY={api_key}")
    if tls_hosts:
        made = make_dev_certs(out_dir, tls_hosts)
        if os.geteuid() == 0:
            os.chown(made.server_key, IMAGE_UID, IMAGE_UID)
        lines += [f"{prefix}TLS_CERT={MOUNTED / SERVER_CERT}" for prefix in TLS_SERVERS]
        lines += [f"{prefix}TLS_KEY={MOUNTED / SERVER_KEY}" for prefix in TLS_SERVERS]
        lines += [f"{prefix}TLS_CA={MOUNTED / CA_CERT}" for prefix in SERVICE_PREFIXES]
    env_path, conf_path = out_dir / MESH_ENV, out_dir / REDIS_CONF
    _write_private(env_path, "\n".join(lines) + "\n")
    _write_private(conf_path, f"requirepass {redis_password}\n")
    return env_path, conf_path
