"""Distil a draft adapter Λ (HAT §3.4, eq. 4, with HASS's and EAGLE-3's changes).

    loss = mean over draft steps j of  w_state · SmoothL1(norm f_L, norm f_S^j) + w_token · CE_topK(H(f_L), H(f_S^j))

f_L is the LLM's deep state (the middle's output, before the norm + head), f_S^j the adapter's at
draft step j on the same shallow states (tophatctl/adapter_training/unroll.py: step j of a feature
adapter reads step j-1's outputs, as it does drafting ahead of the cloud). The token term scores
the head's rows of the truncated draft vocabulary only (vocab.py), which is what the device drafts
from, against the teacher's top-K there. Only Λ learns.
"""

from __future__ import annotations

import hashlib
import logging
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from shared.model.adapter import AdapterError, AdapterSpec, DraftAdapter
from shared.model.checkpoint import Checkpoint
from tophatctl.adapter_training.dataset import DistillData, chat_answers
from tophatctl.adapter_training.unroll import head_rows, state_loss, step_valid, token_loss, unrolled_forward
from tophatctl.adapter_training.vocab import coverage_of, draft_vocabulary

log = logging.getLogger(__name__)

PROMPT_FEATURES = ("zeros", "deep")
TOKEN_VOCABS = ("draft", "full")


@dataclass(frozen=True)
class DistillConfig:
    split_layers: int = 2
    steps: int = 900
    batch_size: int = 8
    learning_rate: float = 3e-3
    w_state: float = 1.0  # SmoothL1 on the (normed) deep states; 0: tokens only
    w_token: float = 1.0  # soft cross-entropy to the teacher's top-K over the scored rows
    top_k: int = 32  # the teacher's top K rows (HASS); 0: its whole distribution over the rows
    token_vocab: str = "draft"  # score the draft vocabulary's rows ("draft") or all 49152 ("full")
    token_positions: int = 512  # answer positions per step and draft step that pay for the head
    vocab_coverage: float = 0.98  # N: the smallest of 1k..16k covering this much of the answers' tokens
    unroll_steps: int = 3  # draft steps trained (feature adapters; 1 = teacher forcing only)
    unroll_detach: bool = False  # step j reads step j-1's outputs without a gradient through them
    prompt_features: str = "zeros"  # "deep": real deep states at prompt positions (a what-if: not what runs)
    normed_loss: bool = True  # SmoothL1 on the head's input (normed states); False: HAT's raw f_L
    bf16: bool = True  # bfloat16 autocast for the forward passes: twice the matmul rate on this CPU
    seed: int = 0
    time_budget_s: float = 0.0  # > 0: fewer steps than `steps` where the measured step time says so
    init_adapter: str = ""  # an adapter file to go on training (its variant, split and draft vocabulary kept)

    def __post_init__(self):
        if self.time_budget_s < 0:
            raise ValueError("time_budget_s must be >= 0 (0: no budget)")
        if min(self.steps, self.batch_size, self.token_positions, self.unroll_steps) < 1:
            raise ValueError("steps, batch_size, token_positions and unroll_steps must be >= 1")
        if not self.learning_rate > 0 or min(self.w_state, self.w_token, self.top_k) < 0:
            raise ValueError("learning_rate must be > 0; w_state, w_token and top_k >= 0")
        if self.w_state == self.w_token == 0:
            raise ValueError("w_state and w_token cannot both be 0")
        if self.prompt_features not in PROMPT_FEATURES or self.token_vocab not in TOKEN_VOCABS:
            raise ValueError(f"prompt_features is one of {PROMPT_FEATURES}, token_vocab one of {TOKEN_VOCABS}")
        if not 0 < self.vocab_coverage <= 1:
            raise ValueError("vocab_coverage must be in (0, 1]")


