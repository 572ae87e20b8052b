"""`tophat bench core | trees | budget | engine | gpu | compile | idle | batch-invariance | topk-tv`: the benches
of the model in this one process (no mesh). Each command reads its options and hands them, as the namespace its
bench reads, to the bench's `main` or `run` in loadgen/, imported inside the command so `tophat --help` does not
load torch. An option several benches share is defined once here. A command's first line takes its options as
`Namespace(**locals())`, before any import adds a name to its locals."""

from __future__ import annotations

from argparse import Namespace
from pathlib import Path
from typing import Optional

import typer

from shared.specdec.draft_config import DraftConfig
from tophat.command_support import MODEL_HELP, SPLIT_LAYERS_HELP, fail

MODEL = typer.Option("smollm2", help=MODEL_HELP)
ADAPTER = typer.Option(None, help="draft adapter file or 'random' (default: the model's own)")
SPLIT_LAYERS = typer.Option(2, help=SPLIT_LAYERS_HELP)
PROMPTS = typer.Option(8, help="held-out chat prompts")
MAX_NEW_TOKENS = typer.Option(64, help="tokens to generate per prompt")
ETA = typer.Option(DraftConfig.eta, help="drafting threshold (HAT eq. 5)")
MAX_DRAFT = typer.Option(DraftConfig.max_draft, help="max draft tokens per round")
THREADS = typer.Option(2, help="torch threads")
DTYPE = typer.Option("f32", help="the weights: f32 | bf16 | int8 | int4")
TREE_WIDTH = typer.Option(DraftConfig.tree_width, help="children per tree node at most")
TREE_MIN_PROB = typer.Option(
    DraftConfig.tree_min_prob, help="grow a tree node while its path's draft probability reaches this"
)
RTT_MS = typer.Option(50.0, help="emulated device-cloud round trip per cloud call (ms)")
NEW_TOKENS = typer.Option(64, help="decode steps per tok/s measurement")
TREES_JSON_OUT = typer.Option(Path("bench-results/trees.json"), help="results JSON")
BUDGET_JSON_OUT = typer.Option(Path("bench-results/budget.json"), help="results JSON")
ENGINE_JSON_OUT = typer.Option(Path("bench-results/engine.json"), help="results JSON")
TOPK_JSON_OUT = typer.Option(None, help="write the report as JSON here")
GPU_JSON_OUT = typer.Option(Path("bench-results/gpu.json"), help="results JSON, rewritten after every stage")


def core_bench(
    model: str = MODEL,
    adapter: Optional[str] = ADAPTER,
    split_layers: int = SPLIT_LAYERS,
    prompts: int = PROMPTS,
    max_new_tokens: int = MAX_NEW_TOKENS,
    eta: float = ETA,
    max_draft: int = MAX_DRAFT,
    threads: int = THREADS,
    dtype: str = DTYPE,
    rtt_ms: float = typer.Option(20.0, help="emulated device-cloud round trip for the second comparison (ms)"),
):
    """The model core in process: draft step, verify pass by draft length, accept lengths, hat vs ushape decode.

    Printed, never asserted (loadgen/bench_core.py)."""
    args = Namespace(**locals())
    from loadgen.bench_core import main

    main(args)


def trees_bench(
    nodes: str = typer.Option("0,16,32,64", help="tree node budgets to compare, comma-separated; 0 = chain"),
    tree_width: int = TREE_WIDTH,
    tree_min_prob: float = TREE_MIN_PROB,
    rtt_ms: float = RTT_MS,
    model: str = MODEL,
    adapter: Optional[str] = ADAPTER,
    split_layers: int = SPLIT_LAYERS,
    prompts: int = PROMPTS,
    max_new_tokens: int = MAX_NEW_TOKENS,
    eta: float = ETA,
    max_draft: int = MAX_DRAFT,
    threads: int = THREADS,
    dtype: str = DTYPE,
    out: Path = TREES_JSON_OUT,
):
    """Draft trees against chains on the same prompts: tokens per round, drafting and verify cost by node count.

    Greedy outputs are checked token-identical to the chain's (loadgen/bench_trees.py)."""
    args = Namespace(**locals())
    from loadgen.bench_trees import run

    run(args)


