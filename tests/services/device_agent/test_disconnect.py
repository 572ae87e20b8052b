"""A client that goes away cancels its request everywhere, streaming or not.

Real mesh (real processes, the demo model): a long generation is started over a
raw TCP socket, which is closed once the verifier is stepping it. Within a short
bound the verifier must hold no session, the device none either, and the
verifier's step counter must stop growing -- the generation did not run on to
`max_tokens` for nobody.
"""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest

from tests.conftest import DEMO_MODEL_DIR
from tests.mesh_tools import device_sessions, verifier_state, wait_until

# end-to-end: real processes, meshes or long statistical runs (make test-fast leaves these out)
pytestmark = pytest.mark.slow

MAX_TOKENS = 1024  # ~20 s of decoding on the demo model: far longer than any bound below
FREED_WITHIN_S = 5.0


@pytest.fixture(scope="module")
def mesh(default_demo_mesh):
    return default_demo_mesh  # conftest: shared with test_soak


def post_and_hold(url: str, body: dict) -> socket.socket:
    """Send a POST over a raw socket and return it unread: closing it is the client going away."""
    parts = urlsplit(url)
    payload = json.dumps(body).encode()
    sock = socket.create_connection((parts.hostname, parts.port), timeout=5)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: streamer\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    return sock


@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
def test_client_disconnect_frees_device_and_verifier(mesh, stream):
    assert wait_until(lambda: verifier_state(mesh)["sessions"] == 0 and device_sessions(mesh) == 0, 10)
    body = {"prompt": "Once upon a time", "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream}
    sock = post_and_hold(mesh.config.streamer_url, body)
    try:
        # Running: the verifier holds the session and has stepped it a few times.
        steps_at_start = verifier_state(mesh)["steps"]
        assert wait_until(
            lambda: verifier_state(mesh)["sessions"] == 1 and verifier_state(mesh)["steps"] >= steps_at_start + 5, 30
        )
        assert device_sessions(mesh) == 1
        time.sleep(0.5)
    finally:
        sock.close()
    assert wait_until(lambda: verifier_state(mesh)["sessions"] == 0, FREED_WITHIN_S), verifier_state(mesh)
    assert wait_until(lambda: device_sessions(mesh) == 0, FREED_WITHIN_S)
    steps = verifier_state(mesh)["steps"]
    time.sleep(1.0)
    assert verifier_state(mesh)["steps"] == steps  # nothing is decoding for the client that left
    # The mesh still serves: the freed slot takes the next request.
    done = httpx.post(
        f"{mesh.config.streamer_url}/v1/completions",
        json={"prompt": "Hello", "max_tokens": 8, "temperature": 0},
        timeout=60,
    )
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 8


# -- the device agent alone: its NDJSON consumer going away cancels the engine's session ---------------


async def test_device_generation_is_cancelled_and_cleaned_up_when_its_reader_leaves(demo_checkpoint, monkeypatch):
    """The device agent's /generate consumer (the streamer) closes the stream mid-generation:
    the engine's session must end as if it had finished -- CloseSession reaches the verifier,
    the device's KV is freed and the session slot is given back."""
    import asyncio

    from services.device_agent import settings as device_settings
    from services.device_agent.app import create_app
    from shared.specdec.device_session import DeviceSession
    from tests.mesh_tools import verifier_on_loopback
    from tests.services.token_streamer.test_token_streamer import serve

    freed: list[int] = []
    running: list[int] = [0]
    free = DeviceSession.free
    freed_mid_step: list[str] = []

    def spy_free(self):
        if running[0]:
            freed_mid_step.append("KV freed while a device thread was still computing on it")
        freed.append(id(self))
        free(self)

    def counted(step):
        def run(self, *args, **kwargs):
            running[0] += 1
            try:
                return step(self, *args, **kwargs)
            finally:
                running[0] -= 1

        return run

    monkeypatch.setattr(DeviceSession, "free", spy_free)
    for name in ("draft", "predraft", "on_verify_result", "on_prefill_result", "prefill_chunk"):
        monkeypatch.setattr(DeviceSession, name, counted(getattr(DeviceSession, name)))
    async with verifier_on_loopback(demo_checkpoint, 2) as (server, ws_url):
        ready_url = ws_url.replace("ws://", "http://").replace("/ws", "/readyz")
        settings = device_settings.Settings(
            model_dir=str(DEMO_MODEL_DIR),
            split_layers=2,
            verifier_url=ws_url,
            bandwidth_probe_interval_s=0,
            rtt_probe_interval_s=0,
        )
        async with serve(create_app(settings)) as device_url, httpx.AsyncClient(timeout=30) as http:

            async def verifier_sessions() -> int:
                return int((await http.get(ready_url)).text.split()[0].split("=")[1])

            freed_before = len(freed)  # the agent's warm-up session, freed at startup
            body = {"prompt": "Once upon a time", "max_new_tokens": 2000, "temperature": 0}
            async with http.stream("POST", f"{device_url}/generate", json=body) as response:
                lines = response.aiter_lines()
                seen = [json.loads(await anext(lines)) for _ in range(4)]  # start, prefill token, 2 rounds
                assert [e["type"] for e in seen] == ["start", "tokens", "tokens", "tokens"]
                assert await verifier_sessions() == 1
            async with asyncio.timeout(FREED_WITHIN_S):  # the stream is closed: the reader left
                while await verifier_sessions() or (await http.get(f"{device_url}/info")).json()["active_sessions"]:
                    await asyncio.sleep(0.02)
            assert len(freed) == freed_before + 1  # the request's own device KV, not only the cloud's
            assert freed_mid_step == []  # ... and only after the step in flight had finished with it
            done = await http.post(f"{device_url}/generate", json={**body, "max_new_tokens": 4})
            assert done.status_code == 200 and json.loads(done.text.splitlines()[-1])["type"] == "done"
