"""The callers' side (shared/auth/client.py) against the real issuer app: a device enrolls with its bootstrap
token and renews its credential; the streamer's token for a device is for that device only."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import jwt
import pytest

from services.state_monitor.app import create_app
from services.state_monitor.settings import load_settings
from shared.auth import verify as auth
from shared.auth.client import BrokerAuth, CredentialUnavailable, Enrollment, TokenBroker
from shared.auth.signing import KeyRing


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def issuer(tmp_path: Path) -> tuple[KeyRing, httpx.ASGITransport]:
    ring = KeyRing.generate()
    ring.save(tmp_path / "keys.json")
    settings = load_settings(
        {}, auth_key_file=str(tmp_path / "keys.json"), redis_url="", embedded_redis=False, device_credential_ttl_s=600
    )
    return ring, httpx.ASGITransport(app=create_app(settings))


def claims(token: str) -> dict:
    return jwt.decode(token, options={"verify_signature": False})


async def test_a_device_enrolls_once_then_renews_with_its_own_credential(issuer):
    ring, transport = issuer
    clock = Clock()
    bootstrap = ring.mint("device-1", "bootstrap", auth.ISSUER, 3600, clock.now)
    broker = TokenBroker(
        "http://monitor",
        bootstrap,
        enrollment=Enrollment("device-1", "http://10.0.0.1:8200"),
        transport=transport,
        clock=clock,
    )
    first = await broker.token(auth.VERIFIER)
    assert (claims(first)["sub"], claims(first)["role"], claims(first)["aud"]) == ("device-1", "device", "verifier")
    assert await broker.token(auth.VERIFIER) == first  # cached until half its life
    credential = await broker.credential()
    clock.now += 301  # past half the device credential's 600 s: renewed with it, not with the bootstrap
    renewed = await broker.credential()
    assert renewed != credential and claims(renewed)["role"] == "device"
    assert repr(broker) == "TokenBroker(subject='device-1', role='bootstrap')" and bootstrap not in repr(broker)
    await broker.aclose()


async def test_a_revoked_device_gets_no_more_tokens(issuer):
    ring, transport = issuer
    clock = Clock()
    bootstrap = ring.mint("device-2", "bootstrap", auth.ISSUER, 3600, clock.now)
    broker = TokenBroker(
        "http://monitor",
        bootstrap,
        enrollment=Enrollment("device-2", "http://10.0.0.2:8200"),
        transport=transport,
        clock=clock,
    )
    await broker.token(auth.PLANNER)
    operator = {"Authorization": f"Bearer {ring.mint('ops', 'operator', auth.ISSUER, 60, clock.now)}"}
    async with httpx.AsyncClient(transport=transport, base_url="http://monitor") as client:
        assert (
            await client.post("/credentials/revoke", json={"role": "device", "subject": "device-2"}, headers=operator)
        ).status_code == 200
    clock.now += 301  # the next renewal is refused, and enrolling again too
    with pytest.raises(CredentialUnavailable):
        await broker.token(auth.VERIFIER)
    await broker.aclose()


async def test_the_streamer_gets_a_token_for_the_device_at_each_url_only(issuer):
    ring, transport = issuer
    for device_id, port in (("device-a", 1), ("device-b", 2)):
        bootstrap = ring.mint(device_id, "bootstrap", auth.ISSUER, 3600, time.time())
        broker = TokenBroker(
            "http://monitor",
            bootstrap,
            enrollment=Enrollment(device_id, f"http://10.0.0.9:{port}"),
            transport=transport,
        )
        await broker.credential()
        await broker.aclose()
    streamer = TokenBroker(
        "http://monitor", ring.mint("token-streamer", "service", auth.ISSUER, 3600, time.time()), transport=transport
    )
    seen: dict[str, str] = {}

    def device(request: httpx.Request) -> httpx.Response:
        seen[request.url.host + str(request.url.port)] = request.headers["authorization"].removeprefix("Bearer ")
        return httpx.Response(200, json={})

    async with httpx.AsyncClient(
        transport=httpx.MockTransport(device), auth=BrokerAuth(streamer, devices=True)
    ) as client:
        await client.get("http://10.0.0.9:1/info")
        await client.get("http://10.0.0.9:2/info")
    assert claims(seen["10.0.0.91"])["aud"] == "device:device-a"
    assert claims(seen["10.0.0.92"])["aud"] == "device:device-b"
    async with httpx.AsyncClient(
        transport=httpx.MockTransport(device), auth=BrokerAuth(streamer, devices=True)
    ) as client:
        with pytest.raises(CredentialUnavailable):  # no device is enrolled there: no token, no call
            await client.get("http://10.0.0.9:3/info")
    await streamer.aclose()
