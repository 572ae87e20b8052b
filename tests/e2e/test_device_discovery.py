"""A mesh run as containers run it: device agents on any free port, with host-name ids, announce
themselves to the state monitor, and the streamer routes to whatever announced (real processes)."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from shared.specdec.reference import generate_full
from tests.conftest import DEMO_MODEL_DIR
from tophatctl.mesh import Mesh
from tophatctl.mesh_config import MeshConfig
from tophatctl.mesh_ports import find_port_base

# end-to-end: real processes, meshes or long statistical runs (make test-fast leaves these out)
pytestmark = pytest.mark.slow

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    config = MeshConfig(
        model_dir=str(DEMO_MODEL_DIR),
        num_devices=2,
        port_base=find_port_base(0),
        discover_devices=True,
        log_dir=tmp_path_factory.mktemp("logs"),
        extra_env={"TOPHAT_STATE_MONITOR_ANNOUNCE_TTL_S": "2", "TOPHAT_STREAMER_DISCOVERY_INTERVAL_S": "0.5"},
    )
    with Mesh(config) as running:
        yield running


def complete(mesh: Mesh, prompt: str) -> dict:
    body = {"model": "demo", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    response = httpx.post(f"{mesh.config.streamer_url}/v1/completions", json=body, timeout=120)
    response.raise_for_status()
    return response.json()


def routable(mesh: Mesh) -> list[dict]:
    return [d for d in httpx.get(f"{mesh.config.streamer_url}/stats", timeout=10).json()["devices"] if d["healthy"]]


def test_devices_announce_and_serve(mesh, demo_checkpoint):
    listed = httpx.get(f"{mesh.config.monitor_url}/devices", timeout=10).json()["devices"]
    assert len(listed) == 2
    assert {d["device_id"] for d in listed} == {"device-0", "device-1"}  # each its own bootstrap token's id
    prompt = "def fibonacci(n):"
    ids = demo_checkpoint.tokenizer.encode(prompt, add_special_tokens=False)
    expected = demo_checkpoint.tokenizer.decode(
        generate_full(demo_checkpoint, ids, MAX_TOKENS).token_ids, skip_special_tokens=True
    )
    for _ in range(3):
        assert complete(mesh, prompt)["choices"][0]["text"] == expected
    deadline = time.monotonic() + 10
    while len(routable(mesh)) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert {d["device_id"] for d in routable(mesh)} == {d["device_id"] for d in listed}


def test_a_vanished_device_is_retired_and_the_rest_serve(mesh):
    victim = next(s for s in mesh.services if s.name == "device-agent-1")
    os.killpg(victim.process.pid, signal.SIGKILL)
    victim.process.wait(10)
    deadline = time.monotonic() + 15
    while len(httpx.get(f"{mesh.config.monitor_url}/devices", timeout=10).json()["devices"]) > 1:
        assert time.monotonic() < deadline, "the dead agent never left the monitor's list"
        time.sleep(0.2)
    while len(routable(mesh)) > 1:
        assert time.monotonic() < deadline, "the streamer still routes to the dead agent"
        time.sleep(0.2)
    for _ in range(3):  # none of these may land on the dead agent
        assert complete(mesh, "import os")["choices"][0]["finish_reason"] in ("length", "stop")
