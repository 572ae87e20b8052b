"""What the issuer changes, kept where a restart finds it: the key ring after a rotation, the revocation list and
which bootstrap token holds each enrolled device id.

Why a file of its own: the signing key file is a secret the deployment mounts (read-only in k8s, Compose and
Swarm), so a rotation or a revocation written there was lost on a restart (the key rotated away from, perhaps
leaked, signed again; revoked devices came back). The state lives in one JSON file, `issuer-state.json`, in
a writable directory (`TOPHAT_STATE_MONITOR_AUTH_STATE_DIR`, a volume the monitor alone mounts; by default the
key file's own directory), replaced atomically (a temporary file, fsync, rename, fsync of the directory), so a
crash leaves the old state or the new, never half of one. Its top level is the key ring's own layout
(shared/auth/signing.py), so `tophat credentials --key-file` reads it as the current ring. It is not in Redis:
every cloud-side service holds the Redis password, and none but the monitor may hold a signing key.

`lineage`: every kid this state's ring ever made active. A state whose lineage does not hold the key file's
active kid belongs to another key ring (the operator ran `tophat mesh-secrets` again, or a local mesh made fresh
keys in the same directory): the key file wins and the state starts afresh (every token the old ring signed,
revoked or bound, is refused as an unknown key anyway).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.auth.signing import KeyRing

log = logging.getLogger(__name__)

STATE_FILE = "issuer-state.json"
LEGACY_REVOKED_SUFFIX = ".revoked.json"  # where revocations were kept beside the key file before


class NotDurable(Exception):
    """A change the issuer could not write where a restart would find it."""


@dataclass
class IssuerState:
    ring: KeyRing
    revoked: set[str] = field(default_factory=set)  # auth.revocation_key(role, subject)
    revoked_tokens: set[str] = field(default_factory=set)  # jti
    enrolled: dict[str, str] = field(default_factory=dict)  # device id -> the jti of the bootstrap that holds it
    lineage: list[str] = field(default_factory=list)  # every kid made active, oldest first

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.ring.to_dict(),
            "revoked": sorted(self.revoked),
            "revoked_tokens": sorted(self.revoked_tokens),
            "enrolled": dict(sorted(self.enrolled.items())),
            "lineage": list(self.lineage),
        }


def load_state(key_file: Path, state_file: Path | None) -> IssuerState:
    """The state saved in `state_file` when it descends from `key_file`'s ring, else the key file's ring afresh
    (and the revocations a former version kept beside the key file, in either case)."""
    ring = KeyRing.load(key_file)
    state = IssuerState(ring, lineage=[ring.active])
    saved: dict[str, Any] = {}
    if state_file is not None and state_file.exists():
        try:
            saved = json.loads(state_file.read_text())
            if not isinstance(saved, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as exc:
            raise ValueError(f"{state_file} is no issuer state: {exc}") from exc
    if saved:
        lineage = [str(kid) for kid in saved.get("lineage", [])]
        if ring.active in lineage:
            state = IssuerState(KeyRing.from_dict(saved), lineage=lineage)
            state.enrolled = {str(k): str(v) for k, v in saved.get("enrolled", {}).items()}
            state.revoked = {str(v) for v in saved.get("revoked", [])}
            state.revoked_tokens = {str(v) for v in saved.get("revoked_tokens", [])}
        else:  # what it revoked and bound was signed by a ring no one trusts now
            log.warning(
                "%s was made for another signing key ring than %s's: starting afresh from the key file",
                state_file,
                key_file,
            )
    legacy = key_file.with_name(key_file.name + LEGACY_REVOKED_SUFFIX)
    if legacy.exists():
        try:
            old = json.loads(legacy.read_text())
            state.revoked |= {str(v) for v in old.get("revoked", [])}
            state.revoked_tokens |= {str(v) for v in old.get("revoked_tokens", [])}
        except (OSError, ValueError, AttributeError) as exc:
            log.warning("cannot read the former revocation list %s: %s", legacy, exc)
    return state


def save_state(state: IssuerState, state_file: Path) -> None:
    """Replace `state_file` atomically and durably; NotDurable naming the path and the reason when it cannot be."""
    tmp = state_file.with_name(f".{state_file.name}.{os.getpid()}.tmp")
    try:
        state_file.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(json.dumps(state.to_dict()).encode())
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, state_file)
        directory = os.open(state_file.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
    except OSError as exc:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            log.debug("cannot remove %s", tmp)
        reason = exc.strerror or type(exc).__name__
        raise NotDurable(
            f"cannot write the issuer's state at {state_file} ({reason}): give the state monitor a writable "
            "TOPHAT_STATE_MONITOR_AUTH_STATE_DIR (a volume only it mounts)"
        ) from exc
