"""`tophat bench serve` (and `bench ablation`): HAT against its baselines on the same mesh, load and arrival trace.

Each mode is a configuration of the same product (HAT §4 baselines):

    ushape    split, no speculation, no chunking                   (request switches)
    usarathi  split, no speculation, whole upload, server chunks   (verifier server chunking)
    cloud     whole model in the cloud, token ids, autoregressive  (verifier full model; no privacy)
    token-sd  device drafts, cloud verifies token ids, stop-and-wait (verifier full model; no privacy)
    picospec  token-sd with PicoSpec's asynchronous pipeline       (verifier full model; no privacy)
    hat       SD + PC + PD, each round's draft shape (none, chain, tree) from the draft budget
    hat-chain hat with every round a chain (HAT as published)      (request switch draft_shape)
    hat-async HAT with the asynchronous pipeline (hidden states)   (request switches)

Modes that need a differently configured verifier get their own mesh; the
others share one. Every mode replays the same arrival times and prompts (same
seed), back to back, and one table prints TTFT / TBT mean and P99, accept
length and ratios against `ushape` measured in this run.

`tophat bench`'s flow over these (options, workloads, RTTs) is loadgen/bench_command.py; the real
mesh against the simulator (`tophat bench sim-check`) is loadgen/bench_sim_check.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from shared.modes import MODE_TABLE

log = logging.getLogger(__name__)

SERVER_CHUNK = {"specbench": 128, "cnndm": 256}  # HAT's U-Sarathi chunk sizes
# The table's modes a bench runs (device needs no cloud; edge-sd has its own bench, loadgen/bench_edge_sd.py)
BENCH_MODES = ("cloud", "token-sd", "picospec", "hat", "hat-async")


T = TypeVar("T")
WHOLE_PROMPTS = "+whole"  # a mode's name with this: its verifier runs every prompt whole (max_prefill_step_ms 0)


@dataclass(frozen=True)
class BenchVariant:
    """One row of a bench: a decoding mode (shared/modes.py) or a baseline built from request switches."""

    name: str
    request_options: dict[str, Any] = field(default_factory=dict)  # the request body's "tophat" object
    verifier_env: tuple[tuple[str, str], ...] = ()  # mesh-level settings this mode needs

    def mesh_key(self) -> tuple:
        return self.verifier_env


def table_variant(mode: str) -> BenchVariant:
    """A mode of shared/modes.py's table, asked for per request, on a verifier that runs the whole model
    where the table says the mode needs it. hat is the agents' default mode: its requests name none."""
    spec = MODE_TABLE[mode]
    env = (("TOPHAT_VERIFIER_FULL_MODEL", "true"),) if spec.verifier_full_model else ()
    return BenchVariant(mode, {} if mode == "hat" else {"mode": mode}, env)


def modes_for(workload: str) -> dict[str, BenchVariant]:
    chunk = str(SERVER_CHUNK.get(workload, 128))
    plain = {"speculative": False, "prompt_chunking": False}
    variants = {
        "ushape": BenchVariant("ushape", plain),
        "usarathi": BenchVariant("usarathi", plain, (("TOPHAT_VERIFIER_SERVER_CHUNK_TOKENS", chunk),)),
        **{mode: table_variant(mode) for mode in BENCH_MODES},
        # hat with every round a chain (HAT as published): the draft budget's shapes against it, in one run
        "hat-chain": BenchVariant("hat-chain", {"draft_shape": "chain"}),
    }
    # each mode on a verifier that computes prompts whole, never in g-bounded pieces: what those pieces change
    whole = (("TOPHAT_VERIFIER_MAX_PREFILL_STEP_MS", "0"),)
    for name, variant in list(variants.items()):
        variants[name + WHOLE_PROMPTS] = BenchVariant(
            name + WHOLE_PROMPTS, variant.request_options, variant.verifier_env + whole
        )
    return variants


def link_with_rtt(link: str, rtt_ms: float | None) -> str:
    """The link spec with its one-way latency set to half of an emulated round trip (`--rtt-ms`)."""
    if rtt_ms is None:
        return link
    if rtt_ms < 0:
        raise ValueError(f"--rtt-ms must be >= 0, got {rtt_ms}")
    kept = [part for part in link.split(",") if part.strip() and not part.strip().lower().startswith("lat=")]
    if kept in ([], ["none"]):
        kept = []
    return ",".join([*kept, f"lat={rtt_ms / 2:g}ms"])


def ablation_modes() -> dict[str, BenchVariant]:
    """HAT Table 5's rows: every combination of SD, PC and PD that the paper reports."""
    rows: dict[str, dict[str, Any]] = {
        "U-shape": dict(speculative=False, prompt_chunking=False, parallel_candidates=0),
        "+PC": dict(speculative=False, prompt_chunking=True, parallel_candidates=0),
        "+SD": dict(speculative=True, prompt_chunking=False, parallel_candidates=0),
        "+SD+PD": dict(speculative=True, prompt_chunking=False),
        "+SD+PC": dict(speculative=True, prompt_chunking=True, parallel_candidates=0),
        "+SD+PC+PD": dict(speculative=True, prompt_chunking=True),
    }
    return {name: BenchVariant(name, options) for name, options in rows.items()}


