"""Every hop authenticated: asymmetric, audience-bound, expiring credentials for devices and services.

A token is a JWT (PyJWT) signed with EdDSA (Ed25519) by the one issuer, the state monitor
(services/state_monitor/issuer.py); nothing else holds a signing key. Its header names the key (`kid`); its
claims are `sub` (a device id or a service's name), `role`, `aud` (the one service or device it is for),
`iat`, `nbf`, `exp` and a `jti`. Every service verifies with the issuer's public key set (`Trust`, read from
the issuer's open `/credentials/jwks` by shared/auth/client.py), which holds several keys during a rotation
and the revocation list. Decoding pins the algorithm list to EdDSA (no downgrade to `none` or HMAC), requires
every claim, checks the audience and the time window with a small leeway (`DEFAULT_LEEWAY_S`, for devices
whose clocks drift). A refusal is a typed `AuthError` whose `reason` says why. Tokens are never logged.

Roles: "device" (sub = its device id), "service" (verifier, streamer, planner), "bootstrap" (a device's
first credential: it can only enroll, at the issuer), "operator" (`tophat credentials`). Audiences:
`VERIFIER`, `PLANNER`, `ISSUER` (the state monitor) and `device_audience(id)` for one device agent. Where each
is checked: the verifier's WebSocket handshake (device), a device agent's /generate and /info (a service's
token for that device), the state monitor's POSTs (a device only for its own device id), the chunk planner
(a device only asking for itself). Probes (/healthz, /readyz, /metrics) stay open. With no issuer configured
everything is open, as before, with a warning when the service faces a network.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

log = logging.getLogger(__name__)

ALGORITHM = "EdDSA"
ROLES = ("device", "service", "bootstrap", "operator")
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})  # probes and scrapes stay open
DEFAULT_LEEWAY_S = 30.0  # clock skew tolerated on exp, nbf and iat
SCOPE_KEY = "tophat.auth.claims"  # where the middleware leaves a request's claims in its ASGI scope
REQUIRED_CLAIMS = ("sub", "role", "aud", "exp", "nbf", "iat", "jti")
# The audiences: the services' names as a token's `aud`, and one per device agent.
ISSUER = "state-monitor"
VERIFIER = "verifier"
PLANNER = "chunk-planner"
STAGE = "verifier-stage"  # a pipeline stage started on its own (services/verifier_cloud/stage.py)
DEVICE_AUDIENCE_PREFIX = "device:"
# The subjects the launcher and deployments give the cloud-side services.
STREAMER_SUBJECT = "token-streamer"
VERIFIER_SUBJECT = "verifier-cloud"
PLANNER_SUBJECT = "chunk-planner"


def device_audience(device_id: str) -> str:
    return f"{DEVICE_AUDIENCE_PREFIX}{device_id}"


class AuthError(Exception):
    """A credential refused. `reason`: missing | malformed | bad_algorithm | unknown_key | bad_signature |
    wrong_audience | expired | not_yet_valid | revoked | forbidden."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason

    @property
    def status(self) -> int:
        return 403 if self.reason == "forbidden" else 401


@dataclass(frozen=True)
class Claims:
    subject: str  # a device id, or a service's name
    role: str  # one of ROLES
    audience: str
    expires_at: int  # unix seconds
    token_id: str = ""  # jti
    issued_at: int = 0


def revocation_key(role: str, subject: str) -> str:
    """How a revoked identity is listed: its role and subject (a device id and a service may share a name)."""
    return f"{role}:{subject}"


@dataclass(frozen=True)
class Trust:
    """What a verifying service trusts: the issuer's public keys by kid and its revocation list."""

    keys: Mapping[str, Ed25519PublicKey] = field(default_factory=dict)
    revoked: frozenset[str] = frozenset()  # revocation_key(role, sub)
    revoked_tokens: frozenset[str] = frozenset()  # jti

    @classmethod
    def from_document(cls, document: Mapping[str, Any]) -> Trust:
        """The issuer's /credentials/jwks answer: {"keys": [JWK], "revoked": [...], "revoked_tokens": [...]};
        ValueError for anything else (an Ed25519 JWK only)."""
        try:
            keys = {}
            for jwk in document["keys"]:
                parsed = jwt.PyJWK(jwk, algorithm=ALGORITHM)
                if not isinstance(parsed.key, Ed25519PublicKey) or not isinstance(jwk.get("kid"), str):
                    raise ValueError("not an Ed25519 public key with a kid")
                keys[jwk["kid"]] = parsed.key
            revoked = frozenset(str(v) for v in document.get("revoked", []))
            tokens = frozenset(str(v) for v in document.get("revoked_tokens", []))
        except (jwt.PyJWTError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"not a key set: {exc}") from exc
        return cls(keys, revoked, tokens)

    def is_revoked(self, claims: Claims) -> bool:
        return revocation_key(claims.role, claims.subject) in self.revoked or claims.token_id in self.revoked_tokens


