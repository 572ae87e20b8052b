"""Distil a draft adapter Λ (HAT §3.4, eq. 4) and measure its acceptance.

    loss = SmoothL1(f_L, f_S) + w_ce · CE(softmax(H_L(f_L)), H_L(f_S))

f_L is the LLM's deep state (the middle's output, before the norm + head), f_S the adapter's on
the same shallow states. Only Λ learns. A feature adapter is also trained one step unrolled: the
second pass reads its own first-pass predictions as the previous deep state, which is what it reads
while drafting ahead of the cloud.
"""

from __future__ import annotations

import asyncio
import logging
import random
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from shared.model.adapter import AdapterSpec, DraftAdapter
from shared.model.checkpoint import Checkpoint
from shared.model.split import MiddleSubmodel
from shared.specdec.device_session import DeviceModel, DeviceSession, DraftConfig
from shared.specdec.engine import LocalCloud, generate
from tophatctl.adapter_training.dataset import DistillData, user_prompt_ids

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistillConfig:
    split_layers: int = 2
    steps: int = 300
    batch_size: int = 8
    learning_rate: float = 3e-3
    w_ce: float = 1.0  # HAT uses 0.1; on SmolLM2 1.0 raised top-1 agreement (measured, see the README)
    ce_positions: int = 256  # positions per step that pay for the full-vocabulary head
    normed_loss: bool = True  # SmoothL1 on the head's input (normed states); False: HAT's raw f_L
    bf16: bool = True  # bfloat16 autocast for the forward passes: twice the matmul rate on this CPU
    seed: int = 0

    def __post_init__(self):
        if self.steps < 1 or self.batch_size < 1 or self.ce_positions < 1:
            raise ValueError("steps, batch_size and ce_positions must be >= 1")
        if not self.learning_rate > 0 or self.w_ce < 0:
            raise ValueError("learning_rate must be > 0 and w_ce >= 0")


def _head(checkpoint: Checkpoint, f: torch.Tensor) -> torch.Tensor:
    return checkpoint.model.lm_head(checkpoint.model.model.norm(f))


def distillation_loss(checkpoint: Checkpoint, f_student: torch.Tensor, f_teacher: torch.Tensor, w_ce: float,
                      ce_rows: torch.Tensor | None = None, normed: bool = False) -> torch.Tensor:
    """Eq. 4 over rows [N, H]; the cross-entropy over `ce_rows` of them (all when None).

    normed: regress the states the head reads (after the final RMSNorm) instead of the raw ones.
    A model with massive activations (SmolLM2: a few dimensions of f_L reach ~2700 against a mean
    |f_L| of 22) makes the raw SmoothL1 a fit of those few dimensions, which the norm then divides away."""
    if normed:
        norm = checkpoint.model.model.norm
        loss = F.smooth_l1_loss(norm(f_student), norm(f_teacher))
    else:
        loss = F.smooth_l1_loss(f_student, f_teacher)
    if w_ce > 0:
        student, teacher = (f_student, f_teacher) if ce_rows is None else (f_student[ce_rows], f_teacher[ce_rows])
        with torch.no_grad():
            teacher_probs = torch.softmax(_head(checkpoint, teacher).float(), dim=-1)  # [N, V]
        student_logp = F.log_softmax(_head(checkpoint, student).float(), dim=-1)
        loss = loss + w_ce * -(teacher_probs * student_logp).sum(-1).mean()
    return loss


def _batch(data: DistillData, indices: list[int], m: int):
    """Right-padded tensors of a batch: ids [B, S], shallow [B, S, H], deep [B, S, H], loss mask,
    and each sequence's previous-deep-state input (zeros before the answer)."""
    seqs = [data.sequences[i] for i in indices]
    width = max(len(s.ids) for s in seqs)
    hidden = seqs[0].deep.shape[-1]
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    shallow = torch.zeros(len(seqs), width, hidden)
    deep = torch.zeros(len(seqs), width, hidden)
    prev = torch.zeros(len(seqs), width, hidden)
    mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    answer_start = torch.zeros(len(seqs), dtype=torch.long)
    for row, s in enumerate(seqs):
        n, p = len(s.ids), s.prompt_len
        ids[row, :n] = s.ids
        shallow[row, :n] = s.shallow[m - 1].float()
        deep[row, :n] = s.deep.float()
        prev[row, p:n] = s.deep[p - 1 : n - 1].float()
        mask[row, p:n] = True
        answer_start[row] = p
    return ids, shallow, deep, prev, mask, answer_start