def loadgen_options(
    url: str,
    workload: str,
    rate: float,
    num_requests: int,
    max_new_tokens: int,
    seed: int,
    out: Path,
    request_options: dict,
    redis_url: str | None,
    model_dir: str,
) -> dict[str, Any]:
    """The option set of one `tophat loadgen` run."""
    return {
        "url": url,
        "workload": workload,
        "rate": rate,
        "burstiness": 1.0,
        "num_requests": num_requests,
        "duration": None,
        "max_new_tokens": max_new_tokens,
        "seed": seed,
        "out": out,
        "tokenizer": Path(model_dir),
        "context_limit": None,
        "length_dist": "gamma",
        "max_concurrency": None,
        "request_timeout": 600.0,
        "temperature": 0.0,
        "model": None,
        "num_devices": None,
        "send_device_hint": False,
        "body_extra": {"tophat": request_options} if request_options else {},
        "slo_ttft_ms": None,
        "slo_tpot_ms": None,
        "slo_e2el_ms": None,
        "prefill_sla_ms": None,
        "decode_sla_ms": None,
        "redis_url": redis_url,
        "state_monitor_url": None,
        "progress": False,
    }


def run_modes(
    modes: dict[str, BenchVariant],
    *,
    workload: str,
    rates: list[float],
    num_requests: int,
    max_new_tokens: int,
    seed: int,
    out: Path,
    devices: int,
    link: str,
    model_dir: str,
    dtype: str = "auto",
    repeats: int = 1,
) -> dict[tuple[str, float], dict]:
    """Run every mode at every rate; returns results.json contents keyed by (mode, rate). With `repeats` > 1 the
    modes of a mesh run that many times in alternating order (A B C, C B A, ...), so a drift in the machine's load
    falls on every mode alike; a mode's row pools the requests of all its repeats (`repeat_tbt_ms` keeps each
    repeat's mean TBT, to show the spread)."""
    from loadgen.load_run import run_load_test
    from tophatctl.mesh import Mesh
    from tophatctl.mesh_config import MeshConfig
    from tophatctl.mesh_ports import find_port_base

    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, not {repeats}")
    runs: dict[tuple[str, float], list[tuple[dict, list]]] = {}
    groups: dict[tuple, list[BenchVariant]] = {}
    for mode in modes.values():
        groups.setdefault(mode.mesh_key(), []).append(mode)
    for group, orders in mesh_turns(list(groups.values()), repeats):
        config = MeshConfig(
            model_dir=model_dir,
            num_devices=devices,
            port_base=find_port_base(devices),
            link=link,
            dtype=dtype,
            extra_env=dict(group[0].mesh_key()),
        )
        with Mesh(config) as mesh:
            for repeat, order in orders:
                for mode in order:
                    for rate in rates:
                        run_dir = out / workload / mode.name / f"rate-{rate:g}"
                        run_dir = run_dir / f"repeat-{repeat}" if repeats > 1 else run_dir
                        log.info("mode %s, %s @ %g req/s (repeat %d)", mode.name, workload, rate, repeat)
                        options = loadgen_options(
                            config.streamer_url,
                            workload,
                            rate,
                            num_requests,
                            max_new_tokens,
                            seed,
                            run_dir,
                            mode.request_options,
                            mesh.redis_url,
                            model_dir,
                        )
                        records: list = []
                        result = asyncio.run(run_load_test(options, records))
                        runs.setdefault((mode.name, rate), []).append((result, records))
    return {key: pooled(repeated) for key, repeated in runs.items()}


def counterbalanced(group: list[T], repeats: int) -> list[list[T]]:
    """The order of each repeat: as given, then reversed, alternately."""
    return [list(group) if repeat % 2 == 0 else list(reversed(group)) for repeat in range(repeats)]


def mesh_turns(
    groups: list[list[BenchVariant]], repeats: int
) -> list[tuple[list[BenchVariant], list[tuple[int, list[BenchVariant]]]]]:
    """The meshes of a bench in the order they come up: (the modes that share one, its (repeat, order) runs).
    One group keeps its mesh through every repeat. Several take turns, repeat by repeat in alternating order,
    a fresh mesh each turn, so a drift in the machine's load falls on every group alike, not only on its modes."""
    if len(groups) == 1 or repeats == 1:
        return [(group, list(enumerate(counterbalanced(group, repeats)))) for group in groups]
    return [
        (group, [(repeat, counterbalanced(group, repeats)[repeat])])
        for repeat in range(repeats)
        for group in counterbalanced(groups, repeats)[repeat]
    ]


