"""The public endpoint's door: API keys, a request rate per credential, and a body size limit.

`Gate` is a pure ASGI middleware, so it answers before FastAPI parses anything:
  * API keys as vLLM takes them: with keys configured, every route but the probes
    (/healthz, /readyz, /metrics) and the web console's page and assets (console.py: no data in them)
    needs `Authorization: Bearer <key>`, the chat WebSocket on
    its handshake; else 401 shaped as OpenAI's (`invalid_api_key`). Keys are compared in
    constant time and never logged, not even in part.
  * A token bucket per credential (shared/net/rate_limit.py): the key, or the client address when
    the endpoint is open (an IPv6 client's /64); past it, 429 with `Retry-After` and
    `rate_limit_exceeded`. A chat WebSocket draws on the same bucket for its handshake and then for
    every message it sends: a message past the limit reaches the app marked with its refusal
    (`REFUSED`), so the app answers it with an error frame instead of serving it.
  * The body is read here, at most `max_body_bytes` of it, before any parser sees it: a
    Content-Length over the limit is refused without keeping a byte, a chunked body once it
    passes the limit (413); what fits is replayed to the app.
A refusal is sent at once; the rest of a refused body is then read and dropped for at most
LINGER_S (as nginx's lingering close does), never kept: a client writes its whole body before
it reads, and a socket closed on unread data is reset, which would lose the answer.
A refused WebSocket handshake gets the same HTTP answer (the ASGI denial response) where the
server offers it, else a close with 1008 (policy violation).
The server's own debug log prints a WebSocket handshake's headers: `RedactCredentials` (shared/auth/verify.py)
blanks them.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Sequence
from typing import Any

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.token_streamer import openai_format as of
from services.token_streamer.console import is_public
from shared.auth.verify import OPEN_PATHS, bearer_token, is_loopback, redact_credentials
from shared.net.rate_limit import RateLimiter, address_key, retry_after_s

log = logging.getLogger(__name__)

BODY_READ_TIMEOUT_S = 30.0  # a client that takes longer to send a body of at most max_body_bytes is gone
LINGER_S = 5.0  # how long the rest of a refused body is read and dropped before the connection closes
NO_KEY = (
    "You didn't provide an API key. You need to provide your API key in an Authorization header "
    "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
)
BAD_KEY = "Incorrect API key provided."
REFUSED = "tophat.refusal"  # the key under which a WebSocket message past the rate limit carries its Refusal


class Refusal(Exception):
    """An answer the gate gives instead of the app's."""

    def __init__(self, status: int, message: str, code: str, type_: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.type_ = status, message, code, type_
        self.headers = headers or {}
        self.body_done = False  # the request's body has been read to its end (nothing to drop)


def content_length(headers: Sequence[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server's parser has already refused a malformed one
    return None


class Gate:
    """ASGI middleware: keys, rate, body size, in that order (an unauthenticated body is never read)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        api_keys: Sequence[str],
        limiter: RateLimiter,
        max_body_bytes: int,
        body_timeout_s: float = BODY_READ_TIMEOUT_S,
    ) -> None:
        self.app = app
        self._keys = [key.encode() for key in api_keys]
        self.limiter = limiter
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in OPEN_PATHS or is_public(scope["path"]):
            # probes, scrapes and the console's page and assets (no data in them): keyless
            await self.app(scope, receive, send)
            return
        try:
            credential = self._admit(scope)
            if scope["type"] == "http":
                receive = await self._read_body(scope, receive)
            else:
                receive = self._metered(credential, receive)
        except Refusal as refusal:
            client = (scope.get("client") or ("?",))[0]
            log.info(
                "refused %s %s from %s: %d %s",
                scope.get("method", "WEBSOCKET"),
                scope["path"],
                client,
                refusal.status,
                refusal.code,
            )
            await self._refuse(scope, receive, send, refusal)
            return
        await self.app(scope, receive, send)

    def _credential(self, scope: Scope) -> str:
        """Which bucket the request draws on: its key's index (no secret kept), else its address."""
        if not self._keys:
            return "addr:" + address_key(str((scope.get("client") or ("unknown",))[0]))
        token = bearer_token(scope.get("headers") or [])
        if token is None:
            raise Refusal(401, NO_KEY, "invalid_api_key", "invalid_request_error", {"WWW-Authenticate": "Bearer"})
        match = -1
        for index, key in enumerate(self._keys):  # every key compared, in constant time each
            if hmac.compare_digest(token, key):
                match = index
        if match < 0:
            raise Refusal(401, BAD_KEY, "invalid_api_key", "invalid_request_error", {"WWW-Authenticate": "Bearer"})
        return f"key:{match}"

    def _admit(self, scope: Scope) -> str:
        """The request's credential, one token taken from its bucket; Refusal when it has none left."""
        credential = self._credential(scope)
        wait_s = self.limiter.acquire(credential)
        if wait_s > 0:
            raise self._rate_refusal(wait_s)
        return credential

    def _rate_refusal(self, wait_s: float) -> Refusal:
        seconds = retry_after_s(wait_s)
        return Refusal(
            429,
            f"Rate limit reached: {self.limiter.rate_per_s:g} requests/s, burst "
            f"{self.limiter.burst}. Try again in {seconds} s.",
            "rate_limit_exceeded",
            of.error_type(429),
            {"Retry-After": str(seconds)},
        )

    def _metered(self, credential: str, receive: Receive) -> Receive:
        """A WebSocket's `receive` where every message the client sends takes a token from its credential's
        bucket, when it arrives (so messages queued behind a long answer count too)."""

        async def metered() -> Message:
            message = await receive()
            if message["type"] == "websocket.receive":
                wait_s = self.limiter.acquire(credential)
                if wait_s > 0:  # its text is not kept: it will not be served
                    return {"type": "websocket.receive", REFUSED: self._rate_refusal(wait_s)}
            return message

        return metered

    def _too_large(self) -> Refusal:
        return Refusal(
            413,
            f"Request body is larger than {self.max_body_bytes} bytes.",
            "request_too_large",
            "invalid_request_error",
            {"Connection": "close"},
        )

    async def _read_body(self, scope: Scope, receive: Receive) -> Receive:
        """Read the body here, refusing it past the limit; return a `receive` that replays it."""
        length = content_length(scope.get("headers") or [])
        if length is not None and length > self.max_body_bytes:
            raise self._too_large()  # not one byte read
        messages: list[Message] = []
        size = 0
        try:
            async with asyncio.timeout(self.body_timeout_s):
                while True:
                    message = await receive()
                    messages.append(message)
                    if message["type"] != "http.request":
                        break  # http.disconnect: the app sees it and gives up
                    size += len(message.get("body", b""))
                    if size > self.max_body_bytes:
                        refusal = self._too_large()  # nothing more is kept
                        refusal.body_done = not message.get("more_body", False)
                        raise refusal
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            refusal = Refusal(
                408,
                f"Request body not received within {self.body_timeout_s:g} s.",
                "request_timeout",
                "invalid_request_error",
                {"Connection": "close"},
            )
            refusal.body_done = True  # too slow to be worth waiting for
            raise refusal from None
        return _replay(messages, receive)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, refusal: Refusal) -> None:
        response = JSONResponse(
            of.error_body(refusal.message, refusal.type_, refusal.code), refusal.status, headers=refusal.headers
        )
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": response.status_code, "headers": response.raw_headers})
            await send({"type": "http.response.body", "body": response.body, "more_body": True})
            if not refusal.body_done:
                await _drop_rest_of_body(receive)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        try:
            async with asyncio.timeout(self.body_timeout_s):
                if (await receive())["type"] != "websocket.connect":
                    return  # the client left during the handshake
                if "websocket.http.response" in scope.get("extensions", {}):
                    await response(scope, receive, send)  # sent as websocket.http.response.*
                else:
                    await send({"type": "websocket.close", "code": 1008, "reason": refusal.code})
        except (TimeoutError, OSError) as exc:
            log.debug("refusing a websocket handshake: %r", exc)


async def _drop_rest_of_body(receive: Receive) -> None:
    """Read what is left of a refused body, keeping none of it, for at most LINGER_S."""
    dropped = 0
    try:
        async with asyncio.timeout(LINGER_S):
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return
                dropped += len(message.get("body", b""))
                if not message.get("more_body", False):
                    return
    except TimeoutError:
        log.debug("refused body still arriving after %.0f s (%d bytes dropped); closing", LINGER_S, dropped)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    pending = list(messages)

    async def replay() -> Message:
        return pending.pop(0) if pending else await receive()  # then the live channel: disconnects

    return replay


SERVER_LOGGERS = ("uvicorn.error", "uvicorn.access", "websockets.server")


def install(app: Any, settings: Any) -> None:
    """Put the gate in front of the streamer's app from its settings; warn when an open endpoint faces a network."""
    keys = settings.api_key_list
    if not keys and not is_loopback(settings.host):
        log.warning(
            "the OpenAI endpoint on %s is open to anyone who can reach it: set TOPHAT_STREAMER_API_KEY "
            "(tophat serve --api-key) to require Authorization: Bearer",
            settings.host,
        )
    redact_credentials(SERVER_LOGGERS)
    limiter = RateLimiter(settings.rate_limit_rps, settings.rate_limit_burst)
    app.add_middleware(Gate, api_keys=keys, limiter=limiter, max_body_bytes=settings.max_body_bytes)
