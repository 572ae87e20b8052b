"""`tophat profile` and `tophat plan`: Jupiter's offline parallelism planning (paper 002 §IV-B).

    tophat profile --model demo                     # per-layer t(S, c) on this machine + sizes
    tophat plan --edge-pipeline "orin;xavier;xavier" --profile build/profiles/demo.json

Mount with `app.command("profile")(profile_command)` and `app.command("plan")(plan_command)`.
Outputs go under build/ (git-ignored) unless --out says otherwise: profiles in build/profiles/
(where `tophat serve --edge-pipeline` looks), plans in build/jupiter/.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Optional

import typer

from shared.jupiter.plan import (
    DEFAULT_REFERENCE_LENGTH,
    PLAN_KINDS,
    EdgePlan,
    build_plan,
    parse_edge_pipeline,
    parse_lan,
)
from shared.jupiter.profile import DEFAULT_LENGTHS, DEFAULT_PREFIXES, DEFAULT_REPEATS, Profile, load_profile
from shared.jupiter.sequence import DEFAULT_K_MAX, DEFAULT_L_MIN_TOLERANCE, min_subsequence_length

log = logging.getLogger(__name__)

OUT_DIR = Path(__file__).resolve().parent.parent / "build" / "jupiter"
DEFAULT_LAN = "100mbit,lat=1ms"  # Jupiter's headline LAN (100 Mbps); latency is our choice


def _fail(message: str) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=2)


def _ints(text: str, name: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        _fail(f"{name} must be comma-separated integers, got {text!r}")
    if not values:
        _fail(f"{name} is empty")
    return values


def run_profile(
    model: str, lengths: list[int], prefixes: list[int], repeats: int, out: Optional[Path] = None
) -> tuple[Profile, Path]:
    """Measure `model` (demo | smollm2 | a checkpoint dir) and save its profile; (profile, path)."""
    from shared.jupiter.profile import measure_profile
    from tophatctl.edge_pipeline import default_profile_path  # where `tophat serve --edge-pipeline` looks
    from tophatctl.models import resolve_model

    model_dir = resolve_model(model)
    profile = measure_profile(model_dir, lengths, prefixes, repeats)
    return profile, profile.save(out or default_profile_path(model_dir))


def format_profile(profile: Profile, tolerance: float = DEFAULT_L_MIN_TOLERANCE) -> str:
    header = "     S " + "".join(f"  c={c:<6d}ms" for c in profile.prefixes) + "   us/token (c=0)"
    rows = [
        f"{profile.model_name}: {profile.num_layers} layers, hidden {profile.hidden_size}, {profile.dtype}, "
        f"measured on {profile.measured_on or '?'}",
        "per-layer time t(S, c):",
        header,
    ]
    for s, times in zip(profile.lengths, profile.layer_times):
        rows.append(f"{s:6d} " + "".join(f"  {t * 1e3:10.3f}" for t in times) + f"   {times[0] / s * 1e6:10.2f}")
    l_min = min_subsequence_length(profile.lengths, [row[0] for row in profile.layer_times], tolerance)
    mib = 1024**2
    rows.append(
        f"memory: {profile.layer_weight_bytes / mib:.2f} MiB/layer, KV {profile.kv_bytes_per_token_layer} "
        f"B/token/layer, embeddings {profile.embed_bytes / mib:.2f} MiB, head {profile.head_bytes / mib:.2f} MiB, "
        f"draft {profile.draft_bytes / mib:.2f} MiB"
    )
    rows.append(f"l_min (per-token time within {tolerance:.0%} of the best S's): {l_min}")
    return "\n".join(rows)


def format_plan(plan: EdgePlan, baselines: dict[str, EdgePlan]) -> str:
    """The partition, its bottleneck against the baselines', and the sub-sequence table by bucket."""
    rows = [f"{plan.kind} plan for {plan.model_name} over {plan.num_stages} devices, LAN {plan.lan}"]
    for device, (start, stop) in zip(plan.devices, plan.stage_layers):
        rows.append(
            f"  {device.name:>8s} (x{device.slowdown:g}, {device.memory_bytes / 1024**2:.0f} MiB): "
            f"layers [{start:3d}, {stop:3d})  {stop - start} layers"
        )
    rows.append(f"bottleneck stage at S={plan.reference_length}: {plan.predicted_bottleneck_s * 1e3:.3f} ms")
    for kind, other in baselines.items():
        ratio = other.predicted_bottleneck_s / plan.predicted_bottleneck_s
        rows.append(
            f"  {kind:>8s}: {other.predicted_bottleneck_s * 1e3:.3f} ms ({ratio:.2f}x), "
            f"layers {[b - a for a, b in other.stage_layers]}"
        )
    rows.append(f"sub-sequences (l_min {plan.l_min}, k_max {plan.k_max}); predicted prefill ms by prompt length:")
    rows.append("  length  " + "".join(f"{k:>10s}" for k in [plan.kind, *baselines]) + "  parts")
    others = {kind: dict(other.predicted_ttft) for kind, other in baselines.items()}
    for length, seconds in plan.predicted_ttft:
        cells = [seconds] + [others[kind].get(length, math.nan) for kind in baselines]
        rows.append(f"  {length:6d}  " + "".join(f"{c * 1e3:10.2f}" for c in cells) + f"  {plan.chunk_sizes(length)}")
    return "\n".join(rows)