def budget_bench(
    shapes: str = typer.Option("none,chain,tree8,tree16", help="draft shapes (shared/planning/draft_budget.py)"),
    rtt_ms: float = RTT_MS,
    link: str = typer.Option("mid", help="the link's bandwidths (shared/net/links.py names)"),
    tree_width: int = TREE_WIDTH,
    tree_min_prob: float = TREE_MIN_PROB,
    model: str = MODEL,
    adapter: Optional[str] = ADAPTER,
    split_layers: int = SPLIT_LAYERS,
    prompts: int = PROMPTS,
    max_new_tokens: int = MAX_NEW_TOKENS,
    eta: float = ETA,
    max_draft: int = MAX_DRAFT,
    threads: int = THREADS,
    dtype: str = DTYPE,
    out: Path = BUDGET_JSON_OUT,
):
    """The draft budget against the verifier's load: each draft shape's round time and tokens/s per session count.

    From figures measured in this run (loadgen/bench_budget.py)."""
    args = Namespace(**locals())
    from loadgen.bench_budget import run

    run(args)


def engine_bench(
    model: str = MODEL,
    split_layers: int = SPLIT_LAYERS,
    new_tokens: int = NEW_TOKENS,
    dtypes: str = typer.Option("f32,bf16,int8,int4", help="dtypes to measure (a '+python' suffix: no C++ layers)"),
    threads: str = typer.Option("1,2", help="torch thread counts, comma-separated"),
    profile: str = typer.Option("f32,int4", help="dtypes whose verify pass and draft step are profiled"),
    quality_positions: int = typer.Option(
        20_000, help="teacher-forced positions of held-out text in the quality table (0: no table)"
    ),
    quality_prompts: int = typer.Option(64, help="held-out chat prompts answered greedily"),
    runs: int = typer.Option(
        5,
        help="decode runs of --new-tokens per figure, the best reported (llama.cpp's alike, after a warm-up): "
        "one run is a third of a second, and this box's speed drifts within seconds",
    ),
    out: Path = ENGINE_JSON_OUT,
):
    """The model runner per dtype against its bandwidth floor, transformers and llama.cpp, then the quality gate.

    `make bench-engine` installs llama.cpp's own environment first (loadgen/bench_engine.py)."""
    args = Namespace(**locals())
    from loadgen.bench_engine import main

    main(args)


def gpu_bench(
    model: str = MODEL,
    weights: str = typer.Option("auto", help="auto | checkpoint | random"),
    adapter: Optional[str] = ADAPTER,
    split_layers: int = SPLIT_LAYERS,
    device: str = typer.Option("cuda", help="auto, cpu, cuda or cuda:N (shared/model/placement.py)"),
    dtype: str = typer.Option("bf16", help="auto, f32, bf16, f16 (int8/int4: CPU only)"),
    new_tokens: int = NEW_TOKENS,
    sessions: str = typer.Option("1,8,32", help="concurrent sessions for decode tok/s"),
    hf_sessions: str = typer.Option("1,8", help="batch sizes for transformers' generate"),
    rows: str = typer.Option("1,4,8,16,32", help="rows per verify pass"),
    context: int = typer.Option(128, help="cached positions before a verify pass"),
    repeats: int = typer.Option(9, help="timed repeats per verify / graph measurement"),
    greedy_prompts: int = typer.Option(8, help="prompts of the greedy check"),
    greedy_tokens: int = typer.Option(48, help="tokens per prompt of the greedy check"),
    eta: float = ETA,
    max_draft: int = MAX_DRAFT,
    stages: str = typer.Option(
        "placement,greedy,decode,verify,transformers,greedy_demo,greedy_f32,cuda_graphs,served_graphs",
        help="which stages to run (placement always runs)",
    ),
    time_budget_s: float = typer.Option(80.0, help="start no stage (or row) after this"),
    threads: Optional[int] = typer.Option(None, help="torch CPU threads (default: torch's own)"),
    out: Path = GPU_JSON_OUT,
):
    """The model runner on an NVIDIA GPU (bfloat16) with transformers beside it, stage by stage.

    A failing stage is recorded and the next runs; exit status 1 when placement failed (loadgen/bench_gpu.py)."""
    args = Namespace(**locals())
    from loadgen.bench_gpu import int_list, main

    if weights not in ("auto", "checkpoint", "random"):
        fail(f"--weights must be auto, checkpoint or random, got {weights!r}")
    args.sessions, args.hf_sessions, args.rows = int_list(sessions), int_list(hf_sessions), int_list(rows)
    results = main(args)
    raise typer.Exit(0 if results["stages"]["placement"]["status"] == "ok" else 1)


