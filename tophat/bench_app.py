"""`tophat bench KIND`: one subcommand per benchmark, each with only its own options, registered here in the
order `tophat bench --help` lists them. The commands live beside the options they read (bench_commands for the
benches that start meshes); each imports its bench inside its body, so `tophat --help` stays fast."""

from __future__ import annotations

import typer

from tophat.bench_commands import (
    ablation_bench,
    disco_bench,
    edge_sd_bench,
    jupiter_bench,
    serve_bench,
    sim_check_bench,
)

bench_app = typer.Typer(
    no_args_is_help=True,
    help="Benchmarks: each kind is a subcommand with its own options (`tophat bench KIND --help`).",
)

# Benches on real meshes (tophat/bench_commands.py).
bench_app.command("serve")(serve_bench)
bench_app.command("ablation")(ablation_bench)
bench_app.command("sim-check")(sim_check_bench)
bench_app.command("disco")(disco_bench)
bench_app.command("jupiter")(jupiter_bench)
bench_app.command("edge-sd")(edge_sd_bench)
