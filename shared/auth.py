"""Every hop authenticated: signed, expiring credentials for devices and services.

A token is `base64url(payload).base64url(mac)`: payload the compact JSON {"sub", "exp", "role"}, mac
HMAC-SHA256 over the payload's base64url text with the mesh secret (as a JWT's HS256, minus its header:
one algorithm, so there is none to downgrade to). `issue` and `verify` are pure (the caller gives `now`);
a refusal is a typed `AuthError` whose `reason` says why. Tokens are compared in constant time and never
logged, not even in part.

Roles: "device" (a device agent, `sub` = its device id) and "service" (verifier, streamer, planner).
Where each is checked: the verifier's WebSocket handshake (device), a device agent's /generate and /info
(service), the state monitor's POSTs (a device only for its own device id), the chunk planner (a device only
asking for itself). Probes (/healthz, /readyz, /metrics) stay open. With no secret configured everything is
open, as before, with a warning when the service faces a network.

Services are given the mesh secret and mint their own short-lived tokens (`BearerAuth`, re-minted at half
life). Simple to run, and the price is that whoever holds the secret can speak as anyone: a device agent may
instead be given only its own token (TOPHAT_DEVICE_AUTH_TOKEN), which cannot be stretched to another device,
but then it cannot check its callers itself.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
import json
import logging
import re
import time
from collections.abc import Callable, Collection, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

log = logging.getLogger(__name__)

ROLES = ("device", "service")
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})  # probes and scrapes stay open
DEFAULT_TTL_S = 600  # a minted token's life; re-minted at half of it
SCOPE_KEY = "tophat.auth.claims"  # where the middleware leaves a request's claims in its ASGI scope


class AuthError(Exception):
    """A credential refused. `reason`: missing | malformed | bad_signature | expired | forbidden."""

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
    expires_at: int  # unix seconds


def _b64encode(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def _b64decode(text: str) -> bytes:
    """Strict: a text that is not the canonical encoding of its bytes is refused (no unused bits, no padding)."""
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError) as exc:
        raise AuthError("malformed", "not base64url") from exc
    if _b64encode(raw) != text:
        raise AuthError("malformed", "not canonical base64url")
    return raw


def _mac(secret: str | bytes, signed: str) -> bytes:
    key = secret.encode() if isinstance(secret, str) else secret
    return hmac.new(key, signed.encode("ascii"), hashlib.sha256).digest()


def issue(secret: str | bytes, subject: str, role: str, ttl_s: float, now: float) -> str:
    if not secret:
        raise ValueError("an empty secret signs nothing")
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    if not subject or ttl_s <= 0:
        raise ValueError("a token needs a subject and a positive ttl")
    payload = json.dumps(
        {"sub": subject, "exp": int(now + ttl_s), "role": role}, separators=(",", ":"), sort_keys=True
    ).encode()
    signed = _b64encode(payload)
    return f"{signed}.{_b64encode(_mac(secret, signed))}"


def verify(secret: str | bytes, token: str | bytes, now: float) -> Claims:
    """The token's claims, or AuthError: malformed, bad_signature (any change, or another secret), expired."""
    if isinstance(token, bytes):
        try:
            token = token.decode("ascii")
        except UnicodeDecodeError as exc:
            raise AuthError("malformed", "not ASCII") from exc
    signed, dot, mac_text = token.partition(".")
    if not dot or not signed or not mac_text or "." in mac_text:
        raise AuthError("malformed", "expected payload.mac")
    mac = _b64decode(mac_text)
    if len(mac) != hashlib.sha256().digest_size:
        raise AuthError("malformed", "the mac is not HMAC-SHA256's length")
    payload = _b64decode(signed)
    if not hmac.compare_digest(mac, _mac(secret, signed)):  # before the payload is trusted for anything
        raise AuthError("bad_signature")
    try:
        fields = json.loads(payload)
    except (UnicodeDecodeError, ValueError) as exc:
        raise AuthError("malformed", "payload is not JSON") from exc
    if not isinstance(fields, dict):
        raise AuthError("malformed", "payload is not an object")
    subject, role, expires_at = fields.get("sub"), fields.get("role"), fields.get("exp")
    if not isinstance(subject, str) or not subject or role not in ROLES or type(expires_at) is not int:
        raise AuthError("malformed", "payload lacks sub, role or exp")
    if now >= expires_at:
        raise AuthError("expired")
    return Claims(subject, role, expires_at)


