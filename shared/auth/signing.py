"""The issuer's side of the mesh's credentials: Ed25519 signing keys and the tokens they sign.

Only the issuer (the state monitor, services/state_monitor/issuer.py) and the operator who made the keys hold a
`KeyRing`; every other service holds its public half (`KeyRing.jwks()`, served on the issuer's open
`/credentials/jwks` and read into shared/auth/verify.py's `Trust`). A ring has one active key, which signs, and the
keys it retired by a rotation, kept for verification until every token they signed has expired (their
`retire_at`), so a rotation refuses nothing still valid. A ring lives in one JSON file (0600: which kid is
active, when each retired one leaves, each key as PKCS#8 PEM), one container secret; a restarted issuer resumes.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from jwt.algorithms import OKPAlgorithm

from shared.auth.verify import ALGORITHM, ROLES

KID_BYTES = 8


def new_kid() -> str:
    return secrets.token_hex(KID_BYTES)


def public_jwk(kid: str, key: Ed25519PublicKey) -> dict[str, Any]:
    jwk = dict(OKPAlgorithm.to_jwk(key, as_dict=True))
    jwk.update({"kid": kid, "alg": ALGORITHM, "use": "sig"})
    return jwk


@dataclass
class KeyRing:
    """kid -> private key; `active` signs; `retire_at[kid]` (unix s) drops a rotated-out key from the JWKS."""

    keys: dict[str, Ed25519PrivateKey]
    active: str
    retire_at: dict[str, float] = field(default_factory=dict)

    @classmethod
    def generate(cls) -> KeyRing:
        kid = new_kid()
        return cls({kid: Ed25519PrivateKey.generate()}, kid)

    def rotate(self, now: float, longest_ttl_s: float) -> str:
        """A new active key; the old one verifies until `longest_ttl_s` after now (then `prune` drops it)."""
        self.retire_at[self.active] = now + longest_ttl_s
        kid = new_kid()
        self.keys[kid] = Ed25519PrivateKey.generate()
        self.active = kid
        return kid

    def prune(self, now: float) -> list[str]:
        gone = [kid for kid, at in self.retire_at.items() if at <= now and kid != self.active]
        for kid in gone:
            del self.keys[kid], self.retire_at[kid]
        return gone

    def jwks(self) -> dict[str, Any]:
        return {"keys": [public_jwk(kid, key.public_key()) for kid, key in sorted(self.keys.items())]}

    def mint(
        self, subject: str, role: str, audience: str, ttl_s: float, now: float, extra: Mapping[str, Any] | None = None
    ) -> str:
        """A signed token: sub, role, aud, iat, nbf, exp, a random jti; `kid` (the active key) in its header."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if not subject or not audience or ttl_s <= 0:
            raise ValueError("a token needs a subject, an audience and a positive ttl")
        issued = int(now)
        claims = {
            **(extra or {}),
            "sub": subject,
            "role": role,
            "aud": audience,
            "iat": issued,
            "nbf": issued,
            "exp": int(now + ttl_s),
            "jti": secrets.token_urlsafe(12),
        }
        return jwt.encode(claims, self.keys[self.active], algorithm=ALGORITHM, headers={"kid": self.active})

    # -- one file (a single container secret): {"active", "retire_at", "keys": {kid: PKCS#8 PEM}} ----------
    def to_dict(self) -> dict[str, Any]:
        keys = {
            kid: key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            ).decode("ascii")
            for kid, key in self.keys.items()
        }
        return {"active": self.active, "retire_at": dict(self.retire_at), "keys": keys}

    @classmethod
    def from_dict(cls, saved: Mapping[str, Any]) -> KeyRing:
        """The ring `to_dict` wrote (other fields beside it are ignored); ValueError when it is none."""
        try:
            active = str(saved["active"])
            retire_at = {str(k): float(v) for k, v in saved.get("retire_at", {}).items()}
            keys = {}
            for kid, pem in saved["keys"].items():
                key = serialization.load_pem_private_key(pem.encode("ascii"), password=None)
                if not isinstance(key, Ed25519PrivateKey):
                    raise ValueError(f"key {kid} is not an Ed25519 private key")
                keys[str(kid)] = key
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise ValueError(f"no signing key ring: {exc}") from exc
        if active not in keys:
            raise ValueError(f"the active key {active} is missing")
        return cls(keys, active, {k: v for k, v in retire_at.items() if k in keys})

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_private(path, json.dumps(self.to_dict()).encode())

    @classmethod
    def load(cls, path: Path) -> KeyRing:
        """The ring saved at `path`; ValueError when it is unreadable or a key is not an Ed25519 private key."""
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path} holds no signing key ring: {exc}") from exc


def write_private(path: Path, data: bytes) -> None:
    """Write a file only its owner reads (an existing file keeps its old mode through O_CREAT: chmod after)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    os.chmod(path, 0o600)