def distillation_loss(
    checkpoint: Checkpoint,
    f_student: torch.Tensor,
    f_teacher: torch.Tensor,
    w_ce: float,
    ce_rows: torch.Tensor | None = None,
    normed: bool = False,
) -> torch.Tensor:
    """HAT's eq. 4 over rows [N, H]: SmoothL1 + w_ce · soft cross-entropy over the whole vocabulary on
    `ce_rows` of them (all when None). The demo model's trainer (code_corpus.py) uses it as written."""
    loss = state_loss(checkpoint, f_student, f_teacher, normed)
    if w_ce > 0:
        student, teacher = (f_student, f_teacher) if ce_rows is None else (f_student[ce_rows], f_teacher[ce_rows])
        loss = loss + w_ce * token_loss(checkpoint, student, teacher, head_rows(checkpoint, None))
    return loss


def batch_tensors(data: DistillData, indices: list[int], m: int, prompt_features: str = "zeros"):
    """Right-padded tensors of a batch: ids [B, S], shallow [B, S, H], deep [B, S, H], loss mask,
    each sequence's previous-deep-state input, and where its answer starts. The previous deep
    state is what runs: the exact one from the answer's first position on, zeros in the prompt
    (the cloud returns the prompt's last deep state only); prompt_features="deep" fills the prompt
    with the real ones instead (what a cloud returning every prompt position's state would give)."""
    seqs = [data.sequences[i] for i in indices]
    width = max(len(s.ids) for s in seqs)
    hidden = seqs[0].deep.shape[-1]
    device = seqs[0].deep.device  # where the states are kept: the CPU, or the GPU that trains
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    shallow = torch.zeros(len(seqs), width, hidden, device=device)
    deep = torch.zeros(len(seqs), width, hidden, device=device)
    prev = torch.zeros(len(seqs), width, hidden, device=device)
    mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    answer_start = torch.zeros(len(seqs), dtype=torch.long)
    for row, s in enumerate(seqs):
        n, p = len(s.ids), s.prompt_len
        first = 1 if prompt_features == "deep" else p
        ids[row, :n] = s.ids
        shallow[row, :n] = s.shallow[m - 1].float()
        deep[row, :n] = s.deep.float()
        prev[row, first:n] = s.deep[first - 1 : n - 1].float()
        mask[row, p:n] = True
        answer_start[row] = p
    return ids.to(device), shallow, deep, prev, mask.to(device), answer_start.to(device)


def adapter_side(checkpoint: Checkpoint, adapter: DraftAdapter, ids: torch.Tensor, prev: torch.Tensor):
    if adapter.spec.side_input == "embedding":
        return checkpoint.decoder.embed_tokens(ids)
    return prev if adapter.spec.side_input == "feature" else None


def attach_draft_vocab(adapter: DraftAdapter, ids: torch.Tensor) -> bool:
    """Store the draft vocabulary on the adapter (saved in its file) where this adapter supports it."""
    setter = getattr(adapter, "set_draft_vocab", None)
    if setter is None:
        log.warning("this DraftAdapter has no set_draft_vocab: the draft vocabulary is not stored")
        return False
    setter(ids)
    return True


def step_loss(
    checkpoint: Checkpoint, out: torch.Tensor, deep: torch.Tensor, valid: torch.Tensor, cfg: DistillConfig, rows
) -> torch.Tensor:
    """One draft step's loss over its valid positions; the head only on `token_positions` of them."""
    where = valid.nonzero(as_tuple=True)
    student, teacher = out[where], deep[where]  # [N, H]
    loss = student.new_zeros((), dtype=torch.float32)
    if cfg.w_state > 0:
        loss = loss + cfg.w_state * state_loss(checkpoint, student, teacher, cfg.normed_loss)
    if cfg.w_token > 0:
        pick = torch.randperm(student.shape[0], device=student.device)[: cfg.token_positions]
        loss = loss + cfg.w_token * token_loss(checkpoint, student[pick], teacher[pick], rows, cfg.top_k)
    return loss


