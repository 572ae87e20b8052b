"""What `tophat bench` does, apart from reading its options and printing: build each bench's
configuration from the options, run it, write its files and return the text to show.

The commands (tophat/bench_commands.py): `bench serve` and `bench ablation`, the serving modes against
one arrival trace (`ModeBench`), `bench sim-check` (loadgen/bench_sim_check.py), `bench disco`
(loadgen/bench_disco.py), `bench jupiter` (loadgen/bench_jupiter.py) and `bench edge-sd`
(loadgen/bench_edge_sd.py). A bad option raises ValueError, a mesh that cannot start
MeshStartError (BENCH_ERRORS): the command turns either into a usage error. Heavy modules (the
launcher, torch, matplotlib) are imported by the function that needs them, so the command line
starts fast.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from loadgen.bench import (
    ablation_modes,
    format_table,
    link_with_rtt,
    modes_for,
    parse_rates,
    plot_modes,
    run_modes,
    save_table,
)
from tophatctl.mesh_config import MeshStartError

BENCH_ERRORS = (ValueError, MeshStartError)
DEFAULT_RATES = "0.5,1,2"
ABLATION_WORKLOADS = ("specbench", "cnndm")


@dataclass(frozen=True)
class ModeBench:
    """Every chosen mode against the same arrival trace, per workload and emulated round trip."""

    workloads: tuple[str, ...]
    rates: tuple[float, ...]
    modes: tuple[str, ...]  # ignored by the ablation, which has its own rows
    link: str  # every device's link (shared/net/links.py spec)
    runs: tuple[tuple[float | None, str], ...]  # per table: (emulated RTT in ms or None, the link with it)
    devices: int
    num_requests: int
    max_new_tokens: int
    seed: int
    out: Path
    ablation: bool = False
    baseline: str = ""  # the mode ratios are taken against; default ushape, or the first mode
    dtype: str = "auto"  # every mesh's verifier and devices (the mesh's own default: auto)
    repeats: int = 1  # the modes of a mesh run this many times, in alternating order (loadgen/bench.py run_modes)

    def __post_init__(self) -> None:
        from shared.model.placement import parse_dtype_spec

        if self.repeats < 1:
            raise ValueError(f"--repeats must be >= 1, not {self.repeats}")

        if not self.workloads or not self.rates or not self.runs:
            raise ValueError("a bench needs at least one workload, rate and link")
        try:
            parse_dtype_spec(self.dtype)
        except ValueError as exc:
            raise ValueError(f"--dtype: {exc}") from exc
        if not self.ablation:
            for workload in self.workloads:
                available = modes_for(workload)
                unknown = [m for m in self.modes if m not in available]
                if unknown:
                    raise ValueError(f"unknown modes {unknown}; choose from {', '.join(available)}")

    @classmethod
    def from_options(
        cls,
        *,
        workload: str,
        rates: str | None,
        modes: str,
        link: str | None,
        devices: int,
        num_requests: int,
        max_new_tokens: int,
        seed: int,
        out: Path,
        rtt_ms: str = "",
        ablation: bool = False,
        baseline: str = "",
        dtype: str = "auto",
        repeats: int = 1,
    ) -> ModeBench:
        """The bench from `tophat bench serve`'s option strings (ValueError naming the bad one)."""
        link = link or "none"
        rate_list = parse_rates(rates or DEFAULT_RATES)
        workloads = ABLATION_WORKLOADS if ablation else tuple(w.strip() for w in workload.split(","))
        try:
            rtts: list[float | None] = [float(x) for x in rtt_ms.split(",") if x.strip()] or [None]
            runs = tuple((rtt, link_with_rtt(link, rtt)) for rtt in rtts)
        except ValueError as exc:
            raise ValueError(f"--rtt-ms: {exc}") from exc
        return cls(
            workloads=workloads,
            rates=tuple(rate_list),
            modes=tuple(modes.split(",")),
            link=link,
            runs=runs,
            devices=devices,
            num_requests=num_requests,
            max_new_tokens=max_new_tokens,
            seed=seed,
            out=out,
            ablation=ablation,
            baseline=baseline,
            dtype=dtype,
            repeats=repeats,
        )