def compile_bench(
    model: str = MODEL,
    dtype: str = typer.Option("int4", help="the weights: f32 | bf16 | int8 | int4"),
    threads: int = typer.Option(1, help="torch threads"),
):
    """Does torch.compile pay for the runner? Eager decode tok/s against norm + MLP compiled by inductor.

    Measured here it did not (docs/design/engine.md), so the runner stays eager (loadgen/bench_compile.py)."""
    args = Namespace(**locals())
    from loadgen.bench_compile import main

    main(args)


def idle_bench(
    model: str = MODEL,
    dtype: str = typer.Option("int4", help="the weights: f32 | bf16 | int8 | int4"),
    split_layers: int = SPLIT_LAYERS,
    rows: int = typer.Option(3, help="rows per verify pass (k + 1)"),
    gap_ms: float = typer.Option(25.0, help="time between passes (sleep, spin)"),
    passes: int = typer.Option(30, help="timed passes per way of waiting"),
    rounds: int = typer.Option(2, help="rounds of every way of waiting"),
):
    """What waiting costs the next verify pass: back to back, after sleeping, spinning or reading other memory.

    Printed side by side, never asserted (loadgen/bench_idle.py)."""
    args = Namespace(**locals())
    from loadgen.bench_idle import main

    main(args)


def batch_invariance_bench(
    model: str = MODEL,
    dtypes: str = typer.Option("int4,int8,f32", help="dtypes to check, comma-separated"),
    prompts: int = typer.Option(24, help="held-out chat prompts"),
    new_tokens: int = typer.Option(48, help="greedy tokens per prompt"),
    threads: int = THREADS,
    attention: str = typer.Option("invariant", help="invariant | sdpa (quantized models; f32 always runs sdpa)"),
):
    """Is the unsplit model's greedy answer the same with its rows computed one per pass or together?

    Counts the prompts whose argmax differs and the exact top-2 ties (loadgen/check_batch_invariance.py)."""
    args = Namespace(**locals())
    from loadgen.check_batch_invariance import main

    if attention not in ("invariant", "sdpa"):
        fail(f"--attention must be invariant or sdpa, got {attention!r}")
    main(args)


def topk_tv_bench(
    model: str = MODEL,
    adapter: Optional[str] = ADAPTER,
    split_layers: int = SPLIT_LAYERS,
    prompts: int = PROMPTS,
    positions: int = typer.Option(32, help="drafted positions per prompt"),
    temperatures: str = typer.Option("0.8,1.0", help="sampling temperatures, comma-separated"),
    ks: str = typer.Option("1,5,10,20,50", help="top-K sizes of the downlink, comma-separated"),
    out: Optional[Path] = TOPK_JSON_OUT,
):
    """How far PicoSpec's top-K downlink moves the correction distribution (total variation per K).

    On real prompts and the real model (loadgen/bench_topk_tv.py)."""
    args = Namespace(**locals())
    from loadgen.bench_topk_tv import main

    try:
        main(args)
    except ValueError as exc:
        fail(str(exc))
