"""Every hop authenticated (issues 12 and 28), on one real mesh (`tophat up`'s default: a fresh signing key per run,
held by the state monitor alone; service credentials for the cloud side; a bootstrap token per device).

Missing, forged (another key), tampered, expired and wrong-audience credentials are refused at every internal
endpoint: the verifier's WebSocket handshake, a device's /generate, the monitor's POST /telemetry and
/devices/announce, the planner. A device credential is refused as a service, at another device, at the monitor
for another device id, and after revocation; a bootstrap token is refused anywhere but enrollment. Probes stay
open, and the mesh, whose services enroll and fetch their own tokens, still serves greedy-exact completions.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import jwt
import pytest
from typer.testing import CliRunner
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from shared.auth import verify as auth
from shared.auth.signing import KeyRing
from shared.specdec.reference import generate_full
from tests.conftest import DEMO_MODEL_DIR
from tests.mesh_tools import wait_until
from tophat.cli import app
from tophatctl.mesh import Mesh
from tophatctl.mesh_config import MeshConfig
from tophatctl.mesh_ports import find_port_base

MAX_TOKENS = 12
DEVICE = "device-0"
STRANGER = KeyRing.generate()  # a key the mesh never trusted


@pytest.fixture(scope="module")
def mesh():
    config = MeshConfig(model_dir=str(DEMO_MODEL_DIR), num_devices=1, port_base=find_port_base(1))
    assert config.auth  # the launcher's default
    with Mesh(config) as running:
        yield running


def token(mesh: Mesh, subject: str, role: str, audience: str, ttl_s: float = 60, now: float | None = None) -> str:
    return mesh.credentials.ring.mint(subject, role, audience, ttl_s, time.time() if now is None else now)


def bearer(mesh: Mesh, subject: str, role: str, audience: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token(mesh, subject, role, audience)}"}


def credentials(mesh: Mesh, role: str, subject: str, audience: str) -> dict[str, dict[str, str]]:
    """Every credential the endpoint must refuse (401), by name -> headers; role/subject/audience: the one it takes."""
    now = time.time()
    good = token(mesh, subject, role, audience)
    other = auth.device_audience("device-9") if audience != auth.device_audience("device-9") else auth.ISSUER
    return {
        "missing": {},
        "not bearer": {"Authorization": f"Basic {good}"},
        "forged": {"Authorization": f"Bearer {STRANGER.mint(subject, role, audience, 60, now)}"},
        "tampered": {"Authorization": f"Bearer {good[:-2]}{'A' if good[-2] != 'A' else 'B'}{good[-1]}"},
        "expired": {"Authorization": f"Bearer {token(mesh, subject, role, audience, 60, now - 200)}"},
        "wrong audience": {"Authorization": f"Bearer {token(mesh, subject, role, other)}"},
    }


def rtt(device_id: str) -> dict:
    return {"kind": "device_rtt", "device_id": device_id, "rtt_s": 0.01}


async def handshake(url: str, headers: dict[str, str]) -> int:
    try:
        async with connect(url, additional_headers=headers, open_timeout=10):
            return 101
    except InvalidStatus as exc:
        return exc.response.status_code


@pytest.mark.slow
def test_verifier_handshake_needs_a_device_token_for_the_verifier(mesh):
    url = mesh.config.verifier_urls().split(",")[0]

    async def run() -> None:
        for name, headers in credentials(mesh, "device", DEVICE, auth.VERIFIER).items():
            assert await handshake(url, headers) == 401, name
        assert await handshake(url, bearer(mesh, "token-streamer", "service", auth.VERIFIER)) == 403  # not a device
        assert await handshake(url, bearer(mesh, DEVICE, "bootstrap", auth.VERIFIER)) == 403
        assert await handshake(url, bearer(mesh, DEVICE, "device", auth.ISSUER)) == 401  # its monitor credential
        assert await handshake(url, bearer(mesh, "device-7", "device", auth.VERIFIER)) == 101

    asyncio.run(run())
    assert httpx.get(f"http://127.0.0.1:{mesh.config.verifier_port}/healthz", timeout=5).status_code == 200


def test_device_generate_and_info_need_a_service_token_for_that_device(mesh):
    url = mesh.config.device_url(0)
    body = {"prompt": "hello", "max_new_tokens": 2}
    mine = auth.device_audience(DEVICE)
    for name, headers in credentials(mesh, "service", "token-streamer", mine).items():
        assert httpx.post(f"{url}/generate", json=body, headers=headers, timeout=10).status_code == 401, name
        assert httpx.get(f"{url}/info", headers=headers, timeout=10).status_code == 401, name
    device = bearer(mesh, DEVICE, "device", mine)  # even this device's own credential: only a service calls it
    assert httpx.post(f"{url}/generate", json=body, headers=device, timeout=10).status_code == 403
    # A device's credential for the monitor is not a service's (audience and role both refuse it).
    as_service = bearer(mesh, DEVICE, "device", auth.ISSUER)
    assert httpx.get(f"{url}/info", headers=as_service, timeout=10).status_code == 401
    streamer = bearer(mesh, "token-streamer", "service", mine)
    assert httpx.get(f"{url}/info", headers=streamer, timeout=10).status_code == 200
    for probe in ("/healthz", "/readyz", "/metrics"):
        assert httpx.get(f"{url}{probe}", timeout=10).status_code == 200, probe


def test_monitor_writes_need_a_token_and_a_device_writes_only_for_itself(mesh):
    url = mesh.config.monitor_url
    announce = {"device_id": DEVICE, "url": "http://127.0.0.1:1", "max_sessions": 1}
    for name, headers in credentials(mesh, "device", DEVICE, auth.ISSUER).items():
        assert httpx.post(f"{url}/telemetry", json=rtt(DEVICE), headers=headers, timeout=10).status_code == 401, name
        assert httpx.post(f"{url}/devices/announce", json=announce, headers=headers, timeout=10).status_code == 401, (
            name
        )
    other = bearer(mesh, "device-1", "device", auth.ISSUER)
    assert httpx.post(f"{url}/telemetry", json=rtt(DEVICE), headers=other, timeout=10).status_code == 403
    assert (
        httpx.post(f"{url}/telemetry", json=[rtt("device-1"), rtt(DEVICE)], headers=other, timeout=10).status_code
        == 403
    )  # one foreign record refuses the batch
    step = {"kind": "verifier_step", "batched_tokens": 1, "compute_s": 0.001}
    assert httpx.post(f"{url}/telemetry", json=step, headers=other, timeout=10).status_code == 403
    assert httpx.post(f"{url}/devices/announce", json=announce, headers=other, timeout=10).status_code == 403
    assert httpx.get(f"{url}/state/device/device-1", timeout=10).status_code == 404  # nothing of it kept
    assert httpx.post(f"{url}/telemetry", json=rtt("device-1"), headers=other, timeout=10).status_code == 200
    assert (
        httpx.post(
            f"{url}/telemetry", json=step, headers=bearer(mesh, "verifier-cloud", "service", auth.ISSUER), timeout=10
        ).status_code
        == 200
    )
    # A bootstrap token writes nothing, not even for its own id.
    bootstrap = bearer(mesh, DEVICE, "bootstrap", auth.ISSUER)
    assert httpx.post(f"{url}/telemetry", json=rtt(DEVICE), headers=bootstrap, timeout=10).status_code == 403
    assert httpx.get(f"{url}/readyz", timeout=10).status_code == 200


def test_planner_needs_a_token_and_a_device_asks_only_for_itself(mesh):
    url = f"{mesh.config.planner_url}/chunk-size"
    params = {"device_id": DEVICE, "prompt_tokens": 50}
    for name, headers in credentials(mesh, "device", DEVICE, auth.PLANNER).items():
        assert httpx.get(url, params=params, headers=headers, timeout=10).status_code == 401, name
        assert (
            httpx.get(
                f"{mesh.config.planner_url}/parallel-draft-steps",
                params={"device_id": DEVICE, "draft_len": 4},
                headers=headers,
                timeout=10,
            ).status_code
            == 401
        ), name
    assert (
        httpx.get(url, params=params, headers=bearer(mesh, "device-1", "device", auth.PLANNER), timeout=10).status_code
        == 403
    )
    assert (
        httpx.get(url, params=params, headers=bearer(mesh, DEVICE, "device", auth.PLANNER), timeout=10).status_code
        == 200
    )
    assert httpx.get(f"{mesh.config.planner_url}/healthz", timeout=10).status_code == 200


def test_only_the_monitor_holds_the_signing_key_and_a_device_only_its_bootstrap(mesh):
    trust = auth.TokenVerifier(auth.Trust.from_document(mesh.credentials.ring.jwks()))
    for service in mesh.services:
        secrets = {
            k: v for k, v in service.env.items() if k.startswith("TOPHAT_") and k.endswith(("_KEY_FILE", "_CREDENTIAL"))
        }
        if service.name == "state-monitor":
            assert secrets == {"TOPHAT_STATE_MONITOR_AUTH_KEY_FILE": str(mesh.credentials.key_file)}
        elif service.name.startswith("device-agent"):
            assert list(secrets) == ["TOPHAT_DEVICE_AUTH_CREDENTIAL"]
            claims = trust.verify(secrets["TOPHAT_DEVICE_AUTH_CREDENTIAL"], auth.ISSUER)
            assert (claims.role, claims.subject) == ("bootstrap", DEVICE)
        else:  # one service credential, its own
            (credential,) = secrets.values()
            assert trust.verify(credential, auth.ISSUER).role == "service"


@pytest.mark.slow
def test_a_revoked_device_is_refused_at_its_next_call(mesh):
    """Revoked at the issuer: the monitor refuses at once, the planner and the verifier once they re-read the
    revocation list (every auth_refresh_s, 1 s), and its enrollment again is refused."""
    victim = "device-5"
    params = {"device_id": victim, "prompt_tokens": 50}
    planner, verifier = f"{mesh.config.planner_url}/chunk-size", mesh.config.verifier_urls().split(",")[0]
    assert (
        httpx.get(planner, params=params, headers=bearer(mesh, victim, "device", auth.PLANNER), timeout=10).status_code
        == 200
    )
    revoked = cli(mesh, "revoke", "--device", victim)  # `tophat credentials revoke`, as an operator runs it
    assert revoked.exit_code == 0, revoked.output
    assert "device:device-5" in json.loads(revoked.output)["revoked"]
    assert (
        httpx.post(
            f"{mesh.config.monitor_url}/telemetry",
            json=rtt(victim),
            headers=bearer(mesh, victim, "device", auth.ISSUER),
            timeout=10,
        ).status_code
        == 401
    )

    def refused_by_planner_and_verifier() -> bool:
        response = httpx.get(planner, params=params, headers=bearer(mesh, victim, "device", auth.PLANNER), timeout=10)
        return (
            response.status_code == 401
            and response.json()["error"]["reason"] == "revoked"
            and asyncio.run(handshake(verifier, bearer(mesh, victim, "device", auth.VERIFIER))) == 401
        )

    assert wait_until(refused_by_planner_and_verifier, 6.0)  # a refresh (every 1 s), with room for a busy box
    enroll = {"device_id": victim, "url": "http://127.0.0.1:2"}
    assert (
        httpx.post(
            f"{mesh.config.monitor_url}/credentials/enroll",
            json=enroll,
            headers=bearer(mesh, "*", "bootstrap", auth.ISSUER),
            timeout=10,
        ).status_code
        == 403
    )


def cli(mesh: Mesh, *args: str):
    return CliRunner().invoke(
        app, ["credentials", *args, "--issuer", mesh.config.monitor_url, "--key-file", str(mesh.credentials.key_file)]
    )


def test_operator_issues_a_bootstrap_token_and_rotates_the_signing_key(mesh):
    issued = cli(mesh, "issue", "--role", "bootstrap", "--subject", "device-8", "--ttl-s", "600")
    assert issued.exit_code == 0, issued.output
    before = {k["kid"] for k in httpx.get(f"{mesh.config.monitor_url}/credentials/jwks", timeout=10).json()["keys"]}
    old_token = token(mesh, "device-8", "device", auth.PLANNER)  # signed by the key being rotated out
    rotated = cli(mesh, "rotate")
    assert rotated.exit_code == 0, rotated.output
    active = json.loads(rotated.output)["active"]
    after = {k["kid"] for k in httpx.get(f"{mesh.config.monitor_url}/credentials/jwks", timeout=10).json()["keys"]}
    assert after == before | {active} and active not in before  # the old key still verifies
    enrolled = httpx.post(
        f"{mesh.config.monitor_url}/credentials/enroll",
        timeout=10,
        json={"device_id": "device-8", "url": "http://127.0.0.1:3"},
        headers={"Authorization": f"Bearer {issued.output.strip()}"},
    )
    assert enrolled.status_code == 200  # the bootstrap token, signed before the rotation, still enrols
    assert jwt.get_unverified_header(enrolled.json()["token"])["kid"] == active  # new tokens: the new key
    params = {"device_id": "device-8", "prompt_tokens": 50}
    new_key = cli(mesh, "issue", "--role", "device", "--subject", "device-8", "--audience", auth.PLANNER)
    assert new_key.exit_code == 0, new_key.output

    def planner_takes(token: str) -> bool:
        return (
            httpx.get(
                f"{mesh.config.planner_url}/chunk-size",
                params=params,
                timeout=10,
                headers={"Authorization": f"Bearer {token}"},
            ).status_code
            == 200
        )

    # the planner re-read the key set (every 1 s; the wait leaves room for a busy box): it takes the new key, and
    # still the old one
    assert wait_until(lambda: planner_takes(new_key.output.strip()), 6.0)
    assert planner_takes(old_token)
    refused = cli(mesh, "issue", "--role", "device", "--subject", "x", "--ttl-s", "1e12")
    assert refused.exit_code == 1 and "422" in refused.output


@pytest.mark.slow
def test_the_mesh_still_serves_greedy_exact_text(mesh, demo_checkpoint):
    tokenizer = demo_checkpoint.tokenizer
    for prompt in ("The quick brown fox", "Once upon a time"):
        body = {"model": "tophat-demo", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        response = httpx.post(f"{mesh.config.streamer_url}/v1/completions", json=body, timeout=120)
        response.raise_for_status()
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        expected = tokenizer.decode(generate_full(demo_checkpoint, ids, MAX_TOKENS).token_ids, skip_special_tokens=True)
        assert response.json()["choices"][0]["text"] == expected
    secrets = [v for k, v in mesh.auth_env.items() if k.endswith("_CREDENTIAL")]
    device_env = next(s for s in mesh.services if s.name == "device-agent-0").env
    secrets.append(device_env["TOPHAT_DEVICE_AUTH_CREDENTIAL"])
    for service in mesh.services:  # no service wrote a credential to its log
        log_text = service.log_path.read_text(errors="replace")
        assert not any(secret in log_text for secret in secrets)
