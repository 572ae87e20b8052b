"""`tophat bench hat | picospec | wire | fuzz-wire | disco-overhead | soak | aiperf`: the benches and checks of
one piece of the mesh (HAT's machinery, PicoSpec's modes, the wire, the DiSCo scheduler) and the long checks of a
whole one (soak, aiperf). Each command reads its options and hands them, as the namespace its bench reads, to the
bench's `main` in loadgen/, imported inside the command so `tophat --help` does not load torch; a command's first
line takes its options as `Namespace(**locals())`, before any import adds a name to its locals. A bench's exit
status is the command's."""

from __future__ import annotations

from argparse import Namespace
from pathlib import Path
from typing import Optional

import typer

from tophat.command_support import MODEL_HELP, SPLIT_LAYERS_HELP, fail

MODEL = typer.Option("smollm2", help=MODEL_HELP)
SEED = typer.Option(0)
PICOSPEC_JSON_OUT = typer.Option(Path("bench-results/picospec.json"), help="results JSON (the table .txt beside)")
AIPERF_OUT = typer.Option(Path("bench-results/aiperf"), help="aiperf's artifacts and the mesh's log")


def hat_bench(
    model: str = MODEL,
    adapter: str = typer.Option("", help="draft adapter file or 'random' (default: the model's own)"),
    link: str = typer.Option("far", help="link of every device (HAT's slow group by default)"),
    link_mode: str = typer.Option("auto", help="how links are emulated: auto | netns | inprocess"),
    devices: int = typer.Option(3, help="device agents"),
    prompt_tokens: int = typer.Option(1024, help="length of the long prompts"),
    repeats: int = typer.Option(2, help="repeats of the prompt-chunking comparison"),
    max_new_tokens: int = typer.Option(48, help="tokens to generate per request"),
):
    """HAT's prompt chunking, speculation and parallel drafting on one real mesh, one at a time.

    Features are switched per request, so every comparison shares machine, links and moment (loadgen/bench_hat.py)."""
    args = Namespace(**locals())
    from loadgen.bench_hat import main

    main(args)


def picospec_bench(
    model: str = MODEL,
    rtt_ms: str = typer.Option("20,50,100", help="emulated round trips (ms), comma-separated"),
    modes: str = typer.Option("cloud,token-sd,picospec,hat,hat-async", help="the modes to compare"),
    prompts: int = typer.Option(4, help="held-out chat prompts, one request at a time"),
    max_new_tokens: int = typer.Option(48, help="tokens to generate per prompt"),
    eta: float = typer.Option(0.6, help="drafting threshold (HAT eq. 5)"),
    max_draft: int = typer.Option(8, help="max draft tokens per round"),
    group: int = typer.Option(2, help="PicoSpec's drafted tokens per group"),
    window: int = typer.Option(8, help="the async modes' drafting window"),
    no_eta_gate: bool = typer.Option(False, "--no-eta-gate", help="async modes draft ahead past low-confidence drafts"),
    downlink: str = typer.Option("full", help="full | topk: what the verifier sends back on a rejection"),
    top_k: int = typer.Option(10, help="--downlink topk: the K largest probabilities"),
    out: Path = PICOSPEC_JSON_OUT,
):
    """PicoSpec's modes per emulated round trip, in process: tokens/s measured beside PicoSpec's model of it.

    One process holds the real verifier and the device's client, a delay line between (loadgen/bench_picospec.py)."""
    args = Namespace(**locals())
    from loadgen.bench_picospec import main

    if downlink not in ("full", "topk"):
        fail(f"--downlink must be full or topk, got {downlink!r}")
    try:
        main(args)
    except ValueError as exc:
        fail(str(exc))


def wire_bench():
    """Encode+decode throughput of hidden-state frames (GB/s of tensor payload), printed, never asserted.

    loadgen/bench_wire.py; the target is >= 1 GB/s, so serialization never rivals the network."""
    from loadgen.bench_wire import main

    main()


