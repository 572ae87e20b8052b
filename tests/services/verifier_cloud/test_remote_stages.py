"""Pipeline stages started on their own (`python -m services.verifier_cloud.stage`), wired by address.

Three stage processes are started by the test, each on its own loopback port, as an operator (or Swarm) would
start them on three hosts; the verifier is given their addresses and spawns nothing. The split halves must
still equal the whole model, the stage link must be authenticated, and a stage that is replaced must be
wired again by the verifier.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
import uvicorn

from services.device_agent.cloud_client import WebSocketCloud
from services.state_monitor.app import create_app as create_monitor_app
from services.state_monitor.settings import load_settings as monitor_settings
from services.verifier_cloud.remote_stages import RemoteStages, wire_remote_stages
from services.verifier_cloud.server import VerifierServer
from services.verifier_cloud.settings import Settings
from shared.auth import verify as auth
from shared.auth.client import BrokerAuth, TokenBroker
from shared.auth.signing import KeyRing
from shared.model.checkpoint import load_checkpoint
from shared.processes.redis_server import free_port
from shared.specdec.reference import generate_full
from shared.wire import schema as wire
from shared.wire.stage_codec import StageLinkError
from tests.mesh_tools import split_identity
from tests.services.verifier_cloud.test_pipeline_stages import M, generate_over_ws

pytestmark = pytest.mark.asyncio(loop_scope="module")

RING = KeyRing.generate()  # the issuer's signing keys: only the issuer (a real state monitor app) uses them
STRANGER = KeyRing.generate()
LAYERS = [(2, 3), (3, 4), (4, 5)]  # the tiny model's middle layers, one per stage
REPO = Path(__file__).resolve().parents[3]


def start_stage(model_dir: Path, issuer_url: str, index: int, port: int) -> subprocess.Popen:
    start, stop = LAYERS[index]
    env = {**os.environ, "TOPHAT_STAGE_AUTH_ISSUER_URL": issuer_url, "PYTHONPATH": str(REPO)}
    command = [
        sys.executable,
        "-m",
        "services.verifier_cloud.stage",
        "--model-dir",
        str(model_dir),
        "--split-layers",
        str(M),
        "--layers",
        f"{start}-{stop}",
        "--index",
        str(index),
        "--listen",
        f"127.0.0.1:{port}",
    ]
    return subprocess.Popen(command, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def stop_stage(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(5)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def issuer(tmp_path_factory):
    """The mesh's issuer: a real state monitor app over uvicorn on loopback, holding RING."""
    keys = tmp_path_factory.mktemp("issuer") / "keys.json"
    RING.save(keys)
    app = create_monitor_app(monitor_settings({}, auth_key_file=str(keys), redis_url="", embedded_redis=False))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        assert not task.done(), "the issuer did not start"
        await asyncio.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    await asyncio.wait_for(task, 10)


@pytest.fixture(scope="module")
def stages(tiny_llama_dir, issuer):
    """([stage process], [its port]): three stages started on their own."""
    ports = [free_port() for _ in LAYERS]
    running = [start_stage(tiny_llama_dir, issuer, i, port) for i, port in enumerate(ports)]
    yield running, ports
    for process in running:
        stop_stage(process)
        assert process.returncode == 0, process.stderr.read().decode()[-2000:] if process.stderr else ""


def remote(ports) -> RemoteStages:
    async def unused() -> bytes:
        raise AssertionError("wire_remote_stages is given its credential")

    return RemoteStages(tuple(("127.0.0.1", p) for p in ports), ("127.0.0.1", 0), "127.0.0.1", unused)


def token(
    role: str = "service", subject: str = "verifier-cloud", audience: str = auth.STAGE, ring: KeyRing = RING
) -> bytes:
    return ring.mint(subject, role, audience, 60, time.time()).encode()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def verifier(stages, tiny_llama_dir, issuer):
    _, ports = stages
    credential = RING.mint(auth.VERIFIER_SUBJECT, "service", auth.ISSUER, 3600, time.time())
    settings = Settings(
        port=0,
        split_layers=M,
        model_dir=str(tiny_llama_dir),
        auth_issuer_url=issuer,
        auth_credential=credential,
        stage_addresses=",".join(f"127.0.0.1:{p}" for p in ports),
        stage_start_timeout_s=60.0,
        stage_timeout_s=30.0,
    )
    server = VerifierServer.from_settings(settings)
    stop, started = asyncio.Event(), asyncio.get_running_loop().create_future()
    task = asyncio.create_task(server.serve_forever(stop, started))
    port = await asyncio.wait_for(started, 90)
    yield server, port
    stop.set()
    await asyncio.wait_for(task, 30)


def device_cloud(checkpoint, issuer: str, port: int) -> WebSocketCloud:
    broker = TokenBroker(issuer, RING.mint("device-0", "device", auth.ISSUER, 3600, time.time()))
    return WebSocketCloud(
        f"ws://127.0.0.1:{port}/ws",
        checkpoint.hidden_size,
        wire.WireDtype.F32,
        auth=BrokerAuth(broker, auth.VERIFIER),
        **split_identity(checkpoint, M),
    )


