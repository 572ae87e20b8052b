"""`tophat adapter-sweep --ablation`: variant x loss x unroll, each row an adapter trained for the same
steps on the same data, measured on the held-out chat prompts (teacher-forced draft agreement and the
accept length, greedy, chain drafting, eta 0.6). Rows land in JSON as they finish (a rerun skips the
rows already there at the same steps), and in a markdown table beside it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from shared.model.adapter import ADAPTER_FILENAME, AdapterSpec, DraftAdapter
from shared.model.checkpoint import Checkpoint
from tophatctl.adapter_training.distill import DistillConfig
from tophatctl.adapter_training.run import (
    DataConfig,
    evaluate,
    load_or_build_data,
    load_or_build_held_out,
    train_and_evaluate,
)

log = logging.getLogger(__name__)

# today's loss: SmoothL1 + soft cross-entropy over the whole vocabulary on 256 positions
OLD_LOSS: dict[str, Any] = {"w_state": 1.0, "w_token": 1.0, "top_k": 0, "token_vocab": "full", "token_positions": 256}
NEW_LOSS: dict[str, Any] = {"w_state": 1.0, "w_token": 1.0, "top_k": 32, "token_vocab": "draft"}
TOKENS_ONLY: dict[str, Any] = {"w_state": 0.0, "w_token": 1.0, "top_k": 32, "token_vocab": "draft"}
LOSS_NAMES = {"state+CE(full vocab)": OLD_LOSS, "state+top32(draft vocab)": NEW_LOSS, "top32(draft vocab)": TOKENS_ONLY}


@dataclass(frozen=True)
class Row:
    name: str
    spec: AdapterSpec
    loss: str
    unroll: int = 1
    options: dict = field(default_factory=dict)  # any other DistillConfig fields

    def config(self, base: DistillConfig) -> DistillConfig:
        return replace(base, **LOSS_NAMES[self.loss], unroll_steps=self.unroll, **self.options)


FEATURE = AdapterSpec("feature", mlp=True)
ROWS = (
    Row("feature+mlp old-loss u1", FEATURE, "state+CE(full vocab)", 1),
    Row("feature+mlp old-loss u3", FEATURE, "state+CE(full vocab)", 3),
    Row("feature+mlp new-loss u1", FEATURE, "state+top32(draft vocab)", 1),
    Row("feature+mlp new-loss u3", FEATURE, "state+top32(draft vocab)", 3),
    Row("feature+mlp tokens-only u3", FEATURE, "top32(draft vocab)", 3),
    Row("feature+mlp new-loss u3 prompt-deep", FEATURE, "state+top32(draft vocab)", 3, {"prompt_features": "deep"}),
    Row("hat+mlp new-loss", AdapterSpec("hat", mlp=True), "state+top32(draft vocab)"),
    Row("fusion+mlp new-loss", AdapterSpec("fusion", mlp=True), "state+top32(draft vocab)"),
)


def _committed_row(
    checkpoint: Checkpoint, base: DistillConfig, eval_prompts: int, eval_new_tokens: int, held_out
) -> dict | None:
    path = checkpoint.path / ADAPTER_FILENAME
    if not path.is_file():
        return None
    adapter = DraftAdapter.load(path, checkpoint, base.split_layers)
    report = {
        "name": "committed adapter (before)",
        "variant": adapter.spec.name,
        "loss": "see its report",
        "unroll": None,
        "steps": None,
        "train_seconds": None,
        "config": {"prompt_features": "zeros"},
    }
    report.update(
        evaluate(checkpoint, adapter, replace(base, prompt_features="zeros"), eval_prompts, eval_new_tokens, held_out)
    )
    return report


def run_ablation(
    checkpoint: Checkpoint,
    base: DistillConfig,
    data_cfg: DataConfig,
    out: Path,
    eval_prompts: int,
    eval_new_tokens: int,
    rows=ROWS,
    only: set[str] | None = None,
) -> list[dict]:
    data = load_or_build_data(checkpoint, data_cfg)
    held_out = load_or_build_held_out(checkpoint, data.max_m)
    done = {r["name"]: r for r in json.loads(out.read_text())} if out.is_file() else {}
    results = []

    def keep(result: dict) -> None:
        results.append(result)
        merged = {**done, **{r["name"]: r for r in results}}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(list(merged.values()), indent=2) + "\n")
        out.with_suffix(".md").write_text(markdown(list(merged.values()), base.steps))

    if "committed adapter (before)" not in done and not only:
        committed = _committed_row(checkpoint, base, eval_prompts, eval_new_tokens, held_out)
        if committed is not None:
            keep(committed)
    for row in rows:
        if (only and row.name not in only) or done.get(row.name, {}).get("steps") == base.steps:
            continue
        _, report = train_and_evaluate(
            checkpoint, data, row.spec, row.config(base), eval_prompts, eval_new_tokens, held_out
        )
        keep(
            {
                "name": row.name,
                "loss": row.loss,
                "unroll": row.unroll if row.spec.variant == "feature" else None,
                "steps": base.steps,
                **report,
            }
        )
    return results


def markdown(rows: list[dict], steps: int) -> str:
    lines = [
        f"Adapter ablation (SmolLM2-135M-Instruct, m = 2): each row trained for its steps on the same data; "
        f"held-out chat prompts (teacher-forced agreement on their greedy answers; accept length greedy, "
        f"chain, eta 0.6). Default steps {steps}.",
        "",
        "| row | variant | loss | unroll | prompt feats | steps | draft vocab N (held-out cover) | TF first draft "
        "| TF steps 1-4 | accept length | distribution | train s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        tf = r.get("teacher_forced", {})
        vocab = r.get("draft_vocab")
        vocab_cell = f"{vocab['size']}" if vocab else "all"
        if "vocab_coverage" in tf:
            vocab_cell += f" ({tf['vocab_coverage']:.3f})"
        held = r["held_out"]
        lines.append(
            f"| {r['name']} | {r['variant']} | {r['loss']} | {r['unroll'] or '-'} "
            f"| {r.get('config', {}).get('prompt_features', 'zeros')} | {r['steps'] or '-'} | {vocab_cell} "
            f"| {tf.get('first_draft', '-')} | {' / '.join(str(x) for x in tf.get('by_step', []))} "
            f"| **{held['mean_accept_length']:.3f}** | {held['distribution']} | {r['train_seconds'] or '-'} |"
        )
    return "\n".join(lines) + "\n"
