"""`tophat bench edge-sd`: Edge SD's draft server against its baselines (paper 001 §IV).

Edge SD serves K users' tasks at once: every round here sends K requests together (one user each, its
uplink SNR from the paper's channel model) to a mesh whose device agent is the draft server
(`--edge-draft-server`) and waits for all of them. One mesh per mode, the same trace of rounds in each:

    edge-sd            eq. 27 uplink shares, Algorithm 1 batches, l chosen by eq. 7, draft/verify pipelined
    uniform-bandwidth  the uplink split evenly (Fig. 9's baseline)
    max-batch          as few batches as the memory budget allows (Fig. 6's baseline)
    no-pipeline        each batch drafted, then verified, before the next is drafted ("SD w/o Pipeline")
    fixed-length       l = 7 for every task (the paper's FSL baseline)

The first round of each mesh is a warm-up (its passes and verdicts give the planner its runtime fits
and α; before them the planner has only the paper's GPU constants) and is not counted. Decoding is
greedy, so every mode answers each task with the same tokens: their latencies compare the same work.

Per request the client times TTFT and E2EL (send -> last token, which includes the round's wait for
the slowest upload, as the paper's latency does). Per round the draft server's measured stage times
go through eq. 20's recursion (loadgen/edge_sd_timeline.py): predicted vs measured inference time.
Everything below `run_edge_sd_bench` is pure and tested in tests/loadgen/test_bench_edge_sd.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

log = logging.getLogger(__name__)

EDGE_SD_MODES = ("edge-sd", "uniform-bandwidth", "max-batch", "no-pipeline", "fixed-length")
FIXED_SPEC_LEN = 7  # the paper's FSL baseline
# The draft server's settings per mode (TOPHAT_DEVICE_EDGE_*); edge-sd is every default.
MODE_SETTINGS = {
    "edge-sd": {},
    "uniform-bandwidth": {"edge_bandwidth": "uniform"},
    "max-batch": {"edge_batching": "max"},
    "no-pipeline": {"edge_pipeline": "false"},
    "fixed-length": {"edge_spec_len": str(FIXED_SPEC_LEN)},
}
# The paper's channel (§IV, Table II): users uniform in a 400 m cell, g = g0 * Exp(1) * d^-2 with
# g0 = -30 dB, transmit power 0.2 W (23 dBm), noise -106 dBm.
CELL_RADIUS_M = 400.0
MIN_DISTANCE_M = 10.0
PATH_LOSS_DB = -30.0
TX_POWER_DBM = 10 * math.log10(0.2e3)
NOISE_DBM = -106.0


@dataclass
class EdgeSDBenchConfig:
    model: str = "smollm2"
    tasks: int = 8  # K per round
    rounds: int = 2  # counted rounds per mode (after one warm-up round)
    max_input: int = 192  # I_k uniform in [min_input, max_input]
    min_input: int = 16
    max_output: int = 32  # O_k uniform in [min_output, max_output]
    min_output: int = 8
    # 2 MHz for K = 8 gives each user the share the paper's K = 100 users get of 25 MHz (Fig. 9)
    bandwidth_mhz: float = 2.0
    # The SBS memory Γ_s, as how many tasks of the longest kind a batch may hold beside the draft model's weights
    # (eqs. 9-10): in the paper Γ_s = 16 GB holds LLaMA-1.1B and ~30 of its tasks, so K = 100 needs several batches.
    tasks_per_batch_memory: int = 3
    # The SBS drafts this many times slower than its compute here (the device speed setting): in the paper the
    # SBS's GPU is ~20x slower per FLOP than the MBS's (Table II's c1), here both share one CPU.
    sbs_slowdown: float = 4.0
    modes: Sequence[str] = EDGE_SD_MODES
    seed: int = 0
    timeout_s: float = 600.0
    out: Path | None = None


@dataclass(frozen=True)
class Task:
    input_tokens: int
    output_tokens: int
    snr_db: float
    prompt: str = ""


@dataclass
class Sample:
    mode: str
    round: int
    task: int
    ttft_ms: float
    e2el_ms: float
    completion_tokens: int | None
    text: str


# -- the trace (pure) -----------------------------------------------------------------------------


def user_snrs_db(count: int, rng: np.random.Generator) -> list[float]:
    """p g / σ² in dB for `count` users placed uniformly in the cell with Rayleigh fading (paper §IV)."""
    distance = np.maximum(MIN_DISTANCE_M, CELL_RADIUS_M * np.sqrt(rng.uniform(size=count)))  # uniform in the disk
    fading = rng.exponential(size=count)
    gain_db = PATH_LOSS_DB + 10 * np.log10(fading) - 20 * np.log10(distance)
    return [float(x) for x in TX_POWER_DBM + gain_db - NOISE_DBM]


def trace(cfg: EdgeSDBenchConfig, rounds: int, rng: np.random.Generator) -> list[list[Task]]:
    """`rounds` rounds of K tasks: lengths uniform in the configured ranges (§IV), SNRs from the channel."""
    out = []
    for _ in range(rounds):
        inputs = rng.integers(cfg.min_input, cfg.max_input + 1, size=cfg.tasks)
        outputs = rng.integers(cfg.min_output, cfg.max_output + 1, size=cfg.tasks)
        out.append([Task(int(i), int(o), s) for i, o, s in zip(inputs, outputs, user_snrs_db(cfg.tasks, rng))])
    return out


def memory_budget_bytes(config: dict[str, Any], cfg: EdgeSDBenchConfig, split_layers: int = 2) -> int:
    """Γ_s: the draft model's weights (eq. 9) and the KV (eq. 10) of `tasks_per_batch_memory` longest tasks."""
    from shared.edge_sd.runtime import split_model_shapes

    draft, _ = split_model_shapes(
        config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"], split_layers
    )
    longest = cfg.max_input + cfg.max_output + 8  # re-encoded prompts can come out a few tokens longer
    return draft.weight_bytes + cfg.tasks_per_batch_memory * draft.kv_bytes_per_token * longest


