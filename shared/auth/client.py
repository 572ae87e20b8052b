"""The callers' side of the mesh's credentials: getting audience-bound tokens, and trusting the issuer's keys.

`TokenBroker` holds a caller's credential for the issuer (the state monitor): a service's, given at deploy
time, or a device's BOOTSTRAP token (its own id's, picked by `own_bootstrap` when the setting holds one per
device), which it exchanges once for its own device credential by enrolling
(`POST /credentials/enroll`: its device id and URL). With that credential it asks the issuer for a token per
audience (`POST /credentials/token`), each cached until half its life, and renews the credential itself the
same way before it expires; a device whose credential was refused (revoked, expired through a long outage,
signed by a retired key) enrolls again, which the issuer refuses for a revoked device. `BrokerAuth` puts the
right token on each httpx request: one fixed audience, or, for the streamer's calls to device agents, the
audience of whichever device the request goes to (`for_device_urls`: the issuer says which enrolled device
holds that URL, and the token is for that device only).

`TrustRefresher` keeps a `TokenVerifier`'s trust (public keys and revocation list) fresh from the issuer's open
`/credentials/jwks`, every `interval_s`: how long a revocation takes to reach a verifying service.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
import jwt

from shared.auth.verify import ISSUER, TokenVerifier, Trust
from shared.device_registry import url_origin
from shared.service_settings import ServiceSettings

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_TRUST_REFRESH_S = 1.0
JWKS_PATH = "/credentials/jwks"


class CredentialUnavailable(httpx.RequestError):
    """No token could be had: the issuer unreachable, or it refused this caller (an httpx error, so the callers'
    handling of an unreachable peer applies)."""


@dataclass(frozen=True)
class Enrollment:
    """What a device enrolls with its bootstrap token: its id and the URL the streamer reaches it at."""

    device_id: str
    url: str
    max_sessions: int | None = None


def unverified_claims(token: str) -> dict[str, Any]:
    """A token's claims read without checking them: only to learn when one's own credential expires and what
    role it has (the issuer, which signed it, checks it on every use)."""
    try:
        claims = jwt.decode(token, options={"verify_signature": False})
    except jwt.PyJWTError as exc:
        raise ValueError("the configured credential is not a JWT") from exc
    if not isinstance(claims, dict):
        raise ValueError("the configured credential is not a JWT")
    return claims


class TokenBroker:
    def __init__(
        self,
        issuer_url: str,
        credential: str,
        *,
        enrollment: Enrollment | None = None,
        verify: ssl.SSLContext | bool = True,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        transport: httpx.AsyncBaseTransport | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        claims = unverified_claims(credential)
        self.subject, self.role = str(claims.get("sub", "")), str(claims.get("role", ""))
        if self.role == "bootstrap" and enrollment is None:
            raise ValueError("a bootstrap credential needs an enrollment (device id and URL)")
        self._bootstrap = credential if self.role == "bootstrap" else ""
        self._credential, self._renew_at = ("", 0.0) if self._bootstrap else (credential, _half_life(claims))
        self.enrollment = enrollment
        self._http = httpx.AsyncClient(
            base_url=issuer_url.rstrip("/"), timeout=timeout_s, verify=verify, transport=transport, trust_env=False
        )
        self._clock = clock
        self._tokens: dict[str, tuple[str, float]] = {}  # audience -> (token, renew at)
        self._device_audiences: dict[str, str] = {}  # a device URL's origin -> its audience
        self._lock = asyncio.Lock()

    def __repr__(self) -> str:  # never a token
        return f"TokenBroker(subject={self.subject!r}, role={self.role!r})"

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _post(self, path: str, token: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            response = await self._http.post(path, json=body, headers={"Authorization": f"Bearer {token}"})
        except httpx.HTTPError as exc:
            raise CredentialUnavailable(f"the issuer is unreachable: {exc}") from exc
        if response.status_code != 200:
            raise CredentialUnavailable(f"the issuer refused {path}: HTTP {response.status_code} {response.text[:200]}")
        try:
            answer = response.json()
            if not isinstance(answer.get("token"), str):
                raise ValueError("no token")
        except (ValueError, AttributeError) as exc:
            raise CredentialUnavailable(f"the issuer's answer to {path} is not a token") from exc
        return dict(answer)

    async def credential(self) -> str:
        """This caller's credential for the issuer: enrolled (a device's first), renewed at half its life."""
        if self._credential and self._clock() < self._renew_at:
            return self._credential
        if self._credential:
            try:
                self._store(await self._post("/credentials/token", self._credential, {"audience": ISSUER}))
                return self._credential
            except CredentialUnavailable as exc:
                if not self._bootstrap:
                    raise
                log.warning("renewing the device credential failed (%s); enrolling again", exc)
        assert self.enrollment is not None  # checked at construction for a bootstrap
        body = {
            "device_id": self.enrollment.device_id,
            "url": self.enrollment.url,
            "max_sessions": self.enrollment.max_sessions,
        }
        self._store(await self._post("/credentials/enroll", self._bootstrap, body))
        log.info("enrolled as device %s", self.enrollment.device_id)
        return self._credential

    def _store(self, answer: dict[str, Any]) -> None:
        self._credential = answer["token"]
        self._renew_at = _half_life(unverified_claims(self._credential))
        self._tokens.clear()

    async def token(self, audience: str) -> str:
        """A token for `audience`, from the cache until half its life has passed."""
        cached = self._tokens.get(audience)
        if cached is not None and self._clock() < cached[1]:
            return cached[0]
        async with self._lock:
            credential = await self.credential()
            if audience == ISSUER:
                return credential
            answer = await self._post("/credentials/token", credential, {"audience": audience})
            self._tokens[audience] = (answer["token"], _half_life(unverified_claims(answer["token"])))
            return str(answer["token"])

    async def device_token(self, url: str) -> str:
        """A token for whichever enrolled device agent serves at `url` (the issuer's answer names it)."""
        origin = url_origin(url)
        audience = self._device_audiences.get(origin)
        if audience is not None:
            return await self.token(audience)
        async with self._lock:
            credential = await self.credential()
            answer = await self._post("/credentials/token", credential, {"device_url": origin})
        audience = str(answer.get("audience", ""))
        self._device_audiences[origin] = audience
        self._tokens[audience] = (answer["token"], _half_life(unverified_claims(answer["token"])))
        return str(answer["token"])

    def forget_device(self, url: str) -> None:
        """Ask the issuer again next time (the URL may now be another device's)."""
        self._device_audiences.pop(url_origin(url), None)


def _half_life(claims: dict[str, Any]) -> float:
    issued, expires = float(claims.get("iat", 0)), float(claims.get("exp", 0))
    return issued + (expires - issued) / 2


class BrokerAuth(httpx.Auth):
    """httpx auth: a token from `broker` for the audience of each request: `audience` when one is given; else
    the audience its URL's origin maps to in `audiences`; else, with `devices`, the audience of the device
    agent at that URL (the streamer's calls); else no token (an open endpoint). A token that cannot be had
    fails the request as an httpx error (CredentialUnavailable)."""

    def __init__(
        self,
        broker: TokenBroker,
        audience: str = "",
        *,
        audiences: Mapping[str, str] | None = None,
        devices: bool = False,
    ) -> None:
        self.broker, self.audience, self.devices = broker, audience, devices
        self.audiences = {url_origin(url): aud for url, aud in (audiences or {}).items() if url}

    def __repr__(self) -> str:
        return f"BrokerAuth({self.broker!r}, audience={self.audience!r})"

    async def token(self) -> str:
        """The token for this auth's one fixed audience (new once the last one has lived half its life)."""
        assert self.audience, "token() and headers() are for one fixed audience"
        return await self.broker.token(self.audience)

    async def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {await self.token()}"}

    async def _token(self, url: str) -> str | None:
        audience = self.audience or self.audiences.get(url_origin(url))
        if audience:
            return await self.broker.token(audience)
        return await self.broker.device_token(url) if self.devices else None

    async def async_auth_flow(self, request: httpx.Request) -> AsyncGenerator[httpx.Request, httpx.Response]:
        try:
            token = await self._token(str(request.url))
        except CredentialUnavailable as exc:
            raise CredentialUnavailable(str(exc), request=request) from exc
        if token is not None:
            request.headers["Authorization"] = f"Bearer {token}"
        response = yield request
        if response.status_code == 401 and self.devices:
            self.broker.forget_device(str(request.url))  # the URL may have moved to another device


def broker_for(
    settings: ServiceSettings, enrollment: Enrollment | None = None, verify: ssl.SSLContext | bool = True
) -> TokenBroker | None:
    """A service's broker when the mesh is authenticated (None when open); ValueError without a credential."""
    if not settings.authenticated:
        return None
    if not settings.auth_credential:
        raise ValueError("auth_issuer_url is set but auth_credential is empty: this service has no credential")
    credential = settings.auth_credential
    if enrollment is not None:
        credential = own_bootstrap(credential, enrollment.device_id)
    return TokenBroker(settings.auth_issuer_url, credential, enrollment=enrollment, verify=verify)


def own_bootstrap(credential: str, device_id: str) -> str:
    """A device's own token among several (space- or comma-separated: `tophat mesh-secrets --device` writes one
    bootstrap token per device id into the file every device mounts): the one whose subject is `device_id`."""
    tokens = credential.replace(",", " ").split()
    if len(tokens) <= 1:
        return credential.strip()
    for token in tokens:
        if unverified_claims(token).get("sub") == device_id:
            return token
    raise ValueError(f"none of the {len(tokens)} bootstrap tokens configured is for device {device_id!r}")


def trust_for(
    settings: ServiceSettings, verify: ssl.SSLContext | bool = True
) -> tuple[TokenVerifier, TrustRefresher] | tuple[None, None]:
    """A verifying service's verifier and the refresher its owner runs (None, None when the mesh is open)."""
    if not settings.authenticated:
        return None, None
    verifier = TokenVerifier(leeway_s=settings.auth_leeway_s)
    refresher = TrustRefresher(verifier, settings.auth_issuer_url, interval_s=settings.auth_refresh_s, verify=verify)
    return verifier, refresher


class TrustRefresher:
    """Keeps `verifier.trust` fresh from the issuer's key set; `run` is the loop its owner starts and cancels."""

    def __init__(
        self,
        verifier: TokenVerifier,
        issuer_url: str,
        *,
        interval_s: float = DEFAULT_TRUST_REFRESH_S,
        verify: ssl.SSLContext | bool = True,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.verifier, self.interval_s = verifier, interval_s
        self._url = issuer_url.rstrip("/") + JWKS_PATH
        self._http = httpx.AsyncClient(timeout=timeout_s, verify=verify, trust_env=False)
        self._failing = False
        self.refreshed_at: float | None = None

    async def refresh(self) -> bool:
        try:
            response = await self._http.get(self._url)
            response.raise_for_status()
            trust = Trust.from_document(response.json())
        except (httpx.HTTPError, ValueError) as exc:
            if not self._failing:
                log.warning("cannot read the issuer's keys at %s: %s (keeping the last ones)", self._url, exc)
            self._failing = True
            return False
        if self._failing:
            log.info("reading the issuer's keys at %s again", self._url)
        self._failing = False
        self.verifier.trust = trust
        self.refreshed_at = time.monotonic()
        return True

    async def run(self) -> None:
        try:
            while True:
                await self.refresh()
                await asyncio.sleep(self.interval_s)
        finally:
            await self._http.aclose()
