"""`tophat train-adapter` for chat models and `tophat adapter-sweep`: build (or reuse) the
distillation data, train, measure acceptance on the held-out chat prompts, save.

    tophat train-adapter --model smollm2 --variant feature --mlp --split-layers 2
    tophat adapter-sweep --model smollm2          # variants at one m, then the best one at m = 1..4
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from shared.chat import has_chat_template
from shared.model.adapter import ADAPTER_FILENAME, ADAPTER_REPORT_FILENAME, AdapterSpec, DraftAdapter
from shared.model.checkpoint import Checkpoint, ModelLoadError
from tophatctl.adapter_training.dataset import (
    DistillData,
    build_distill_data,
    generate_answers,
    sample_user_prompts,
)
from tophatctl.adapter_training.distill import DistillConfig, train_adapter
from tophatctl.adapter_training.evaluate import evaluate_accept_length, teacher_forced_agreement
from tophatctl.adapter_training.prompts import (
    HELD_OUT_CHAT_PROMPTS,
    general_prompts,
    near_held_out,
    teacher_forced_texts,
    training_prompts,
)
from tophatctl.adapter_training.vocab import coverage_of

log = logging.getLogger(__name__)

DATA_DIR = Path("build/adapter-data")


@dataclass(frozen=True)
class DataConfig:
    prompts: int = 320  # chat prompts about stdlib docstrings and Debian package descriptions
    texts: int = 160  # teacher-forced passages of the same texts
    general: int = 384  # everyday chat prompts over the common words of those texts
    self_written: int = 1200  # user questions the model writes itself (Magpie), then answers
    max_new_tokens: int = 96
    max_m: int = 4
    bf16: bool = True  # generate (not extract) in bfloat16: ~1.5x the rate; see generate_answers
    seed: int = 0
    generate_batch: int = 96  # rows per generate call (a GPU takes thousands)
    extract_batch: int = 8  # sequences per state-extraction pass
    cache_states: bool = True  # save each part's states under build/ (prompts and answers are always saved)


def _cached_answers(checkpoint: Checkpoint, prompts: list[str], cfg: DataConfig, path: Path):
    """The prompts' greedy answers, saved after every batch: a build cut short goes on where it stopped."""
    answers: list[list[int]] = json.loads(path.read_text()) if path.is_file() else []
    chunk = cfg.generate_batch
    for start in range(len(answers), len(prompts), chunk):
        answers += generate_answers(checkpoint, prompts[start : start + chunk], cfg.max_new_tokens, chunk, cfg.bf16)
        path.write_text(json.dumps(answers))
    return answers


def _part(
    checkpoint: Checkpoint, name: str, cfg: DataConfig, make_prompts, texts: list[str], answers_only: bool = False
) -> DistillData:
    """One cached slice of the data (built once; a later, larger mix reuses it). answers_only: stop once
    the prompts and answers are saved (no states: an empty slice)."""
    path = DATA_DIR / (
        f"{checkpoint.path.name}-{name}-t{len(texts)}-n{cfg.max_new_tokens}"
        f"-m{cfg.max_m}-s{cfg.seed}{'-bf16' if cfg.bf16 else ''}.pt"
    )
    if path.is_file() and cfg.cache_states:
        log.info("reusing distillation data %s", path)
        return DistillData.load(path)
    prompts_path = path.with_suffix(".prompts.json")  # the prompts alone: a build cut short restarts after them
    if prompts_path.is_file():
        cached = json.loads(prompts_path.read_text())
        prompts, prompt_seconds = cached["prompts"], cached["seconds"]
    else:
        started = time.monotonic()
        prompts = make_prompts()
        prompt_seconds = round(time.monotonic() - started, 1)
        prompts_path.parent.mkdir(parents=True, exist_ok=True)
        prompts_path.write_text(json.dumps({"prompts": prompts, "seconds": prompt_seconds}))
    started = time.monotonic()
    leaked = [p for p in prompts if near_held_out(p)]
    if leaked:  # the builders exclude them; this guards the guarantee the numbers rest on
        raise RuntimeError(f"held-out prompts (or near copies) leaked into training: {leaked[:5]}")
    answers = _cached_answers(checkpoint, prompts, cfg, path.with_suffix(".answers.json"))
    if answers_only:
        log.info("%s: %d answers, %d tokens", name, len(answers), sum(map(len, answers)))
        return DistillData([], cfg.max_m, round(prompt_seconds + time.monotonic() - started, 1))
    data = build_distill_data(
        checkpoint,
        prompts,
        texts,
        cfg.max_m,
        cfg.max_new_tokens,
        bf16=cfg.bf16,
        answers=answers,
        extract_batch=cfg.extract_batch,
    )
    data.build_seconds = round(prompt_seconds + time.monotonic() - started, 1)  # writing the prompts counts
    if cfg.cache_states:
        data.save(path)
    log.info(
        "distillation data %s: %d sequences, %d tokens, built in %.0f s",
        path,
        len(data.sequences),
        data.num_tokens,
        data.build_seconds,
    )
    return data


