"""`tophat bench jupiter --edge-pipeline SPEC`: Jupiter's edge pipeline against its baselines (Jupiter §VI).

Jupiter serves one request at a time on a LAN of edge devices (single-sequence inference), so
every prompt is sent alone and timed at the client (TTFT: request -> first token; E2EL: request ->
last token). One mesh per layer partition, each an edge pipeline over the same devices and LAN
(tophatctl/edge_pipeline.py), the same prompts in each:

    serial           equal layer split, the whole prompt as one sub-sequence (EdgeShard-style)
    equal-split      equal layer split, pipelined prefill with P equal sub-sequences
    jupiter          DP layer partition (eq. 1) + DP sub-sequences (eqs. 2-4)
    jupiter-outline  the jupiter mesh with outline-based parallel decoding, on open questions,
                     against sequential speculative decoding of the same questions ("jupiter")

Decoding is HAT's speculative decoding through the pipeline in every mode (greedy), so the answers
of the first three modes are token-identical: their latencies compare the same work.

Everything below `run_jupiter_bench` is pure (aggregation, ratios, tables) and tested by hand-made
inputs in tests/loadgen/test_bench_jupiter.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

log = logging.getLogger(__name__)

PIPELINE_MODES = ("serial", "equal-split", "jupiter")
PLAN_KIND = {"serial": "serial", "equal-split": "equal", "jupiter": "jupiter"}
DEFAULT_BUCKETS = (64, 256, 1024)
DEVICE_SESSIONS = 8  # an outline's points (up to 5) run at once on device 0, beside the kept directive
# Open questions of the kinds Jupiter's quality table keeps (generic, knowledge, counterfactual): the
# outline router accepts them; code and math would be routed to sequential decoding anyway.
OUTLINE_QUESTIONS = (
    "What are the main benefits of regular exercise?",
    "How can a small team improve its communication?",
    "What should a traveller consider before visiting a new country?",
    "What would change if humans could photosynthesize?",
)


@dataclass
class JupiterBenchConfig:
    model: str = "smollm2"
    edge_pipeline: str = "orin;xavier;xavier"
    lan: str = "lan"
    buckets: Sequence[int] = DEFAULT_BUCKETS
    per_bucket: int = 3
    max_tokens: int = 32
    outline_questions: Sequence[str] = OUTLINE_QUESTIONS
    outline_max_tokens: int = 160  # the sequential answer's budget; each outline point gets its share
    seed: int = 0
    timeout_s: float = 300.0
    out: Path | None = None
    modes: Sequence[str] = (*PIPELINE_MODES, "jupiter-outline")


@dataclass
class Sample:
    mode: str
    bucket: int | None  # prompt-length bucket; None for the outline questions
    prompt_tokens: int | None
    ttft_ms: float
    e2el_ms: float
    completion_tokens: int | None
    text: str
    stats: dict[str, Any] = field(default_factory=dict)


# -- the live part -------------------------------------------------------------------------------


async def timed_request(client, url: str, body: dict[str, Any], timeout_s: float) -> tuple[float, float, str, dict]:
    """(ttft_s, e2el_s, text, tophat stats) of one streamed request, timed by the load generator's sender."""
    from loadgen.metrics import RequestRecord
    from loadgen.runner import send_request

    record = RequestRecord(index=0, arrival_s=0.0, max_tokens=int(body.get("max_tokens") or 0))
    await send_request(client, url, body, record, time.perf_counter(), timeout_s)
    if record.error is not None:
        raise RuntimeError(f"request failed: {record.error}")
    stats = {
        **(record.tophat or {}),
        "completion_tokens": record.completion_tokens,
        "prompt_tokens": record.prompt_tokens,
    }
    assert record.end_s is not None, "send_request sets end_s whatever happens"
    first = record.chunk_times_s[0] if record.chunk_times_s else record.end_s
    return first, record.end_s, "".join(record.chunk_texts), stats