def check_draft_adapter(model_dir: str) -> None:
    """The benches run speculative devices: a missing draft adapter is a clear MeshStartError up
    front, not a device that crashes after the first mesh is up."""
    from tophatctl.mesh_config import MeshConfig, mesh_model_dir

    mesh_model_dir(MeshConfig(model_dir=model_dir))


def run_mode_bench(bench: ModeBench, model_dir: str) -> Iterator[str]:
    """Run the bench; yields each table as soon as its runs are done (tables, per-request CSVs and
    plots are written under bench.out as they go)."""
    out = bench.out
    for workload in bench.workloads:
        for rtt, link in bench.runs:
            if bench.ablation:
                chosen, base, title = ablation_modes(), "U-shape", f"HAT Table 5 layout, {workload}"
            else:
                available = modes_for(workload)
                chosen = {m: available[m] for m in bench.modes}
                base = bench.baseline or ("ushape" if "ushape" in chosen else next(iter(chosen)))
                title = f"{workload}, link {link}, {bench.devices} devices"
            kind = "ablation" if bench.ablation else "bench"
            tag = f"{kind}-{workload}" + (f"-rtt{rtt:g}" if rtt is not None else "")
            run_out = out / tag if rtt is not None else out
            results = run_modes(
                chosen,
                workload=workload,
                rates=list(bench.rates),
                num_requests=bench.num_requests,
                max_new_tokens=bench.max_new_tokens,
                seed=bench.seed,
                out=run_out,
                devices=bench.devices,
                link=link,
                model_dir=model_dir,
                dtype=bench.dtype,
                repeats=bench.repeats,
            )
            table = format_table(results, base, title)
            save_table(out, tag, table, results)
            plot_modes(run_out, workload, results, tag)
            yield table


def sim_check_report(bench: ModeBench, model_dir: str) -> str:
    """`bench sim-check`: the first workload's modes on the real mesh (its link, no emulated RTT) and in
    the simulator calibrated from it; the report is also written to OUT/sim-check.txt."""
    from loadgen.bench_sim_check import sim_vs_real

    text = sim_vs_real(
        workload=bench.workloads[0],
        rates=list(bench.rates),
        num_requests=bench.num_requests,
        max_new_tokens=bench.max_new_tokens,
        seed=bench.seed,
        out=bench.out,
        devices=bench.devices,
        link=bench.link,
        model_dir=model_dir,
        modes=list(bench.modes),
    )
    bench.out.mkdir(parents=True, exist_ok=True)
    (bench.out / "sim-check.txt").write_text(text)
    return text


def edge_sd_report(
    *,
    tasks: int,
    rounds: int,
    bandwidth_mhz: float,
    sbs_slowdown: float,
    modes: str,
    max_new_tokens: int,
    seed: int,
    model_dir: str,
    out: Path,
) -> str:
    """`bench edge-sd`: the draft server against each baseline on one trace; results JSON (OUT, or
    OUT/edge-sd.json) and the table beside it. Returns the table."""
    from loadgen.bench_edge_sd import EdgeSDBenchConfig, format_edge_sd_table, run_edge_sd_bench

    target = out if out.suffix == ".json" else out / "edge-sd.json"
    cfg = EdgeSDBenchConfig(
        model=model_dir,
        tasks=tasks,
        rounds=rounds,
        bandwidth_mhz=bandwidth_mhz,
        sbs_slowdown=sbs_slowdown,
        max_output=max_new_tokens,
        seed=seed,
        out=target,
        modes=split_list(modes),
    )
    table = format_edge_sd_table(run_edge_sd_bench(cfg))
    target.with_suffix(".txt").write_text(table + "\n")
    return table