def _side(checkpoint: Checkpoint, adapter: DraftAdapter, ids: torch.Tensor, prev: torch.Tensor) -> torch.Tensor | None:
    if adapter.spec.side_input == "embedding":
        return checkpoint.model.model.embed_tokens(ids)
    return prev if adapter.spec.side_input == "feature" else None


def train_adapter(checkpoint: Checkpoint, data: DistillData, spec: AdapterSpec, cfg: DistillConfig,
                  progress_every: int = 25) -> tuple[DraftAdapter, dict]:
    if not 1 <= cfg.split_layers <= data.max_m:
        raise ValueError(f"the data holds shallow states for m = 1..{data.max_m}, not {cfg.split_layers}")
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    adapter = DraftAdapter(checkpoint, cfg.split_layers, spec)
    params = adapter.trainable_parameters()
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=0.0)
    started = time.monotonic()
    adapter.train()
    losses: list[float] = []
    for step in range(cfg.steps):
        ids, shallow, deep, prev, mask, answer_start = _batch(
            data, rng.sample(range(len(data.sequences)), cfg.batch_size), cfg.split_layers)
        rows = mask.nonzero(as_tuple=True)
        ce_rows = torch.randperm(len(rows[0]))[: cfg.ce_positions]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
            out = adapter.forward_training(shallow, _side(checkpoint, adapter, ids, prev))  # [B, S, H]
            loss = distillation_loss(checkpoint, out[rows], deep[rows], cfg.w_ce, ce_rows, cfg.normed_loss)
            if spec.side_input == "feature":
                # one step unrolled: after the answer's first position, read the first pass's predictions
                own = out.detach().float().roll(1, dims=1)
                later = torch.arange(ids.shape[1])[None, :] > answer_start[:, None]  # [B, S]
                prev_unrolled = torch.where(later[..., None], own, prev)
                out2 = adapter.forward_training(shallow, prev_unrolled)
                loss2 = distillation_loss(checkpoint, out2[rows], deep[rows], cfg.w_ce, ce_rows, cfg.normed_loss)
                loss = (loss + loss2) / 2
        for group in optimizer.param_groups:  # warm-up, then linear decay to 10%
            group["lr"] = cfg.learning_rate * min(1.0, (step + 1) / 20) * (1 - 0.9 * step / cfg.steps)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        losses.append(loss.item())
        if (step + 1) % progress_every == 0 or step + 1 == cfg.steps:
            log.info("%s m=%d step %d/%d loss %.4f (%.0f s)", spec.name, cfg.split_layers, step + 1, cfg.steps,
                     statistics.fmean(losses[-progress_every:]), time.monotonic() - started)
    adapter.eval()
    adapter.requires_grad_(False)
    report = {"variant": spec.name, "train_seconds": round(time.monotonic() - started, 1),
              "final_loss": round(statistics.fmean(losses[-progress_every:]), 4), "config": asdict(cfg)}
    return adapter, report


def evaluate_accept_length(checkpoint: Checkpoint, adapter: DraftAdapter, prompts: list[str], eta: float = 0.6,
                           max_new_tokens: int = 64) -> dict:
    """Greedy tokens per verification round on chat prompts, its distribution, and the device's
    drafting cost per round."""
    m = adapter.split_layers
    device = DeviceModel.from_checkpoint(checkpoint, m, adapter)
    cloud = LocalCloud(MiddleSubmodel(checkpoint, m))
    lengths: list[int] = []
    draft_seconds = 0.0
    for index, prompt in enumerate(prompts):
        session = DeviceSession(device, user_prompt_ids(checkpoint, prompt), draft_config=DraftConfig(eta=eta),
                                max_new_tokens=max_new_tokens)
        lengths += asyncio.run(generate(session, cloud, session_id=index + 1)).accept_lengths
        draft_seconds += sum(seconds for seconds, _ in session.draft_seconds)
    return {
        "eta": eta,
        "prompts": len(prompts),
        "rounds": len(lengths),
        "mean_accept_length": round(statistics.fmean(lengths), 3),
        "distribution": dict(sorted(Counter(lengths).items())),
        "draft_ms_per_round": round(1e3 * draft_seconds / len(lengths), 2),
    }
