"""`tophat bench`: the serving modes, DiSCo, Jupiter's edge pipeline or Edge SD measured on real
meshes. This module reads the options and prints; what each bench does is loadgen/bench_command.py,
imported inside the command, so `tophat --help` does not load it."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import typer

from tophat.command_support import MODEL_HELP, fail


def bench(
    workload: str = typer.Option("specbench", help="specbench | cnndm (comma-separated for several)"),
    rates: Optional[str] = typer.Option(
        None, help="request rates (req/s), comma-separated (default 0.5,1,2; --disco: one rate, default 2)"
    ),
    modes: str = typer.Option("ushape,usarathi,cloud,hat", help="modes to compare"),
    link_profile: Optional[str] = typer.Option(
        None,
        "--link",
        "--link-profile",
        help="link of every device (near|mid|far|none|spec; default none, --disco: far,lat=50ms,jitter=25ms)",
    ),
    devices: int = typer.Option(2, help="device agents"),
    num_requests: int = typer.Option(16, help="requests per mode and rate"),
    max_new_tokens: int = typer.Option(32),
    seed: int = typer.Option(0),
    dtype: str = typer.Option(
        "auto",
        help="every mesh's verifier and device agents: auto (f32 on a CPU), int4, int8, "
        "bf16, f32 (not with --disco or --sim-check)",
    ),
    model: str = typer.Option("smollm2", help=MODEL_HELP),
    out: Path = typer.Option(Path("bench-results"), help="results, tables and plots go here"),
    ablation: bool = typer.Option(False, "--ablation", help="HAT Table 5 (SD/PC/PD on and off), both workloads"),
    sim_check: bool = typer.Option(False, "--sim-check", help="real mesh vs `tophat simulate` calibrated from it"),
    rtt_ms: str = typer.Option(
        "",
        "--rtt-ms",
        help="emulated round trips (ms), comma-separated: one table each (the link's one-way latency set to half)",
    ),
    baseline: str = typer.Option("", help="the mode ratios are taken against (default: ushape, or the first mode)"),
    disco: bool = typer.Option(
        False,
        "--disco",
        help="DiSCo vs device-only, cloud-only and random per budget "
        "(loadgen/bench_disco.py); --out may name the results JSON",
    ),
    budget: str = typer.Option("0.1,0.25,0.5,0.75", help="--disco: budgets b, comma-separated"),
    constraint: str = typer.Option("server", help="--disco: cost regime server | device | both (two meshes)"),
    reading_rate: float = typer.Option(5.0, "--reading-rate", min=0.0, help="--disco: r_c, tokens/s (0: unpaced)"),
    speed: str = typer.Option("", help="--disco: device speed class or slowdown (default 10)"),
    migration: bool = typer.Option(True, "--migration/--no-migration", help="--disco: token-level migration"),
    edge_pipeline: str = typer.Option(
        "",
        "--edge-pipeline",
        help="Jupiter: serial vs equal-split vs jupiter vs "
        "jupiter-outline on an edge pipeline of these devices, e.g. 'orin;xavier;xavier' "
        "(loadgen/bench_jupiter.py); --out may name the results JSON",
    ),
    lan: str = typer.Option("lan", "--lan", help="--edge-pipeline: the LAN between neighbouring devices"),
    buckets: str = typer.Option("64,256,1024", help="--edge-pipeline: prompt lengths (tokens), comma-separated"),
    per_bucket: int = typer.Option(3, "--per-bucket", help="--edge-pipeline: prompts per length"),
    jupiter_modes: str = typer.Option(
        "serial,equal-split,jupiter,jupiter-outline", "--jupiter-modes", help="--edge-pipeline: the modes to run"
    ),
    edge_sd: bool = typer.Option(
        False,
        "--edge-sd",
        help="Edge SD: the draft server (eq. 27 shares, DP batching, "
        "eq. 7 length, pipeline) vs each baseline on one trace (loadgen/bench_edge_sd.py); "
        "--out may name the results JSON",
    ),
    tasks: int = typer.Option(8, "--tasks", min=1, max=64, help="--edge-sd: users' tasks per round (K)"),
    rounds: int = typer.Option(2, "--rounds", min=1, help="--edge-sd: counted rounds per mode (after a warm-up)"),
    bandwidth_mhz: float = typer.Option(2.0, "--bandwidth-mhz", help="--edge-sd: the shared uplink B_w (MHz)"),
    sbs_slowdown: float = typer.Option(
        4.0,
        "--sbs-slowdown",
        min=1.0,
        help="--edge-sd: the draft server drafts this many times slower than this host computes",
    ),
    edge_sd_modes: str = typer.Option(
        "edge-sd,uniform-bandwidth,max-batch,no-pipeline,fixed-length",
        "--edge-sd-modes",
        help="--edge-sd: the modes to run",
    ),
):
    """Every mode against the same arrival trace, back to back; one table with ratios vs ushape."""
    from loadgen.bench_command import (  # imports torch: only when a bench runs
        BENCH_ERRORS,
        ModeBench,
        check_draft_adapter,
        disco_bench_options,
        disco_report,
        edge_sd_report,
        jupiter_report,
        parse_buckets,
        run_mode_bench,
        sim_check_report,
    )

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("loadgen").setLevel(logging.INFO)
    if edge_sd:
        served = served_model_dir(model)
        try:
            table = edge_sd_report(
                tasks=tasks,
                rounds=rounds,
                bandwidth_mhz=bandwidth_mhz,
                sbs_slowdown=sbs_slowdown,
                modes=edge_sd_modes,
                max_new_tokens=max_new_tokens,
                seed=seed,
                model_dir=served,
                out=out,
            )
        except BENCH_ERRORS as exc:
            fail(str(exc))
        typer.echo(table)
        return
    if edge_pipeline:
        try:
            bucket_list = parse_buckets(edge_pipeline, buckets)
            text = jupiter_report(
                edge_pipeline=edge_pipeline,
                lan=lan,
                buckets=bucket_list,
                per_bucket=per_bucket,
                modes=jupiter_modes,
                max_new_tokens=max_new_tokens,
                seed=seed,
                model_dir=served_model_dir(model),
                out=out,
            )
        except BENCH_ERRORS as exc:
            fail(str(exc))
        typer.echo(text)
        return
    if disco:
        try:
            options = disco_bench_options(rates, link_profile, budget, constraint, speed)
        except ValueError as exc:
            fail(str(exc))
        typer.echo(
            disco_report(
                options,
                workload=workload,
                devices=devices,
                num_requests=num_requests,
                max_new_tokens=max_new_tokens,
                seed=seed,
                out=out,
                model_dir=served_model_dir(model),
                reading_rate=reading_rate,
                migration=migration,
            )
        )
        return
    try:
        plan = ModeBench.from_options(
            workload=workload,
            rates=rates,
            modes=modes,
            link_profile=link_profile,
            rtt_ms=rtt_ms,
            ablation=ablation,
            baseline=baseline,
            devices=devices,
            num_requests=num_requests,
            max_new_tokens=max_new_tokens,
            seed=seed,
            out=out,
            dtype=dtype,
        )
        served = served_model_dir(model)
        check_draft_adapter(served)
    except BENCH_ERRORS as exc:
        fail(str(exc))
    if sim_check:
        typer.echo(sim_check_report(plan, served))
        return
    for table in run_mode_bench(plan, served):
        typer.echo("\n" + table)
    typer.echo(f"\nresults, per-request CSVs and plots under {out}/")


def served_model_dir(model: str) -> str:
    """--model as the checkpoint directory the bench's meshes load (a usage error if there is none)."""
    from tophatctl.models import resolve_model_or_exit

    return str(resolve_model_or_exit(model))