def fuzz_wire_bench(
    model: str = MODEL,
    split_layers: int = typer.Option(2, help=SPLIT_LAYERS_HELP),
    frames: int = typer.Option(2000, help="mutated frames to send"),
    seed: int = SEED,
):
    """Seeded mutations of valid frames sent to a live verifier: each must get its typed error, none a drop.

    Exit status 1 when a connection dropped or a reply was wrong (loadgen/fuzz_wire.py)."""
    args = Namespace(**locals())
    from loadgen.fuzz_wire import main

    raise typer.Exit(main(args))


def disco_overhead_bench(
    sizes: str = typer.Option("1000,10000,100000", help="history sizes (samples per distribution), comma-separated"),
    decisions: int = typer.Option(100_000, help="decide() calls timed per policy"),
    budget: float = typer.Option(0.5, help="the budget b of the policies"),
    alpha: float = typer.Option(0.05, help="the policies' alpha"),
    seed: int = SEED,
    as_json: bool = typer.Option(False, "--json", help="print the rows as JSON"),
):
    """DiSCo's scheduler overhead: build() once and decide() per call, per history size and constraint.

    Printed, never asserted (loadgen/disco_overhead.py)."""
    args = Namespace(**locals())
    from loadgen.disco_overhead import main

    try:
        args.sizes = [int(size) for size in sizes.split(",") if size.strip()]
    except ValueError:
        fail(f"--sizes must be comma-separated integers, got {sizes!r}")
    main(args)


def soak_bench(
    model: str = MODEL,
    duration: float = typer.Option(600.0, help="seconds of load after the warm-up"),
    rate: Optional[float] = typer.Option(None, help="requests/s (default: measured in the warm-up)"),
    devices: int = typer.Option(1, help="device agents"),
    warmup_requests: int = typer.Option(4, help="sent one at a time; they time the auto rate"),
    warmup_s: float = typer.Option(60.0, help="then this long of the soak's own load"),
    max_new_tokens: int = typer.Option(32, help="tokens to generate per request"),
    seed: int = SEED,
    rss_max_growth_pct: float = typer.Option(
        5.0,
        help="a service whose RSS grows more than this % after the warm-up (and more than --rss-min-growth-mib) "
        "fails the soak",
    ),
    rss_min_growth_mib: float = typer.Option(
        8.0, help="growth below this many MiB never fails (allocator noise of a small process)"
    ),
):
    """A long Poisson load through the streamer of a real mesh: failed requests and each service's memory growth.

    Exit status 1 when a request failed or a service's RSS grew past both limits (loadgen/soak.py)."""
    args = Namespace(**locals())
    from loadgen.soak import main

    try:
        status = main(args)
    except ValueError as exc:
        fail(str(exc))
    raise typer.Exit(status)


def aiperf_bench(
    aiperf: str = typer.Option(
        ".venv-aiperf/bin/aiperf", help="the aiperf executable (`make test-aiperf` installs it)"
    ),
    model: str = MODEL,
    requests: int = typer.Option(8, help="requests aiperf sends"),
    concurrency: int = typer.Option(2, help="requests in flight"),
    input_tokens: int = typer.Option(64, help="synthetic prompt length"),
    output_tokens: int = typer.Option(24, help="tokens asked per answer (max_completion_tokens, ignore_eos)"),
    request_timeout_s: float = typer.Option(120.0, help="aiperf's per-request timeout"),
    aiperf_timeout_s: float = typer.Option(600.0, help="the whole aiperf run"),
    ready_timeout_s: float = typer.Option(300.0, help="how long the mesh may take to be ready"),
    out: Path = AIPERF_OUT,
):
    """NVIDIA's aiperf, an outside load tool, against a real mesh's OpenAI endpoint.

    Passes when every request succeeded, TTFT and ITL are reported and every answer has the asked length; exit
    status 1 otherwise (loadgen/aiperf_check.py)."""
    args = Namespace(**locals())
    from loadgen.aiperf_check import main

    raise typer.Exit(main(args))