def load_or_build_data(checkpoint: Checkpoint, cfg: DataConfig, answers_only: bool = False) -> DistillData:
    """answers_only: build and save every part's prompts and answers, and no states (an empty data set)."""
    if not has_chat_template(checkpoint.tokenizer):
        raise ModelLoadError(f"{checkpoint.path} has no chat template; distilling on its own answers needs one")
    if not cfg.prompts + cfg.texts + cfg.general + cfg.self_written:
        raise ValueError("the data needs some prompts or texts: all four counts are 0")
    parts = []
    if cfg.prompts or cfg.texts:
        parts.append(
            _part(
                checkpoint,
                f"docs-p{cfg.prompts}",
                cfg,
                lambda: training_prompts(cfg.prompts, cfg.seed),
                teacher_forced_texts(cfg.texts, cfg.seed),
                answers_only,
            )
        )
    if cfg.general:
        parts.append(
            _part(
                checkpoint,
                f"general-p{cfg.general}",
                cfg,
                lambda: general_prompts(cfg.general, cfg.seed),
                [],
                answers_only,
            )
        )
    if cfg.self_written:
        parts.append(
            _part(
                checkpoint,
                f"self-p{cfg.self_written}",
                cfg,
                lambda: sample_user_prompts(
                    checkpoint, cfg.self_written, cfg.seed, batch_size=cfg.generate_batch, bf16=cfg.bf16
                ),
                [],
                answers_only,
            )
        )
    return DistillData(
        [s for part in parts for s in part.sequences], cfg.max_m, round(sum(part.build_seconds for part in parts), 1)
    )


def load_or_build_held_out(checkpoint: Checkpoint, max_m: int, max_new_tokens: int = 64) -> DistillData:
    """The model's own greedy (fp32) answers to the held-out chat prompts, with their states, built
    by the same code as the training data: for teacher-forced measurement only, never trained on."""
    path = DATA_DIR / f"{checkpoint.path.name}-heldout-p{len(HELD_OUT_CHAT_PROMPTS)}-n{max_new_tokens}-m{max_m}.pt"
    if path.is_file():
        return DistillData.load(path)
    data = build_distill_data(checkpoint, list(HELD_OUT_CHAT_PROMPTS), [], max_m, max_new_tokens, bf16=False)
    data.save(path)
    return data


def evaluate(
    checkpoint: Checkpoint,
    adapter,
    cfg: DistillConfig,
    eval_prompts: int,
    eval_new_tokens: int,
    held_out: DistillData | None,
    tree_nodes: tuple[int, ...] = (),
) -> dict:
    """The held-out numbers of one adapter: teacher-forced agreement (when `held_out` is given) and
    the accept length, both with the prompt features it was trained with; the chain's, and a tree's
    of each size in `tree_nodes` (under held_out.trees)."""
    started = time.monotonic()
    out: dict[str, Any] = {}
    if held_out is not None:
        out["teacher_forced"] = teacher_forced_agreement(
            checkpoint, adapter, held_out, prompt_features=cfg.prompt_features
        )
        if getattr(adapter, "draft_vocab", None) is not None:  # the draft vocabulary on the held-out answers
            out["teacher_forced"]["vocab_coverage"] = round(coverage_of(held_out.sequences, adapter.draft_vocab), 5)
    if eval_prompts > 0:  # 0: teacher-forced only (a GPU run measures the accept length later, on a CPU)
        out["held_out"] = evaluate_accept_length(
            checkpoint,
            adapter,
            list(HELD_OUT_CHAT_PROMPTS[:eval_prompts]),
            max_new_tokens=eval_new_tokens,
            prompt_features=cfg.prompt_features,
        )
        trees = {
            str(nodes): evaluate_accept_length(
                checkpoint,
                adapter,
                list(HELD_OUT_CHAT_PROMPTS[:eval_prompts]),
                max_new_tokens=eval_new_tokens,
                prompt_features=cfg.prompt_features,
                tree_nodes=nodes,
            )
            for nodes in tree_nodes
        }
        if trees:
            out["held_out"]["trees"] = trees
    out["eval_seconds"] = round(time.monotonic() - started, 1)
    return out


