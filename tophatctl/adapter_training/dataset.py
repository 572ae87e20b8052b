"""The distillation data: the model's own greedy answers to the training prompts (as EAGLE
regenerates its data with the target), plus teacher-forced passages; per position the shallow
states after layers 1..max_m and the deep state f_L (the last layer's output, before the norm).

One sequence = prompt ids (through the chat template) + answer ids; `prompt_len` marks where the
answer starts, which is where the device has exact deep states to feed a feature adapter.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.chat import chat_prompt_ids
from shared.model.checkpoint import Checkpoint

log = logging.getLogger(__name__)


@dataclass
class DistillSequence:
    ids: torch.Tensor  # [L] int64
    prompt_len: int
    shallow: torch.Tensor  # [max_m, L, H] fp16: state after layers 1..max_m
    deep: torch.Tensor  # [L, H] fp16: f_L


@dataclass
class DistillData:
    sequences: list[DistillSequence]
    max_m: int
    build_seconds: float

    @property
    def num_tokens(self) -> int:
        return sum(len(s.ids) for s in self.sequences)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"sequences": [vars(s) for s in self.sequences], "max_m": self.max_m,
                    "build_seconds": self.build_seconds}, path)

    @classmethod
    def load(cls, path: Path) -> "DistillData":
        raw = torch.load(path, weights_only=True)
        return cls([DistillSequence(**s) for s in raw["sequences"]], raw["max_m"], raw["build_seconds"])


def user_prompt_ids(checkpoint: Checkpoint, prompt: str) -> list[int]:
    """One user turn through the model's chat template, ready for the assistant's answer."""
    return chat_prompt_ids(checkpoint.tokenizer, [{"role": "user", "content": prompt}])


@torch.inference_mode()
def generate_answers(checkpoint: Checkpoint, prompts: list[str], max_new_tokens: int, batch_size: int) -> list[list[int]]:
    """Greedy answers, batched (left padding); each cut after the end-of-turn token."""
    tokenizer = checkpoint.tokenizer
    eos = checkpoint.eos_token_id
    answers: list[list[int]] = []
    started = time.monotonic()
    for start in range(0, len(prompts), batch_size):
        batch = [user_prompt_ids(checkpoint, p) for p in prompts[start : start + batch_size]]
        width = max(len(ids) for ids in batch)
        input_ids = torch.tensor([[eos] * (width - len(ids)) + ids for ids in batch])  # [B, W]
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch])
        out = checkpoint.model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                        do_sample=False, pad_token_id=eos, eos_token_id=eos)
        for row in out[:, width:].tolist():
            answers.append(row[: row.index(eos) + 1] if eos in row else row)
        done = start + len(batch)
        log.info("answers %d/%d (%.0f s)", done, len(prompts), time.monotonic() - started)
    return answers


@torch.inference_mode()
def extract_states(checkpoint: Checkpoint, sequences: list[tuple[list[int], int]], max_m: int,
                   batch_size: int = 8) -> list[DistillSequence]:
    """Shallow and deep states per position, batched with right padding (causal: padding after a
    sequence cannot change its states, so each equals its unpadded pass)."""
    captured: dict[str, torch.Tensor] = {}
    hook = checkpoint.model.model.norm.register_forward_hook(lambda _m, inputs, _o: captured.update(deep=inputs[0]))
    out: list[DistillSequence] = []
    try:
        order = sorted(range(len(sequences)), key=lambda i: len(sequences[i][0]))  # similar lengths together
        for start in range(0, len(order), batch_size):
            chunk = [sequences[i] for i in order[start : start + batch_size]]
            width = max(len(ids) for ids, _ in chunk)
            input_ids = torch.tensor([ids + [0] * (width - len(ids)) for ids, _ in chunk])  # [B, W]
            hidden = checkpoint.model.model(input_ids=input_ids, output_hidden_states=True).hidden_states
            for row, (ids, prompt_len) in enumerate(chunk):
                n = len(ids)
                shallow = torch.stack([hidden[m][row, :n] for m in range(1, max_m + 1)]).half()  # [max_m, L, H]
                out.append(DistillSequence(torch.tensor(ids), prompt_len, shallow, captured["deep"][row, :n].half()))
    finally:
        hook.remove()
    return out


def build_distill_data(checkpoint: Checkpoint, prompts: list[str], texts: list[str], max_m: int,
                       max_new_tokens: int, batch_size: int = 16, max_len: int = 256) -> DistillData:
    started = time.monotonic()
    pairs: list[tuple[list[int], int]] = []
    answers = generate_answers(checkpoint, prompts, max_new_tokens, batch_size)
    for prompt, answer in zip(prompts, answers):
        prompt_ids = user_prompt_ids(checkpoint, prompt)
        if answer and len(prompt_ids) < max_len - 8:
            pairs.append(((prompt_ids + answer)[:max_len], len(prompt_ids)))
    for text in texts:
        ids = checkpoint.tokenizer.encode(text, add_special_tokens=False)[:max_len]
        if len(ids) > 16:
            pairs.append((ids, 8))  # the first few tokens play the prompt: no deep state before them
    log.info("%d sequences; extracting states", len(pairs))
    sequences = extract_states(checkpoint, pairs, max_m)
    return DistillData(sequences, max_m, round(time.monotonic() - started, 1))
