"""DiSCo scheduler overhead: `tophat bench disco-overhead [--json]`.

Builds dispatch policies from log-normal synthetic prompt lengths and server TTFTs of 1K, 10K
and 100K samples (the scale of DiSCo's §5 overhead study, 0.1-15 ms) for both constraints, and
times build() once and decide() per call. Prints a table (or JSON); asserts nothing about time.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np

from shared.disco.cost import CostModel
from shared.disco.dispatch import DispatchPolicy

COSTS = {"server": CostModel(), "device": CostModel(exchange_rate=1e-4)}  # Algorithm 1 picks each side


def synthetic_history(samples: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(prompt lengths in tokens, median ~150; server TTFTs in s, median 0.5 s, a long tail)."""
    lengths = np.maximum(np.round(rng.lognormal(math.log(150), 1.0, samples)), 1)  # [samples]
    ttft_s = rng.lognormal(math.log(0.5), 0.6, samples)  # [samples]
    return lengths, ttft_s


def measure(
    sizes=(1_000, 10_000, 100_000), decisions: int = 100_000, budget: float = 0.5, alpha: float = 0.05, seed: int = 0
) -> list[dict]:
    """One row per (constraint, history size): build ms and decide() p50/p99/max in microseconds."""
    rng = np.random.default_rng(seed)
    rows = []
    for samples in sizes:
        lengths, ttft_s = synthetic_history(samples, rng)
        prompts = [int(length) for length in synthetic_history(decisions, rng)[0]]
        for constraint, cost in COSTS.items():
            start = time.perf_counter()
            policy = DispatchPolicy.build(cost, lengths, ttft_s, budget, alpha)
            build_ms = (time.perf_counter() - start) * 1e3
            timings_ns = np.empty(decisions, dtype=np.int64)  # [decisions]
            for i, prompt in enumerate(prompts):
                t0 = time.perf_counter_ns()
                policy.decide(prompt)
                timings_ns[i] = time.perf_counter_ns() - t0
            rows.append(
                {
                    "constraint": constraint,
                    "samples": samples,
                    "decisions": decisions,
                    "budget": budget,
                    "build_ms": build_ms,
                    "decide_p50_us": float(np.percentile(timings_ns, 50)) / 1e3,
                    "decide_p99_us": float(np.percentile(timings_ns, 99)) / 1e3,
                    "decide_max_us": float(timings_ns.max()) / 1e3,
                    "length_threshold": policy.length_threshold,
                    "beta": policy.beta,
                    "w_tail_s": policy.w_tail,
                }
            )
    return rows


def format_table(rows: list[dict]) -> str:
    lines = [
        f"{'constraint':<10} {'samples':>8} {'build ms':>9} {'p50 us':>7} {'p99 us':>7} {'max us':>8}"
        f" {'l_th':>7} {'beta':>8} {'w_tail s':>8}"
    ]
    for r in rows:
        lines.append(
            f"{r['constraint']:<10} {r['samples']:>8} {r['build_ms']:>9.2f} {r['decide_p50_us']:>7.2f}"
            f" {r['decide_p99_us']:>7.2f} {r['decide_max_us']:>8.1f} {r['length_threshold']:>7.0f}"
            f" {r['beta']:>8.5f} {r['w_tail_s']:>8.3f}"
        )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> list[dict]:
    rows = measure(args.sizes, args.decisions, args.budget, args.alpha, args.seed)
    print(json.dumps(rows, indent=2) if args.as_json else format_table(rows))
    return rows
