"""DiSCo end to end on a real mesh (real processes, sockets, Redis; the demo model): a race the
device wins with the cloud's session freed, a cost migration mid-answer, and a cloud that vanishes
mid-answer handed to the device. Every answer's text is checked token for token against what the
endpoints' models produce from the same prefix.

Two streamers share the mesh's device agent: the mesh's own with the default (server-constrained)
costs, and a second one whose exchange rate makes device energy dominate (device-constrained).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from shared.runtime import build_device_model
from shared.specdec.device_session import DraftConfig
from shared.specdec.local_decode import LocalSession
from shared.specdec.reference import generate_full
from shared.specdec.sampling import SamplingParams
from tests.conftest import DEMO_MODEL_DIR, REPO_ROOT
from tests.mesh_tools import device_sessions, verifier_state, wait_until
from tophatctl.demo_model.corpus import held_out_prompts
from tophatctl.mesh import Mesh
from tophatctl.mesh_config import MeshConfig
from tophatctl.mesh_ports import find_port_base

# end-to-end: real processes, meshes or long statistical runs (make test-fast leaves these out)
# timing: races and fits of real processes' speeds, so make test runs it alone (after the rest)
pytestmark = [pytest.mark.slow, pytest.mark.timing]

LINK = "lat=60ms"  # the cloud is a round trip away; the device is not
SPEED = "10"  # a device 10x slower than this host: still first for a short prompt, and slower to decode


@pytest.fixture(scope="module")
def mesh():
    base = find_port_base(1)
    config = MeshConfig(
        model_dir=str(DEMO_MODEL_DIR),
        num_devices=1,
        port_base=base,
        link=LINK,
        speed=SPEED,
        link_mode="inprocess",
        auth=False,
        extra_env={"TOPHAT_VERIFIER_FULL_MODEL": "true", "TOPHAT_STREAMER_DISCO_REFRESH_S": "0.3"},
        device_env={"failover_deadline_s": "1.0"},
    )
    with Mesh(config) as running:
        yield running


@pytest.fixture(scope="module")
def device_constrained(mesh, tmp_path_factory):
    """A second streamer over the same device agent, pricing device energy far above the server."""
    port = mesh.config.port_base + 50
    env = {
        **os.environ,
        "TOPHAT_STREAMER_PORT": str(port),
        "TOPHAT_STREAMER_DEVICE_URLS": mesh.config.device_url(0),
        "TOPHAT_STREAMER_STATE_MONITOR_URL": mesh.config.monitor_url,
        "TOPHAT_STREAMER_EXCHANGE_RATE": "1e-3",
        "TOPHAT_STREAMER_DISCO_REFRESH_S": "0.3",
    }
    log = (tmp_path_factory.mktemp("streamer") / "streamer.log").open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "services.token_streamer"], env=env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        else:
            raise RuntimeError("the second streamer did not become ready")
        yield url
    finally:
        process.terminate()
        process.wait(10)
        log.close()


@pytest.fixture(scope="module")
def models(demo_checkpoint):
    return demo_checkpoint, build_device_model(demo_checkpoint, 2, None)


@pytest.fixture(scope="module")
def prompt_ids(demo_checkpoint):
    return demo_checkpoint.tokenizer.encode(held_out_prompts(1, seed=11)[0][:120], add_special_tokens=False)


def device_alone(device_model, ids: list[int], max_new: int) -> list[int]:
    session = LocalSession(device_model, list(ids), SamplingParams(), DraftConfig(0.6, 0), max_new)
    tokens = session.prefill()
    while not session.is_finished:
        tokens += session.step()
    return tokens


def complete(url: str, checkpoint, ids: list[int], max_tokens: int, **tophat) -> dict:
    prompt = checkpoint.tokenizer.decode(ids)
    body = {"model": "demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "tophat": tophat}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def decode(checkpoint, ids: list[int]) -> str:
    return checkpoint.tokenizer.decode(ids, skip_special_tokens=True)


def test_race_the_device_wins_and_the_cloud_session_is_freed(mesh, models, prompt_ids):
    checkpoint, device_model = models
    # b = 1: every prompt races (eq. 3 leaves nothing device-only); the cloud is a 120 ms round trip away.
    answer = complete(
        mesh.config.streamer_url,
        checkpoint,
        prompt_ids,
        24,
        dispatch="disco",
        budget=1.0,
        reading_rate_tps=0,
        migration=False,
    )
    stats = answer["tophat"]
    assert stats["endpoints"] == ["cloud", "device"] and stats["endpoint"] == "device"
    assert answer["choices"][0]["text"] == decode(checkpoint, device_alone(device_model, prompt_ids, 24))
    assert stats["migrations"] == [] and stats["cost"]["tokens"]["device"]["decode"] == 24
    assert stats["cost"]["server"] > 0  # the losing cloud leg read the prompt: it is paid for
    assert wait_until(lambda: verifier_state(mesh)["sessions"] == 0, 10)  # its session (and KV) is gone
    assert wait_until(lambda: device_sessions(mesh) == 0, 10)


def test_cost_migration_device_to_cloud_loses_and_repeats_nothing(mesh, device_constrained, models, prompt_ids):
    checkpoint, device_model = models
    # Device-constrained: the device's decode is the costly one. It wins the race (b = 1: no wait) and,
    # once r_c * t_m tokens are buffered, hands decoding to the cloud by token ids.
    answer = complete(device_constrained, checkpoint, prompt_ids, 24, dispatch="disco", budget=1.0, reading_rate_tps=5)
    stats = answer["tophat"]
    assert stats["endpoint"] == "device", stats
    [migration] = [m for m in stats["migrations"] if "called_off" not in m]
    assert (migration["from"], migration["to"], migration["reason"]) == ("device", "cloud", "cost")
    k = migration["at_token"]
    assert 1 <= k < 24 and migration["buffered"] >= migration["buffer_needed"] >= 1
    head = device_alone(device_model, prompt_ids, k)
    tail = generate_full(checkpoint, prompt_ids + head, 24 - k).token_ids
    assert answer["choices"][0]["text"] == decode(checkpoint, head + tail)
    tokens = stats["cost"]["tokens"]
    # the race's cloud leg read the prompt; each receiver (one called off included) prompt + generated ids
    receivers = sum(len(prompt_ids) + m["at_token"] for m in stats["migrations"])
    assert tokens["cloud"]["prefill"] == len(prompt_ids) + receivers
    assert answer["usage"]["completion_tokens"] == 24
    print(
        f"\nmigration at token {k}: buffered {migration['buffered']} (needed {migration['buffer_needed']}), "
        f"target ready after {migration['ready_s']:.3f} s, largest delivery gap {migration['max_gap_s']:.3f} s "
        f"(1/r_c = {1 / 5:.3f} s)"
    )


def test_a_cloud_that_vanishes_mid_answer_is_handed_to_the_device(mesh, device_constrained, models, prompt_ids):
    checkpoint, device_model = models
    # A server TTFT history of 30 s: with b = 0 the device waits F^-1(1) = 30 s, so the cloud answers.
    records = [
        {
            "kind": "request",
            "request_id": f"seed-{i}",
            "prompt_tokens": 50,
            "ttft_s": 30.0,
            "server_ttft_s": 30.0,
            "endpoint": "cloud",
        }
        for i in range(12)
    ]
    httpx.post(f"{mesh.config.monitor_url}/telemetry", json=records, timeout=5).raise_for_status()
    time.sleep(1.0)  # two refreshes of the streamer's history
    body = {
        "model": "demo",
        "prompt": checkpoint.tokenizer.decode(prompt_ids),
        "max_tokens": 60,
        "temperature": 0,
        "stream": True,
        "tophat": {"dispatch": "disco", "budget": 0.0, "reading_rate_tps": 0, "migration": False},
    }
    text, final = "", None
    verifier = next(s for s in mesh.services if s.name == "verifier-cloud")
    killed = False
    with httpx.stream("POST", f"{device_constrained}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            if chunk.get("choices"):
                text += chunk["choices"][0].get("text") or ""
            if "tophat" in chunk:
                final = chunk["tophat"]
            if text and not killed:  # the cloud is answering: it goes away mid-answer
                os.kill(verifier.process.pid, signal.SIGKILL)
                killed = True
    assert killed and final is not None
    assert final["endpoint"] == "cloud" and final["decision"] == "tail-wait"
    [migration] = final["migrations"]
    assert (migration["from"], migration["to"], migration["reason"]) == ("cloud", "device", "cloud_lost")
    k = migration["at_token"]
    head = generate_full(checkpoint, prompt_ids, k).token_ids
    tail = device_alone(device_model, prompt_ids + head, 60 - k)
    assert text == decode(checkpoint, head + tail)
