"""`tophat serve --edge-pipeline SPEC`: one model over several edge devices as pipeline stages (Jupiter).

The layer partition (shared/jupiter/partition.py) gives device i the layers [a_i, b_i); device 0's
range starts at 0. Jupiter's processes on that partition:

    device 0  device agent: embeddings + layers [0, m) + draft adapter + norm/head (drafts, accepts)
              verifier main (its scheduler, on device 0 beside the agent: no link between them)
              stage on layers [m, b_0)                    (only when device 0 holds more than m layers)
    device i  stage on layers [a_i, b_i)                 (i >= 1)

Neighbouring stages talk over the stage transport (shared/wire/stage_link.py: TCP, msgpack) and every hop
between two *different* devices is shaped with the LAN profile; the last stage's output travels back
to device 0 over the LAN too (the ring closes where the head is). m is the draft adapter's split: the
adapter imitates the layers after m from the states at m, so device 0 always drafts from layer m
whatever the partition gives it.

`stage_wiring` is pure: it turns a partition into the verifier's and the device agent's settings;
`configure_mesh` plans (or loads) the partition for a mesh about to start and points it at stage 0.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tophatctl.mesh_config import MeshConfig, MeshStartError

log = logging.getLogger(__name__)

MAX_PLANNED_LENGTH = 4096  # prompt lengths the sub-sequence table covers (longer ones scale the last entry)


@dataclass(frozen=True)
class StageWiring:
    """The verifier's pipeline as the edge pipeline runs it."""

    stage_layers: list[tuple[int, int]]  # the verifier's stages, in order (the middle layers [m, n))
    stage_devices: list[int]  # the edge device each stage runs on
    stage_slowdowns: list[float]
    hop_links: list[str]  # P + 1 hops: main -> stage 0, stage i -> stage i+1, last stage -> main

    def verifier_env(self) -> dict[str, str]:
        return {
            "TOPHAT_VERIFIER_PIPELINE_STAGES": str(len(self.stage_layers)),
            "TOPHAT_VERIFIER_STAGE_LAYERS": ",".join(f"{a}-{b}" for a, b in self.stage_layers),
            "TOPHAT_VERIFIER_STAGE_SLOWDOWNS": ",".join(f"{s:g}" for s in self.stage_slowdowns),
            "TOPHAT_VERIFIER_STAGE_LINKS": ";".join(self.hop_links),
        }


def stage_wiring(
    device_layers: Sequence[tuple[int, int]], slowdowns: Sequence[float], draft_layers: int, lan: str
) -> StageWiring:
    """Device i holds layers device_layers[i]; the verifier's stages are those ranges past the draft split.

    Raises ValueError when the ranges do not tile [0, n) in order, device 0 holds fewer than
    `draft_layers` layers, or nothing is left for the verifier."""
    if len(device_layers) != len(slowdowns) or len(device_layers) < 2:
        raise ValueError("an edge pipeline needs >= 2 devices, one slowdown each")
    start = 0
    for a, b in device_layers:
        if a != start or b <= a:
            raise ValueError(f"device layer ranges must tile the model in order, got {list(device_layers)}")
        start = b
    first_stop = device_layers[0][1]
    if first_stop < draft_layers:
        raise ValueError(f"device 0 holds {first_stop} layers but drafts from layer {draft_layers}")
    stages: list[tuple[int, int]] = []
    devices: list[int] = []
    if first_stop > draft_layers:
        stages.append((draft_layers, first_stop))
        devices.append(0)
    for i, (first, stop) in enumerate(device_layers[1:], start=1):
        stages.append((first, stop))
        devices.append(i)
    hosts = [0, *devices, 0]  # the verifier main sits on device 0, beside the agent
    hops = [lan if hosts[h] != hosts[h + 1] else "none" for h in range(len(hosts) - 1)]
    return StageWiring(stages, devices, [float(slowdowns[d]) for d in devices], hops)


def default_profile_path(model_dir: Path) -> Path:
    """Where `tophat profile` stores a model's profile unless told otherwise (build/ is not committed)."""
    from tophatctl.models import REPO_ROOT  # imports torch: only when a profile is looked for

    return REPO_ROOT / "build" / "profiles" / f"{Path(model_dir).name}.json"


