"""Draft trees in the simulator: what a device's tree round of N nodes yields, sends and costs, all measured.

* Tokens and rows, jointly: `tophat evaluate-adapter` drafts trees of N nodes on the held-out chat prompts
  (the device's DraftConfig: width 4, depth <= 8, nodes grown while their path probability reaches
  tree_min_prob) and records how many rows each round sent (the root plus its kept nodes: often fewer than
  N + 1) and, per row count, the tokens those rounds yielded (`held_out.trees.<N>.by_rows`). A simulated tree
  round draws one (rows, tokens) pair: a round never yields more than it drafted, and both marginals are
  the measured ones.
* Drafting: the device model has one step time (gamma) and no per-level cost, so a tree round is charged the
  measured tree/chain ratio of drafting per round (`tophat bench trees`: `budgets.<N>.draft_ms_per_round`
  over `budgets.0.draft_ms_per_round`, the same prompts in one run) times this simulator's own chain round on
  the device (gamma x the chain's mean rows, `budget.chain_figures`).
* Rows on the wire and at the verifier: the drawn rows up, the same rows' deep states down (the cloud answers
  every tree row: DeviceSession._on_tree_result), and g(mu) over them in the verifier's step.
* No parallel drafting around a tree: the device pre-drafts only after a chain (Drafting.predraft: a tree
  already drafts the alternatives), and an adopted pre-drafted branch is a chain.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from loadgen.simulate.calibration import Calibration
from loadgen.simulate.gpu_profile import REPO, GpuProfileError, read_json

DEFAULT_TREE_NODES = 16  # the device's tree shape (services/device_agent/settings.py: none,chain,tree16)
DEFAULT_TREES_BENCH = REPO / "docs" / "benchmarks" / "2026-11-28-trees-f32.json"


def tree_joint_from_report(data: Any, nodes: int, source: str = "<adapter report>") -> list[list[float]]:
    """[rows, tokens, count] of the held-out tree rounds of `nodes` nodes (`held_out.trees.<N>.by_rows`)."""
    trees = data.get("held_out", {}).get("trees", {}) if isinstance(data, Mapping) else {}
    by_rows = trees.get(str(nodes), {}).get("by_rows") if isinstance(trees, Mapping) else None
    if not isinstance(by_rows, Mapping) or not by_rows:
        raise GpuProfileError(
            f"{source}: no held_out.trees.{nodes}.by_rows (tophat evaluate-adapter --tree-nodes {nodes} writes it; "
            "simulate --tree-nodes 0: no trees)"
        )
    try:
        joint = [
            [float(rows), float(tokens), float(count)]
            for rows, counts in by_rows.items()
            for tokens, count in counts.items()
        ]
    except (AttributeError, TypeError, ValueError) as exc:
        raise GpuProfileError(f"{source}: held_out.trees.{nodes}.by_rows is not rows -> tokens -> count") from exc
    return joint


def draft_ratio_from_bench(data: Any, nodes: int, source: str = "<trees bench>") -> float:
    """A tree round's drafting over a chain round's, from `tophat bench trees`' JSON (one run, same prompts)."""
    budgets = data.get("budgets") if isinstance(data, Mapping) else None
    try:
        tree = float(budgets[str(nodes)]["draft_ms_per_round"])  # type: ignore[index]
        chain = float(budgets["0"]["draft_ms_per_round"])  # type: ignore[index]
    except (KeyError, TypeError, ValueError) as exc:
        raise GpuProfileError(
            f"{source}: needs budgets.0 and budgets.{nodes} draft_ms_per_round (tophat bench trees --nodes 0,{nodes})"
        ) from exc
    if not (tree > 0 and chain > 0):
        raise GpuProfileError(f"{source}: draft_ms_per_round must be positive")
    return tree / chain


def with_trees(
    cal: Calibration, report: str | Path, bench: str | Path = DEFAULT_TREES_BENCH, nodes: int = DEFAULT_TREE_NODES
) -> Calibration:
    """The calibration with tree rounds of `nodes` nodes: the adapter report's held-out tree rounds and the
    trees bench's drafting ratio."""
    joint = tree_joint_from_report(read_json(report), nodes, str(report))
    ratio = draft_ratio_from_bench(read_json(bench, "trees bench"), nodes, str(bench))
    out = dataclasses.replace(cal, tree_nodes=nodes, tree_joint=joint, tree_draft_ratio=ratio, notes=list(cal.notes))
    tokens, rows = out.tree_means()
    out.notes.append(
        f"trees of {nodes} nodes: {tokens:.2f} tokens and {rows:.2f} rows a round ({report}); drafting "
        f"{ratio:.2f}x a chain round's ({bench})"
    )
    return out
