"""`tophat privacy`: the table of what the cloud can learn (tophatctl/privacy/harness.py), as text, JSON and a plot.

tophat privacy --model smollm2 --splits 1,2,4 --json        # {"results": [{"m", "attack", "defence", ...}]}
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Optional

import typer

log = logging.getLogger(__name__)


def format_privacy_table(results: dict[str, Any]) -> str:
    lines = [
        "m  attack   defence     attacker       prompt top1  top5   drafted top1  top5   train (tokens, steps, s)",
        "-  -------  ----------  -------------  -----------  -----  ------------  -----  ------------------------",
    ]
    for row in results["results"]:
        train = row.get("train", {})
        drafted = (
            f"{row['draft_top1']:>12.3f}  {row['draft_top5']:>5.3f}" if "draft_top1" in row else f"{'-':>12}  {'-':>5}"
        )
        lines.append(
            f"{row['m']}  {row['attack']:<7}  {row['defence']:<10}  {row['attacker']:<13}  "
            f"{row['top1']:>11.3f}  {row['top5']:>5.3f}  {drafted}  "
            f"{train.get('tokens', 0):>6}, {train.get('steps', 0):>5}, {train.get('wall_s', 0.0):>6.1f}"
        )
    lines += [
        "",
        "m  defence     accept length  TTFT ms  TBT ms  answers = unsplit model (greedy)",
        "-  ----------  -------------  -------  ------  --------------------------------",
    ]
    for row in results["costs"]:
        accept = "-" if row["mean_accept_length"] is None else f"{row['mean_accept_length']:.2f}"
        lines.append(
            f"{row['m']}  {row['defence']:<10}  {accept:>13}  {row['mean_ttft_ms']:>7.0f}  "
            f"{row['mean_tbt_ms']:>6.0f}  {row['answers_exact'] * 100:>5.0f} %"
        )
    if "rotation_recovery_error" in results.get("notes", {}):
        lines.append(
            f"\nrotation solved from the cloud's weights: relative error "
            f"{results['notes']['rotation_recovery_error']:.1e}"
        )
    return "\n".join(lines)


def plot_privacy(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    rows = [r for r in results["results"] if r["defence"] == "none"]
    for attack in dict.fromkeys(r["attack"] for r in rows):
        mine = sorted((r["m"], r["top1"]) for r in rows if r["attack"] == attack)
        ax.plot([m for m, _ in mine], [t for _, t in mine], marker="o", label=attack)
    ax.set_xlabel("split depth m (layers on the device)")
    ax.set_ylabel("prompt tokens recovered (top-1)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(title="attack")
    ax.set_title("What the cloud recovers from the hidden states it is sent")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def privacy_command(
    model: str = typer.Option("smollm2", help="smollm2 | demo | a checkpoint directory"),
    splits: str = typer.Option("1,2,3,4,6", help="split depths m, comma-separated"),
    attacks: str = typer.Option("nearest,linear,mlp,context", help="attacks, weakest to strongest"),
    defences: str = typer.Option(
        "none,rotation,noise:0.1,noise:0.3", help="none | rotation | noise:SIGMA (at --defence-split)"
    ),
    defence_split: int = typer.Option(2, "--defence-split", help="the m the defences are measured at"),
    train_tokens: int = typer.Option(30_000, "--train-tokens", min=100, help="the attacker's public text (tokens)"),
    steps: int = typer.Option(800, min=1, help="optimiser steps of the learned attacks"),
    prompts: int = typer.Option(16, min=1, help="held-out prompts the cloud is sent"),
    max_new_tokens: int = typer.Option(16, "--max-new-tokens", min=1),
    as_json: bool = typer.Option(False, "--json", help="print the results JSON instead of the tables"),
    out: Path = typer.Option(Path("bench-results/privacy.json"), help="results JSON (table .txt, plot .png beside)"),
    threads: Optional[int] = typer.Option(None, help="torch threads (default: torch's)"),
):
    """Attack what the cloud receives, per split depth, attack and defence; report recovery and defence costs."""
    import torch

    from tophatctl.models import resolve_model_or_exit
    from tophatctl.privacy.harness import ATTACKS, PrivacyConfig, run_privacy

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if threads:
        torch.set_num_threads(threads)
    try:
        split_list = [int(s) for s in splits.split(",") if s.strip()]
        attack_list = [a.strip() for a in attacks.split(",") if a.strip()]
        defence_list = [d.strip() for d in defences.split(",") if d.strip()]
        unknown = set(attack_list) - set(ATTACKS)
        bad = [d for d in defence_list if d not in ("none", "rotation") and not d.startswith("noise:")]
        if unknown or bad or not split_list or min(split_list) < 1:
            raise ValueError(f"unknown attacks {sorted(unknown)} or defences {bad}, or splits not >= 1")
        for d in defence_list:
            if d.startswith("noise:") and not float(d.split(":", 1)[1]) > 0:
                raise ValueError(f"{d}: noise needs a sigma > 0")
    except ValueError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(code=2) from exc
    cfg = PrivacyConfig(
        model_dir=resolve_model_or_exit(model),
        splits=split_list,
        attacks=attack_list,
        defences=defence_list,
        defence_split=defence_split,
        train_tokens=train_tokens,
        steps=steps,
        eval_prompts=prompts,
        max_new_tokens=max_new_tokens,
    )
    results = run_privacy(cfg)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    table = format_privacy_table(results)
    out.with_suffix(".txt").write_text(table + "\n")
    plot_privacy(results, out.with_suffix(".png"))
    typer.echo(json.dumps({"results": results["results"], "costs": results["costs"]}, indent=1) if as_json else table)