def predicted_inference_s(stages: Sequence[dict[str, Any]]) -> float | None:
    """Eq. 20-22 on one round's measured stage times: T_inf the recursion predicts for that schedule."""
    from loadgen.edge_sd_timeline import pipeline_timeline

    if not stages or any("verify_s" not in s for s in stages):
        return None
    steps = max(s["step"] for s in stages)
    batches = max(s["batch"] for s in stages) + 1
    draft = [[0.0] * batches for _ in range(steps)]
    verify = [[0.0] * batches for _ in range(steps)]
    for s in stages:
        draft[s["step"] - 1][s["batch"]] = s["draft_s"]
        verify[s["step"] - 1][s["batch"]] = s["verify_s"]
    per_batch = [max((s["step"] for s in stages if s["batch"] == b), default=0) for b in range(batches)]
    return pipeline_timeline(draft, verify, per_batch).inference_latency


def sequential_inference_s(stages: Sequence[dict[str, Any]]) -> float | None:
    """The no-pipeline schedule's T_inf on the same stage times (every draft and verify in turn)."""
    if not stages or any("verify_s" not in s for s in stages):
        return None
    return float(sum(s["draft_s"] + s["verify_s"] for s in stages))


# -- the live part --------------------------------------------------------------------------------


def with_prompts(rounds: list[list[Task]], model_dir: Path, seed: int) -> list[list[Task]]:
    """Held-out text cut to each task's input length (re-encoded: lengths can move by a token)."""
    from loadgen.workloads import HeldOutText, load_tokenizer

    held_out = HeldOutText(load_tokenizer(model_dir))
    rng = np.random.default_rng(seed + 1)
    out = []
    for tasks in rounds:
        cut = [held_out.cut(t.input_tokens, rng) for t in tasks]
        out.append([Task(n, t.output_tokens, t.snr_db, text) for t, (text, n) in zip(tasks, cut)])
    return out