async def _run_prompts(
    base_url: str, mode: str, prompts: list[tuple[int, str, int]], cfg: JupiterBenchConfig, tophat: dict[str, Any]
) -> list[Sample]:
    import httpx

    samples = []
    async with httpx.AsyncClient(timeout=cfg.timeout_s) as client:
        for bucket, prompt, tokens in prompts:
            body = {
                "model": "tophat",
                "prompt": prompt,
                "max_tokens": cfg.max_tokens,
                "temperature": 0,
                "stream": True,
                "tophat": tophat,
            }
            ttft, e2el, text, stats = await timed_request(client, f"{base_url}/v1/completions", body, cfg.timeout_s)
            samples.append(
                Sample(mode, bucket, tokens, ttft * 1e3, e2el * 1e3, stats.get("completion_tokens"), text, stats)
            )
            log.info(
                "%s bucket %d (%d tokens): TTFT %.0f ms, E2EL %.0f ms", mode, bucket, tokens, ttft * 1e3, e2el * 1e3
            )
    return samples


async def _run_questions(base_url: str, mode: str, cfg: JupiterBenchConfig, outline: bool) -> list[Sample]:
    import httpx

    samples = []
    async with httpx.AsyncClient(timeout=cfg.timeout_s) as client:
        for question in cfg.outline_questions:
            body = {
                "model": "tophat",
                "messages": [{"role": "user", "content": question}],
                "max_tokens": cfg.outline_max_tokens,
                "temperature": 0,
                "stream": True,
                "tophat": {"outline": outline},
            }
            ttft, e2el, text, stats = await timed_request(
                client, f"{base_url}/v1/chat/completions", body, cfg.timeout_s
            )
            samples.append(
                Sample(
                    mode,
                    None,
                    stats.get("prompt_tokens"),
                    ttft * 1e3,
                    e2el * 1e3,
                    stats.get("completion_tokens"),
                    text,
                    stats,
                )
            )
            log.info("%s %r: E2EL %.0f ms, outline %s", mode, question[:40], e2el * 1e3, stats.get("outline"))
    return samples


def bench_prompts(model_dir: Path, buckets: Sequence[int], per_bucket: int, seed: int) -> list[tuple[int, str, int]]:
    """(bucket, prompt text, its token count): `per_bucket` held-out prompts of each length."""
    import numpy as np

    from loadgen.workloads import HeldOutText, load_tokenizer

    held_out = HeldOutText(load_tokenizer(model_dir))
    rng = np.random.default_rng(seed)
    return [(bucket, *held_out.cut(bucket, rng)) for bucket in buckets for _ in range(per_bucket)]


def run_jupiter_bench(cfg: JupiterBenchConfig) -> dict[str, Any]:
    """Start one mesh per layer partition, time the same prompts on each, return the results JSON."""
    from tophatctl.mesh import Mesh
    from tophatctl.mesh_config import MeshConfig, mesh_model_dir
    from tophatctl.mesh_ports import find_port_base

    model_dir = mesh_model_dir(MeshConfig(model_dir=cfg.model))
    prompts = bench_prompts(model_dir, cfg.buckets, cfg.per_bucket, cfg.seed)
    samples: list[Sample] = []
    plans: dict[str, Any] = {}
    for mode in PIPELINE_MODES:
        wants_outline = mode == "jupiter" and "jupiter-outline" in cfg.modes
        if mode not in cfg.modes and not wants_outline:
            continue
        config = MeshConfig(
            model_dir=str(model_dir),
            port_base=find_port_base(1),
            edge_pipeline=cfg.edge_pipeline,
            lan=cfg.lan,
            edge_plan_kind=PLAN_KIND[mode],
            auth=False,
            link_mode="inprocess",
            device_env={"max_sessions": str(DEVICE_SESSIONS)},
        )
        with Mesh(config) as mesh:
            plan = mesh.edge_plan
            assert plan is not None, "a mesh with an edge pipeline plans it as it starts"
            plans[mode] = {
                "kind": plan.kind,
                "stage_layers": [list(r) for r in plan.stage_layers],
                "predicted_bottleneck_ms": plan.predicted_bottleneck_s * 1e3,
                "sub_sequences": {b: plan.chunk_sizes(b) for b in cfg.buckets},
                "predicted_ttft_ms": {b: s * 1e3 for b, s in plan.predicted_ttft if b in cfg.buckets},
            }
            tophat = {"prompt_chunking": mode != "serial"}
            if mode in cfg.modes:
                samples += asyncio.run(_run_prompts(config.streamer_url, mode, prompts, cfg, tophat))
            if wants_outline:
                samples += asyncio.run(_run_questions(config.streamer_url, "jupiter-sequential", cfg, outline=False))
                samples += asyncio.run(_run_questions(config.streamer_url, "jupiter-outline", cfg, outline=True))
    results = build_jupiter_results(samples, plans, cfg)
    if cfg.out is not None:
        cfg.out.parent.mkdir(parents=True, exist_ok=True)
        cfg.out.write_text(json.dumps(results, indent=1))
    return results