def load_or_measure_profile(model_dir: Path, path: Path | None = None):
    """The model's stored profile; measured (and stored) first when there is none or it is another model's."""
    from shared.jupiter.profile import ProfileError, load_profile, measure_profile
    from shared.model.checkpoint import read_config

    path = path or default_profile_path(model_dir)
    config = read_config(Path(model_dir))
    try:
        profile = load_profile(path)
        if (profile.num_layers, profile.hidden_size) == (config["num_hidden_layers"], config["hidden_size"]):
            return profile
        log.warning("profile %s is for another model; measuring again", path)
    except ProfileError as exc:
        log.info("no usable profile (%s); measuring %s", exc, model_dir)
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each stage runs: one process per device, one thread each
    try:
        profile = measure_profile(model_dir)
    finally:
        torch.set_num_threads(threads)
    profile.save(path)
    return profile


def edge_plan(model_dir: Path, spec: str, lan: str, kind: str, draft_layers: int, plan_path: str | None = None):
    """A stored plan (checked against the model and the spec), or one planned now from the stored profile."""
    from shared.jupiter.plan import build_plan, load_plan, parse_edge_pipeline, parse_lan
    from shared.model.checkpoint import read_config

    config = read_config(Path(model_dir))
    devices = parse_edge_pipeline(spec)
    if plan_path:
        plan = load_plan(plan_path, config["num_hidden_layers"], config["hidden_size"])
        if [(d.slowdown, d.memory_bytes) for d in plan.devices] != [(d.slowdown, d.memory_bytes) for d in devices]:
            raise ValueError(
                f"plan {plan_path} is for devices {[d.name for d in plan.devices]} with other speeds "
                f"or memory budgets, not {spec!r}"
            )
        if parse_lan(plan.lan) != parse_lan(lan):
            raise ValueError(f"plan {plan_path} was made for the LAN {plan.lan!r}, not {lan!r}")
        if plan.draft_layers != draft_layers:
            raise ValueError(f"plan {plan_path} drafts from layer {plan.draft_layers}, the mesh from {draft_layers}")
        return plan
    profile = load_or_measure_profile(Path(model_dir))
    bandwidth, latency = parse_lan(lan)
    max_len = min(int(config.get("max_position_embeddings", 2048)), MAX_PLANNED_LENGTH)
    return build_plan(profile, devices, bandwidth, latency, draft_layers=draft_layers, max_len=max_len, kind=kind)


def configure_mesh(config: MeshConfig, model_dir: Path):
    """Plan (or load) `config.edge_pipeline` for a mesh about to start; returns the plan and the verifier's stage
    settings. The plan is stored in the mesh's log directory and `config` changed to run it: one device agent
    (stage 0, at device 0's speed, beside the verifier's main: no link between them) reading that plan."""
    if config.num_devices != 1 or config.verifiers != 1:
        raise MeshStartError("an edge pipeline serves from one device agent (its first stage) and one verifier")
    try:
        plan = edge_plan(
            model_dir,
            config.edge_pipeline,
            config.lan,
            config.edge_plan_kind,
            config.split_layers,
            config.edge_plan or None,
        )
        wiring = stage_wiring(plan.stage_layers, [d.slowdown for d in plan.devices], plan.draft_layers, plan.lan)
    except ValueError as exc:
        raise MeshStartError(f"edge pipeline {config.edge_pipeline!r}: {exc}") from exc
    assert config.log_dir is not None, "Mesh() sets the log directory"
    plan_path = plan.save(config.log_dir / "edge-plan.json")
    log.info(
        "edge pipeline %s: layers %s (%s plan), verifier stages %s, hops %s",
        config.edge_pipeline,
        list(plan.stage_layers),
        plan.kind,
        wiring.stage_layers,
        wiring.hop_links,
    )
    config.pipeline_stages = len(wiring.stage_layers)
    config.speed = f"{plan.devices[0].slowdown:g}"
    config.link = "none"  # the agent and the verifier's main both live on device 0
    config.device_env = {**config.device_env, "edge_plan": str(plan_path)}
    return plan, wiring.verifier_env()
