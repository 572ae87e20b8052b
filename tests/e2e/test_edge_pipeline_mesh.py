"""`tophat up --edge-pipeline`: the demo model over three emulated edge devices (orin; xavier; xavier), real
processes, stages chained over TCP with the LAN profile on every hop between devices (tophatctl/edge_pipeline.py).

Greedy output through the pipeline (HAT drafting on device 0, verification through every stage, rollback
on every stage) must equal the unsplit model's; the prompt enters as the plan's sub-sequences."""

from __future__ import annotations

import json

import httpx
import pytest

from shared.jupiter.plan import build_plan, parse_edge_pipeline, parse_lan
from shared.jupiter.profile import Profile
from shared.specdec.reference import generate_full
from tests.conftest import DEMO_MODEL_DIR
from tophatctl.mesh import Mesh
from tophatctl.mesh_config import MeshConfig
from tophatctl.mesh_ports import find_port_base

# end-to-end: real processes, meshes or long statistical runs (make test-fast leaves these out)
pytestmark = pytest.mark.slow

SPEC = "orin;xavier;xavier"


def stored_plan(path):
    """A plan stored the way `tophat plan --out` stores one, from a fixed profile of the demo model's shape
    (a measured one depends on the machine's load; the mesh must follow whatever plan it is given):
    per-layer time 50 us + 20 us per token + 10 ns per token x prefix token: sub-sequences of 32+ pay."""
    lengths, prefixes = (1, 8, 32, 128, 512), (0, 512)
    profile = Profile(
        "demo",
        8,
        256,
        3_147_776,
        1024,
        8_388_608,
        8_389_632,
        lengths,
        prefixes,
        tuple(tuple(50e-6 + 20e-6 * s + 10e-9 * s * c for c in prefixes) for s in lengths),
    )
    plan = build_plan(profile, parse_edge_pipeline(SPEC), *parse_lan("lan"), draft_layers=2, max_len=512)
    return plan.save(path)


@pytest.fixture(scope="module")
def edge_mesh(tmp_path_factory):
    logs = tmp_path_factory.mktemp("edge-mesh")
    config = MeshConfig(
        model_dir=str(DEMO_MODEL_DIR),
        port_base=find_port_base(1),
        edge_pipeline=SPEC,
        lan="lan",
        edge_plan=str(stored_plan(logs / "plan.json")),
        auth=False,
        link_mode="inprocess",
        log_dir=logs,
    )
    with Mesh(config) as mesh:
        yield mesh


def _generate(mesh, body: dict) -> tuple[list[int], dict]:
    with httpx.Client(timeout=120) as http:
        response = http.post(f"{mesh.config.device_url(0)}/generate", json={"temperature": 0.0, **body})
    assert response.status_code == 200, response.text
    events = [json.loads(line) for line in response.text.splitlines()]
    assert events[-1]["type"] == "done", events[-1]
    return [t for e in events if e["type"] == "tokens" for t in e["token_ids"]], events[-1]


def test_the_plan_puts_more_layers_on_the_fast_device_and_stages_run_as_processes(edge_mesh):
    plan = edge_mesh.edge_plan
    counts = [stop - start for start, stop in plan.stage_layers]
    assert plan.kind == "jupiter" and len(counts) == 3 and sum(counts) == 8
    assert counts[0] > counts[1] and counts[0] > counts[2]  # orin is 3x the xaviers
    verifier_stages = ([(2, plan.stage_layers[0][1])] if plan.stage_layers[0][1] > 2 else []) + list(
        plan.stage_layers[1:]
    )
    log = (edge_mesh.config.log_dir / "verifier-cloud.log").read_text()
    for index, (start, stop) in enumerate(verifier_stages):  # each stage its own process, loaded its own layers
        assert f"stage {index} ready: layers [{start}, {stop})" in log


def test_greedy_through_the_pipeline_equals_the_unsplit_model(edge_mesh, demo_checkpoint):
    tokenizer = demo_checkpoint.tokenizer
    prompts = [
        tokenizer.encode(text, add_special_tokens=False)
        for text in (
            "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(",
            "The standard library's json module " * 12,  # long enough to be cut into several sub-sequences
        )
    ]
    for prompt in prompts:
        expected = generate_full(demo_checkpoint, prompt, 24).token_ids
        tokens, done = _generate(edge_mesh, {"prompt_ids": prompt, "max_new_tokens": 24})
        assert tokens == expected
    parts = edge_mesh.edge_plan.chunk_sizes(len(prompts[1]))
    assert sum(parts) == len(prompts[1]) and len(parts) > 1
