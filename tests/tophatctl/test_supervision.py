"""Losing a process loses nothing for long: `tophat up` restarts what dies, and readiness tells the truth.

A real `tophat up` (its own process, the demo model, one device) writes its state file; the test
reads every pid from it, `kill -9`s the verifier and then a device agent, and watches the mesh:
while the verifier is down the device agent's /readyz says 503 with a reason and the streamer
answers at once with a typed error (no hang); the supervisor brings the verifier back (a new pid in
the state file), the device reconnects and a greedy completion equals the unsplit model's. A
second, in-process streamer routes around a device agent whose verifier is unreachable.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from shared.specdec.reference import generate_full
from tests.conftest import DEMO_MODEL_DIR
from tophatctl.mesh_ports import find_port_base
from tophatctl.service_process import REPO_ROOT
from tophatctl.supervisor import RestartPolicy

# end-to-end: real processes, meshes or long statistical runs (make test-fast leaves these out)
pytestmark = pytest.mark.slow

ROLES = {"verifier-cloud", "device-agent", "token-streamer", "chunk-planner", "state-monitor", "redis"}
PROMPT = "Once upon a time"
MAX_TOKENS = 12
START_TIMEOUT_S = 90.0
RECOVERY_TIMEOUT_S = 40.0
FAILOVER_DEADLINE_S = 30.0  # the device agent's default failover_deadline_s


def wait_for(predicate, timeout_s: float, interval_s: float = 0.1):
    """The predicate's first truthy value within the timeout, else its last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval_s)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def get(url: str) -> httpx.Response | None:
    try:
        return httpx.get(url, timeout=2.0)
    except httpx.HTTPError:
        return None


