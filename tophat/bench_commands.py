"""`tophat bench serve | ablation | sim-check | disco | jupiter | edge-sd`: the benches that start real
meshes. This module reads each one's options and prints; what the bench does is loadgen/bench_command.py,
imported inside the command, so `tophat --help` does not load it. An option several benches share is
defined once here and reused by each command that takes it."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import typer

from tophat.command_support import MODEL_HELP, fail

MODEL = typer.Option("smollm2", help=MODEL_HELP)
OUT = typer.Option(Path("bench-results"), help="results, tables and plots go here")
JSON_OUT = typer.Option(
    Path("bench-results"), help="results JSON (a .json path) or the directory it goes in, with the table beside it"
)
WORKLOAD = typer.Option("specbench", help="specbench | cnndm (comma-separated for several)")
RATES = typer.Option(None, help="request rates (req/s), comma-separated (default 0.5,1,2)")
MODES = typer.Option("ushape,usarathi,cloud,hat", help="modes to compare (shared/modes.py)")
LINK = typer.Option(None, help="link of every device (near|mid|far|none|spec; default none)")
RTT_MS = typer.Option(
    "", help="emulated round trips (ms), comma-separated: one table each (the link's one-way latency set to half)"
)
DEVICES = typer.Option(2, help="device agents")
NUM_REQUESTS = typer.Option(16, help="requests per mode and rate")
MAX_NEW_TOKENS = typer.Option(32, help="tokens to generate per request")
SEED = typer.Option(0)
DTYPE = typer.Option(
    "auto", help="every mesh's verifier and device agents: auto (int4 on a CPU, bf16 on CUDA), int4, int8, bf16, f32"
)
REPEATS = typer.Option(
    1, help="run the modes this many times in alternating order (A B, B A, ...) and pool their requests", min=1
)


def start_logging() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("loadgen").setLevel(logging.INFO)


def served_model_dir(model: str) -> str:
    """--model as the checkpoint directory the bench's meshes load (a usage error if there is none)."""
    from tophatctl.models import resolve_model_or_exit

    return str(resolve_model_or_exit(model))


def mode_bench(model: str, **options):
    """The ModeBench of `bench serve`, `ablation` or `sim-check` from the command's options, and its model
    directory (a usage error for a bad option or a model without a draft adapter)."""
    from loadgen.bench_command import BENCH_ERRORS, ModeBench, check_draft_adapter

    start_logging()
    try:
        plan = ModeBench.from_options(**options)
        served = served_model_dir(model)
        check_draft_adapter(served)
    except BENCH_ERRORS as exc:
        fail(str(exc))
    return plan, served


def print_mode_tables(plan, served: str) -> None:
    from loadgen.bench_command import run_mode_bench

    for table in run_mode_bench(plan, served):
        typer.echo("\n" + table)
    typer.echo(f"\nresults, per-request CSVs and plots under {plan.out}/")


def serve_bench(
    workload: str = WORKLOAD,
    rates: Optional[str] = RATES,
    modes: str = MODES,
    link: Optional[str] = LINK,
    rtt_ms: str = RTT_MS,
    baseline: str = typer.Option("", help="the mode ratios are taken against (default: ushape, or the first mode)"),
    devices: int = DEVICES,
    num_requests: int = NUM_REQUESTS,
    max_new_tokens: int = MAX_NEW_TOKENS,
    seed: int = SEED,
    dtype: str = DTYPE,
    repeats: int = REPEATS,
    model: str = MODEL,
    out: Path = OUT,
):
    """The serving modes against one arrival trace on one mesh, back to back.

    One table per workload and round trip, with ratios against the baseline mode."""
    plan, served = mode_bench(**locals())
    print_mode_tables(plan, served)


def ablation_bench(
    rates: Optional[str] = RATES,
    link: Optional[str] = LINK,
    rtt_ms: str = RTT_MS,
    devices: int = DEVICES,
    num_requests: int = NUM_REQUESTS,
    max_new_tokens: int = MAX_NEW_TOKENS,
    seed: int = SEED,
    dtype: str = DTYPE,
    model: str = MODEL,
    out: Path = OUT,
):
    """HAT Table 5: speculative decoding, prompt chunking and parallel drafting on and off, on both workloads."""
    plan, served = mode_bench(ablation=True, workload="specbench", modes="", **locals())
    print_mode_tables(plan, served)


