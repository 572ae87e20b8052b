"""The draft budget against the verifier's load (shared/planning/draft_budget.py), from figures measured in one run
(part of `make bench-core`; printed, never asserted).

1. Each draft shape (none, chain, tree<N>) on the same held-out prompts through the in-process middle:
   tokens per round, rows per round, device drafting seconds per round (greedy; outputs checked identical).
2. g(mu): the middle layers over one batch of mu rows (sessions of 8 rows, each after a 128-token context),
   mu = 1 .. 1024, measured on this machine.
3. For S = 1 .. 32 sessions sharing each verifier step, every shape's predicted round time and tokens/s
   with the chosen budget, at a given round trip and link: where the budget falls as the load rises.

    tophat bench budget --model smollm2 --shapes none,chain,tree8,tree16 --rtt-ms 50
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import replace

import torch

from loadgen.bench_core import DelayedCloud, load_bench_models
from shared.model.split import MiddleSubmodel
from shared.net.links import parse_link_spec, scaled_for_hidden
from shared.planning.compute_delay import ComputeDelayPredictor
from shared.planning.draft_budget import BudgetOption, DraftShape, LinkLoad, choose_budget, round_seconds
from shared.specdec.decode_loop import generate
from shared.specdec.device_session import DeviceSession, DraftConfig

LOADS = (1, 2, 4, 8, 16, 32)
SESSION_ROWS = 8


def measure_shapes(device, middle, prompts, shapes: list[DraftShape], args) -> tuple[dict[str, dict], float]:
    """Each shape's figures, and the device's mean per-round time outside drafting and the cloud wait."""
    figures, reference = {}, None
    overheads: list[float] = []
    for shape in shapes:
        config = DraftConfig(args.eta, shape.max_draft, shape.tree_nodes, args.tree_width, args.tree_min_prob)
        lengths: list[int] = []
        rows: list[int] = []
        draft_s = 0.0
        outputs = []
        for index, ids in enumerate(prompts):
            session = DeviceSession(device, ids, draft_config=config, max_new_tokens=args.max_new_tokens)
            result = asyncio.run(generate(session, DelayedCloud(middle, 0.0), session_id=index + 1))
            outputs.append(result.token_ids)
            lengths += result.accept_lengths
            rows += session.round_rows
            overheads += session.round_overhead_s
            draft_s += sum(seconds for seconds, _ in session.draft_seconds)
        reference = reference or outputs
        figures[shape.name] = {
            "identical": outputs == reference,
            "accept": round(statistics.fmean(lengths), 3),
            "rows": round(statistics.fmean(rows), 2),
            "draft_s": round(draft_s / len(lengths), 4),
        }
    return figures, statistics.fmean(overheads) if overheads else 0.0


def measure_g(middle: MiddleSubmodel, hidden_size: int, repeats: int = 3) -> list[tuple[int, float]]:
    """(mu, median seconds) of one middle pass over mu rows in sessions of SESSION_ROWS rows."""
    points = []
    for mu in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024):
        sizes = [SESSION_ROWS] * (mu // SESSION_ROWS) + ([mu % SESSION_ROWS] if mu % SESSION_ROWS else [])
        caches = [middle.new_cache() for _ in sizes]
        middle.forward_batch([(cache, torch.randn(128, hidden_size)) for cache in caches])
        samples = []
        for _ in range(repeats):
            for cache in caches:
                cache.truncate(128)
            started = time.perf_counter()
            middle.forward_batch([(cache, torch.randn(n, hidden_size)) for cache, n in zip(caches, sizes)])
            samples.append(time.perf_counter() - started)
        for cache in caches:
            cache.free()
        points.append((mu, statistics.median(samples)))
    return points


def budget_table(figures: dict[str, dict], g_points, link: LinkLoad) -> list[dict]:
    g_curve = ComputeDelayPredictor(alpha=0.0)
    for mu, seconds in g_points:
        g_curve.observe(mu, seconds)

    def g(mu: float) -> float:
        return g_curve.predict(mu) or 0.0

    options = [BudgetOption(name, f["accept"], f["rows"], f["draft_s"]) for name, f in figures.items()]
    table = []
    for sessions in LOADS:
        at_load = replace(link, sessions=sessions)
        chosen, rates = choose_budget(options, at_load, g)
        table.append(
            {
                "sessions": sessions,
                "overhead_s": round(link.overhead_s, 4),
                "chosen": chosen,
                "tokens_per_s": {name: round(rate, 2) for name, rate in rates.items()},
                "round_ms": {o.name: round(1e3 * round_seconds(o, at_load, g), 1) for o in options},
            }
        )
    return table


def print_table(figures: dict[str, dict], g_points, table: list[dict], args) -> None:
    print(f"\ndraft shapes, same prompts, same run ({args.prompts} prompts x {args.max_new_tokens} tokens):")
    print("  shape    accept  rows/round  draft ms/round  identical")
    for name, f in figures.items():
        print(f"  {name:7s}  {f['accept']:6.2f}  {f['rows']:10.2f}  {1e3 * f['draft_s']:14.1f}  {f['identical']}")
    print(
        "\ng(mu) on this machine, the middle layers over mu rows (ms): "
        + ", ".join(f"{mu}:{1e3 * s:.0f}" for mu, s in g_points)
    )
    names = list(figures)
    print(
        f"\ndraft budget against load (round trip {args.rtt_ms:.0f} ms, link {args.link}, device "
        f"overhead {1e3 * table[0]['overhead_s']:.1f} ms/round; predicted tokens/s per session; * = chosen):"
    )
    print("  sessions  " + "  ".join(f"{n:>8s}" for n in names) + "  chosen")
    for row in table:
        cells = [f"{row['tokens_per_s'][n]:7.2f}{'*' if n == row['chosen'] else ' '}" for n in names]
        print(f"  {row['sessions']:8d}  " + "  ".join(cells) + f"  {row['chosen']}")


def run(args) -> dict:
    checkpoint, device, middle, prompts = load_bench_models(args)
    shapes = [DraftShape.parse(name.strip(), args.max_draft) for name in args.shapes.split(",") if name.strip()]
    figures, overhead_s = measure_shapes(device, middle, prompts, shapes, args)
    g_points = measure_g(middle, checkpoint.hidden_size)
    profile = scaled_for_hidden(parse_link_spec(args.link), checkpoint.hidden_size)
    link = LinkLoad(
        args.rtt_ms / 1e3, checkpoint.hidden_size * 2, profile.uplink_bytes_s, profile.downlink_bytes_s, 1, overhead_s
    )
    table = budget_table(figures, g_points, link)
    print_table(figures, g_points, table, args)
    result = {
        "model": args.model,
        "rtt_ms": args.rtt_ms,
        "link": args.link,
        "shapes": figures,
        "g_ms": {mu: round(1e3 * s, 2) for mu, s in g_points},
        "by_load": table,
    }
    out = getattr(args, "out", None)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
    return result
