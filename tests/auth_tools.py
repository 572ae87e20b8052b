"""Test helpers for the mesh's credentials: a loopback issuer key set for services that verify tokens."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator

from shared.auth import verify as auth
from shared.auth.signing import KeyRing


@contextlib.asynccontextmanager
async def jwks_server(
    ring: KeyRing, revoked: set[str] | None = None, revoked_tokens: set[str] | None = None
) -> AsyncIterator[str]:
    """A loopback HTTP server answering every GET with the ring's public key set (as the issuer's
    /credentials/jwks does): yields its base URL, to be a service's auth_issuer_url. `revoked`: the revocation
    list it serves (auth.revocation_key(role, sub) entries), read at each answer, so a test revokes by adding;
    `revoked_tokens`: likewise, single tokens by their jti."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            listed = {"revoked": sorted(revoked or ()), "revoked_tokens": sorted(revoked_tokens or ())}
            body = json.dumps({**ring.jwks(), **listed}).encode()
            head = f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            writer.write(head.encode() + b"connection: close\r\n\r\n" + body)
            await writer.drain()
        finally:
            writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    async with server:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def wait_trusted(verifier: auth.TokenVerifier | None, timeout_s: float = 10.0) -> None:
    """Until a service's verifier has read the issuer's keys."""
    assert verifier is not None
    deadline = time.monotonic() + timeout_s
    while not verifier.trust.keys:
        assert time.monotonic() < deadline, "the service never read the issuer's keys"
        await asyncio.sleep(0.05)


def bearer(ring: KeyRing, subject: str, role: str, audience: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {ring.mint(subject, role, audience, 60, time.time())}"}
