"""The issuer (services/state_monitor/issuer.py) inside the real state-monitor app: enrollment, audience tokens,
revocation, rotation, and what a bootstrap token, a device and a service can and cannot get."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import jwt
import pytest

from services.state_monitor.app import create_app
from services.state_monitor.settings import load_settings
from shared.auth import verify as auth
from shared.auth.signing import KeyRing

DEVICE_URL = "http://10.0.0.7:8200"


@pytest.fixture
def ring(tmp_path: Path) -> KeyRing:
    made = KeyRing.generate()
    made.save(tmp_path / "keys.json")
    return made


@pytest.fixture
async def monitor(tmp_path: Path, ring: KeyRing) -> AsyncIterator[httpx.AsyncClient]:
    settings = load_settings({}, auth_key_file=str(tmp_path / "keys.json"), redis_url="", embedded_redis=False)
    app = create_app(settings)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://monitor") as client:
        yield client


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def minted(ring: KeyRing, subject: str, role: str, audience: str = auth.ISSUER, ttl_s: float = 600) -> dict[str, str]:
    return bearer(ring.mint(subject, role, audience, ttl_s, time.time()))


async def enroll(monitor: httpx.AsyncClient, headers: dict[str, str], device_id: str, url: str) -> httpx.Response:
    return await monitor.post("/credentials/enroll", json={"device_id": device_id, "url": url}, headers=headers)


def claims_of(token: str) -> dict:
    return jwt.decode(token, options={"verify_signature": False})


async def test_a_bootstrap_token_enrolls_its_own_device_and_nothing_else(monitor, ring):
    bootstrap = minted(ring, "device-1", "bootstrap")
    assert (await enroll(monitor, bootstrap, "device-2", DEVICE_URL)).status_code == 403  # another id
    answer = await enroll(monitor, bootstrap, "device-1", DEVICE_URL)
    assert answer.status_code == 200
    credential = claims_of(answer.json()["token"])
    assert (credential["sub"], credential["role"], credential["aud"]) == ("device-1", "device", auth.ISSUER)
    devices = (await monitor.get("/devices")).json()["devices"]
    assert [(d["device_id"], d["url"]) for d in devices] == [("device-1", DEVICE_URL)]
    # The bootstrap token itself is no device credential: no tokens, no telemetry, no announcement.
    assert (
        await monitor.post("/credentials/token", json={"audience": auth.VERIFIER}, headers=bootstrap)
    ).status_code == 403
    rtt = {"kind": "device_rtt", "device_id": "device-1", "rtt_s": 0.01}
    assert (await monitor.post("/telemetry", json=rtt, headers=bootstrap)).status_code == 403
    announce = {"device_id": "device-1", "url": DEVICE_URL}
    assert (await monitor.post("/devices/announce", json=announce, headers=bootstrap)).status_code == 403
    # The device's own credential does all of it.
    own = bearer(answer.json()["token"])
    assert (await monitor.post("/telemetry", json=rtt, headers=own)).status_code == 200
    assert (await monitor.post("/devices/announce", json=announce, headers=own)).status_code == 200


async def test_a_stolen_bootstrap_token_cannot_take_over_an_enrolled_device(monitor, ring):
    fleet = minted(ring, "*", "bootstrap")  # a fleet's, which once enrolled any id: it enrolls nothing now
    assert (await enroll(monitor, fleet, "device-1", DEVICE_URL)).status_code == 403
    own = minted(ring, "device-1", "bootstrap")
    assert (await enroll(monitor, own, "device-1", DEVICE_URL)).status_code == 200
    taken = await enroll(monitor, own, "device-1", "http://10.6.6.6:8200")  # a thief with the same token
    assert taken.status_code == 409 and "live" in taken.text
    second = await enroll(monitor, minted(ring, "device-1", "bootstrap"), "device-1", "http://10.6.6.6:8200")
    assert second.status_code == 409 and "another bootstrap" in second.text  # another token for the id
    stolen_url = await enroll(monitor, minted(ring, "device-6", "bootstrap"), "device-6", DEVICE_URL)
    assert stolen_url.status_code == 409 and "device-1" in stolen_url.text  # a new id at the live device's URL
    devices = (await monitor.get("/devices")).json()["devices"]
    assert [(d["device_id"], d["url"]) for d in devices] == [("device-1", DEVICE_URL)]


async def test_audience_tokens_per_role(monitor, ring):
    enrolled = await enroll(monitor, minted(ring, "device-1", "bootstrap"), "device-1", DEVICE_URL)
    device = bearer(enrolled.json()["token"])
    for audience in (auth.VERIFIER, auth.PLANNER, auth.ISSUER):
        answer = await monitor.post("/credentials/token", json={"audience": audience}, headers=device)
        assert answer.status_code == 200 and claims_of(answer.json()["token"])["aud"] == audience
    for audience in (auth.device_audience("device-2"), auth.device_audience("device-1"), "anything"):
        assert (
            await monitor.post("/credentials/token", json={"audience": audience}, headers=device)
        ).status_code == 403
    assert (
        await monitor.post("/credentials/token", json={"device_url": DEVICE_URL}, headers=device)
    ).status_code == 403  # a device never calls another device
    streamer = minted(ring, "token-streamer", "service")
    answer = await monitor.post("/credentials/token", json={"device_url": DEVICE_URL + "/"}, headers=streamer)
    assert answer.status_code == 200 and answer.json()["audience"] == auth.device_audience("device-1")
    token = claims_of(answer.json()["token"])
    assert (token["sub"], token["role"], token["aud"]) == ("token-streamer", "service", "device:device-1")
    assert token["exp"] - token["iat"] == 300  # an access token's life
    assert (
        await monitor.post("/credentials/token", json={"device_url": "http://10.9.9.9:1"}, headers=streamer)
    ).status_code == 404
    # A token for another audience is no credential at the issuer.
    for_verifier = minted(ring, "device-1", "device", auth.VERIFIER)
    assert (
        await monitor.post("/credentials/token", json={"audience": auth.PLANNER}, headers=for_verifier)
    ).status_code == 401


async def test_a_revoked_device_is_refused_at_its_next_call_and_cannot_enroll_again(monitor, ring):
    bootstrap = minted(ring, "device-1", "bootstrap")
    enrolled = await enroll(monitor, bootstrap, "device-1", DEVICE_URL)
    device = bearer(enrolled.json()["token"])
    operator = minted(ring, "ops", "operator")
    assert (
        await monitor.post("/credentials/revoke", json={"role": "device", "subject": "device-1"}, headers=device)
    ).status_code == 403  # only an operator revokes
    assert (
        await monitor.post("/credentials/revoke", json={"role": "device", "subject": "device-1"}, headers=operator)
    ).status_code == 200
    refused = await monitor.post("/credentials/token", json={"audience": auth.ISSUER}, headers=device)
    assert refused.status_code == 401 and refused.json()["error"]["reason"] == "revoked"
    assert "device:device-1" in (await monitor.get("/credentials/jwks")).json()["revoked"]
    for again in (bootstrap, minted(ring, "device-1", "bootstrap")):  # its bootstrap is revoked with it
        refused = await enroll(monitor, again, "device-1", "http://10.0.0.8:1")
        assert refused.status_code == 401 and refused.json()["error"]["reason"] == "revoked"


async def test_a_bootstrap_token_is_revoked_by_its_id(monitor, ring):
    token = ring.mint("device-3", "bootstrap", auth.ISSUER, 600, time.time())
    operator = minted(ring, "ops", "operator")
    assert (
        await monitor.post("/credentials/revoke", json={"token_id": claims_of(token)["jti"]}, headers=operator)
    ).status_code == 200
    refused = await enroll(monitor, bearer(token), "device-3", DEVICE_URL)
    assert refused.status_code == 401 and refused.json()["error"]["reason"] == "revoked"


async def test_rotation_keeps_the_old_key_until_its_tokens_expired(monitor, ring, tmp_path):
    operator = minted(ring, "ops", "operator")
    old = minted(ring, "token-streamer", "service")
    rotated = await monitor.post("/credentials/rotate", headers=operator)
    assert rotated.status_code == 200 and rotated.json()["active"] != ring.active
    kids = {k["kid"] for k in (await monitor.get("/credentials/jwks")).json()["keys"]}
    assert kids == {ring.active, rotated.json()["active"]}
    renewed = await monitor.post("/credentials/token", json={"audience": auth.ISSUER}, headers=old)
    assert renewed.status_code == 200  # the old key's token still works
    assert jwt.get_unverified_header(renewed.json()["token"])["kid"] == rotated.json()["active"]
    assert KeyRing.load(tmp_path / "keys.json").active == ring.active  # the key file is only read
    assert KeyRing.load(tmp_path / "issuer-state.json").active == rotated.json()["active"]  # the state is saved


async def test_operator_issue_is_capped_and_operator_only(monitor, ring):
    operator = minted(ring, "ops", "operator")
    body = {"role": "bootstrap", "subject": "device-9", "ttl_s": 3600}
    issued = await monitor.post("/credentials/issue", json=body, headers=operator)
    assert issued.status_code == 200 and claims_of(issued.json()["token"])["role"] == "bootstrap"
    assert (
        await monitor.post("/credentials/issue", json=body, headers=minted(ring, "token-streamer", "service"))
    ).status_code == 403
    assert (
        await monitor.post("/credentials/issue", json={**body, "ttl_s": 10**9}, headers=operator)
    ).status_code == 422
    fleet = {**body, "subject": "*"}  # a bootstrap for any id is no longer made
    assert (await monitor.post("/credentials/issue", json=fleet, headers=operator)).status_code == 422
