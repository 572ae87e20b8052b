"""`tophat bench KIND`: one subcommand per benchmark, each with only its own options, registered here in the
order `tophat bench --help` lists them. The commands live beside the options they read (bench_commands for the
benches that start meshes, bench_model_commands and bench_check_commands for the others); each imports its bench
inside its body, so `tophat --help` stays fast."""

from __future__ import annotations

import typer

from tophat.bench_check_commands import (
    aiperf_bench,
    disco_overhead_bench,
    fuzz_wire_bench,
    hat_bench,
    picospec_bench,
    soak_bench,
    wire_bench,
)
from tophat.bench_commands import (
    ablation_bench,
    disco_bench,
    edge_sd_bench,
    jupiter_bench,
    serve_bench,
    sim_check_bench,
)
from tophat.bench_model_commands import (
    batch_invariance_bench,
    budget_bench,
    compile_bench,
    core_bench,
    engine_bench,
    gpu_bench,
    idle_bench,
    topk_tv_bench,
    trees_bench,
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
# The model in this one process (tophat/bench_model_commands.py).
bench_app.command("core")(core_bench)
bench_app.command("trees")(trees_bench)
bench_app.command("budget")(budget_bench)
bench_app.command("engine")(engine_bench)
bench_app.command("gpu")(gpu_bench)
bench_app.command("compile")(compile_bench)
bench_app.command("idle")(idle_bench)
bench_app.command("batch-invariance")(batch_invariance_bench)
bench_app.command("topk-tv")(topk_tv_bench)
# One piece of the mesh, and the long checks of a whole one (tophat/bench_check_commands.py).
bench_app.command("hat")(hat_bench)
bench_app.command("picospec")(picospec_bench)
bench_app.command("wire")(wire_bench)
bench_app.command("fuzz-wire")(fuzz_wire_bench)
bench_app.command("disco-overhead")(disco_overhead_bench)
bench_app.command("soak")(soak_bench)
bench_app.command("aiperf")(aiperf_bench)
