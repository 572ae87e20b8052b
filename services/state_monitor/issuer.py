"""The mesh's one credential issuer, inside the state monitor, and its HTTP routes (/credentials/*).

Why here: the monitor already keeps the device registry (which device announced which URL), which is
exactly what enrollment binds and what an audience for "the device at this URL" is looked up in; every
device and service already reaches it; and it runs no model and faces no user, so the signing key lives in
the smallest and least exposed process. Nothing else holds a signing key (shared/auth/signing.py).

Routes:
  GET  /credentials/jwks     open: the public keys (several kids during a rotation) and the revocation list
  POST /credentials/enroll   a BOOTSTRAP token: enroll the one device id it names (its `sub`; a fleet's `*`
                             enrolls nothing) at its URL; answers that device's credential. The first enrollment
                             binds the id to that bootstrap token (its jti): another token for the id is refused
                             until the operator issues one through the issuer (which rebinds it). Refused too for
                             a revoked device (its bootstrap is revoked with it), an id a live device holds, a URL
                             another live device holds.
  POST /credentials/token    a device's or service's credential: a token for one audience (`audience`, or
                             `device_url` for whichever device is enrolled there), or a renewed credential
  POST /credentials/issue | revoke | rotate    an operator's token (`tophat credentials`)
Rotations, revocations and enrollments are saved (issuer_state.py) before they are answered; one that cannot
be saved is answered 503 with the reason (a rotation or an enrollment is then undone; a revocation holds until
a restart).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

import jwt
from fastapi import FastAPI, HTTPException, Request
from pydantic import BaseModel, ConfigDict, Field

from services.state_monitor.issuer_state import STATE_FILE, IssuerState, NotDurable, load_state, save_state
from services.state_monitor.records import DeviceAnnouncement, Ident
from shared.auth import verify as auth
from shared.auth.signing import KeyRing
from shared.device_registry import DeviceRegistry, UrlTaken

log = logging.getLogger(__name__)

FLEET = "*"  # a fleet bootstrap's subject, which once enrolled any id: refused now (one token per device)
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
    """The key ring, the revocation list, which bootstrap holds each enrolled id, and what may be issued to whom.
    Every change is saved (issuer_state.py) before it is answered: one that cannot be is a 503, never a 200."""

    def __init__(
        self,
        ring: KeyRing | IssuerState,
        registry: DeviceRegistry,
        *,
        state_file: Path | None = None,
        leeway_s: float = auth.DEFAULT_LEEWAY_S,
        device_ttl_s: float = 3600.0,
        service_ttl_s: float = 86_400.0,
        access_ttl_s: float = 300.0,
        max_ttl_s: float = 30 * 86_400.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.state = ring if isinstance(ring, IssuerState) else IssuerState(ring, lineage=[ring.active])
        self.registry, self.state_file, self.clock = registry, state_file, clock
        self.device_ttl_s, self.service_ttl_s, self.access_ttl_s, self.max_ttl_s = (
            device_ttl_s,
            service_ttl_s,
            access_ttl_s,
            max_ttl_s,
        )
        self.verifier = auth.TokenVerifier(leeway_s=leeway_s)
        self._publish()
        if state_file is None:
            log.warning("the issuer keeps rotations, revocations and enrollments in memory only (no state file)")
        else:
            try:
                save_state(self.state, state_file)
            except NotDurable as exc:
                log.error("%s; until then revoke, rotate, issue and enroll answer 503", exc)

    @classmethod
    def from_key_file(
        cls, key_file: Path, registry: DeviceRegistry, *, state_dir: Path | None = None, **kwargs: Any
    ) -> Issuer:
        """The issuer of `key_file`'s ring, resumed from its state in `state_dir` (default: the key file's)."""
        state_file = (state_dir or key_file.parent) / STATE_FILE
        return cls(load_state(key_file, state_file), registry, state_file=state_file, **kwargs)

    @property
    def ring(self) -> KeyRing:
        return self.state.ring

    @property
    def revoked(self) -> set[str]:
        return self.state.revoked

    @property
    def revoked_tokens(self) -> set[str]:
        return self.state.revoked_tokens

    def document(self) -> dict[str, Any]:
        """What /credentials/jwks serves (shared/auth/verify.Trust.from_document reads it)."""
        self._prune()
        return {**self.ring.jwks(), "revoked": sorted(self.revoked), "revoked_tokens": sorted(self.revoked_tokens)}

    def _prune(self) -> None:
        if self.ring.prune(self.clock()):
            self._publish()
            try:
                self._save()
            except NotDurable as exc:  # the next change saves it (a pruned key is gone from memory already)
                log.warning("%s", exc)

    def _publish(self) -> None:
        """The issuer's own verifier trusts what it serves (it checks every call to it at once, no refresh)."""
        self.verifier.trust = auth.Trust.from_document(
            {**self.ring.jwks(), "revoked": list(self.revoked), "revoked_tokens": list(self.revoked_tokens)}
        )

    def _save(self) -> None:
        if self.state_file is not None:
            save_state(self.state, self.state_file)

    def _commit(self, what: str, undo: Callable[[], object] | None) -> None:
        """Save the state after `what` changed it; when it cannot be: undo it (None: keep it in memory, a
        revocation) and answer 503 naming why."""
        try:
            self._save()
        except NotDurable as exc:
            if undo is not None:
                undo()
                self._publish()
                kept = "not done"
            else:
                kept = "in force until the monitor restarts, then lost"
            log.error("%s: %s (%s)", what, exc, kept)
            raise HTTPException(503, f"{what} was not saved, so it is {kept}: {exc}") from exc

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
        device_id = body.device_id
        if bootstrap.subject != device_id:
            # A bootstrap names its one device id; a fleet's `*` (which minted any id) enrolls nothing.
            raise HTTPException(403, f"this bootstrap token enrolls {bootstrap.subject!r} only, not {device_id!r}")
        if {auth.revocation_key("device", device_id), auth.revocation_key("bootstrap", device_id)} & self.revoked:
            raise HTTPException(403, f"device {device_id} is revoked")
        holder = self.state.enrolled.get(device_id)
        if holder is not None and holder != bootstrap.token_id:
            # The id is bound to the bootstrap token that first enrolled it: another holder (a second token
            # minted for the id, a copy of a stale secret) re-enrolls it only after the operator re-issues it.
            raise HTTPException(409, f"device {device_id} is enrolled by another bootstrap token")
        if self.registry.get(device_id) is not None:
            # A live device keeps its id, and renews with its own credential instead.
            raise HTTPException(409, f"device {device_id} is enrolled and live")
        if holder is None:
            self.state.enrolled[device_id] = bootstrap.token_id
            self._commit(f"enrolling device {device_id}", lambda: self.state.enrolled.pop(device_id, None))
        try:
            self.registry.announce(device_id, body.url, body.max_sessions)
        except UrlTaken as exc:
            raise HTTPException(409, str(exc)) from exc
        log.info("enrolled device %s at %s", device_id, body.url)
        return self.mint(device_id, "device", auth.ISSUER, self.device_ttl_s)

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
        if body.role == "bootstrap" and body.subject == FLEET:
            raise HTTPException(422, "a bootstrap token names one device id (a fleet's '*' would mint any id)")
        log.info("operator issued a %s credential for %s (audience %s)", body.role, body.subject, body.audience)
        answer = self.mint(body.subject, body.role, body.audience, body.ttl_s)
        if body.role == "bootstrap":  # the operator hands the id to this token's holder: the old one's ends
            device_id, before = body.subject, self.state.enrolled.get(body.subject)
            jti = jwt.decode(answer["token"], options={"verify_signature": False})["jti"]
            self.state.enrolled[device_id] = str(jti)

            def undo() -> None:
                if before is None:
                    self.state.enrolled.pop(device_id, None)
                else:
                    self.state.enrolled[device_id] = before

            self._commit(f"binding device {device_id} to a new bootstrap token", undo)
        return answer

    def revoke(self, body: RevokeRequest) -> dict[str, Any]:
        if body.token_id is not None:
            self.revoked_tokens.add(body.token_id)
        elif body.subject is not None and body.role is not None:
            self.revoked.add(auth.revocation_key(body.role, body.subject))
            if body.role == "device":  # and its bootstrap: it enrolls it no more
                self.revoked.add(auth.revocation_key("bootstrap", body.subject))
        else:
            raise HTTPException(422, "give a token_id, or a role and a subject")
        what = body.token_id and "a token" or f"{body.role} {body.subject}"
        log.info("revoked %s", what)
        self._publish()
        self._commit(f"revoking {what}", None)  # refused at once either way; 503 when a restart would lose it
        return {"revoked": sorted(self.revoked), "revoked_tokens": sorted(self.revoked_tokens)}

    def rotate(self) -> dict[str, Any]:
        before = self.ring.to_dict(), list(self.state.lineage)
        old = self.ring.active
        kid = self.ring.rotate(self.clock(), self.max_ttl_s)
        self.state.lineage.append(kid)

        def undo() -> None:
            self.state.ring, self.state.lineage = KeyRing.from_dict(before[0]), before[1]

        self._publish()
        self._commit("rotating the signing key", undo)
        log.info("rotated the signing key: %s is active; %s verifies until its tokens expired", kid, old)
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