def initial_adapter(checkpoint: Checkpoint, spec: AdapterSpec, cfg: DistillConfig) -> tuple[DraftAdapter, dict]:
    """The adapter in cfg.init_adapter, to train on (it must be of `spec` at this split), and the file named
    by its sha256 for the report."""
    path = Path(cfg.init_adapter)
    adapter = DraftAdapter.load(path, checkpoint, cfg.split_layers)  # on the checkpoint's device, as a new one
    if adapter.spec != spec:
        raise AdapterError(f"{path} is a {adapter.spec.name} adapter; this training is for {spec.name}")
    return adapter, {"file": path.name, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


BUDGET_WARMUP_STEPS = 5  # steps not timed: the first ones pay for warm-up
BUDGET_PROBE_STEPS = 30  # steps run before a time budget first fixes how many the schedule runs


def is_budget_probe(step: int) -> bool:
    """Where a time budget plans again: at step 30, then at each doubling (60, 120, 240, ...), from the
    rate since the last plan. A GPU's early steps can run at half its later rate (an H100: 8 steps/s up to
    step ~100, then 19), so one early plan would leave most of the budget unspent."""
    if step < BUDGET_PROBE_STEPS or step % BUDGET_PROBE_STEPS:
        return False
    doublings = step // BUDGET_PROBE_STEPS
    return doublings & (doublings - 1) == 0


def planned_steps(
    cfg: DistillConfig, seconds_per_step: float, spent: float = 0.0, done: int = BUDGET_PROBE_STEPS
) -> int:
    """The steps a time budget affords: the `done` steps run so far plus what the rest of the budget buys
    at the measured rate, at most cfg.steps. The learning-rate schedule decays over these."""
    if cfg.time_budget_s <= 0 or seconds_per_step <= 0:
        return cfg.steps
    more = int(max(0.0, cfg.time_budget_s - spent) / seconds_per_step)
    return min(cfg.steps, done + more)


def train_adapter(
    checkpoint: Checkpoint, data: DistillData, spec: AdapterSpec, cfg: DistillConfig, progress_every: int = 25
) -> tuple[DraftAdapter, dict]:
    if not 1 <= cfg.split_layers <= data.max_m:
        raise ValueError(f"the data holds shallow states for m = 1..{data.max_m}, not {cfg.split_layers}")
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    initial = None
    if cfg.init_adapter:
        adapter, initial = initial_adapter(checkpoint, spec, cfg)
    else:
        adapter = DraftAdapter(checkpoint, cfg.split_layers, spec)
    vocab_ids, vocab_report = adapter_vocabulary(checkpoint, adapter, data, cfg)
    if initial is not None:
        vocab_report["initial_adapter"] = initial
    stored = attach_draft_vocab(adapter, vocab_ids)
    rows = scored_rows(checkpoint, vocab_ids, cfg)
    steps = cfg.unroll_steps if spec.side_input == "feature" else 1  # nothing else reads its own outputs
    params = adapter.trainable_parameters()
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=0.0)
    started = time.monotonic()
    adapter.train()
    losses: list[float] = []
    schedule = StepSchedule(cfg, started)
    step = 0
    while step < schedule.planned and not schedule.replan(step):
        indices = rng.sample(range(len(data.sequences)), cfg.batch_size)
        loss = batch_loss(checkpoint, adapter, data, indices, cfg, rows, steps)
        for group in optimizer.param_groups:  # warm-up, then linear decay to 10%
            group["lr"] = cfg.learning_rate * min(1.0, (step + 1) / 20) * (1 - 0.9 * step / schedule.planned)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        losses.append(loss.item())
        step += 1
        if step % progress_every == 0 or step == schedule.planned:
            log.info(
                "%s m=%d step %d/%d loss %.4f (%.0f s)",
                spec.name,
                cfg.split_layers,
                step,
                schedule.planned,
                statistics.fmean(losses[-progress_every:]),
                time.monotonic() - started,
            )
    adapter.eval()
    adapter.requires_grad_(False)
    report = {
        "variant": spec.name,
        "train_seconds": round(time.monotonic() - started, 1),
        "final_loss": round(statistics.fmean(losses[-progress_every:]), 4),
        "steps_run": step,
        "device": str(data.sequences[0].deep.device),
        "config": asdict(cfg),
        "draft_vocab": {**vocab_report, "stored_on_adapter": stored},
    }
    return adapter, report