async def _run_round(
    base_url: str, device_url: str, mode: str, index: int, tasks: list[Task], timeout_s: float
) -> tuple[list[Sample], dict[str, Any]]:
    import httpx

    from loadgen.bench_jupiter import timed_request

    async with httpx.AsyncClient(timeout=timeout_s) as client:

        async def one(task: Task):
            body = {
                "model": "tophat",
                "prompt": task.prompt,
                "max_tokens": task.output_tokens,
                "temperature": 0,
                "stream": True,
                "tophat": {"snr_db": task.snr_db},
            }
            return await timed_request(client, f"{base_url}/v1/completions", body, timeout_s)

        results = await asyncio.gather(*(one(t) for t in tasks))
        rounds = (await client.get(f"{device_url}/edge-sd/rounds", timeout=10)).json()["rounds"]
    samples = [
        Sample(mode, index, k, ttft * 1e3, e2el * 1e3, stats.get("completion_tokens"), text)
        for k, (ttft, e2el, text, stats) in enumerate(results)
    ]
    return samples, rounds[-1]


def run_edge_sd_bench(cfg: EdgeSDBenchConfig) -> dict[str, Any]:
    from shared.model.checkpoint import read_config
    from tophatctl.mesh import Mesh
    from tophatctl.mesh_config import MeshConfig, mesh_model_dir
    from tophatctl.mesh_ports import find_port_base

    unknown = set(cfg.modes) - set(EDGE_SD_MODES)
    if unknown:
        raise ValueError(f"unknown modes {sorted(unknown)}; choose from {', '.join(EDGE_SD_MODES)}")
    model_dir = mesh_model_dir(MeshConfig(model_dir=cfg.model))
    rounds = with_prompts(trace(cfg, cfg.rounds + 1, np.random.default_rng(cfg.seed)), model_dir, cfg.seed)
    memory_budget = memory_budget_bytes(read_config(model_dir), cfg)
    samples: list[Sample] = []
    round_records: list[dict[str, Any]] = []
    for mode in cfg.modes:
        env = {
            "edge_bandwidth_mhz": str(cfg.bandwidth_mhz),
            "edge_memory_budget": str(memory_budget),
            "speed": f"{cfg.sbs_slowdown:g}",
            "edge_max_tasks": str(cfg.tasks),
            "edge_window_s": "0.2",
            **MODE_SETTINGS[mode],
        }
        config = MeshConfig(
            model_dir=str(model_dir),
            port_base=find_port_base(1),
            edge_draft_server=True,
            auth=False,
            link_mode="inprocess",
            device_env=env,
        )
        with Mesh(config) as mesh:
            for index, tasks in enumerate(rounds):
                got, record = asyncio.run(
                    _run_round(config.streamer_url, mesh.config.device_url(0), mode, index, tasks, cfg.timeout_s)
                )
                log.info(
                    "%s round %d: mean E2EL %.0f ms, batches %s, l %s",
                    mode,
                    index,
                    statistics.fmean(s.e2el_ms for s in got),
                    record["plan"]["batches"],
                    record["plan"]["spec_len"],
                )
                if index == 0:
                    continue  # warm-up: the planner had no telemetry yet
                samples += got
                round_records.append(
                    {"mode": mode, "round": index, **summarise_round(record, pipelined=mode != "no-pipeline")}
                )
    results = build_edge_sd_results(samples, round_records, cfg)
    if cfg.out is not None:
        cfg.out.parent.mkdir(parents=True, exist_ok=True)
        cfg.out.write_text(json.dumps(results, indent=1))
    return results


# -- pure: aggregation and tables -------------------------------------------------------------------