def profile_command(
    model: str = typer.Option("demo", help="demo | smollm2 | a checkpoint directory"),
    lengths: str = typer.Option(",".join(map(str, DEFAULT_LENGTHS)), help="sequence lengths S to time"),
    prefixes: str = typer.Option(",".join(map(str, DEFAULT_PREFIXES)), help="KV prefix lengths c before them"),
    repeats: int = typer.Option(DEFAULT_REPEATS, min=1, help="timed passes per (S, c); the median counts"),
    out: Optional[Path] = typer.Option(
        None, help="profile JSON (default build/profiles/MODEL.json, where `tophat serve --edge-pipeline` looks for it)"
    ),
    threads: int = typer.Option(
        1,
        min=1,
        help="torch threads: 1 by default, as each edge stage is its own "
        "process sharing this host's few cores (more threads contend and time noisily)",
    ),
):
    """Profile per-layer time t(S, c) on this machine (the reference device class, orin) and the
    model's memory per layer, for `tophat plan` (Jupiter §IV-B)."""
    import torch

    from shared.model.checkpoint import ModelLoadError

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        profile, path = run_profile(model, _ints(lengths, "--lengths"), _ints(prefixes, "--prefixes"), repeats, out)
    except (ModelLoadError, ValueError, OSError) as exc:
        _fail(str(exc))
    finally:
        torch.set_num_threads(previous_threads)  # the caller's setting (a test process runs on)
    typer.echo(format_profile(profile))
    typer.echo(f"profile written to {path}")


def plan_command(
    edge_pipeline: str = typer.Option(
        ..., "--edge-pipeline", help="devices in order, e.g. 'orin;xavier;xavier:512MiB'"
    ),
    profile: Path = typer.Option(..., "--profile", help="a profile JSON from `tophat profile`"),
    lan: str = typer.Option(DEFAULT_LAN, help="LAN between neighbours: '100mbit,lat=1ms' or a link spec"),
    kind: str = typer.Option("jupiter", "--edge-plan-kind", help=" | ".join(PLAN_KINDS)),
    draft_layers: int = typer.Option(
        2, "--split-layers", min=0, help="m: layers the first device must keep (it drafts from layer m)"
    ),
    max_len: int = typer.Option(2048, "--max-len", min=1, help="longest prompt planned (and KV sized) for"),
    reference_length: int = typer.Option(DEFAULT_REFERENCE_LENGTH, help="S at which stage costs are compared"),
    k_max: int = typer.Option(DEFAULT_K_MAX, "--k-max", min=1, help="most sub-sequences per prompt"),
    l_min_tolerance: float = typer.Option(
        DEFAULT_L_MIN_TOLERANCE, help="l_min: per-token time within this fraction of the longest profiled S's"
    ),
    out: Optional[Path] = typer.Option(None, help="plan JSON (default build/jupiter/plan-MODEL-KIND.json)"),
):
    """Plan an edge pipeline from a profile: DP layer partition and sub-sequence table, saved for reuse."""
    from shared.jupiter.partition import PartitionError
    from shared.jupiter.profile import ProfileError

    try:
        loaded = load_profile(profile)
        devices = parse_edge_pipeline(edge_pipeline)
        bandwidth, latency = parse_lan(lan)
        plans = {}
        for each in dict.fromkeys([kind, *PLAN_KINDS]):  # the chosen kind first, then the others to compare
            try:
                plans[each] = build_plan(
                    loaded,
                    devices,
                    bandwidth,
                    latency,
                    draft_layers,
                    max_len,
                    each,
                    reference_length,
                    k_max,
                    l_min_tolerance,
                )
            except (PartitionError, ValueError):
                if each == kind:
                    raise
                log.warning("no %s plan for comparison: it does not fit", each)
    except (ProfileError, ValueError) as exc:
        _fail(str(exc))
    plan = plans.pop(kind)
    path = plan.save(out or OUT_DIR / f"plan-{plan.model_name}-{kind}.json")
    typer.echo(format_plan(plan, plans))
    typer.echo(f"plan written to {path}")