class RunningMesh:
    def __init__(self, tmp: Path):
        self.base = find_port_base(1)
        self.state_file = tmp / "state.json"
        self.log = open(tmp / "tophat-up.log", "wb")  # noqa: SIM115 - closed in stop()
        command = (
            "from tophat.cli import app; app()",
            "up",
            "--model",
            str(DEMO_MODEL_DIR),
            "--port-base",
            str(self.base),
            "--state-file",
            str(self.state_file),
            "--no-auth",
        )  # open: a test streamer outside the mesh calls its device agent
        self.process = subprocess.Popen(
            [sys.executable, "-c", *command],
            cwd=REPO_ROOT,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.streamer = f"http://127.0.0.1:{self.base}"
        self.device = f"http://127.0.0.1:{self.base + 200}"

    def entries(self) -> list[dict]:
        try:
            return json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return []

    def pid_of(self, role: str) -> int | None:
        return next((e["pid"] for e in self.entries() if e["role"] == role), None)

    def ready(self) -> bool:
        response = get(f"{self.streamer}/readyz")
        return response is not None and response.status_code == 200

    def log_text(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=5)
        self.log.close()


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    running = RunningMesh(tmp_path_factory.mktemp("supervised"))
    try:
        started = wait_for(
            lambda: running.process.poll() is not None or (len(running.entries()) == len(ROLES) and running.ready()),
            START_TIMEOUT_S,
            0.3,
        )
        assert started and running.process.poll() is None, running.log_text()
        yield running
    finally:
        pids = [e["pid"] for e in running.entries()]
        running.stop()
        assert not [pid for pid in pids if alive(pid)], "tophat up left processes behind"


def complete(mesh: RunningMesh) -> httpx.Response:
    return httpx.post(
        f"{mesh.streamer}/v1/completions",
        timeout=60,
        json={"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0},
    )


def expected_text(checkpoint) -> str:
    ids = checkpoint.tokenizer.encode(PROMPT, add_special_tokens=False)
    return checkpoint.tokenizer.decode(generate_full(checkpoint, ids, MAX_TOKENS).token_ids, skip_special_tokens=True)


def test_state_file_lists_every_role_with_a_live_pid_and_no_password(mesh):
    entries = mesh.entries()
    assert {e["role"] for e in entries} == ROLES
    assert all(alive(e["pid"]) for e in entries), entries
    redis_url = next(e["url"] for e in entries if e["role"] == "redis")
    assert redis_url.startswith("redis://***@"), redis_url  # the embedded Redis's password is redacted
    assert next(e["url"] for e in entries if e["role"] == "device-agent") == mesh.device


def test_killed_verifier_makes_devices_unready_then_is_restarted(mesh, demo_checkpoint):
    assert complete(mesh).json()["choices"][0]["text"] == expected_text(demo_checkpoint)
    old_pid = mesh.pid_of("verifier-cloud")
    killed_at = time.monotonic()
    os.kill(old_pid, signal.SIGKILL)

    # The device agent notices at once (its connection dropped) and says why it is not ready.
    unready = wait_for(lambda: (r := get(f"{mesh.device}/readyz")) is not None and r.status_code == 503 and r, 10)
    assert unready, "the device agent stayed ready without a verifier"
    assert "verifier" in unready.json()["error"]["message"]
    # A request while the verifier is away, beside the watch for its restart: the streamer answers
    # with a typed error (the device is marked down), or the device waits for the verifier's return
    # (its failover deadline, 30 s by default) and finishes -- never a hang.
    with ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        during_outage = pool.submit(lambda: (complete(mesh), time.monotonic() - started))
        new_pid = wait_for(lambda: (pid := mesh.pid_of("verifier-cloud")) != old_pid and pid, RECOVERY_TIMEOUT_S)
        assert new_pid and alive(new_pid), mesh.log_text()
        print(f"verifier killed -> new pid: {time.monotonic() - killed_at:.2f} s")
        answer, answered_after_s = during_outage.result(timeout=60)
    if answer.status_code != 200:
        assert answer.status_code in (502, 503) and answer.json()["error"]["code"], answer.text
        assert answered_after_s < FAILOVER_DEADLINE_S + 5
    else:  # the verifier came back within this request: then it must be the right text
        assert answer.json()["choices"][0]["text"] == expected_text(demo_checkpoint)
    print(f"request during the outage: HTTP {answer.status_code} after {answered_after_s:.2f} s: {answer.text[:300]}")

    assert wait_for(
        lambda: (r := get(f"{mesh.device}/readyz")) is not None and r.status_code == 200, RECOVERY_TIMEOUT_S
    ), mesh.log_text()
    assert wait_for(mesh.ready, RECOVERY_TIMEOUT_S)
    print(f"verifier killed -> restarted and device ready: {time.monotonic() - killed_at:.2f} s")
    assert complete(mesh).json()["choices"][0]["text"] == expected_text(demo_checkpoint)
    assert "verifier-cloud exited with -9" in mesh.log_text()


def test_killed_device_agent_is_restarted(mesh, demo_checkpoint):
    old_pid = mesh.pid_of("device-agent")
    killed_at = time.monotonic()
    os.kill(old_pid, signal.SIGKILL)
    new_pid = wait_for(lambda: (pid := mesh.pid_of("device-agent")) != old_pid and pid, RECOVERY_TIMEOUT_S)
    assert new_pid and alive(new_pid), mesh.log_text()
    print(f"device agent killed -> new pid: {time.monotonic() - killed_at:.2f} s")
    assert wait_for(
        lambda: (r := get(f"{mesh.device}/readyz")) is not None and r.status_code == 200, RECOVERY_TIMEOUT_S
    ), mesh.log_text()
    assert wait_for(mesh.ready, RECOVERY_TIMEOUT_S)
    print(f"device agent killed -> restarted and ready: {time.monotonic() - killed_at:.2f} s")
    assert complete(mesh).json()["choices"][0]["text"] == expected_text(demo_checkpoint)


async def test_streamer_routes_around_a_device_without_a_verifier(mesh, demo_checkpoint):
    """A second device agent whose verifier is unreachable is not ready, and a streamer over both
    devices sends every request to the one that is."""
    from services.device_agent import settings as device_settings
    from services.device_agent.agent import DeviceAgent
    from services.device_agent.app import create_app as device_app
    from services.token_streamer.app import create_app as streamer_app
    from services.token_streamer.settings import load_settings
    from tests.services.token_streamer.test_token_streamer import dead_url, serve

    dead = dead_url().replace("http://", "ws://") + "/ws"  # nothing listens there
    settings = device_settings.Settings(
        device_id="orphan",
        model_dir=str(DEMO_MODEL_DIR),
        split_layers=2,
        verifier_url=dead,
        bandwidth_probe_interval_s=0,
        rtt_probe_interval_s=0,
    )
    agent = await asyncio.to_thread(DeviceAgent, settings)  # loaded before serve()'s 5 s start bound
    async with serve(device_app(settings, agent)) as orphan, httpx.AsyncClient(timeout=60) as http:
        not_ready = await http.get(f"{orphan}/readyz")
        assert not_ready.status_code == 503 and "verifier" in not_ready.json()["error"]["message"]
        streamer_settings = load_settings({}, device_urls=f"{orphan},{mesh.device}", health_interval_s=0.5)
        async with serve(streamer_app(streamer_settings)) as streamer:
            assert (await http.get(f"{streamer}/readyz")).json() == {"ready": True, "ready_devices": 1}  # probes
            health = {d["url"]: d["healthy"] for d in (await http.get(f"{streamer}/stats")).json()["devices"]}
            assert health == {orphan: False, mesh.device: True}
            for _ in range(3):
                answer = await http.post(
                    f"{streamer}/v1/completions", json={"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
                )
                assert answer.status_code == 200, answer.text
                assert answer.json()["choices"][0]["text"] == expected_text(demo_checkpoint)


def test_restart_backoff_doubles_to_a_cap_and_resets_after_a_long_run():
    policy = RestartPolicy(initial_s=0.5, max_s=10.0, reset_after_s=30.0)
    delays, delay = [], None
    for _ in range(7):
        delay = policy.next_delay(delay, uptime_s=1.0)
        delays.append(delay)
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert policy.next_delay(10.0, uptime_s=31.0) == 0.5  # it stayed up: a new crash starts over
