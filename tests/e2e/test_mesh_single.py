"""End to end on a real mesh with one device agent: real processes, real
sockets on loopback, real Redis. Devices reach the verifier through a relay
that records every cloud-bound frame, so privacy is checked on what really
crossed the wire."""

from __future__ import annotations

import json
import time

import httpx
import pytest
import redis

from shared.specdec.reference import generate_full
from shared.wire import schema as wire
from tests.conftest import DEMO_MODEL_DIR
from tests.mesh_tools import CapturingRelay
from tophatctl.demo_model.corpus import held_out_prompts
from tophatctl.mesh import Mesh
from tophatctl.mesh_config import MeshConfig
from tophatctl.mesh_ports import find_port_base

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def relay_and_mesh():
    base = find_port_base(1)
    relay = CapturingRelay(f"ws://127.0.0.1:{base + 100}/ws").start()
    config = MeshConfig(model_dir=str(DEMO_MODEL_DIR), num_devices=1, port_base=base, device_verifier_url=relay.url)
    with Mesh(config) as mesh:
        yield relay, mesh
    relay.stop()


@pytest.fixture(scope="module")
def prompts(demo_checkpoint):
    return [p[:160] for p in held_out_prompts(3, seed=5)]


def complete(mesh: Mesh, prompt: str, **extra) -> dict:
    body = {"model": "tophat-demo", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
    response = httpx.post(f"{mesh.config.streamer_url}/v1/completions", json=body, timeout=120)
    response.raise_for_status()
    return response.json()


@pytest.mark.slow
def test_greedy_text_equals_the_full_model(relay_and_mesh, demo_checkpoint, prompts):
    _, mesh = relay_and_mesh
    tokenizer = demo_checkpoint.tokenizer
    for prompt in prompts:
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        expected = tokenizer.decode(generate_full(demo_checkpoint, ids, MAX_TOKENS).token_ids, skip_special_tokens=True)
        assert complete(mesh, prompt)["choices"][0]["text"] == expected


def test_device_agent_streams_token_ids_equal_to_the_full_model(relay_and_mesh, demo_checkpoint, prompts):
    _, mesh = relay_and_mesh
    ids = demo_checkpoint.tokenizer.encode(prompts[0], add_special_tokens=False)
    events = []
    with httpx.stream(
        "POST",
        f"{mesh.config.device_url(0)}/generate",
        # the chain named: the draft budget may answer "none" on a loaded CI box, and this test is about the
        # speculative rounds (several tokens per round trip), not about the budget's choice
        json={"prompt_ids": ids, "max_new_tokens": MAX_TOKENS, "draft_shape": "chain"},
        timeout=120,
        auth=mesh.operator_auth(),
    ) as response:  # as the streamer calls it
        for line in response.iter_lines():
            if line:
                events.append(json.loads(line))
    tokens = [t for e in events if e["type"] == "tokens" for t in e["token_ids"]]
    assert tokens == generate_full(demo_checkpoint, ids, MAX_TOKENS).token_ids
    assert events[0]["type"] == "start" and events[-1]["type"] == "done"
    assert len([e for e in events if e["type"] == "tokens"]) < len(tokens)  # several tokens per round trip


def test_openai_client_streams_sse_until_done(relay_and_mesh, prompts):
    from httpx_sse import connect_sse
    from openai import OpenAI

    _, mesh = relay_and_mesh
    client = OpenAI(base_url=f"{mesh.config.streamer_url}/v1", api_key="unused", timeout=120)
    stream = client.chat.completions.create(
        model="tophat-demo",
        messages=[{"role": "user", "content": prompts[1]}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
    )
    pieces = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
    assert "".join(pieces)
    with httpx.Client(timeout=120) as http:
        with connect_sse(
            http,
            "POST",
            f"{mesh.config.streamer_url}/v1/completions",
            json={"prompt": prompts[2], "max_tokens": 8, "stream": True},
        ) as source:
            data = [event.data for event in source.iter_sse()]
    assert data[-1] == "[DONE]"
    assert all(json.loads(d)["object"] == "text_completion" for d in data[:-1])


def test_no_cloud_bound_frame_carries_tokens_or_text(relay_and_mesh, demo_checkpoint, prompts):
    relay, mesh = relay_and_mesh
    complete(mesh, prompts[0])
    assert relay.frames, "the relay saw no traffic"
    types = set()
    for frame in relay.frames:
        message = wire.assert_privacy_safe(frame)
        types.add(type(message).__name__)
        assert prompts[0][:24].encode() not in frame
    assert {"OpenSession", "PrefillChunk", "VerifyRequest"} <= types


def _wait_for(predicate, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    return predicate()


def test_telemetry_keys_appear_in_redis(relay_and_mesh, prompts):
    _, mesh = relay_and_mesh
    complete(mesh, prompts[1])
    client = redis.Redis.from_url(mesh.redis_url, decode_responses=True)
    assert _wait_for(lambda: client.xlen("tophat:verifier:steps") > 0)
    assert _wait_for(lambda: client.xlen("tophat:requests") > 0)
    assert _wait_for(lambda: client.exists("tophat:device:device-0:state"))
    step = client.xrevrange("tophat:verifier:steps", count=1)[0][1]
    assert int(step["batched_tokens"]) >= 1 and float(step["compute_s"]) > 0
    cloud = httpx.get(f"{mesh.config.monitor_url}/state/cloud", timeout=5).json()
    assert cloud["mu"] is not None
    # The device measured its link with bulk probes and reported gamma, beta_up and beta_down.
    device = _wait_for(
        lambda: (lambda d: d if d.get("beta_down") else None)(
            httpx.get(f"{mesh.config.monitor_url}/state/device/device-0", timeout=5).json()
        )
    )
    assert device["beta_up"] > 0 and device["beta_down"] > 0 and device["gamma"] > 0
    # ... and, for the simulator, its small-message round trip, per-round overhead and prompt cost.
    assert device["rtt_s"] > 0 and device["round_overhead_s"] >= 0 and device["prefill_token_s"] > 0
    assert cloud["step_overhead_s"] is not None and cloud["step_overhead_s"] >= 0


def test_serving_survives_redis_going_away(relay_and_mesh, prompts):
    _, mesh = relay_and_mesh
    port = mesh.redis.port
    mesh.redis.stop()
    try:
        assert complete(mesh, prompts[2])["choices"][0]["text"]
        assert httpx.get(f"{mesh.config.monitor_url}/readyz", timeout=5).status_code == 200
    finally:
        mesh.redis.start()
    assert mesh.redis.port == port
    # The monitor's sink reconnects on its own backoff (or at once, woken by the next record); only
    # what is served after that can reach Redis, so wait for the reconnect before serving again.
    assert _wait_for(lambda: httpx.get(f"{mesh.config.monitor_url}/readyz", timeout=5).json()["redis"]["connected"], 15)
    # The verifier sends its steps in batches: a request's steps may go in one POST, and the first write on a
    # pooled connection from before the restart can fail (that batch is dropped and counted). Telemetry has
    # resumed when a later request's steps arrive.
    client = redis.Redis.from_url(mesh.redis_url, decode_responses=True)
    for _ in range(3):
        complete(mesh, prompts[2])
        if _wait_for(lambda: client.xlen("tophat:verifier:steps") > 0, 5):
            break
    assert client.xlen("tophat:verifier:steps") > 0  # telemetry resumed


@pytest.mark.slow
def test_per_request_switches_reach_the_device(relay_and_mesh, prompts):
    _, mesh = relay_and_mesh
    hat = complete(mesh, prompts[0])
    ushape = complete(mesh, prompts[0], tophat={"speculative": False, "prompt_chunking": False})
    assert ushape["choices"][0]["text"] == hat["choices"][0]["text"]  # lossless either way
    assert ushape["tophat"]["mean_accept_length"] == 1.0
    bad = httpx.post(
        f"{mesh.config.streamer_url}/v1/completions",
        json={"prompt": "x", "max_tokens": 2, "tophat": {"speculativ": False}},
        timeout=30,
    )
    assert bad.status_code == 400
