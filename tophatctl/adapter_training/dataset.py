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

from shared.chat import chat_prompt_ids, has_chat_template
from shared.model.checkpoint import Checkpoint
from tophatctl.adapter_training.prompts import near_held_out

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
        torch.save(
            {"sequences": [vars(s) for s in self.sequences], "max_m": self.max_m, "build_seconds": self.build_seconds},
            path,
        )

    @classmethod
    def load(cls, path: Path) -> "DistillData":
        raw = torch.load(path, weights_only=True)
        return cls([DistillSequence(**s) for s in raw["sequences"]], raw["max_m"], raw["build_seconds"])


def model_device(checkpoint: Checkpoint) -> torch.device:
    """Where the checkpoint's weights are (the CPU, or a GPU the training runs on)."""
    return checkpoint.lm_head.weight.device


def user_prompt_ids(checkpoint: Checkpoint, prompt: str) -> list[int]:
    """One user turn through the model's chat template, ready for the assistant's answer."""
    return chat_prompt_ids(checkpoint.tokenizer, [{"role": "user", "content": prompt}])


def _user_turn_prefix(checkpoint: Checkpoint) -> list[int]:
    """The template's ids up to where a user's words go (system turn + user header), found by
    rendering a placeholder turn and cutting at it: whatever the template."""
    marker = "\u2063QUERY\u2063"
    text = checkpoint.text_tokenizer().decode(user_prompt_ids(checkpoint, marker))
    if marker not in text:
        raise ValueError("the chat template does not carry the user's words through verbatim")
    return checkpoint.text_tokenizer().encode(text[: text.index(marker)], add_special_tokens=False)


@torch.inference_mode()
def _generate(
    checkpoint: Checkpoint, rows: list[list[int]], max_new_tokens: int, bf16: bool, **sampling
) -> list[list[int]]:
    """One batch through model.generate (left padding); each row's new ids cut after the end-of-turn token."""
    eos = checkpoint.eos_token_id
    device = model_device(checkpoint)
    width = max(len(ids) for ids in rows)
    input_ids = torch.tensor([[eos] * (width - len(ids)) + ids for ids in rows], device=device)  # [B, W]
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in rows], device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        out = checkpoint.causal_lm.generate(
            input_ids=input_ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            pad_token_id=eos,
            eos_token_id=eos,
            **sampling,
        )
    return [row[: row.index(eos) + 1] if eos in row else row for row in out[:, width:].tolist()]


def generate_answers(
    checkpoint: Checkpoint, prompts: list[str], max_new_tokens: int, batch_size: int, bf16: bool = False
) -> list[list[int]]:
    """Greedy answers, batched; each cut after the end-of-turn token. bf16: the model's bf16 answers
    (~1.5x the rate on this CPU; they are training inputs only, the states are extracted in fp32)."""
    answers: list[list[int]] = []
    started = time.monotonic()
    for start in range(0, len(prompts), batch_size):
        batch = [user_prompt_ids(checkpoint, p) for p in prompts[start : start + batch_size]]
        answers += _generate(checkpoint, batch, max_new_tokens, bf16, do_sample=False)
        log.info("answers %d/%d (%.0f s)", len(answers), len(prompts), time.monotonic() - started)
    return answers


MAGPIE_SEED_STRIDE = 100_003  # batches per data seed before two seeds' generator seeds could meet