def train_and_evaluate(
    checkpoint: Checkpoint,
    data: DistillData,
    spec: AdapterSpec,
    cfg: DistillConfig,
    eval_prompts: int,
    eval_new_tokens: int,
    held_out: DistillData | None = None,
):
    adapter, report = train_adapter(checkpoint, data, spec, cfg)
    report.update(evaluate(checkpoint, adapter, cfg, eval_prompts, eval_new_tokens, held_out))
    log.info("%s m=%d: %s %s", spec.name, cfg.split_layers, report.get("teacher_forced"), report.get("held_out"))
    return adapter, report


def train_chat_adapter(
    checkpoint: Checkpoint,
    spec: AdapterSpec,
    cfg: DistillConfig,
    data_cfg: DataConfig,
    out: Path | None,
    eval_prompts: int = len(HELD_OUT_CHAT_PROMPTS),
    eval_new_tokens: int = 64,
) -> dict:
    started = time.monotonic()
    data = load_or_build_data(checkpoint, data_cfg)
    held_out = load_or_build_held_out(checkpoint, data.max_m)
    adapter, report = train_and_evaluate(checkpoint, data, spec, cfg, eval_prompts, eval_new_tokens, held_out)
    report["data"] = {
        "sequences": len(data.sequences),
        "tokens": data.num_tokens,
        "build_seconds": data.build_seconds,
        **vars(data_cfg),
    }
    report["wall_seconds"] = round(time.monotonic() - started + data.build_seconds, 1)
    out = out or checkpoint.path / ADAPTER_FILENAME
    out.parent.mkdir(parents=True, exist_ok=True)
    adapter.save(out, extra_metadata=report)
    out.with_name(ADAPTER_REPORT_FILENAME).write_text(json.dumps(report, indent=2) + "\n")
    log.info("adapter saved to %s", out)
    return report


def evaluate_adapter_file(
    checkpoint: Checkpoint, path: Path, eval_prompts: int, eval_new_tokens: int = 64, tree_nodes: tuple[int, ...] = ()
) -> dict:
    """Measure a trained adapter file (trained elsewhere, e.g. on a GPU) on this machine: teacher-forced
    agreement and accept length on the held-out prompts (chains, and trees of `tree_nodes` nodes), with the
    prompt features it was trained with; the numbers replace those in its adapter_report.json and in the
    file's own metadata."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        report = json.loads((handle.metadata() or {}).get("training", "{}"))
    m = int(report.get("config", {}).get("split_layers", 2))
    cfg = DistillConfig(split_layers=m, prompt_features=report.get("config", {}).get("prompt_features", "zeros"))
    adapter = DraftAdapter.load(path, checkpoint, m)
    held_out = load_or_build_held_out(checkpoint, m)
    report.update(evaluate(checkpoint, adapter, cfg, eval_prompts, eval_new_tokens, held_out, tree_nodes))
    adapter.save(path, extra_metadata=report)
    path.with_name(ADAPTER_REPORT_FILENAME).write_text(json.dumps(report, indent=2) + "\n")
    return report


def sweep(
    checkpoint: Checkpoint,
    cfg: DistillConfig,
    data_cfg: DataConfig,
    specs: list[AdapterSpec],
    eval_prompts: int,
    eval_new_tokens: int,
) -> list[dict]:
    """Each variant on the same data and steps at cfg.split_layers, then the best at m = 1..max_m."""
    data = load_or_build_data(checkpoint, data_cfg)
    held_out = load_or_build_held_out(checkpoint, data.max_m)
    rows = []
    for spec in specs:
        _, report = train_and_evaluate(checkpoint, data, spec, cfg, eval_prompts, eval_new_tokens, held_out)
        rows.append(report)
    best = max(rows, key=lambda r: r["held_out"]["mean_accept_length"])
    best_spec = AdapterSpec(best["variant"].removesuffix("+mlp"), best["variant"].endswith("+mlp"))
    for m in range(1, data.max_m + 1):
        if m != cfg.split_layers:
            _, report = train_and_evaluate(
                checkpoint, data, best_spec, replace(cfg, split_layers=m), eval_prompts, eval_new_tokens, held_out
            )
            rows.append(report)
    return rows
