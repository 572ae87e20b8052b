"""End to end with four device agents in parallel and eight concurrent sessions
on one verifier (real processes, loopback sockets, real Redis)."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest
import redis

from shared.specdec.reference import generate_full
from tests.conftest import DEMO_MODEL_DIR
from tophatctl.demo_model.corpus import held_out_prompts
from tophatctl.mesh import Mesh
from tophatctl.mesh_config import MeshConfig
from tophatctl.mesh_ports import find_port_base

# end-to-end: real processes, meshes or long statistical runs (make test-fast leaves these out)
pytestmark = pytest.mark.slow

MAX_TOKENS = 20


@pytest.fixture(scope="module")
def mesh():
    config = MeshConfig(model_dir=str(DEMO_MODEL_DIR), num_devices=4, port_base=find_port_base(4))
    with Mesh(config) as running:
        yield running


def complete(mesh: Mesh, prompt: str) -> str:
    body = {"model": "tophat-demo", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    response = httpx.post(f"{mesh.config.streamer_url}/v1/completions", json=body, timeout=300)
    response.raise_for_status()
    return response.json()["choices"][0]["text"]


def expected_text(checkpoint, prompt: str) -> str:
    ids = checkpoint.tokenizer.encode(prompt, add_special_tokens=False)
    return checkpoint.tokenizer.decode(generate_full(checkpoint, ids, MAX_TOKENS).token_ids, skip_special_tokens=True)


def test_eight_concurrent_sessions_over_four_devices(mesh, demo_checkpoint):
    prompts = [p[:120] for p in held_out_prompts(8, seed=21)]
    expected = [expected_text(demo_checkpoint, p) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda p: complete(mesh, p), prompts))
    assert got == expected

    # Every device served some of them.
    served = []
    for i in range(4):
        client = redis.Redis.from_url(mesh.redis_url, decode_responses=True)
        served.append(client.xlen(f"tophat:device:device-{i}:events"))
    assert all(n > 0 for n in served), served

    # The verifier batched sessions together: some step carried several sessions' tokens.
    client = redis.Redis.from_url(mesh.redis_url, decode_responses=True)
    steps = [fields for _, fields in client.xrange("tophat:verifier:steps")]
    batched = [s for s in steps if int(s["num_sessions"]) >= 2]
    assert batched, "no forward pass served two sessions at once"
    assert all(int(s["batched_tokens"]) >= int(s["num_sessions"]) for s in batched)