def bearer(value: str | bytes | None) -> str | bytes | None:
    """The token of an `Authorization: Bearer <token>` header's value, or None."""
    if not value:
        return None
    if isinstance(value, bytes):
        scheme, _, token = value.strip().partition(b" ")
        return token.strip() if scheme.lower() == b"bearer" and token.strip() else None
    text_scheme, _, text = value.strip().partition(" ")
    return text.strip() if text_scheme.lower() == "bearer" and text.strip() else None


def authenticate(secret: str, header: str | bytes | None, roles: Collection[str], now: float) -> Claims:
    """Check an Authorization header's value: AuthError (missing, malformed, ..., forbidden for another role)."""
    token = bearer(header)
    if token is None:
        raise AuthError("missing", "Authorization: Bearer <token> required")
    claims = verify(secret, token, now)
    if claims.role not in roles:
        raise AuthError("forbidden", f"a {claims.role} credential cannot call this")
    return claims


def may_act_for(claims: Claims | None, device_id: str | None) -> bool:
    """Whether the caller may write for `device_id` (None: a verifier's or request record): a service may; a
    device only for itself; anyone when authentication is off (claims None)."""
    if claims is None or claims.role == "service":
        return True
    return device_id is not None and hmac.compare_digest(device_id.encode(), claims.subject.encode())


class BearerAuth(httpx.Auth):
    """httpx auth: `Authorization: Bearer` on every request, a fresh token minted before the last one expires
    (or a fixed token given from outside)."""

    def __init__(
        self,
        secret: str = "",
        subject: str = "",
        role: str = "service",
        ttl_s: float = DEFAULT_TTL_S,
        token: str = "",
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not (secret or token):
            raise ValueError("BearerAuth needs a secret to mint with or a token")
        self._secret, self.subject, self.role, self.ttl_s = secret, subject, role, ttl_s
        self._fixed, self._clock = token, clock
        self._token, self._renew_at = "", 0.0

    def __repr__(self) -> str:  # no secret, no token
        return f"BearerAuth(subject={self.subject!r}, role={self.role!r})"

    def token(self) -> str:
        if self._fixed:
            return self._fixed
        now = self._clock()
        if now >= self._renew_at:
            self._token = issue(self._secret, self.subject, self.role, self.ttl_s, now)
            self._renew_at = now + self.ttl_s / 2
        return self._token

    def header(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token()}"}

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        request.headers["Authorization"] = f"Bearer {self.token()}"
        yield request


def client_auth(secret: str, subject: str, role: str, token: str = "") -> BearerAuth | None:
    """What a service's outgoing clients send: None (nothing) when the mesh runs open."""
    return BearerAuth(secret, subject, role, token=token) if (secret or token) else None


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


def warn_if_open(service: str, secret: str, host: str, env_var: str) -> None:
    if not secret and not is_loopback(host):
        log.warning(
            "%s on %s accepts unauthenticated calls from anyone who can reach it: set %s (tophat up "
            "--auth does) to require signed credentials",
            service,
            host,
            env_var,
        )


class RequireToken:
    """ASGI middleware: a request to a guarded path needs a valid token of one of `roles`, else 401 (no, bad,
    expired credential) or 403 (another role); the claims go into the scope (`claims_of`). `guarded(method,
    path)` picks the paths; OPEN_PATHS are never guarded. The body is not read before the check."""

    def __init__(
        self,
        app: Any,
        *,
        secret: str,
        roles: Collection[str],
        guarded: Callable[[str, str], bool] = lambda method, path: True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.app, self._secret, self.roles, self.guarded, self.clock = app, secret, frozenset(roles), guarded, clock

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
            claims = authenticate(self._secret, header, self.roles, self.clock())
        except AuthError as exc:
            client = (scope.get("client") or ("?",))[0]
            log.info("refused %s %s from %s: %s", scope.get("method"), scope["path"], client, exc.reason)
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
            return
        scope[SCOPE_KEY] = claims
        await self.app(scope, receive, send)


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
    app: Any, secret: str, roles: Collection[str], guarded: Callable[[str, str], bool] = lambda method, path: True
) -> None:
    """Guard a FastAPI app when a mesh secret is configured; with none, leave it open."""
    if secret:
        app.add_middleware(RequireToken, secret=secret, roles=roles, guarded=guarded)