class TokenVerifier:
    """Checks tokens against the current `trust` (swapped whole by its refresher or by the issuer itself)."""

    def __init__(self, trust: Trust | None = None, leeway_s: float = DEFAULT_LEEWAY_S) -> None:
        self.trust = trust or Trust()
        self.leeway_s = leeway_s

    def verify(self, token: str | bytes, audience: str) -> Claims:
        """The token's claims, or AuthError (see its reasons); the clock is the system's, with the leeway."""
        trust = self.trust
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError as exc:
            raise AuthError("malformed", "not a JWT") from exc
        if header.get("alg") != ALGORITHM:
            raise AuthError("bad_algorithm", f"only {ALGORITHM} is accepted")
        kid = header.get("kid")
        key = trust.keys.get(kid) if isinstance(kid, str) else None
        if key is None:
            raise AuthError("unknown_key", "no trusted key has this token's kid")
        try:
            fields = jwt.decode(
                token,
                key,
                algorithms=[ALGORITHM],  # pinned: the header's alg never picks the check
                audience=audience,
                leeway=self.leeway_s,
                options={"require": list(REQUIRED_CLAIMS)},
            )
        except jwt.ExpiredSignatureError as exc:
            raise AuthError("expired") from exc
        except jwt.ImmatureSignatureError as exc:
            raise AuthError("not_yet_valid") from exc
        except jwt.InvalidAudienceError as exc:
            raise AuthError("wrong_audience", f"this token is not for {audience}") from exc
        except jwt.InvalidSignatureError as exc:
            raise AuthError("bad_signature") from exc
        except jwt.InvalidAlgorithmError as exc:
            raise AuthError("bad_algorithm") from exc
        except jwt.PyJWTError as exc:
            raise AuthError("malformed", type(exc).__name__) from exc
        claims = _claims(fields)
        if trust.is_revoked(claims):
            raise AuthError("revoked")
        return claims


def _claims(fields: Mapping[str, Any]) -> Claims:
    subject, role, aud, exp, jti, iat = (fields.get(k) for k in ("sub", "role", "aud", "exp", "jti", "iat"))
    if not isinstance(subject, str) or not subject or role not in ROLES or not isinstance(aud, str):
        raise AuthError("malformed", "sub, role or aud (one audience) missing")
    if type(exp) is not int or type(iat) is not int or not isinstance(jti, str):
        raise AuthError("malformed", "exp, iat or jti of the wrong type")
    return Claims(subject, role, aud, exp, jti, iat)


def bearer(value: str | bytes | None) -> str | bytes | None:
    """The token of an `Authorization: Bearer <token>` header's value, or None."""
    if not value:
        return None
    if isinstance(value, bytes):
        scheme, _, token = value.strip().partition(b" ")
        return token.strip() if scheme.lower() == b"bearer" and token.strip() else None
    text_scheme, _, text = value.strip().partition(" ")
    return text.strip() if text_scheme.lower() == "bearer" and text.strip() else None


def authenticate(verifier: TokenVerifier, header: str | bytes | None, audience: str, roles: Collection[str]) -> Claims:
    """Check an Authorization header's value for `audience`: AuthError (missing, ..., forbidden for another role)."""
    token = bearer(header)
    if token is None:
        raise AuthError("missing", "Authorization: Bearer <token> required")
    claims = verifier.verify(token, audience)
    if claims.role not in roles:
        raise AuthError("forbidden", f"a {claims.role} credential cannot call this")
    return claims


def may_act_for(claims: Claims | None, device_id: str | None) -> bool:
    """Whether the caller may write for `device_id` (None: a verifier's or request record): a service may; a
    device only for itself; anyone when authentication is off (claims None)."""
    if claims is None or claims.role in ("service", "operator"):
        return True
    return (
        claims.role == "device"
        and device_id is not None
        and hmac.compare_digest(device_id.encode(), claims.subject.encode())
    )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


