"""`tophat simulate`: the mesh's serving modes at scale, as a discrete-event simulation.

Mount with `app.command("simulate")(simulate_command)` (from loadgen.simulate.cli). Pure
Python: runs in seconds, needs no model, no torch, no running mesh (unless asked to
calibrate from a state monitor).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer

if TYPE_CHECKING:
    from loadgen.simulate.calibration import Calibration

log = logging.getLogger(__name__)


def _fail(message: str) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=2)


def _floats(text: str, name: str) -> list[float]:
    try:
        values = [math.inf if p.strip().lower() == "inf" else float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        _fail(f"{name} must be comma-separated numbers, got {text!r}")
    if not values:
        _fail(f"{name} is empty")
    return values


def simulate_command(
    calibration: Optional[Path] = typer.Option(None, help="calibration JSON (see loadgen/simulate/calibration.py)"),
    state_monitor_url: Optional[str] = typer.Option(None, help="or: calibrate from a running state monitor"),
    devices: int = typer.Option(30, min=1, help="simulated devices (HAT: 30; 20 slow / 10 fast when expanded)"),
    stages: Optional[int] = typer.Option(None, min=1, help="cloud pipeline stages P (default 4; 1 with --gpu-profile)"),
    rates: str = typer.Option("4,6,9", help="request rates (req/s), comma-separated; inf = all at t=0"),
    modes: str = typer.Option(
        "ushape,usarathi,cloud,hat",
        help="ushape, usarathi[-C], cloud[-stream], hat[-sd][-pc][-pd], hat-budget, hat-tree",
    ),
    workload: str = typer.Option("specbench", help="prompt lengths: specbench or cnndm (HAT Table 3)"),
    num_requests: int = typer.Option(200, "--num-requests", "-n", min=1, help="requests per run"),
    seed: int = typer.Option(0, help="seed for arrivals, prompts and speculation draws"),
    burstiness: float = typer.Option(1.0, help="gamma shape of inter-arrival gaps (1 = Poisson)"),
    max_new_tokens: Optional[int] = typer.Option(None, min=1, help="tokens per request (default: calibration, 128)"),
    routing: str = typer.Option("least-loaded", help="least-loaded (token streamer) or round-robin"),
    heterogeneous: bool = typer.Option(True, help="slow down 2/3 of the devices when expanding profiles"),
    mode_cycle: Optional[str] = typer.Option(None, help="device speed modes cycled every 5 requests, e.g. 1,2,5,10"),
    baseline: str = typer.Option("ushape", help="mode the ratios are taken against"),
    out: Optional[Path] = typer.Option(None, help="write simulation.json (and calibration.json) here"),
    compare_real: Optional[list[Path]] = typer.Option(None, help="loadgen results.json to compare with (repeatable)"),
    real_mode: Optional[str] = typer.Option(None, help="mode of the --compare-real runs (default: hat)"),
    gpu_profile: Optional[str] = typer.Option(
        None,
        help="the cloud on a GPU: a `tophat bench gpu` JSON, or h100 (docs/benchmarks/gpu-h100.json); g(mu) "
        "from its verify pass per row count, the model's shape from it, accept lengths from "
        "--adapter-report, links scaled to its hidden size (loadgen/simulate/gpu_profile.py)",
    ),
    gpu_passes: str = typer.Option(
        "eager",
        help="with --gpu-profile: eager (as measured per row count) or graph "
        "(the eager curve scaled to the 1-row CUDA-graph replay)",
    ),
    replicas: Optional[int] = typer.Option(
        None,
        min=1,
        help="verifier replicas, each session pinned to one (default 8 with --gpu-profile: an 8-GPU server; else 1)",
    ),
    adapter_report: Optional[str] = typer.Option(
        None,
        help="with --gpu-profile: accept lengths from this adapter report's held-out chain rounds "
        "(default models/smollm2/adapter_report.json)",
    ),
    tree_nodes: int = typer.Option(
        16,
        min=0,
        help="with --gpu-profile: tree rounds of this many nodes for hat-tree and hat-budget (0: none), "
        "from --adapter-report's held_out.trees and --trees-bench (loadgen/simulate/trees.py)",
    ),
    trees_bench: Optional[str] = typer.Option(
        None,
        help="with --tree-nodes: a `tophat bench trees` JSON, for a tree round's drafting over a chain "
        "round's (default docs/benchmarks/2026-11-28-trees-f32.json)",
    ),
    target: Optional[float] = typer.Option(
        None, help="say whether hat's mean TBT is <= this x the baseline's at every rate (e.g. 0.6)"
    ),
    target_modes: str = typer.Option("hat,hat-tree,hat-budget", help="the modes --target judges (those run)"),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="log every run"),
) -> None:
    """Simulate the serving modes (HAT testbed scale) from latency models fitted to the real mesh."""
    import dataclasses

    from loadgen.simulate.gpu_profile import DEFAULT_REPLICAS
    from loadgen.simulate.modes import parse_modes
    from loadgen.simulate.report import grid_tables, ratio_summary
    from loadgen.simulate.run import SimConfig, simulate_grid

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("loadgen.simulate").setLevel(logging.INFO if verbose else logging.WARNING)
    if calibration is not None and state_monitor_url:
        _fail("give at most one of --calibration and --state-monitor-url")
    try:
        cal = _calibration(calibration, state_monitor_url)
        if gpu_profile:
            cal = _on_gpu(cal, gpu_profile, gpu_passes, adapter_report, tree_nodes, trees_bench)
        if mode_cycle:
            cal = dataclasses.replace(cal, mode_cycle=_floats(mode_cycle, "--mode-cycle"))
        default_replicas = DEFAULT_REPLICAS if gpu_profile else 1
        config = SimConfig(
            devices=devices,
            stages=stages or (1 if gpu_profile else 4),
            replicas=replicas or default_replicas,
            workload=workload,
            num_requests=num_requests,
            seed=seed,
            burstiness=burstiness,
            routing=routing,
            heterogeneous=heterogeneous,
            max_new_tokens=max_new_tokens,
        )
        mode_list = parse_modes(modes, workload)
        grid = simulate_grid(cal, mode_list, _floats(rates, "--rates"), config)
    except (OSError, ValueError) as exc:
        _fail(str(exc))
    source = calibration or state_monitor_url or "built-in paper-scale defaults"
    typer.echo(
        f"calibration: {source}"
        + (f", cloud on {gpu_profile} ({gpu_passes} passes, {config.replicas} replicas)" if gpu_profile else "")
    )
    for note in cal.notes:
        typer.echo(f"  {note}")
    typer.echo(grid_tables(grid, baseline))
    if len(mode_list) > 1:
        typer.echo("")
        judged = tuple(name.strip().lower() for name in target_modes.split(",") if name.strip())
        typer.echo(ratio_summary(grid, baseline, judged, target))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "simulation.json").write_text(json.dumps(grid, indent=1, default=str) + "\n")
        cal.save(out / "calibration.json")
        typer.echo(f"results in {out}")
    _compare(grid, compare_real or [], real_mode)


def _calibration(path: Optional[Path], state_monitor_url: Optional[str]) -> Calibration:
    """The calibration a run starts from: a file, a running state monitor, or the built-in defaults."""
    from loadgen.simulate.calibration import Calibration
    from loadgen.simulate.fit import from_telemetry

    if path is not None:
        return Calibration.load(path)
    if state_monitor_url:
        return from_telemetry(state_monitor_url)
    return Calibration()


def _on_gpu(
    cal: Calibration,
    gpu_profile: str,
    gpu_passes: str,
    adapter_report: Optional[str],
    tree_nodes: int,
    trees_bench: Optional[str],
) -> Calibration:
    """The cloud on the GPU a `tophat bench gpu` profile measured: its g(mu) and model shape, accept lengths
    (and tree rounds) from the adapter report."""
    from loadgen.simulate.gpu_profile import (
        DEFAULT_ADAPTER_REPORT,
        describe_decode,
        gpu_calibration,
        load_adapter_accept,
        load_full_accept_rate,
        load_gpu_profile,
    )
    from loadgen.simulate.trees import DEFAULT_TREES_BENCH, with_trees

    profile = load_gpu_profile(gpu_profile)
    report = adapter_report or DEFAULT_ADAPTER_REPORT
    cal = gpu_calibration(profile, load_adapter_accept(report), gpu_passes, cal, load_full_accept_rate(report))
    if tree_nodes:
        cal = with_trees(cal, report, trees_bench or DEFAULT_TREES_BENCH, tree_nodes)
    cal.notes.append(describe_decode(profile))
    return cal


def _compare(grid: dict[str, Any], paths: list[Path], real_mode: Optional[str]) -> None:
    """The simulated grid beside each measured loadgen run (--compare-real)."""
    from loadgen.simulate.report import compare_with_real

    for path in paths:
        typer.echo("")
        try:
            compare_with_real(grid, path, mode=real_mode)
        except (OSError, ValueError) as exc:
            _fail(f"cannot compare with {path}: {exc}")