def summarise_round(record: dict[str, Any], pipelined: bool = True) -> dict[str, Any]:
    """One round for the results: its plan, stage means and T_inf measured vs predicted from its measured
    stage times by the schedule it ran (eq. 20's pipeline, or one stage after another without it)."""
    plan = record["plan"]
    predicted = (predicted_inference_s if pipelined else sequential_inference_s)(record["stages"])
    decode = [s for s in record["stages"] if s["step"] > 1 and "verify_s" in s]
    prefill = [s for s in record["stages"] if s["step"] == 1 and "verify_s" in s]
    return {
        "batches": plan["batches"],
        "spec_len": plan["spec_len"],
        "shares": plan["shares"],
        "alpha": plan.get("alpha"),
        "draft_runtime": plan.get("draft_runtime"),
        "verify_runtime": plan.get("verify_runtime"),
        "mean_draft_step_ms": _mean([s["draft_s"] * 1e3 for s in decode]),
        "mean_verify_step_ms": _mean([s["verify_s"] * 1e3 for s in decode]),
        "prefill_draft_ms": sum(s["draft_s"] for s in prefill) * 1e3,
        "prefill_verify_ms": sum(s["verify_s"] for s in prefill) * 1e3,
        "sources": plan["sources"],
        "upload_ms": record["upload_s"] * 1e3,
        "inference_ms": record["inference_s"] * 1e3,
        "predicted_inference_ms": None if predicted is None else predicted * 1e3,
        "planned_inference_ms": plan["predicted"]["inference_s"] * 1e3,
    }


def _mean(xs: Sequence[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def build_edge_sd_results(
    samples: Sequence[Sample], rounds: Sequence[dict[str, Any]], cfg: EdgeSDBenchConfig
) -> dict[str, Any]:
    entries = []
    for mode in cfg.modes:
        mine = [s for s in samples if s.mode == mode]
        if not mine:
            continue
        per_round: dict[int, list[float]] = {}
        for s in mine:
            per_round.setdefault(s.round, []).append(s.e2el_ms)
        entries.append(
            {
                "mode": mode,
                "requests": len(mine),
                "mean_ttft_ms": _mean([s.ttft_ms for s in mine]),
                "mean_e2el_ms": _mean([s.e2el_ms for s in mine]),
                "mean_round_latency_ms": _mean([max(v) for v in per_round.values()]),
                "rounds": [r for r in rounds if r["mode"] == mode],
            }
        )
    texts: dict[tuple[int, int], set[str]] = {}
    for s in samples:
        texts.setdefault((s.round, s.task), set()).add(s.text)
    config = {k: v for k, v in vars(cfg).items() if k != "out"}
    config["modes"] = list(cfg.modes)
    return {
        "bench": "edge-sd",
        "config": config,
        "results": entries,
        "answers_identical_across_modes": all(len(v) == 1 for v in texts.values()) if texts else None,
    }


def _gain(base: float | None, ours: float | None) -> str:
    if not base or ours is None:
        return "-"
    return f"{(1 - ours / base) * 100:+.1f}%"


PAPER_GAINS = {
    "uniform-bandwidth": "up to 44.9%",
    "max-batch": "up to 21.4%",
    "no-pipeline": "~31%",
    "fixed-length": "(Fig. 8)",
}


def format_edge_sd_table(results: dict[str, Any]) -> str:
    rows = {e["mode"]: e for e in results["results"]}
    ours = rows.get("edge-sd", {})
    lines = [
        "mode               mean TTFT ms  mean E2EL ms  round ms  edge-sd's gain (E2EL)  paper",
        "-----------------  ------------  ------------  --------  ---------------------  -----------",
    ]
    for mode, e in rows.items():
        gain = "" if mode == "edge-sd" else _gain(e["mean_e2el_ms"], ours.get("mean_e2el_ms"))
        lines.append(
            f"{mode:<17}  {e['mean_ttft_ms']:>12.0f}  {e['mean_e2el_ms']:>12.0f}  "
            f"{e['mean_round_latency_ms']:>8.0f}  {gain:>21}  {PAPER_GAINS.get(mode, '')}"
        )
    lines.append("")
    lines.append("round  mode               batches  l  upload ms  inference ms  predicted from its stages  planned")
    for e in results["results"]:
        for r in e["rounds"]:
            predicted = r["predicted_inference_ms"]
            lines.append(
                f"{r['round']:>5}  {e['mode']:<17}  {len(r['batches']):>7}  {r['spec_len']:>1}  "
                f"{r['upload_ms']:>9.0f}  {r['inference_ms']:>12.0f}  "
                f"{'-' if predicted is None else f'{predicted:.0f}':>25}  {r['planned_inference_ms']:>7.0f}"
            )
    same = results.get("answers_identical_across_modes")
    lines.append(f"\nanswers identical across modes (greedy): {same}")
    return "\n".join(lines)