class RedactCredentials(logging.Filter):
    """Blanks credentials in a log record: uvicorn's and websockets' servers, at debug, log every handshake
    header, Authorization included."""

    PATTERNS = (re.compile(r"(?i)(authorization\W{0,4})[^\r\n'\"]+"), re.compile(r"(?i)(bearer\s+)[^\s'\",;)]+"))

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        redacted = message
        for pattern in self.PATTERNS:
            redacted = pattern.sub(r"\1[redacted]", redacted)
        if redacted != message:
            record.msg, record.args = redacted, ()
        return True


def redact_credentials(logger_names: Sequence[str]) -> None:
    """Put RedactCredentials on each named logger, once. A logger's filter sees only the records logged on it
    (not its children's), so name the exact loggers the servers use."""
    for name in logger_names:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactCredentials) for f in logger.filters):
            logger.addFilter(RedactCredentials())


def warn_if_open(service: str, authenticated: bool, host: str, env_var: str) -> None:
    if not authenticated and not is_loopback(host):
        log.warning(
            "%s on %s accepts unauthenticated calls from anyone who can reach it: set %s (tophat serve "
            "--auth does) to require signed credentials",
            service,
            host,
            env_var,
        )


class RequireToken:
    """ASGI middleware: a request to a guarded path needs a valid token for `audience` of one of `roles`, else
    401 (no, bad, expired, revoked credential, or one for another audience) or 403 (another role); the claims
    go into the scope (`claims_of`). `guarded(method, path)` picks the paths; OPEN_PATHS are never guarded.
    The body is not read before the check."""

    def __init__(
        self,
        app: Any,
        *,
        verifier: TokenVerifier,
        audience: str,
        roles: Collection[str],
        guarded: Callable[[str, str], bool] = lambda method, path: True,
    ) -> None:
        self.app, self.verifier, self.audience = app, verifier, audience
        self.roles, self.guarded = frozenset(roles), guarded

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if (
            scope["type"] != "http"
            or scope["path"] in OPEN_PATHS
            or not self.guarded(scope.get("method", "GET"), scope["path"])
        ):
            await self.app(scope, receive, send)
            return
        try:
            header = authorization_header(scope.get("headers") or [])
            claims = authenticate(self.verifier, header, self.audience, self.roles)
        except AuthError as exc:
            client = (scope.get("client") or ("?",))[0]
            log.info("refused %s %s from %s: %s", scope.get("method"), scope["path"], client, exc.reason)
            await send_refusal(send, exc)
            return
        scope[SCOPE_KEY] = claims
        await self.app(scope, receive, send)


async def send_refusal(send: Callable, exc: AuthError) -> None:
    """An ASGI JSON answer for a refused credential: 401 with WWW-Authenticate, or 403."""
    body = json.dumps(
        {
            "error": {
                "code": "unauthorized" if exc.status == 401 else "forbidden",
                "reason": exc.reason,
                "message": str(exc),
            }
        }
    ).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if exc.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def authorization_header(headers: Sequence[tuple[bytes, bytes]]) -> bytes | None:
    """The first Authorization header's value among ASGI `headers`, or None."""
    for name, value in headers:
        if name.lower() == b"authorization":
            return value
    return None


def bearer_token(headers: Sequence[tuple[bytes, bytes]]) -> bytes | None:
    """The credential of ASGI `headers`' `Authorization: Bearer <token>`, or None when there is none
    (the one parser for both the mesh's signed tokens and the streamer's API keys)."""
    token = bearer(authorization_header(headers))
    return token if isinstance(token, bytes) else None


def claims_of(scope: Mapping[str, Any]) -> Claims | None:
    """The claims RequireToken admitted this request with; None when authentication is off."""
    return scope.get(SCOPE_KEY)


def install(
    app: Any,
    verifier: TokenVerifier | None,
    audience: str,
    roles: Collection[str],
    guarded: Callable[[str, str], bool] = lambda method, path: True,
) -> None:
    """Guard a FastAPI app when the mesh runs authenticated (a verifier); with none, leave it open."""
    if verifier is not None:
        app.add_middleware(RequireToken, verifier=verifier, audience=audience, roles=roles, guarded=guarded)
