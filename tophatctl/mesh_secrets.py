"""The secrets a container deployment mounts (`tophat mesh-secrets`, `make secrets`).

`tophat-mesh.env`: `KEY=VALUE` lines the cloud-side services read through `TOPHAT_SETTINGS_FILE` — the issuer's
URL and a service credential for the verifier and the streamer (shared/auth/verify.py), the state monitor's signing
key file's mounted path and Redis password, and optionally the OpenAI endpoint's API key.
`tophat-device.env`: what a device agent reads instead: the issuer's URL and one BOOTSTRAP token per device id
(`device_ids`; each device uses the one naming its id, shared/auth/client.own_bootstrap). A bootstrap token
enrolls only its own id, binds it at the first enrollment and ends when the device is revoked
(services/state_monitor/issuer.py); it is never a signing key or a service's credential. Every device that
mounts the file holds every listed id's token: to keep one device from holding another's, give each device a
copy holding its own token only.
`signing-keys.json`: the Ed25519 signing key ring (shared/auth/signing.py), mounted into the state monitor alone.
`redis.conf`: `requirepass` for the Redis container (a config file, so the password never sits on a
command line). With `tls_hosts`, a development CA and a server certificate for those names
(tophatctl/certs.py) and the settings lines that make the cloud-side services serve TLS and every service
trust the CA, at the paths Compose mounts them (`/run/secrets/`). Secret files are written 0600; when run
as root they are handed to the images' user (uid 10001), because Compose bind-mounts file secrets with
their host owner and mode.
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

MESH_ENV = "tophat-mesh.env"
DEVICE_ENV = "tophat-device.env"
SIGNING_KEYS = "signing-keys.json"
REDIS_CONF = "redis.conf"
MONITOR_PORT = 8020  # where the containers' state monitor (the issuer) listens (docker-compose.yml, swarm/, k8s/)
# A deployment's credentials' lives: services and devices renew theirs at the issuer long before; the bootstrap
# token must outlive the fleet's enrolment (revoke it by its id, `tophat credentials revoke`, to end it early).
SERVICE_CREDENTIAL_TTL_S = 30 * 86_400.0
BOOTSTRAP_TTL_S = 30 * 86_400.0
DEFAULT_DEVICE_IDS = ("device-1",)  # docker-compose.yml's one device agent
IMAGE_UID = 10001
# Served with TLS in a container deployment; device agents are reached at addresses no fixed certificate
# names (their containers' own), so they serve plain HTTP to callers that must hold a token.
TLS_SERVERS = ("TOPHAT_VERIFIER_", "TOPHAT_STREAMER_", "TOPHAT_CHUNK_PLANNER_", "TOPHAT_STATE_MONITOR_")
MOUNTED = Path("/run/secrets")
# Every service's settings prefix: each takes the mesh secret and the CA under its own (and reads only its own).
SERVICE_PREFIXES = (
    "TOPHAT_VERIFIER_",
    "TOPHAT_DEVICE_",
    "TOPHAT_STREAMER_",
    "TOPHAT_CHUNK_PLANNER_",
    "TOPHAT_STATE_MONITOR_",
)
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


def check_device_ids(device_ids: list[str] | tuple[str, ...]) -> list[str]:
    """The ids, each once; ValueError for none, '*' (a fleet's token, which enrolls nothing) or one the state
    monitor would refuse."""
    from services.state_monitor.records import IDENT_PATTERN

    ids = list(dict.fromkeys(device_ids))
    if not ids:
        raise ValueError("give at least one device id")
    for device_id in ids:
        if not re.fullmatch(IDENT_PATTERN, device_id):
            raise ValueError(f"{device_id!r} is no device id (letters, digits, '.', '_', '-')")
    return ids


def make_mesh_secrets(
    out_dir: Path,
    api_key: str = "",
    tls_hosts: list[str] | None = None,
    issuer_url: str = "",
    device_ids: list[str] | tuple[str, ...] = DEFAULT_DEVICE_IDS,
) -> tuple[Path, Path, Path, Path]:
    """Write fresh secrets; returns (tophat-mesh.env, tophat-device.env, signing-keys.json, redis.conf).
    `issuer_url`: where services and devices reach the state monitor (default its service name); `device_ids`:
    the devices' ids (Swarm's and k8s's: their nodes' host names), one bootstrap token each."""
    import time

    from shared.auth import verify as auth
    from shared.auth.signing import KeyRing
    from tophatctl.certs import CA_CERT, SERVER_CERT, SERVER_KEY, make_dev_certs

    ids = check_device_ids(device_ids)
    out_dir.mkdir(parents=True, exist_ok=True)
    issuer_url = issuer_url or f"{'https' if tls_hosts else 'http'}://state-monitor:{MONITOR_PORT}"
    ring, now = KeyRing.generate(), time.time()
    redis_password = new_secret()
    lines = ["# written by `tophat mesh-secrets`: the cloud side's, mounted as a secret, never committed"]
    lines.append(f"TOPHAT_STATE_MONITOR_AUTH_KEY_FILE={MOUNTED / SIGNING_KEYS}")
    for prefix, subject in (("TOPHAT_VERIFIER_", auth.VERIFIER_SUBJECT), ("TOPHAT_STREAMER_", auth.STREAMER_SUBJECT)):
        credential = ring.mint(subject, "service", auth.ISSUER, SERVICE_CREDENTIAL_TTL_S, now)
        lines += [f"{prefix}AUTH_ISSUER_URL={issuer_url}", f"{prefix}AUTH_CREDENTIAL={credential}"]
    lines.append(f"TOPHAT_CHUNK_PLANNER_AUTH_ISSUER_URL={issuer_url}")  # it only verifies
    lines.append(f"TOPHAT_STATE_MONITOR_REDIS_PASSWORD={redis_password}")
    bootstraps = " ".join(ring.mint(i, "bootstrap", auth.ISSUER, BOOTSTRAP_TTL_S, now) for i in ids)
    device = [
        f"# written by `tophat mesh-secrets`: the device agents' (a bootstrap token for each of {', '.join(ids)}"
        "; each device uses its own id's), never committed",
        f"TOPHAT_DEVICE_AUTH_ISSUER_URL={issuer_url}",
        f"TOPHAT_DEVICE_AUTH_CREDENTIAL={bootstraps}",
    ]
    if api_key:
        lines.append(f"TOPHAT_STREAMER_API_KEY={api_key}")
    if tls_hosts:
        made = make_dev_certs(out_dir, tls_hosts)
        if os.geteuid() == 0:
            os.chown(made.server_key, IMAGE_UID, IMAGE_UID)
        lines += [f"{prefix}TLS_CERT={MOUNTED / SERVER_CERT}" for prefix in TLS_SERVERS]
        lines += [f"{prefix}TLS_KEY={MOUNTED / SERVER_KEY}" for prefix in TLS_SERVERS]
        lines += [f"{prefix}TLS_CA={MOUNTED / CA_CERT}" for prefix in SERVICE_PREFIXES if prefix != "TOPHAT_DEVICE_"]
        device.append(f"TOPHAT_DEVICE_TLS_CA={MOUNTED / CA_CERT}")
    env_path, device_path = out_dir / MESH_ENV, out_dir / DEVICE_ENV
    keys_path, conf_path = out_dir / SIGNING_KEYS, out_dir / REDIS_CONF
    _write_private(env_path, "\n".join(lines) + "\n")
    _write_private(device_path, "\n".join(device) + "\n")
    ring.save(keys_path)
    if os.geteuid() == 0:
        os.chown(keys_path, IMAGE_UID, IMAGE_UID)
    _write_private(conf_path, f"requirepass {redis_password}\n")
    return env_path, device_path, keys_path, conf_path