def sample_user_prompts(
    checkpoint: Checkpoint,
    count: int,
    seed: int = 0,
    max_new_tokens: int = 48,
    batch_size: int = 96,
    bf16: bool = False,
) -> list[str]:
    """`count` distinct user questions written by the chat model itself (as Magpie does): sample
    from the template's text up to the user's words, keep the turns it finished. Never one of, or
    close to, the held-out prompts."""
    eos = checkpoint.eos_token_id
    prefix = _user_turn_prefix(checkpoint)
    generator_seed = seed * MAGPIE_SEED_STRIDE  # seed 1's batches share no generator seed with seed 0's
    prompts: list[str] = []
    seen: set[str] = set()
    started = time.monotonic()
    for _ in range(20 * (count // batch_size + 1)):
        if len(prompts) >= count:
            break
        torch.manual_seed(generator_seed)  # each batch its own seed: the same prompts on every run
        generator_seed += 1
        for row in _generate(
            checkpoint, [prefix] * batch_size, max_new_tokens, bf16, do_sample=True, temperature=1.0, top_p=0.95
        ):
            if not row or row[-1] != eos:
                continue  # ran out of tokens mid-question
            text = checkpoint.text_tokenizer().decode(row[:-1]).strip()
            if len(text.split()) >= 4 and text not in seen and not near_held_out(text):
                seen.add(text)
                prompts.append(text)
        log.info("self-written prompts %d/%d (%.0f s)", min(len(prompts), count), count, time.monotonic() - started)
    return prompts[:count]


def chat_answers(checkpoint: Checkpoint, sequences: list[DistillSequence]) -> list[DistillSequence]:
    """The sequences whose part after prompt_len is the model's own answer to a chat turn (they start
    with the template's user-turn prefix), not a teacher-forced passage; all of them for a model
    without a chat template."""
    if not has_chat_template(getattr(checkpoint, "tokenizer", None)):
        return sequences
    prefix = torch.tensor(_user_turn_prefix(checkpoint))
    return [s for s in sequences if len(s.ids) > len(prefix) and torch.equal(s.ids[: len(prefix)], prefix)]


@torch.inference_mode()
def extract_states(
    checkpoint: Checkpoint, sequences: list[tuple[list[int], int]], max_m: int, batch_size: int = 8
) -> list[DistillSequence]:
    """Shallow and deep states per position, batched with right padding (causal: padding after a
    sequence cannot change its states, so each equals its unpadded pass). The states stay where the
    model is (a GPU keeps the whole data set in its memory); the ids stay on the CPU."""
    captured: dict[str, torch.Tensor] = {}
    hook = checkpoint.decoder.norm.register_forward_hook(lambda _m, inputs, _o: captured.update(deep=inputs[0]))
    out: list[DistillSequence] = []
    try:
        order = sorted(range(len(sequences)), key=lambda i: len(sequences[i][0]))  # similar lengths together
        for start in range(0, len(order), batch_size):
            chunk = [sequences[i] for i in order[start : start + batch_size]]
            width = max(len(ids) for ids, _ in chunk)
            input_ids = torch.tensor(
                [ids + [0] * (width - len(ids)) for ids, _ in chunk], device=model_device(checkpoint)
            )  # [B, W]
            hidden = checkpoint.decoder(input_ids=input_ids, output_hidden_states=True).hidden_states
            for row, (ids, prompt_len) in enumerate(chunk):
                n = len(ids)
                shallow = torch.stack([hidden[m][row, :n] for m in range(1, max_m + 1)]).half()  # [max_m, L, H]
                out.append(DistillSequence(torch.tensor(ids), prompt_len, shallow, captured["deep"][row, :n].half()))
    finally:
        hook.remove()
    return out


def build_distill_data(
    checkpoint: Checkpoint,
    prompts: list[str],
    texts: list[str],
    max_m: int,
    max_new_tokens: int,
    batch_size: int = 96,
    max_len: int = 256,
    bf16: bool = True,
    answers: list[list[int]] | None = None,
    extract_batch: int = 8,
) -> DistillData:
    """answers: the prompts' answers when already generated (else generated here)."""
    started = time.monotonic()
    pairs: list[tuple[list[int], int]] = []
    if answers is None:
        answers = generate_answers(checkpoint, prompts, max_new_tokens, batch_size, bf16)
    for prompt, answer in zip(prompts, answers):
        prompt_ids = user_prompt_ids(checkpoint, prompt)
        if answer and len(prompt_ids) < max_len - 8:
            pairs.append(((prompt_ids + answer)[:max_len], len(prompt_ids)))
    for text in texts:
        ids = checkpoint.text_tokenizer().encode(text, add_special_tokens=False)[:max_len]
        if len(ids) > 16:
            pairs.append((ids, 8))  # the first few tokens play the prompt: no deep state before them
    log.info("%d sequences; extracting states", len(pairs))
    sequences = extract_states(checkpoint, pairs, max_m, extract_batch)
    return DistillData(sequences, max_m, round(time.monotonic() - started, 1))