# -- pure: aggregation and tables -------------------------------------------------------------------


def _mean(xs: Sequence[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def build_jupiter_results(samples: Sequence[Sample], plans: dict[str, Any], cfg: JupiterBenchConfig) -> dict[str, Any]:
    """One entry per (mode, bucket) with mean TTFT and E2EL, one per outline run, and the plans."""
    entries = []
    for mode in PIPELINE_MODES:
        for bucket in cfg.buckets:
            mine = [s for s in samples if s.mode == mode and s.bucket == bucket]
            if not mine:
                continue
            entries.append(
                {
                    "mode": mode,
                    "bucket": bucket,
                    "n": len(mine),
                    "prompt_tokens": _mean([s.prompt_tokens for s in mine if s.prompt_tokens is not None]),
                    "mean_ttft_ms": _mean([s.ttft_ms for s in mine]),
                    "mean_e2el_ms": _mean([s.e2el_ms for s in mine]),
                    "completion_tokens": _mean([s.completion_tokens or 0 for s in mine]),
                    "sub_sequences": plans.get(mode, {}).get("sub_sequences", {}).get(bucket),
                }
            )
    outline: list[dict[str, Any]] = [
        {
            "mode": s.mode,
            "question": q,
            "e2el_ms": s.e2el_ms,
            "ttft_ms": s.ttft_ms,
            "completion_tokens": s.completion_tokens,
            "outline": s.stats.get("outline"),
            "text": s.text,
        }
        for s, q in _with_questions(samples, cfg)
    ]
    for mode in ("jupiter-sequential", "jupiter-outline"):
        answers = [o for o in outline if o["mode"] == mode]
        if answers:
            entries.append(
                {
                    "mode": mode,
                    "bucket": None,
                    "n": len(answers),
                    "mean_ttft_ms": _mean([o["ttft_ms"] for o in answers]),
                    "mean_e2el_ms": _mean([o["e2el_ms"] for o in answers]),
                    "completion_tokens": _mean([o["completion_tokens"] or 0 for o in answers]),
                }
            )
    identical = _identical_answers(samples)
    return {
        "bench": "jupiter",
        "edge_pipeline": cfg.edge_pipeline,
        "lan": cfg.lan,
        "model": cfg.model,
        "max_tokens": cfg.max_tokens,
        "plans": plans,
        "results": entries,
        "outline": outline,
        "answers_identical_across_modes": identical,
    }


def _with_questions(samples: Sequence[Sample], cfg: JupiterBenchConfig) -> list[tuple[Sample, str]]:
    out = []
    for mode in ("jupiter-sequential", "jupiter-outline"):
        mine = [s for s in samples if s.mode == mode]
        out += list(zip(mine, cfg.outline_questions))
    return out


def _identical_answers(samples: Sequence[Sample]) -> bool | None:
    """Whether every prompt got the same text in every pipeline mode (lossless: it must)."""
    by_mode = {m: [s.text for s in samples if s.mode == m] for m in PIPELINE_MODES}
    runs = [texts for texts in by_mode.values() if texts]
    if len(runs) < 2:
        return None
    return all(texts == runs[0] for texts in runs[1:])


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def format_jupiter_table(results: dict[str, Any]) -> str:
    """TTFT and E2EL per bucket for the three pipeline modes with ratios, then outline vs sequential."""
    rows = {(e["mode"], e["bucket"]): e for e in results["results"]}
    buckets = sorted({e["bucket"] for e in results["results"] if e["bucket"] is not None})
    lines = [
        f"Jupiter bench: edge pipeline {results['edge_pipeline']}, LAN {results['lan']}, model "
        f"{results['model']}, max_tokens {results['max_tokens']}, one request at a time"
    ]
    for mode, plan in results["plans"].items():
        predicted = ", ".join(
            f"{b}: {ms:.0f}" for b, ms in sorted((int(b), ms) for b, ms in plan.get("predicted_ttft_ms", {}).items())
        )
        lines.append(
            f"  {mode:12s} layers {plan['stage_layers']}  predicted bottleneck "
            f"{plan['predicted_bottleneck_ms']:.1f} ms" + (f", prefill ms by length {predicted}" if predicted else "")
        )
    lines.append(
        f"{'bucket':>6s} {'metric':6s} {'serial':>9s} {'equal':>9s} {'jupiter':>9s} "
        f"{'serial/jup':>10s} {'equal/jup':>9s}  sub-sequences (jupiter)"
    )
    for bucket in buckets:
        for metric in ("ttft", "e2el"):
            values = [rows.get((m, bucket), {}).get(f"mean_{metric}_ms") for m in PIPELINE_MODES]
            cells = " ".join(f"{v:8.0f}ms" if v is not None else f"{'-':>10s}" for v in values)
            subs = rows.get(("jupiter", bucket), {}).get("sub_sequences") if metric == "ttft" else ""
            lines.append(
                f"{bucket:6d} {metric:6s} {cells} {_ratio(values[0], values[2]):>10s} "
                f"{_ratio(values[1], values[2]):>9s}  {subs or ''}"
            )
    seq, out = rows.get(("jupiter-sequential", None)), rows.get(("jupiter-outline", None))
    if seq and out:
        lines.append(
            f"outline: E2EL {out['mean_e2el_ms']:.0f} ms for {out['completion_tokens']:.0f} tokens vs "
            f"sequential {seq['mean_e2el_ms']:.0f} ms for {seq['completion_tokens']:.0f} tokens "
            f"({_ratio(seq['mean_e2el_ms'], out['mean_e2el_ms'])} faster; tokens/s "
            f"{_rate(out)} vs {_rate(seq)})"
        )
    if results.get("answers_identical_across_modes") is not None:
        lines.append(
            f"answers token-identical across serial / equal-split / jupiter: "
            f"{results['answers_identical_across_modes']}"
        )
    return "\n".join(lines)


def _rate(entry: dict[str, Any]) -> str:
    ms = entry.get("mean_e2el_ms")
    return f"{entry['completion_tokens'] / ms * 1e3:.1f}" if ms and entry.get("completion_tokens") else "-"


def format_outline_answers(results: dict[str, Any], width: int = 100) -> str:
    """Each question's sequential and outline answers, side by side in reading order."""
    import textwrap

    by_question: dict[str, dict[str, dict]] = {}
    for o in results["outline"]:
        by_question.setdefault(o["question"], {})[o["mode"]] = o
    lines = []
    for question, modes in by_question.items():
        lines.append(f"Q: {question}")
        for mode in ("jupiter-sequential", "jupiter-outline"):
            o = modes.get(mode)
            if o is None:
                continue
            lines.append(
                f"  [{mode}, {o['e2el_ms']:.0f} ms, {o['completion_tokens']} tokens, outline {o.get('outline')}]"
            )
            lines += textwrap.wrap(o["text"].strip(), width, initial_indent="    ", subsequent_indent="    ")
    return "\n".join(lines)
