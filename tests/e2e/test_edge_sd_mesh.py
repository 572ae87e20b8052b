"""`tophat up --edge-draft-server`: the demo model's draft server (device agent 0 in its edge role), the verifier
holding the whole target, the chunk planner planning each round from the state monitor's telemetry, real
processes. Users come through the token streamer's OpenAI endpoint at once, each with its uplink SNR."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from shared.specdec.reference import generate_full
from tests.conftest import DEMO_MODEL_DIR
from tophatctl.mesh import Mesh
from tophatctl.mesh_config import MeshConfig
from tophatctl.mesh_ports import find_port_base

# end-to-end: real processes, meshes or long statistical runs (make test-fast leaves these out)
# timing: races and fits of real processes' speeds, so make test runs it alone (after the rest)
pytestmark = [pytest.mark.slow, pytest.mark.timing]

QUESTIONS = (
    "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(",
    "The standard library's json module ",
    "import os\nimport sys\n\n\ndef main():\n",
    'class Config:\n    """',
)


@pytest.fixture(scope="module")
def edge_sd_mesh(tmp_path_factory):
    logs = tmp_path_factory.mktemp("edge-sd-mesh")
    config = MeshConfig(
        model_dir=str(DEMO_MODEL_DIR),
        port_base=find_port_base(1),
        edge_draft_server=True,
        auth=False,
        link_mode="inprocess",
        log_dir=logs,
        device_env={"edge_window_s": "1.0"},
    )
    with Mesh(config) as mesh:
        yield mesh


async def _ask_together(mesh, prompts: list[str], snrs: list[float]) -> list[dict]:
    async with httpx.AsyncClient(timeout=120) as http:

        async def one(prompt: str, snr_db: float) -> dict:
            body = {
                "model": "tophat",
                "prompt": prompt,
                "max_tokens": 16,
                "temperature": 0,
                "tophat": {"snr_db": snr_db},
            }
            response = await http.post(f"{mesh.config.streamer_url}/v1/completions", json=body)
            assert response.status_code == 200, response.text
            return response.json()

        return await asyncio.gather(*(one(p, s) for p, s in zip(prompts, snrs)))


def test_users_at_once_get_the_unsplit_models_answers_in_one_planned_round(edge_sd_mesh, demo_checkpoint):
    tokenizer = demo_checkpoint.tokenizer
    answers = asyncio.run(_ask_together(edge_sd_mesh, list(QUESTIONS), [12.0, 25.0, 40.0, 55.0]))
    for prompt, answer in zip(QUESTIONS, answers):
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        expected = generate_full(demo_checkpoint, ids, 16).token_ids
        assert answer["choices"][0]["text"] == tokenizer.decode(expected)
    with httpx.Client(timeout=10) as http:
        rounds = http.get(f"{edge_sd_mesh.config.device_url(0)}/edge-sd/rounds").json()["rounds"]
        plan = http.get(f"{edge_sd_mesh.config.planner_url}/edge-sd/plan").json()
    (record,) = rounds  # the four arrived within the window: one round
    assert sorted(i for b in record["plan"]["batches"] for i in b) == [0, 1, 2, 3]
    assert plan["batches"] == record["plan"]["batches"]  # planned by the chunk planner, which keeps the latest
    shares = plan["shares"]
    assert abs(sum(shares) - 1) < 1e-9 and len(set(round(s, 9) for s in shares)) > 1  # eq. 27, not uniform
    assert plan["sources"]["snr_db"] == "request" and plan["sources"]["shares"] == "eq27"
    # the first round plans from the defaults; its passes and verdicts reach the monitor for the next
    assert plan["sources"]["draft_runtime"].startswith("default")


def test_the_next_round_is_planned_from_the_first_ones_telemetry(edge_sd_mesh):
    # after the first test's round (or this one's first, run alone), the monitor holds its samples
    for _ in range(2):
        asyncio.run(_ask_together(edge_sd_mesh, list(QUESTIONS), [20.0, 20.0, 30.0, 30.0]))
    with httpx.Client(timeout=10) as http:
        plan = http.get(f"{edge_sd_mesh.config.planner_url}/edge-sd/plan").json()
        telemetry = http.get(f"{edge_sd_mesh.config.monitor_url}/state/edge-sd").json()
    assert telemetry["draft"] and telemetry["verify"] and telemetry["verdicts"]
    assert plan["sources"]["alpha"] == "telemetry"
    assert plan["sources"]["draft_runtime"] == "fitted:telemetry"
    assert plan["sources"]["verify_runtime"] == "fitted:telemetry"


def test_a_bad_snr_is_refused_with_a_typed_error(edge_sd_mesh):
    with httpx.Client(timeout=30) as http:
        response = http.post(
            f"{edge_sd_mesh.config.streamer_url}/v1/completions",
            json={"model": "tophat", "prompt": "x", "max_tokens": 4, "tophat": {"snr_db": "loud"}},
        )
    assert response.status_code in (400, 422)
    assert "snr_db" in json.dumps(response.json())
