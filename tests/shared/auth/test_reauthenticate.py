"""A device renews its open connection's credential (wire Reauthenticate): through the real verifier on a real
loopback WebSocket, a connection that sends a fresh token outlives its first one and keeps working; a token of
another device, an expired one or a revoked one is refused with a typed ErrorFrame (CREDENTIAL) and the
connection closed (1008). The device agent's connection sends a fresh token by itself at half of its token's life.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from services.device_agent.cloud_client import WebSocketCloud
from services.device_agent.reauth import keep_fresh, renew_at
from services.verifier_cloud.http_front import CREDENTIAL_CLOSE_CODE
from shared.auth import verify as auth
from shared.auth.client import CredentialUnavailable, unverified_claims
from shared.auth.signing import KeyRing
from shared.model.checkpoint import load_checkpoint
from shared.wire import schema as wire
from tests.auth_tools import jwks_server, wait_trusted
from tests.mesh_tools import open_session, split_identity, verifier_on_loopback

M = 2
RING = KeyRing.generate()
OTHER_RING = KeyRing.generate()  # an issuer the verifier does not trust


@pytest.fixture(scope="module")
def checkpoint(tiny_llama_dir):
    return load_checkpoint(tiny_llama_dir, with_tokenizer=False)


def _token(device_id: str, ttl_s: float = 60, now: float | None = None) -> str:
    return RING.mint(device_id, "device", auth.VERIFIER, ttl_s, time.time() if now is None else now)


@contextlib.asynccontextmanager
async def verifier_trusting(checkpoint, revoked_tokens: set[str] | None = None):
    """The verifier checking devices' tokens against RING (no leeway), its revocation list re-read every 0.2 s."""
    credential = RING.mint("verifier-cloud", "service", auth.ISSUER, 600, time.time())
    async with (
        jwks_server(RING, set(), revoked_tokens) as issuer,
        verifier_on_loopback(
            checkpoint, M, auth_issuer_url=issuer, auth_credential=credential, auth_leeway_s=0.0, auth_refresh_s=0.2
        ) as (server, url),
    ):
        await wait_trusted(server.trust)
        yield server, url


async def test_a_connection_that_reauthenticates_outlives_its_first_token(checkpoint):
    async with verifier_trusting(checkpoint) as (_, url):
        first = _token("dev-a", ttl_s=2)
        expires_at = unverified_claims(first)["exp"]
        async with connect(url, additional_headers={"Authorization": f"Bearer {first}"}) as ws:
            assert isinstance(await open_session(ws, checkpoint, 1), wire.SessionOpened)
            await ws.send(wire.encode(wire.Reauthenticate(_token("dev-a", ttl_s=60))))  # no reply when accepted
            await asyncio.sleep(max(0.0, expires_at - time.time()) + 1.0)  # past the first token's expiry
            assert isinstance(await open_session(ws, checkpoint, 2), wire.SessionOpened)


def _revoked_case(revoked: set[str]) -> tuple[str, str]:
    token = _token("dev-a")
    revoked.add(unverified_claims(token)["jti"])
    return token, "revoked"


