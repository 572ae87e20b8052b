"""shared/auth.py: signed, expiring mesh credentials (property tests) and the ASGI guard."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest
from fastapi import FastAPI, Request
from hypothesis import given, settings
from hypothesis import strategies as st

from shared import auth

SECRET = "mesh-secret-for-tests"
NOW = 1_800_000_000.0
subjects = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=40)
roles = st.sampled_from(auth.ROLES)
ttls = st.integers(min_value=1, max_value=10**7)


@given(subject=subjects, role=roles, ttl=ttls, secret=st.text(min_size=1, max_size=64))
@pytest.mark.slow
def test_round_trip(subject: str, role: str, ttl: int, secret: str) -> None:
    claims = auth.verify(secret, auth.issue(secret, subject, role, ttl, NOW), NOW)
    assert claims == auth.Claims(subject, role, int(NOW + ttl))


@settings(max_examples=300)
@given(subject=subjects, role=roles, data=st.data())
def test_any_single_byte_change_is_refused(subject: str, role: str, data: st.DataObject) -> None:
    token = auth.issue(SECRET, subject, role, 60, NOW).encode()
    index = data.draw(st.integers(0, len(token) - 1))
    byte = data.draw(st.integers(0, 255).filter(lambda b: b != token[index]))
    changed = token[:index] + bytes([byte]) + token[index + 1:]
    with pytest.raises(auth.AuthError) as refused:
        auth.verify(SECRET, changed, NOW)
    assert refused.value.reason in ("malformed", "bad_signature")


@given(subject=subjects, role=roles, ttl=ttls, late=st.integers(0, 10**6))
def test_expired_is_refused(subject: str, role: str, ttl: int, late: int) -> None:
    token = auth.issue(SECRET, subject, role, ttl, NOW)
    with pytest.raises(auth.AuthError) as refused:
        auth.verify(SECRET, token, NOW + ttl + late)
    assert refused.value.reason == "expired" and refused.value.status == 401


@given(subject=subjects, role=roles, other=st.text(min_size=1, max_size=64))
def test_wrong_secret_is_refused(subject: str, role: str, other: str) -> None:
    if other == SECRET:
        return
    with pytest.raises(auth.AuthError) as refused:
        auth.verify(other, auth.issue(SECRET, subject, role, 60, NOW), NOW)
    assert refused.value.reason == "bad_signature"


@pytest.mark.parametrize("token", ["", ".", "abc", "a.b.c", "e30.", ".e30", "e30.e30", "!!!.???", "é.é"])
def test_malformed_is_refused(token: str) -> None:
    with pytest.raises(auth.AuthError) as refused:
        auth.verify(SECRET, token, NOW)
    assert refused.value.reason in ("malformed", "bad_signature")


def test_authenticate_checks_header_and_role() -> None:
    device = auth.issue(SECRET, "device-0", "device", 60, NOW)
    assert auth.authenticate(SECRET, f"Bearer {device}", {"device"}, NOW).subject == "device-0"
    for header, reason in [(None, "missing"), ("Basic abc", "missing"), (f"Bearer {device}x", "malformed")]:
        with pytest.raises(auth.AuthError) as refused:
            auth.authenticate(SECRET, header, {"device"}, NOW)
        assert refused.value.reason == reason
    with pytest.raises(auth.AuthError) as refused:
        auth.authenticate(SECRET, f"Bearer {device}", {"service"}, NOW)
    assert refused.value.reason == "forbidden" and refused.value.status == 403


def test_may_act_for() -> None:
    device = auth.Claims("device-0", "device", 0)
    assert auth.may_act_for(device, "device-0")
    assert not auth.may_act_for(device, "device-1") and not auth.may_act_for(device, None)
    assert auth.may_act_for(auth.Claims("token-streamer", "service", 0), "device-1")
    assert auth.may_act_for(None, None)  # authentication off


def test_bearer_auth_remints_before_expiry_and_hides_itself() -> None:
    clock = [NOW]
    minter = auth.BearerAuth(SECRET, "verifier-cloud", "service", ttl_s=100, clock=lambda: clock[0])
    first = minter.token()
    assert minter.token() == first
    clock[0] += 60  # past half life: a new token that outlives the old one
    second = minter.token()
    assert second != first and auth.verify(SECRET, second, NOW + 120).subject == "verifier-cloud"
    assert SECRET not in repr(minter) and second not in repr(minter)
    assert auth.client_auth("", "x", "service") is None


def test_guard_refuses_before_the_app_and_leaves_probes_open(caplog: pytest.LogCaptureFixture) -> None:
    app = FastAPI()
    seen: list[str] = []

    @app.post("/telemetry")
    async def telemetry(request: Request) -> dict:
        claims = auth.claims_of(request.scope)
        seen.append(claims.subject)
        return {"ok": True}

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"ok": True}

    auth.install(app, SECRET, {"device"})
    token = auth.issue(SECRET, "device-3", "device", 60, __import__("time").time())

    async def run() -> list[int]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return [(await client.post("/telemetry", json={})).status_code,
                    (await client.post("/telemetry", headers={"Authorization": f"Bearer {token}x"})).status_code,
                    (await client.get("/healthz")).status_code,
                    (await client.post("/telemetry", json={}, auth=auth.BearerAuth(token=token))).status_code]

    with caplog.at_level(logging.DEBUG):
        assert asyncio.run(run()) == [401, 401, 200, 200]
    assert seen == ["device-3"]
    assert token not in caplog.text