def sim_check_bench(
    workload: str = typer.Option("specbench", help="specbench | cnndm"),
    rates: Optional[str] = RATES,
    modes: str = MODES,
    link: Optional[str] = LINK,
    devices: int = DEVICES,
    num_requests: int = NUM_REQUESTS,
    max_new_tokens: int = MAX_NEW_TOKENS,
    seed: int = SEED,
    model: str = MODEL,
    out: Path = OUT,
):
    """The real mesh against `tophat simulate` calibrated from it.

    The report is also written to OUT/sim-check.txt (loadgen/bench_sim_check.py)."""
    plan, served = mode_bench(**locals())  # first: locals() is the options alone
    from loadgen.bench_command import sim_check_report

    typer.echo(sim_check_report(plan, served))


def disco_bench(
    budget: str = typer.Option("0.1,0.25,0.5,0.75", help="budgets b, comma-separated"),
    constraint: str = typer.Option("server", help="cost regime server | device | both (two meshes)"),
    rate: Optional[float] = typer.Option(None, help="request rate (req/s; default 2): every policy replays one trace"),
    link: Optional[str] = typer.Option(None, help="link of every device (default far,lat=50ms,jitter=25ms)"),
    speed: str = typer.Option("", help="device speed class or slowdown (default 10)"),
    reading_rate: float = typer.Option(5.0, min=0.0, help="r_c, tokens/s (0: unpaced)"),
    migration: bool = typer.Option(True, "--migration/--no-migration", help="token-level migration"),
    workload: str = WORKLOAD,
    devices: int = DEVICES,
    num_requests: int = NUM_REQUESTS,
    max_new_tokens: int = MAX_NEW_TOKENS,
    seed: int = SEED,
    model: str = MODEL,
    out: Path = JSON_OUT,
):
    """DiSCo against device-only, cloud-only and random dispatch per budget.

    The table, the results JSON and TTFT-vs-cost plots (loadgen/bench_disco.py)."""
    from loadgen.bench_command import disco_bench_options, disco_report

    start_logging()
    try:
        options = disco_bench_options(rate, link, budget, constraint, speed)
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


def jupiter_bench(
    edge_pipeline: str = typer.Option(
        ..., help="the pipeline's devices in order, e.g. 'orin;xavier;xavier' (shared/jupiter/plan.py)"
    ),
    lan: str = typer.Option("lan", help="the LAN between neighbouring devices"),
    buckets: str = typer.Option("64,256,1024", help="prompt lengths (tokens), comma-separated"),
    per_bucket: int = typer.Option(3, help="prompts per length"),
    modes: str = typer.Option("serial,equal-split,jupiter,jupiter-outline", help="the modes to run"),
    max_new_tokens: int = MAX_NEW_TOKENS,
    seed: int = SEED,
    model: str = MODEL,
    out: Path = JSON_OUT,
):
    """Jupiter: serial vs equal-split vs jupiter vs jupiter-outline on an edge pipeline.

    The table and the outline answers are written beside the results JSON (loadgen/bench_jupiter.py)."""
    from loadgen.bench_command import BENCH_ERRORS, jupiter_report, parse_buckets

    start_logging()
    try:
        text = jupiter_report(
            edge_pipeline=edge_pipeline,
            lan=lan,
            buckets=parse_buckets(edge_pipeline, buckets),
            per_bucket=per_bucket,
            modes=modes,
            max_new_tokens=max_new_tokens,
            seed=seed,
            model_dir=served_model_dir(model),
            out=out,
        )
    except BENCH_ERRORS as exc:
        fail(str(exc))
    typer.echo(text)


def edge_sd_bench(
    tasks: int = typer.Option(8, min=1, max=64, help="users' tasks per round (K)"),
    rounds: int = typer.Option(2, min=1, help="counted rounds per mode (after a warm-up)"),
    bandwidth_mhz: float = typer.Option(2.0, help="the shared uplink B_w (MHz)"),
    sbs_slowdown: float = typer.Option(
        4.0, min=1.0, help="the draft server drafts this many times slower than this host computes"
    ),
    modes: str = typer.Option("edge-sd,uniform-bandwidth,max-batch,no-pipeline,fixed-length", help="the modes to run"),
    max_new_tokens: int = MAX_NEW_TOKENS,
    seed: int = SEED,
    model: str = MODEL,
    out: Path = JSON_OUT,
):
    """Edge SD: the draft server against each baseline on one trace.

    The draft server: eq. 27 shares, DP batching, eq. 7 length, pipeline (loadgen/bench_edge_sd.py)."""
    from loadgen.bench_command import BENCH_ERRORS, edge_sd_report

    start_logging()
    try:
        table = edge_sd_report(
            tasks=tasks,
            rounds=rounds,
            bandwidth_mhz=bandwidth_mhz,
            sbs_slowdown=sbs_slowdown,
            modes=modes,
            max_new_tokens=max_new_tokens,
            seed=seed,
            model_dir=served_model_dir(model),
            out=out,
        )
    except BENCH_ERRORS as exc:
        fail(str(exc))
    typer.echo(table)