REFUSED = {
    "another device's": lambda revoked: (_token("dev-b"), "forbidden"),
    "expired": lambda revoked: (_token("dev-a", ttl_s=10, now=time.time() - 100), "expired"),
    "revoked": _revoked_case,
    "forged": lambda revoked: (OTHER_RING.mint("dev-a", "device", auth.VERIFIER, 60, time.time()), "unknown_key"),
    "a service's": lambda revoked: (RING.mint("dev-a", "service", auth.VERIFIER, 60, time.time()), "forbidden"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
async def test_a_refused_new_token_ends_the_connection_with_1008(checkpoint, case):
    revoked_tokens: set[str] = set()
    async with verifier_trusting(checkpoint, revoked_tokens) as (server, url):
        token, reason = REFUSED[case](revoked_tokens)
        for _ in range(100):  # the verifier has read the revocation list with this token on it
            if revoked_tokens <= server.trust.trust.revoked_tokens:
                break
            await asyncio.sleep(0.05)
        headers = {"Authorization": f"Bearer {_token('dev-a')}"}
        async with (
            connect(url, additional_headers=headers) as ws,
            connect(url, additional_headers={"Authorization": f"Bearer {_token('dev-c')}"}) as bystander,
        ):
            assert isinstance(await open_session(ws, checkpoint, 1), wire.SessionOpened)
            await ws.send(wire.encode(wire.Reauthenticate(token)))
            refusal = wire.decode(await asyncio.wait_for(ws.recv(), 10))
            assert isinstance(refusal, wire.ErrorFrame) and refusal.code == wire.ErrorCode.CREDENTIAL, refusal
            assert reason in refusal.message
            with pytest.raises(ConnectionClosed) as info:
                await asyncio.wait_for(ws.recv(), 10)
            assert info.value.rcvd is not None
            assert (info.value.rcvd.code, info.value.rcvd.reason) == (CREDENTIAL_CLOSE_CODE, f"credential {reason}")
            for _ in range(50):  # its sessions are freed as its connection ends
                if 1 not in server.scheduler.sessions:
                    break
                await asyncio.sleep(0.02)
            assert 1 not in server.scheduler.sessions
            assert isinstance(await open_session(bystander, checkpoint, 2), wire.SessionOpened)  # others go on


async def test_with_auth_off_a_reauthenticate_is_ignored(checkpoint):
    async with verifier_on_loopback(checkpoint, M) as (_, url), connect(url) as ws:
        await ws.send(wire.encode(wire.Reauthenticate("not.a.token")))
        assert isinstance(await open_session(ws, checkpoint, 1), wire.SessionOpened)  # no reply came before this one


class _Tokens:
    """The device's BrokerAuth for the verifier: a short first token, then fresh long ones."""

    def __init__(self, device_id: str, first_ttl_s: float) -> None:
        self.device_id, self.first_ttl_s = device_id, first_ttl_s
        self.given: list[str] = []

    async def token(self) -> str:
        self.given.append(_token(self.device_id, ttl_s=self.first_ttl_s if not self.given else 60))
        return self.given[-1]


async def test_the_device_connection_renews_its_token_by_itself_and_outlives_it(checkpoint):
    tokens = _Tokens("dev-a", first_ttl_s=2)
    async with verifier_trusting(checkpoint) as (_, url):
        cloud = WebSocketCloud(
            url,
            checkpoint.hidden_size,
            request_timeout_s=5,
            auth=tokens,  # type: ignore[arg-type]
            **split_identity(checkpoint, M),
        )
        try:
            await cloud.open(1)
            connection = cloud._connection
            expires_at = unverified_claims(tokens.given[0])["exp"]
            await asyncio.sleep(max(0.0, expires_at - time.time()) + 1.0)
            assert len(tokens.given) == 2  # one fresh token, sent on the open connection
            await cloud.open(2)
            assert cloud._connection is connection and cloud.connected  # the same connection, still open
        finally:
            await cloud.close_connection()


async def test_keep_fresh_sends_a_fresh_token_at_half_life_and_retries_a_failure():
    first = _token("dev-a", ttl_s=2)
    due, expires_at = renew_at(first)
    calls: list[float] = []
    sent: list[tuple[float, wire.Message]] = []

    async def fresh() -> str:
        calls.append(time.time())
        if len(calls) == 1:
            raise CredentialUnavailable("the issuer is unreachable")
        return _token("dev-a", ttl_s=60)

    async def send(frame: bytes) -> None:
        sent.append((time.time(), wire.decode(frame)))

    task = asyncio.create_task(keep_fresh(first, fresh, send, timeout_s=1.0))
    try:
        for _ in range(100):
            if sent:
                break
            await asyncio.sleep(0.05)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert calls[0] >= due - 0.05  # not before half the token's life...
    ((at, message),) = sent
    assert isinstance(message, wire.Reauthenticate) and message.token != first
    assert at < expires_at  # ...and, after one failure, before its end
    assert unverified_claims(message.token)["sub"] == "dev-a"
