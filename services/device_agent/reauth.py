"""Keeping an open verifier connection's credential fresh: the device side of the wire's Reauthenticate.

The verifier holds an open connection to the token it connected with and closes it (1008) once that token
expires (shared/auth/credential_watch.py). Access tokens live minutes, so a connection that carries requests for
longer sends a fresh one on itself: `keep_fresh`, an owned task per connection (cloud_connection.py starts it
as it connects and cancels it as the connection ends), waits until the token in force has lived half its life
(the broker renews its cached tokens at half-life too, so the one it then gives is new), sends
`Reauthenticate(fresh token)`, and goes on with the new token. Getting a token and sending it are each
bounded by `timeout_s`; a failure is retried within the time the token in force has left.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from websockets.exceptions import ConnectionClosed

from shared.auth.client import CredentialUnavailable, unverified_claims
from shared.wire import schema as wire

log = logging.getLogger("services.device_agent.cloud")

RETRY_MIN_S = 0.1  # a failed renewal is tried again after at least this long...
RETRY_MAX_S = 5.0  # ...and at most this long (sooner when the token in force has little life left)

FreshToken = Callable[[], Awaitable[str]]  # a token for the verifier, new once the last one is half-way through
SendFrame = Callable[[bytes], Awaitable[None]]  # one frame up the connection


def renew_at(token: str) -> tuple[float, float]:
    """(when `token` has lived half its life, when it expires), unix seconds, from its own (unverified) claims."""
    claims = unverified_claims(token)
    issued, expires = float(claims.get("iat", 0)), float(claims.get("exp", 0))
    return issued + (expires - issued) / 2, expires


async def keep_fresh(
    token: str,
    fresh_token: FreshToken,
    send: SendFrame,
    *,
    timeout_s: float,
    clock: Callable[[], float] = time.time,
) -> None:
    """Until cancelled or the connection closes: at half of `token`'s life send a fresh one; then of that one."""
    while True:
        due, expires = renew_at(token)
        await asyncio.sleep(max(0.0, due - clock()))
        try:
            async with asyncio.timeout(timeout_s):
                new = await fresh_token()
            if new == token:  # the broker's cache has not turned over yet (clocks a hair apart)
                raise CredentialUnavailable("the broker gave the token in force again")
            async with asyncio.timeout(timeout_s):
                await send(wire.encode(wire.Reauthenticate(new)))
        except ConnectionClosed:
            return  # the connection is gone: its successor gets a task of its own
        except (CredentialUnavailable, TimeoutError, wire.WireError, ValueError) as exc:
            retry_s = min(RETRY_MAX_S, max(RETRY_MIN_S, (expires - clock()) / 4))
            log.warning("renewing the verifier connection's token failed (%s); again in %.1fs", exc, retry_s)
            await asyncio.sleep(retry_s)
            continue
        log.info("sent the verifier a fresh token for the open connection")
        token = new
