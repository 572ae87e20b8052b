"""A credential keeps counting after the handshake (issue 47): the real verifier, on a real loopback WebSocket,
closes an open device connection within 2 s of its token being revoked at the issuer or expiring, with a typed
close (1008, "credential revoked" / "credential expired"), and frees its sessions; other devices go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from services.verifier_cloud.http_front import CREDENTIAL_CLOSE_CODE
from shared.auth import verify as auth
from shared.auth.signing import KeyRing
from shared.model.checkpoint import load_checkpoint
from shared.wire import schema as wire
from tests.auth_tools import jwks_server, wait_trusted
from tests.mesh_tools import open_session, verifier_on_loopback

M = 2
RING = KeyRing.generate()
WITHIN_S = 2.0


@pytest.fixture(scope="module")
def checkpoint(tiny_llama_dir):
    return load_checkpoint(tiny_llama_dir, with_tokenizer=False)


def _headers(device_id: str, ttl_s: float = 60) -> dict[str, str]:
    return {"Authorization": f"Bearer {RING.mint(device_id, 'device', auth.VERIFIER, ttl_s, time.time())}"}


@contextlib.asynccontextmanager
async def verifier_trusting(checkpoint, revoked: set[str], **overrides):
    """The verifier checking devices' tokens against RING, whose issuer serves `revoked` as its revocation list."""
    credential = RING.mint("verifier-cloud", "service", auth.ISSUER, 600, time.time())
    async with (
        jwks_server(RING, revoked) as issuer,
        verifier_on_loopback(checkpoint, M, auth_issuer_url=issuer, auth_credential=credential, **overrides) as (
            server,
            url,
        ),
    ):
        await wait_trusted(server.trust)
        yield server, url


async def _closed_after(ws, timeout_s: float) -> tuple[float, ConnectionClosed]:
    """(seconds until the verifier closed `ws`, how): fails if it stays open `timeout_s`."""
    started = time.monotonic()
    with pytest.raises(ConnectionClosed) as info:
        await asyncio.wait_for(ws.recv(), timeout_s)
    return time.monotonic() - started, info.value


async def test_a_revoked_devices_open_socket_is_closed_within_2s(checkpoint):
    revoked: set[str] = set()
    async with verifier_trusting(checkpoint, revoked) as (server, url):
        async with (
            connect(url, additional_headers=_headers("dev-a")) as victim,
            connect(url, additional_headers=_headers("dev-b")) as bystander,
        ):
            assert isinstance(await open_session(victim, checkpoint, 1), wire.SessionOpened)
            assert isinstance(await open_session(bystander, checkpoint, 2), wire.SessionOpened)
            revoked.add(auth.revocation_key("device", "dev-a"))  # at the issuer, as `tophat credentials revoke`
            took_s, closed = await _closed_after(victim, 10.0)
            assert took_s < WITHIN_S, f"closed {took_s:.2f}s after the revocation"
            assert closed.rcvd is not None
            assert (closed.rcvd.code, closed.rcvd.reason) == (CREDENTIAL_CLOSE_CODE, "credential revoked")
            for _ in range(50):  # its sessions are freed as its connection ends
                if 1 not in server.scheduler.sessions:
                    break
                await asyncio.sleep(0.02)
            assert 1 not in server.scheduler.sessions
            # another device's connection and sessions are untouched
            assert isinstance(await open_session(bystander, checkpoint, 3), wire.SessionOpened)
            assert 2 in server.scheduler.sessions


async def test_an_expired_credentials_open_socket_is_closed_within_2s(checkpoint):
    async with verifier_trusting(checkpoint, set(), auth_leeway_s=0.0) as (_, url):
        headers = _headers("dev-c", ttl_s=2)
        expires_at = (
            auth.TokenVerifier(auth.Trust.from_document(RING.jwks()), leeway_s=0)
            .verify(headers["Authorization"].removeprefix("Bearer "), auth.VERIFIER)
            .expires_at
        )
        async with (
            connect(url, additional_headers=headers) as ws,
            connect(url, additional_headers=_headers("dev-d")) as fresh,
        ):
            assert isinstance(await open_session(ws, checkpoint, 1), wire.SessionOpened)
            _, closed = await _closed_after(ws, 10.0)
            late_s = time.time() - expires_at
            assert 0 <= late_s < WITHIN_S, f"closed {late_s:.2f}s after the token expired"
            assert closed.rcvd is not None
            assert (closed.rcvd.code, closed.rcvd.reason) == (CREDENTIAL_CLOSE_CODE, "credential expired")
            assert isinstance(await open_session(fresh, checkpoint, 2), wire.SessionOpened)