def parse_buckets(edge_pipeline: str, buckets: str) -> list[int]:
    """`--edge-pipeline`'s devices checked and `--buckets` as prompt lengths (ValueError for a bad one)."""
    from shared.jupiter.plan import parse_edge_pipeline

    parse_edge_pipeline(edge_pipeline)
    bucket_list = [int(b) for b in buckets.split(",") if b.strip()]
    if not bucket_list or min(bucket_list) < 1:
        raise ValueError("--buckets needs positive prompt lengths")
    return bucket_list


def jupiter_report(
    *,
    edge_pipeline: str,
    lan: str,
    buckets: list[int],
    per_bucket: int,
    modes: str,
    max_new_tokens: int,
    seed: int,
    model_dir: str,
    out: Path,
) -> str:
    """`bench jupiter`: serial, equal-split and Jupiter on one edge pipeline; results JSON (OUT, or
    OUT/jupiter.json), the table and the outline answers beside it. Returns what to show."""
    from loadgen.bench_jupiter import (
        JupiterBenchConfig,
        format_jupiter_table,
        format_outline_answers,
        run_jupiter_bench,
    )

    target = out if out.suffix == ".json" else out / "jupiter.json"
    cfg = JupiterBenchConfig(
        model=model_dir,
        edge_pipeline=edge_pipeline,
        lan=lan,
        buckets=buckets,
        per_bucket=per_bucket,
        max_tokens=max_new_tokens,
        seed=seed,
        out=target,
        modes=split_list(modes),
    )
    results = run_jupiter_bench(cfg)
    text = format_jupiter_table(results) + "\n\n" + format_outline_answers(results)
    target.with_suffix(".txt").write_text(text + "\n")
    return f"{text}\n\nresults in {target}"


def disco_bench_options(rate: float | None, link: str | None, budget: str, constraint: str, speed: str) -> dict:
    """`tophat bench disco`'s parsed options (ValueError for a bad one)."""
    from loadgen.bench_disco import DEFAULT_LINK, DEFAULT_RATE, DEFAULT_SPEED, parse_budgets, parse_constraint
    from shared.net.links import parse_link_spec
    from shared.planning.device_speed import speed_schedule

    rate = DEFAULT_RATE if rate is None else rate
    if rate <= 0:
        raise ValueError(f"--rate must be > 0, got {rate}")
    link = link or DEFAULT_LINK
    parse_link_spec(link)
    speed = speed or DEFAULT_SPEED
    speed_schedule(speed)
    return {
        "rate": rate,
        "link": link,
        "budgets": parse_budgets(budget),
        "constraints": parse_constraint(constraint),
        "speed": speed,
    }


def disco_report(
    options: dict,
    *,
    workload: str,
    devices: int,
    num_requests: int,
    max_new_tokens: int,
    seed: int,
    out: Path,
    model_dir: str,
    reading_rate: float,
    migration: bool,
) -> str:
    """`bench disco`: DiSCo against device-only, cloud-only and random per budget (loadgen/bench_disco.py),
    with `options` from disco_bench_options. Returns the table and where the results went."""
    # the module, not its function: a test replaces bench_disco.bench_disco to check the options
    from loadgen import bench_disco as disco

    table, json_path, plots = disco.bench_disco(
        workload=workload,
        num_requests=num_requests,
        max_new_tokens=max_new_tokens,
        seed=seed,
        out=out,
        devices=devices,
        model_dir=model_dir,
        reading_rate_tps=reading_rate,
        migration=migration,
        **options,
    )
    return f"\n{table}\n\nresults in {json_path}; plots: {', '.join(str(p) for p in plots)}"


def split_list(text: str) -> list[str]:
    """A comma-separated option as its non-empty, stripped items."""
    return [item.strip() for item in text.split(",") if item.strip()]