def adapter_vocabulary(
    checkpoint: Checkpoint, adapter: DraftAdapter, data: DistillData, cfg: DistillConfig
) -> tuple[torch.Tensor, dict[str, Any]]:
    """The draft vocabulary's ids and its report: a trained adapter's own (its head rows are what it learned
    to score), else the smallest covering cfg.vocab_coverage of the answers' tokens."""
    answers = chat_answers(checkpoint, data.sequences)
    if adapter.draft_vocab is not None:
        vocab_ids = adapter.draft_vocab
        return vocab_ids, {"size": int(vocab_ids.numel()), "coverage": round(coverage_of(answers, vocab_ids), 5)}
    return draft_vocabulary(answers, cfg.vocab_coverage, checkpoint.eos_token_id, checkpoint.vocab_size)


def scored_rows(checkpoint: Checkpoint, vocab_ids: torch.Tensor, cfg: DistillConfig):
    """The head's rows the token term scores (the draft vocabulary's, or all), in bfloat16 when training in it:
    cast once, not on every autocast matmul."""
    rows = head_rows(checkpoint, vocab_ids if cfg.token_vocab == "draft" else None)
    if cfg.bf16:
        weight, bias = rows
        rows = (weight.to(torch.bfloat16), None if bias is None else bias.to(torch.bfloat16))
    return rows


def batch_loss(
    checkpoint: Checkpoint,
    adapter: DraftAdapter,
    data: DistillData,
    indices: list[int],
    cfg: DistillConfig,
    rows,
    steps: int,
) -> torch.Tensor:
    """The mean over draft steps of a batch's loss, the adapter unrolled `steps` draft steps."""
    ids, shallow, deep, prev, mask, answer_start = batch_tensors(data, indices, cfg.split_layers, cfg.prompt_features)
    lengths = torch.tensor([len(data.sequences[i].ids) for i in indices], device=shallow.device)
    with torch.autocast(shallow.device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
        side = adapter_side(checkpoint, adapter, ids, prev)
        outs = unrolled_forward(adapter, shallow, side, answer_start, steps, cfg.unroll_detach, lengths)
        step_losses = [
            step_loss(checkpoint, out, deep, mask & step_valid(answer_start, ids.shape[1], j), cfg, rows)
            for j, out in enumerate(outs)
        ]
        # summed from the first loss, not sum()'s 0: the same additions, and the loss stays a Tensor
        return sum(step_losses[1:], step_losses[0]) / len(outs)


class StepSchedule:
    """How many steps the training runs: cfg.steps, or under a time budget what the rate measured at each
    budget probe (is_budget_probe) affords."""

    def __init__(self, cfg: DistillConfig, started: float):
        self.cfg = cfg
        self.started = started
        self.planned = cfg.steps
        self.probe_started, self.probe_step = started, 0

    def replan(self, step: int) -> bool:
        """Called before each step; True when the budget is spent and training stops before `step`."""
        if step == BUDGET_WARMUP_STEPS:  # the first steps pay for warm-up (a GPU's: several times a step)
            self.probe_started, self.probe_step = time.monotonic(), step
        if self.cfg.time_budget_s <= 0 or not is_budget_probe(step):
            return False
        now = time.monotonic()
        seconds_per_step = (now - self.probe_started) / (step - self.probe_step)
        self.planned = max(step, planned_steps(self.cfg, seconds_per_step, spent=now - self.started, done=step))
        self.probe_started, self.probe_step = now, step
        return step >= self.planned
