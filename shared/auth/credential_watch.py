"""Credentials keep counting after the handshake: an open connection ends when its credential is revoked or expires.

A service that checks a token once, when a long-lived connection opens (the verifier's WebSocket handshake),
admits the connection's claims here (`CredentialWatch.admit`). `run`, a task its owner starts and cancels,
checks every admitted credential every `interval_s` against the verifier's current trust (the issuer's
revocation list, swapped in by shared/auth/client.py's `TrustRefresher` every `auth_refresh_s`) and the clock
(its `exp`, with the verifier's leeway, as the handshake checked it), and closes a connection that fails with
its typed reason ("revoked" or "expired", shared/auth/verify.py's `AuthError` reasons) through the owner's `close`.
A revocation therefore reaches an open connection within auth_refresh_s + interval_s. A connection renewed
with a fresh token for the same subject (`renew`, the verifier's Reauthenticate) is held to the new claims.

Each close runs as an owned task, bounded by `close_timeout_s`; `run` cancels the ones still running when it
is cancelled. Nothing here knows WebSockets: `close(connection, reason)` is the owner's.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

from shared.auth.verify import Claims, TokenVerifier

log = logging.getLogger(__name__)

CHECK_EVERY_S = 0.25  # how often each open connection's credential is checked
CLOSE_TIMEOUT_S = 5.0  # one close (a WebSocket close handshake) at most

Closer = Callable[[Any, str], Awaitable[None]]  # (connection, reason) -> closed


def refusal(verifier: TokenVerifier, claims: Claims, now: float) -> str | None:
    """Why `claims`, admitted earlier, no longer hold at `now` (unix seconds): "revoked", "expired", or None."""
    if verifier.trust.is_revoked(claims):
        return "revoked"
    if now > claims.expires_at + verifier.leeway_s:
        return "expired"
    return None


class CredentialWatch:
    def __init__(
        self,
        verifier: TokenVerifier,
        close: Closer,
        *,
        interval_s: float = CHECK_EVERY_S,
        close_timeout_s: float = CLOSE_TIMEOUT_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.verifier, self.close, self.clock = verifier, close, clock
        self.interval_s, self.close_timeout_s = interval_s, close_timeout_s
        # connection -> the claims it was admitted with; weak: a connection that is gone is forgotten with it
        self._open: weakref.WeakKeyDictionary[Any, Claims] = weakref.WeakKeyDictionary()
        self._closing: set[asyncio.Task[None]] = set()

    def admit(self, connection: Any, claims: Claims) -> None:
        self._open[connection] = claims

    def renew(self, connection: Any, claims: Claims) -> bool:
        """Hold an admitted connection to new `claims` (a fresh token for the same subject, checked by the
        caller); False when it is no longer admitted (its credential failed and it is being closed)."""
        if connection not in self._open:
            return False
        self.admit(connection, claims)
        return True

    def forget(self, connection: Any) -> None:
        self._open.pop(connection, None)

    def __len__(self) -> int:
        return len(self._open)

    def sweep(self) -> list[tuple[Any, str]]:
        """Close (as owned tasks) every connection whose credential no longer holds: [(connection, reason)]."""
        now = self.clock()
        ended = []
        for connection, claims in list(self._open.items()):
            reason = refusal(self.verifier, claims, now)
            if reason is None:
                continue
            self._open.pop(connection, None)
            log.info("closing %s's connection: its credential is %s", claims.subject, reason)
            task = asyncio.create_task(self._close(connection, reason), name=f"credential-close-{claims.subject}")
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
            ended.append((connection, reason))
        return ended

    async def _close(self, connection: Any, reason: str) -> None:
        try:
            async with asyncio.timeout(self.close_timeout_s):
                await self.close(connection, reason)
        except TimeoutError:
            log.warning("closing a connection whose credential is %s took over %.0fs", reason, self.close_timeout_s)
        except OSError as exc:  # the peer went first: nothing left to close
            log.debug("closing a connection whose credential is %s: %s", reason, exc)

    async def run(self) -> None:
        """The owner's task: sweep every `interval_s` until cancelled, then cancel the closes still running."""
        try:
            while True:
                await asyncio.sleep(self.interval_s)
                self.sweep()
        finally:
            for task in list(self._closing):
                task.cancel()
            if self._closing:
                await asyncio.gather(*self._closing, return_exceptions=True)
