"""The mesh's one credential issuer, inside the state monitor, and its HTTP routes (/credentials/*).

Why here: the monitor already keeps the device registry (which device announced which URL), which is
exactly what enrollment binds and what an audience for "the device at this URL" is looked up in; every
device and service already reaches it; and it runs no model and faces no user, so the signing key lives in
the smallest and least exposed process. Nothing else holds a signing key (shared/auth_keys.py).

Routes:
  GET  /credentials/jwks     open: the public keys (several kids during a rotation) and the revocation list
  POST /credentials/enroll   a BOOTSTRAP token: enroll a device id (its own: the bootstrap's `sub`, or any id
                             for a fleet bootstrap `*`) at its URL; answers that device's credential. Refused
                             for a revoked id, an id a live device holds, a URL another live device holds.
  POST /credentials/token    a device's or service's credential: a token for one audience (`audience`, or
                             `device_url` for whichever device is enrolled there), or a renewed credential
  POST /credentials/issue | revoke | rotate    an operator's token (`tophat credentials`)
Rotations are saved in the key file and revocations beside it (`<key file>.revoked.json`) when writable.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import FastAPI, HTTPException, Request
from pydantic import BaseModel, ConfigDict, Field

from services.state_monitor.records import DeviceAnnouncement, Ident
from shared import auth
from shared.auth_keys import KeyRing, write_private
from shared.device_registry import DeviceRegistry, UrlTaken

log = logging.getLogger(__name__)

REVOKED_SUFFIX = ".revoked.json"
ANY_DEVICE = "*"  # a fleet bootstrap's subject: it may enroll any id no live device holds
# Which audiences each role may ask a token for (a device: the services it calls; a service: the devices).
DEVICE_AUDIENCES = frozenset({auth.ISSUER, auth.VERIFIER, auth.PLANNER})
SERVICE_AUDIENCES = frozenset({auth.ISSUER, auth.PLANNER, auth.STAGE})


class TokenRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    audience: Annotated[str, Field(min_length=1, max_length=200)] | None = None
    device_url: Annotated[str, Field(min_length=8, max_length=512)] | None = None


class IssueRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["device", "service", "bootstrap", "operator"]
    subject: Annotated[str, Field(min_length=1, max_length=128)]
    audience: Annotated[str, Field(min_length=1, max_length=200)] = auth.ISSUER
    ttl_s: Annotated[float, Field(gt=0)]


class RevokeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["device", "service", "bootstrap", "operator"] | None = None
    subject: Ident | None = None
    token_id: Annotated[str, Field(min_length=1, max_length=64)] | None = None


class Issuer:
    """The key ring, the revocation list, and what may be issued to whom."""

    def __init__(
        self,
        ring: KeyRing,
        registry: DeviceRegistry,
        *,
        key_file: Path | None = None,
        leeway_s: float = auth.DEFAULT_LEEWAY_S,
        device_ttl_s: float = 3600.0,
        service_ttl_s: float = 86_400.0,
        access_ttl_s: float = 300.0,
        max_ttl_s: float = 30 * 86_400.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.ring, self.registry, self.key_file, self.clock = ring, registry, key_file, clock
        self.device_ttl_s, self.service_ttl_s, self.access_ttl_s, self.max_ttl_s = (
            device_ttl_s,
            service_ttl_s,
            access_ttl_s,
            max_ttl_s,
        )
        self.revoked: set[str] = set()
        self.revoked_tokens: set[str] = set()
        self.revoked_file = key_file.with_name(key_file.name + REVOKED_SUFFIX) if key_file is not None else None
        if self.revoked_file is not None and self.revoked_file.exists():
            saved = json.loads(self.revoked_file.read_text())
            self.revoked, self.revoked_tokens = set(saved.get("revoked", [])), set(saved.get("revoked_tokens", []))
        self.verifier = auth.TokenVerifier(leeway_s=leeway_s)
        self._publish()

    @classmethod
    def from_key_file(cls, key_file: Path, registry: DeviceRegistry, **kwargs: Any) -> Issuer:
        return cls(KeyRing.load(key_file), registry, key_file=key_file, **kwargs)

    def document(self) -> dict[str, Any]:
        """What /credentials/jwks serves (shared/auth.Trust.from_document reads it)."""
        self._prune()
        return {**self.ring.jwks(), "revoked": sorted(self.revoked), "revoked_tokens": sorted(self.revoked_tokens)}

    def _prune(self) -> None:
        if self.ring.prune(self.clock()):
            self._publish()

    def _publish(self) -> None:
        """The issuer's own verifier trusts what it serves (it checks every call to it at once, no refresh)."""
        self.verifier.trust = auth.Trust.from_document(
            {**self.ring.jwks(), "revoked": list(self.revoked), "revoked_tokens": list(self.revoked_tokens)}
        )

    def _save(self) -> None:
        if self.key_file is None or self.revoked_file is None:
            return
        try:
            self.ring.save(self.key_file)
            body = {"revoked": sorted(self.revoked), "revoked_tokens": sorted(self.revoked_tokens)}
            write_private(self.revoked_file, json.dumps(body).encode())
        except OSError as exc:  # a read-only secret mount: kept in memory until a restart
            log.warning("cannot save the issuer's state at %s: %s (kept in memory only)", self.key_file, exc)

    @staticmethod
    def caller(request: Request, roles: set[str]) -> auth.Claims:
        """The claims the monitor's middleware admitted (every POST needs a valid token there), if of `roles`."""
        claims = auth.claims_of(request.scope)
        if claims is None or claims.role not in roles:
            role = claims.role if claims else "no"
            log.info("refused %s to a %s credential", request.url.path, role)
            raise HTTPException(403, f"a {role} credential cannot call {request.url.path}")
        return claims

    def mint(self, subject: str, role: str, audience: str, ttl_s: float) -> dict[str, Any]:
        self._prune()
        token = self.ring.mint(subject, role, audience, ttl_s, self.clock())
        return {"token": token, "audience": audience, "expires_in": ttl_s}

    def enroll(self, bootstrap: auth.Claims, body: DeviceAnnouncement) -> dict[str, Any]:
        if bootstrap.subject not in (ANY_DEVICE, body.device_id):
            raise HTTPException(403, "this bootstrap token enrolls another device id")
        if auth.revocation_key("device", body.device_id) in self.revoked:
            raise HTTPException(403, f"device {body.device_id} is revoked")
        if self.registry.get(body.device_id) is not None:
            # A live device keeps its id: a bootstrap token (stolen, or a second device misconfigured with the
            # same id) cannot take it over; the device itself renews with its own credential instead.
            raise HTTPException(409, f"device {body.device_id} is enrolled and live")
        try:
            self.registry.announce(body.device_id, body.url, body.max_sessions)
        except UrlTaken as exc:
            raise HTTPException(409, str(exc)) from exc
        log.info("enrolled device %s at %s", body.device_id, body.url)
        return self.mint(body.device_id, "device", auth.ISSUER, self.device_ttl_s)

    def token(self, caller: auth.Claims, request: TokenRequest) -> dict[str, Any]:
        if (request.audience is None) == (request.device_url is None):
            raise HTTPException(422, "give one of audience and device_url")
        audience = request.audience
        if request.device_url is not None:
            holder = self.registry.holder(request.device_url)
            if holder is None:
                raise HTTPException(404, f"no live device is enrolled at {request.device_url}")
            audience = auth.device_audience(holder.device_id)
        assert audience is not None
        allowed = (
            audience in DEVICE_AUDIENCES
            if caller.role == "device"
            else audience in SERVICE_AUDIENCES or audience.startswith(auth.DEVICE_AUDIENCE_PREFIX)
        )
        if not allowed:
            raise HTTPException(403, f"a {caller.role} credential gets no token for {audience}")
        if audience == auth.ISSUER:  # renewing the caller's own credential
            ttl = self.device_ttl_s if caller.role == "device" else self.service_ttl_s
        else:
            ttl = self.access_ttl_s
        return self.mint(caller.subject, caller.role, audience, ttl)

    def issue(self, body: IssueRequest) -> dict[str, Any]:
        if body.ttl_s > self.max_ttl_s:
            raise HTTPException(422, f"ttl_s is at most {self.max_ttl_s}")
        log.info("operator issued a %s credential for %s (audience %s)", body.role, body.subject, body.audience)
        return self.mint(body.subject, body.role, body.audience, body.ttl_s)

    def revoke(self, body: RevokeRequest) -> dict[str, Any]:
        if body.token_id is not None:
            self.revoked_tokens.add(body.token_id)
        elif body.subject is not None and body.role is not None:
            self.revoked.add(auth.revocation_key(body.role, body.subject))
        else:
            raise HTTPException(422, "give a token_id, or a role and a subject")
        log.info("revoked %s", body.token_id and "a token" or f"{body.role} {body.subject}")
        self._publish()
        self._save()
        return {"revoked": sorted(self.revoked), "revoked_tokens": sorted(self.revoked_tokens)}

    def rotate(self) -> dict[str, Any]:
        old = self.ring.active
        kid = self.ring.rotate(self.clock(), self.max_ttl_s)
        log.info("rotated the signing key: %s is active; %s verifies until its tokens expired", kid, old)
        self._publish()
        self._save()
        return {"active": kid, "retiring": {k: v for k, v in self.ring.retire_at.items()}}


def install_routes(app: FastAPI, issuer: Issuer) -> None:
    @app.get("/credentials/jwks")
    async def jwks() -> dict[str, Any]:
        return issuer.document()

    @app.post("/credentials/enroll")
    async def enroll(body: DeviceAnnouncement, request: Request) -> dict[str, Any]:
        return issuer.enroll(issuer.caller(request, {"bootstrap"}), body)

    @app.post("/credentials/token")
    async def token(body: TokenRequest, request: Request) -> dict[str, Any]:
        return issuer.token(issuer.caller(request, {"device", "service", "operator"}), body)

    @app.post("/credentials/issue")
    async def issue(body: IssueRequest, request: Request) -> dict[str, Any]:
        issuer.caller(request, {"operator"})
        return issuer.issue(body)

    @app.post("/credentials/revoke")
    async def revoke(body: RevokeRequest, request: Request) -> dict[str, Any]:
        issuer.caller(request, {"operator"})
        return issuer.revoke(body)

    @app.post("/credentials/rotate")
    async def rotate(request: Request) -> dict[str, Any]:
        issuer.caller(request, {"operator"})
        return issuer.rotate()