def pooled(repeated: list[tuple[dict, list]]) -> dict:
    """One row from a mode's repeats: the first repeat's results with the metrics of every repeat's requests."""
    from loadgen import metrics

    if len(repeated) == 1:
        return repeated[0][0]
    first = repeated[0][0]
    records = [record for _, records in repeated for record in records]
    return {
        **first,
        **metrics.build_results(records),
        "repeats": len(repeated),
        "repeat_tbt_ms": [result["mean_tbt_ms"] for result, _ in repeated],
    }


def _ratio_cell(row: dict, base: dict | None, key: str) -> str:
    """row[key] / base[key] as a table cell; "-" without a baseline run or with a zero one."""
    return f"{row[key] / base[key]:.2f}x" if base and base.get(key) else "-"


def format_table(results: dict[tuple[str, float], dict], baseline: str, title: str) -> str:
    lines = [
        title,
        f"{'mode':12s} {'rate':>5s} {'done':>5s} {'TTFT mean':>10s} {'TTFT p99':>9s} {'TBT mean':>9s} "
        f"{'TBT p99':>8s} {'tok/s':>6s} {'accept':>7s} {'TTFT/base':>10s} {'TBT/base':>9s}",
    ]
    for (mode, rate), r in results.items():
        base = results.get((baseline, rate))
        lines.append(
            f"{mode:12s} {rate:5g} {r['completed']:5d} {r['mean_ttft_ms']:9.1f}ms {r['p99_ttft_ms']:7.1f}ms "
            f"{r['mean_tbt_ms']:7.2f}ms {r['p99_tbt_ms']:6.1f}ms "
            f"{1e3 / r['mean_tbt_ms'] if r['mean_tbt_ms'] else 0:6.1f} {r.get('mean_accept_length') or 0:7.2f} "
            f"{_ratio_cell(r, base, 'mean_ttft_ms'):>10s} {_ratio_cell(r, base, 'mean_tbt_ms'):>9s}"
        )
    return "\n".join(lines + repeat_ratio_lines(results, baseline))


def repeat_ratio_lines(results: dict[tuple[str, float], dict], baseline: str) -> list[str]:
    """With repeats: each mode's TBT against the baseline's, repeat by repeat (the spread a pooled ratio hides)."""
    lines = []
    for (mode, rate), r in results.items():
        base = results.get((baseline, rate))
        if mode == baseline or not base or len(r.get("repeat_tbt_ms") or ()) != len(base.get("repeat_tbt_ms") or ()):
            continue
        ratios = [f"{m / b:.2f}x" for m, b in zip(r["repeat_tbt_ms"], base["repeat_tbt_ms"]) if m and b]
        lines.append(f"  {mode} @ {rate:g}: TBT/base per repeat {' '.join(ratios)}")
    return ["", "per repeat (alternating order):", *lines] if lines else []


def save_table(out: Path, name: str, table: str, results: dict[tuple[str, float], dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.txt").write_text(table + "\n")
    summary = {
        f"{mode}@{rate:g}": {"mode": mode, **{k: v for k, v in r.items() if not isinstance(v, (list, dict))}}
        for (mode, rate), r in results.items()
    }
    (out / f"{name}.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")


def parse_rates(text: str) -> list[float]:
    rates = [float(x) for x in text.split(",") if x.strip()]
    if not rates or any(not (r > 0) or math.isnan(r) for r in rates):
        raise ValueError(f"--rates must be positive numbers, got {text!r}")
    return rates


def plot_modes(out: Path, workload: str, results: dict[tuple[str, float], dict], name: str) -> list[Path]:
    """Per rate, CDFs of TTFT and of HAT's decode SLA (delay per 10 tokens), one line per mode."""
    import csv

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for rate in sorted({r for _, r in results}):
        fig, (ax_ttft, ax_decode) = plt.subplots(1, 2, figsize=(10, 3.8))
        for mode, mode_rate in results:
            if mode_rate != rate:
                continue
            rate_dir = out / workload / mode / f"rate-{rate:g}"
            rows = []
            # one run's requests, or every repeat's pooled (`--repeats`: rate-R/repeat-N/requests.csv)
            for path in sorted(rate_dir.glob("requests.csv")) + sorted(rate_dir.glob("repeat-*/requests.csv")):
                with open(path) as handle:
                    rows += [r for r in csv.DictReader(handle) if r["ok"] in ("True", "true", "1")]
            for ax, column in ((ax_ttft, "ttft_ms"), (ax_decode, "decode_sla_ms")):
                values = sorted(float(r[column]) for r in rows if r[column] not in ("", "nan"))
                if values:
                    ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", label=mode)
        ax_ttft.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title=f"TTFT, {workload} @ {rate:g} req/s")
        ax_decode.set(xlabel="delay per 10 generated tokens (ms)", title="decode SLA (HAT)")
        for ax in (ax_ttft, ax_decode):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / f"{name}-rate-{rate:g}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