@pytest.mark.slow
async def test_independent_stage_processes_answer_like_the_whole_model(verifier, tiny_llama_dir, issuer):
    server, port = verifier
    assert (
        server.pipeline is not None and server.pipeline.remote is not None and server.pipeline.workers.processes == []
    )
    checkpoint = load_checkpoint(tiny_llama_dir, with_tokenizer=False)
    prompts = [[(7 * i + j) % 200 + 1 for j in range(5 + 4 * i)] for i in range(3)]
    cloud = device_cloud(checkpoint, issuer, port)
    got = await asyncio.gather(*(generate_over_ws(checkpoint, cloud, p, 900 + i) for i, p in enumerate(prompts)))
    await cloud.close_connection()
    assert got == [generate_full(checkpoint, p, 12).token_ids for p in prompts]
    assert await server.pipeline.probe() == [{}, {}, {}]  # every stage freed the sessions' KV


@pytest.mark.slow
async def test_a_replaced_stage_is_wired_again_and_serves_exactly(verifier, stages, tiny_llama_dir, issuer):
    server, port = verifier
    running, ports = stages
    pipeline = server.pipeline
    assert pipeline is not None
    stop_stage(running[1])  # the host of stage 1 went away; its replacement comes up on the same address
    async with httpx.AsyncClient(timeout=5) as http:
        for _ in range(300):
            if (await http.get(f"http://127.0.0.1:{port}/readyz")).status_code == 503:
                break
            await asyncio.sleep(0.1)
        assert (await http.get(f"http://127.0.0.1:{port}/readyz")).status_code == 503
        running[1] = start_stage(tiny_llama_dir, issuer, 1, ports[1])
        for _ in range(600):
            if (await http.get(f"http://127.0.0.1:{port}/readyz")).status_code == 200:
                break
            await asyncio.sleep(0.1)
        assert (await http.get(f"http://127.0.0.1:{port}/readyz")).status_code == 200
    assert pipeline.restarts >= 1
    checkpoint = load_checkpoint(tiny_llama_dir, with_tokenizer=False)
    prompt = [5, 17, 33, 2, 9, 4]
    cloud = device_cloud(checkpoint, issuer, port)
    assert await generate_over_ws(checkpoint, cloud, prompt, 950) == generate_full(checkpoint, prompt, 12).token_ids
    await cloud.close_connection()


@pytest.mark.slow
async def test_a_stage_link_needs_a_service_credential_and_the_right_layers(verifier, stages):
    """Run after the verifier's own runs (its stop frees the stages): a device's credential, one for another
    audience, a forged or malformed one, or a wrong layer plan wires nothing, and the stages stay up for the next
    good wiring."""
    server, _ = verifier
    await server.pipeline.aclose()  # Stop flows down the chain: every stage ends its run and waits again
    _, ports = stages
    refused = (token("device", "device-0"), token(audience=auth.VERIFIER), token(ring=STRANGER), b"not-a-token")
    for credential in refused:
        with pytest.raises(StageLinkError, match="stage 2"):
            await asyncio.to_thread(wire_remote_stages, remote(ports), LAYERS, credential, 5.0)
    with pytest.raises(StageLinkError, match="holding layers \\[4, 5\\)"):
        await asyncio.to_thread(wire_remote_stages, remote(ports), [(2, 3), (3, 4), (4, 6)], token(), 5.0)
    first, last = await asyncio.to_thread(wire_remote_stages, remote(ports), LAYERS, token(), 10.0)
    first.close()
    last.close()


async def test_stage_addresses_set_the_stage_count_and_exclude_emulated_links(tiny_llama_dir):
    settings = Settings(model_dir=str(tiny_llama_dir), stage_addresses="jetson-1:7200, [::1]:7201")
    settings.validate()
    assert settings.pipeline_stages == 2 and settings.stage_workers
    assert settings.remote_stage_addresses() == [("jetson-1", 7200), ("::1", 7201)]
    for bad in (
        {"stage_addresses": "jetson-1"},
        {"stage_addresses": "a:1,b:2", "stage_links": "lan"},
        {"stage_addresses": "a:1,b:2", "pipeline_stages": 3},
        {"stage_return_address": "nope"},
    ):
        with pytest.raises(ValueError):
            Settings(model_dir=str(tiny_llama_dir), **bad).validate()


async def test_a_stage_on_a_taken_port_fails_at_once_naming_it(caplog):
    from services.verifier_cloud.stage import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["--layers", "2-5", "--listen", f"127.0.0.1:{port}"]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in caplog.text


async def test_a_silent_connection_to_a_stages_port_does_not_delay_its_wiring(tiny_llama_dir):
    """Issue 47: anyone who can reach a stage's port could hold a connection open without a word, and the stage
    gave it the whole control timeout before reading the verifier's. Now every connection is read at once, each
    within its own handshake deadline: the verifier wires the stage while silent connections are held open."""
    port = free_port()
    stage = start_stage(tiny_llama_dir, "", 0, port)  # an open mesh: the credential is not what is tested here
    layers, address = [LAYERS[0]], ("127.0.0.1", port)
    try:
        first, last = await asyncio.to_thread(wire_remote_stages, remote([port]), layers, b"open", 60.0)  # loaded
        first.close()  # the run ends: the stage waits to be wired again
        last.close()
        silent = [socket.create_connection(address, timeout=5) for _ in range(3)]
        await asyncio.sleep(0.3)  # the stage has accepted them (and, before, read the first one's credential for 10 s)
        started = time.monotonic()
        first, last = await asyncio.to_thread(wire_remote_stages, remote([port]), layers, b"open", 8.0)
        took_s = time.monotonic() - started
        first.close()
        last.close()
        assert took_s < 3.0, f"wiring took {took_s:.1f}s with silent connections held open"
        for sock in silent:
            sock.close()
    finally:
        stop_stage(stage)
