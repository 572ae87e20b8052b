"""Every hop authenticated (issue 12), on one real mesh (`tophat up`'s default: a random mesh secret per run).

Missing, forged (bad signature), expired and wrong-identity credentials are refused at every internal
endpoint: the verifier's WebSocket handshake, a device's /generate, the monitor's POST /telemetry and
/devices/announce, the planner. A device token writing for another device id gets 403. Probes stay open,
and the mesh, whose services mint and send their own tokens, still serves greedy-exact completions.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from shared import auth
from shared.specdec.reference import generate_full
from tests.conftest import DEMO_MODEL_DIR
from tophatctl.mesh import Mesh
from tophatctl.mesh_config import MeshConfig
from tophatctl.mesh_ports import find_port_base

MAX_TOKENS = 12
DEVICE = "device-0"


@pytest.fixture(scope="module")
def mesh():
    config = MeshConfig(model_dir=str(DEMO_MODEL_DIR), num_devices=1, port_base=find_port_base(1))
    assert config.auth  # the launcher's default
    with Mesh(config) as running:
        yield running


def secret_of(mesh: Mesh) -> str:
    return mesh.auth_env["TOPHAT_VERIFIER_AUTH_SECRET"]


def credentials(mesh: Mesh, role: str, subject: str) -> dict[str, dict[str, str]]:
    """Every credential the endpoint must refuse, by name -> headers; `role`/`subject` the one it would take."""
    secret, now = secret_of(mesh), time.time()
    good = auth.issue(secret, subject, role, 60, now)
    return {
        "missing": {},
        "not bearer": {"Authorization": f"Basic {good}"},
        "forged": {"Authorization": f"Bearer {auth.issue('not-the-mesh-secret', subject, role, 60, now)}"},
        "tampered": {"Authorization": f"Bearer {good[:-2]}{'A' if good[-2] != 'A' else 'B'}{good[-1]}"},
        "expired": {"Authorization": f"Bearer {auth.issue(secret, subject, role, 60, now - 120)}"},
    }


def bearer(mesh: Mesh, subject: str, role: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {auth.issue(secret_of(mesh), subject, role, 60, time.time())}"}


def rtt(device_id: str) -> dict:
    return {"kind": "device_rtt", "device_id": device_id, "rtt_s": 0.01}


@pytest.mark.slow
def test_verifier_handshake_needs_a_device_token(mesh):
    url = mesh.config.verifier_urls().split(",")[0]

    async def status(headers: dict[str, str]) -> int:
        try:
            async with connect(url, additional_headers=headers, open_timeout=10):
                return 101
        except InvalidStatus as exc:
            return exc.response.status_code

    async def run() -> None:
        for name, headers in credentials(mesh, "device", DEVICE).items():
            assert await status(headers) == 401, name
        assert await status(bearer(mesh, "token-streamer", "service")) == 403  # not a device
        assert await status(bearer(mesh, "device-7", "device")) == 101

    asyncio.run(run())
    assert httpx.get(f"http://127.0.0.1:{mesh.config.verifier_port}/healthz", timeout=5).status_code == 200


def test_device_generate_and_info_need_a_service_token(mesh):
    url = mesh.config.device_url(0)
    body = {"prompt": "hello", "max_new_tokens": 2}
    for name, headers in credentials(mesh, "service", "token-streamer").items():
        assert httpx.post(f"{url}/generate", json=body, headers=headers, timeout=10).status_code == 401, name
        assert httpx.get(f"{url}/info", headers=headers, timeout=10).status_code == 401, name
    device = bearer(mesh, DEVICE, "device")  # even this device's own credential: only the streamer calls it
    assert httpx.post(f"{url}/generate", json=body, headers=device, timeout=10).status_code == 403
    assert httpx.get(f"{url}/info", headers=bearer(mesh, "token-streamer", "service"), timeout=10).status_code == 200
    for probe in ("/healthz", "/readyz", "/metrics"):
        assert httpx.get(f"{url}{probe}", timeout=10).status_code == 200, probe


def test_monitor_writes_need_a_token_and_a_device_writes_only_for_itself(mesh):
    url = mesh.config.monitor_url
    announce = {"device_id": DEVICE, "url": "http://127.0.0.1:1", "max_sessions": 1}
    for name, headers in credentials(mesh, "device", DEVICE).items():
        assert httpx.post(f"{url}/telemetry", json=rtt(DEVICE), headers=headers, timeout=10).status_code == 401, name
        assert httpx.post(f"{url}/devices/announce", json=announce, headers=headers,
                          timeout=10).status_code == 401, name
    other = bearer(mesh, "device-1", "device")
    assert httpx.post(f"{url}/telemetry", json=rtt(DEVICE), headers=other, timeout=10).status_code == 403
    assert httpx.post(f"{url}/telemetry", json=[rtt("device-1"), rtt(DEVICE)], headers=other,
                      timeout=10).status_code == 403  # one foreign record refuses the batch
    step = {"kind": "verifier_step", "batched_tokens": 1, "compute_s": 0.001}
    assert httpx.post(f"{url}/telemetry", json=step, headers=other, timeout=10).status_code == 403
    assert httpx.post(f"{url}/devices/announce", json=announce, headers=other, timeout=10).status_code == 403
    assert httpx.get(f"{url}/state/device/device-1", timeout=10).status_code == 404  # nothing of it kept
    assert httpx.post(f"{url}/telemetry", json=rtt("device-1"), headers=other, timeout=10).status_code == 200
    assert httpx.post(f"{url}/telemetry", json=step, headers=bearer(mesh, "verifier-cloud", "service"),
                      timeout=10).status_code == 200
    assert httpx.get(f"{url}/readyz", timeout=10).status_code == 200


def test_planner_needs_a_token_and_a_device_asks_only_for_itself(mesh):
    url = f"{mesh.config.planner_url}/chunk-size"
    params = {"device_id": DEVICE, "prompt_tokens": 50}
    for name, headers in credentials(mesh, "device", DEVICE).items():
        assert httpx.get(url, params=params, headers=headers, timeout=10).status_code == 401, name
        assert httpx.get(f"{mesh.config.planner_url}/parallel-draft-steps", params={"device_id": DEVICE,
                         "draft_len": 4}, headers=headers, timeout=10).status_code == 401, name
    assert httpx.get(url, params=params, headers=bearer(mesh, "device-1", "device"), timeout=10).status_code == 403
    assert httpx.get(url, params=params, headers=bearer(mesh, DEVICE, "device"), timeout=10).status_code == 200
    assert httpx.get(f"{mesh.config.planner_url}/healthz", timeout=10).status_code == 200


@pytest.mark.slow
def test_the_mesh_still_serves_greedy_exact_text(mesh, demo_checkpoint):
    tokenizer = demo_checkpoint.tokenizer
    for prompt in ("The quick brown fox", "Once upon a time"):
        body = {"model": "tophat-demo", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        response = httpx.post(f"{mesh.config.streamer_url}/v1/completions", json=body, timeout=120)
        response.raise_for_status()
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        expected = tokenizer.decode(generate_full(demo_checkpoint, ids, MAX_TOKENS).token_ids,
                                    skip_special_tokens=True)
        assert response.json()["choices"][0]["text"] == expected
    for service in mesh.services:  # no service wrote a credential to its log
        assert secret_of(mesh) not in service.log_path.read_text(errors="replace")
