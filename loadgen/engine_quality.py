"""`make bench-engine`'s quality table: each dtype (and llama.cpp's Q4_1 run of the same GGUF) against f32.

Two measures, as llama.cpp's `llama-perplexity --kl-divergence` reports them, plus answers:
- teacher-forced windows of held-out text (the standard library files the project holds out of every training
  set): per position, whether the top token equals f32's ("same top"), KL(f32 || dtype) of the next-token
  distributions, and each engine's perplexity on the text itself;
- greedy chat answers to QUALITY_PROMPTS, compared whole with f32's.
The gate a dtype must pass to be a default: same top >= 99.3 %, mean KL <= 1e-4, answers identical to f32's on
>= 58 of 64 prompts (scaled for another count), and a same top at least llama.cpp's.
"""

from __future__ import annotations

import json
import math
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from loadgen.quality_prompts import QUALITY_PROMPTS
from shared.model.checkpoint import Checkpoint

GATE_SAME_TOP = 0.993
GATE_MEAN_KL = 1e-4
GATE_ANSWERS = 58 / 64


def text_windows(checkpoint: Checkpoint, positions: int, window: int = 256) -> list[list[int]]:
    """Token windows of held-out text, enough that `positions` next tokens are scored (window - 1 each)."""
    from tophatctl.demo_model.corpus import held_out_files

    ids: list[int] = []
    count = math.ceil(positions / (window - 1))
    for held_out in held_out_files():
        ids += checkpoint.text_tokenizer().encode(held_out.text, add_special_tokens=False)
        if len(ids) >= count * window:
            break
    if len(ids) < count * window:
        raise ValueError(f"held-out text has {len(ids)} tokens, {count * window} wanted")
    return [ids[i * window : (i + 1) * window] for i in range(count)]


def chat_prompts(checkpoint: Checkpoint, count: int) -> list[list[int]]:
    from tophatctl.adapter_training.dataset import user_prompt_ids

    return [user_prompt_ids(checkpoint, prompt) for prompt in QUALITY_PROMPTS[:count]]


@torch.inference_mode()
def window_logits(checkpoint: Checkpoint, window: list[int]) -> torch.Tensor:
    """[n, V] float32 logits at every position of a window, teacher-forced."""
    return checkpoint.model(input_ids=torch.tensor([window])).logits[0].float()


class Scores:
    """Running sums of one engine's agreement with f32 over teacher-forced positions."""

    def __init__(self) -> None:
        self.positions = self.same_top = 0
        self.kl = self.nll = 0.0

    def add(self, reference: torch.Tensor, logits: torch.Tensor, window: list[int]) -> None:
        # reference, logits: [n, V]; position i predicts window[i + 1]
        reference, logits = reference[:-1].double(), logits[:-1].double()
        p_log, q_log = reference.log_softmax(-1), logits.log_softmax(-1)
        self.kl += float((p_log.exp() * (p_log - q_log)).sum())
        self.same_top += int((reference.argmax(-1) == logits.argmax(-1)).sum())
        self.nll += float(-q_log.gather(1, torch.tensor(window[1:])[:, None]).sum())
        self.positions += len(window) - 1

    def summary(self) -> dict[str, float | int]:
        return {
            "positions": self.positions,
            "same_top": self.same_top / self.positions,
            "mean_kl": self.kl / self.positions,
            "perplexity": math.exp(self.nll / self.positions),
        }


def llama_command(gguf: Path, python: Path, *args: str) -> dict:
    script = Path(__file__).with_name("llama_cpp_decode.py")
    done = subprocess.run(
        [str(python), str(script), str(gguf), *args], capture_output=True, text=True, timeout=3600, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def llama_window_logits(gguf: Path, python: Path, windows: list[list[int]]) -> Iterator[torch.Tensor]:
    """llama.cpp's logits per window (written by its own process, read back and deleted one at a time)."""
    with tempfile.TemporaryDirectory(prefix="llama-logits-") as folder:
        spec = Path(folder, "windows.json")
        spec.write_text(json.dumps(windows))
        llama_command(gguf, python, "--windows-file", str(spec), "--logits-dir", folder, "--threads", "2")
        for i in range(len(windows)):
            path = Path(folder, f"{i}.npy")
            yield torch.from_numpy(np.load(path))
            path.unlink()


def until_eos(tokens: list[int], eos: int | None) -> list[int]:
    """An answer as a chat shows it: up to and with its end-of-sequence token."""
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def quality_table(
    engines: dict[str, Checkpoint],
    answer: Callable[[Checkpoint, list[int], int], list[int]],
    positions: int,
    prompts: int,
    new_tokens: int = 48,
    llama: tuple[Path, Path] | None = None,
) -> dict[str, dict]:
    """Per engine (the first is f32, the reference): teacher-forced scores and identical greedy answers; with
    `llama` = (GGUF, its venv's python), llama.cpp's row too."""
    names = list(engines)
    reference_name = names[0]
    reference = engines[reference_name]
    windows = text_windows(reference, positions)
    scores = {name: Scores() for name in names}
    llama_scores = Scores()
    llama_logits = llama_window_logits(*llama, windows) if llama else None
    for window in windows:
        base = window_logits(reference, window)
        for name in names:
            scores[name].add(base, base if name == reference_name else window_logits(engines[name], window), window)
        if llama_logits is not None:
            llama_scores.add(base, next(llama_logits), window)
    asked = chat_prompts(reference, prompts)
    answers = {name: [answer(engines[name], p, new_tokens) for p in asked] for name in names}
    if llama:
        with tempfile.TemporaryDirectory(prefix="llama-prompts-") as folder:
            spec = Path(folder, "prompts.json")
            spec.write_text(json.dumps(asked))
            answers["llama.cpp Q4_1"] = llama_command(
                *llama, "--prompts-file", str(spec), "--new-tokens", str(new_tokens)
            )["answers"]
        scores["llama.cpp Q4_1"] = llama_scores
    eos = reference.eos_token_id
    table = {}
    for name, score in scores.items():
        same = sum(
            until_eos(a[:new_tokens], eos) == until_eos(b[:new_tokens], eos)
            for a, b in zip(answers[name], answers[reference_name])
        )
        table[name] = {**score.summary(), "same_answers": same, "prompts": len(asked)}
    llama_top = table.get("llama.cpp Q4_1", {}).get("same_top", 0.0)
    for row in table.values():
        row["passes_gate"] = bool(
            row["same_top"] >= GATE_SAME_TOP
            and row["mean_kl"] <= GATE_MEAN_KL
            and row["same_answers"] >= GATE_ANSWERS * row["prompts"]
            and row["same_top"] >= llama_top
        )
    return table


def print_quality(table: dict[str, dict]) -> None:
    print("\n| engine | same top as f32 | mean KL(f32 || engine) | perplexity | greedy answers = f32's | gate |")
    print("|---|---|---|---|---|---|")
    for name, row in table.items():
        print(
            f"| {name} | {row['same_top']:.3%} | {row['mean_kl']:.2e} | {row['perplexity']:.3f} | "
            f"{row['same_answers']}/{row['prompts']} | {'pass' if row['passes_gate'] else 'FAIL'} |"
        )
    positions = next(iter(table.values()))["positions"]
    print(
        f"({positions} teacher-forced positions of held-out text; gate: same top >= {GATE_SAME_TOP:.1%}, "
        f"mean KL <= {GATE_MEAN_KL:g}, answers >= {GATE_ANSWERS:.1%} and same top >= llama.cpp's)"
    )
