"""Measuring a draft adapter on the held-out chat prompts, two ways:

- teacher-forced draft agreement (quick): the model's own greedy answers to the held-out prompts,
  built by the same dataset code as the training data (never trained on); per answer position, does
  the adapter's top-1 (over its draft vocabulary, as the device drafts) equal the model's? Step 0 is
  the first draft of a round (it reads the cloud's exact deep state), step j the (j+1)-th (it reads
  the adapter's own earlier outputs, unroll.py);
- the accept length (what matters): real HAT decoding, greedy, chain drafting with eta, against
  the middle layers in this process.

`prompt_features="deep"` measures a what-if: the feature adapter reading the real deep states at
the prompt's positions, which the device does not have today (the cloud returns the deep state of
the prompt's last position only); the accept length then comes from a session whose prefill feeds
the adapter those states (computed here by the whole model).
"""

from __future__ import annotations

import asyncio
import statistics
from collections import Counter
from dataclasses import dataclass

import torch

from shared.model.adapter import DraftAdapter
from shared.model.checkpoint import Checkpoint
from shared.model.split import MiddleSubmodel
from shared.specdec.decode_loop import LocalCloud, generate
from shared.specdec.device_session import DeviceModel, DeviceSession, DraftConfig, SessionError
from tophatctl.adapter_training.dataset import DistillData, extract_states, user_prompt_ids
from tophatctl.adapter_training.distill import adapter_side, batch_tensors
from tophatctl.adapter_training.unroll import head_rows, scored_logits, step_valid, unrolled_forward


def draft_vocab_of(adapter: DraftAdapter) -> torch.Tensor | None:
    vocab = getattr(adapter, "draft_vocab", None)
    return vocab if isinstance(vocab, torch.Tensor) and vocab.numel() else None


@torch.inference_mode()
def teacher_forced_agreement(
    checkpoint: Checkpoint,
    adapter: DraftAdapter,
    data: DistillData,
    steps: int = 4,
    prompt_features: str = "zeros",
    batch_size: int = 8,
) -> dict:
    """Top-1 agreement with the model at each draft step over the answers' positions."""
    vocab = draft_vocab_of(adapter)
    rows = head_rows(checkpoint, vocab)
    full = head_rows(checkpoint, None)
    hits = [0] * steps
    totals = [0] * steps
    for start in range(0, len(data.sequences), batch_size):
        indices = list(range(start, min(start + batch_size, len(data.sequences))))
        ids, shallow, deep, prev, mask, answer_start = batch_tensors(
            data, indices, adapter.split_layers, prompt_features
        )
        side = adapter_side(checkpoint, adapter, ids, prev)
        lengths = torch.tensor([len(data.sequences[i].ids) for i in indices], device=shallow.device)
        side = None if side is None else side.to(adapter.dtype)
        outs = unrolled_forward(adapter, shallow.to(adapter.dtype), side, answer_start, steps, lengths=lengths)
        for j in range(steps):
            out = outs[min(j, len(outs) - 1)]  # hat / fusion: every step reads what step 0 read
            valid = mask & step_valid(answer_start, ids.shape[1], j)
            target = scored_logits(checkpoint, deep[valid].to(adapter.dtype), full).argmax(-1)
            drafted = scored_logits(checkpoint, out[valid], rows).argmax(-1)
            if vocab is not None:
                drafted = vocab.to(drafted.device)[drafted]
            hits[j] += int((drafted == target).sum())
            totals[j] += int(valid.sum())
    by_step = [round(h / t, 4) if t else None for h, t in zip(hits, totals)]
    return {
        "first_draft": by_step[0],
        "by_step": by_step,
        "positions": totals[0],
        "sequences": len(data.sequences),
        "prompt_features": prompt_features,
    }


@dataclass
class PromptStateSession(DeviceSession):
    """A what-if session: at the prompt's positions the adapter reads the real deep states of the
    positions before (`prompt_deep`, [P, H]) instead of zeros."""

    prompt_deep: torch.Tensor | None = None

    def prefill_chunk(self, size: int) -> tuple[int, torch.Tensor]:
        start = self.commit_len
        if size < 1 or start + size > len(self.prompt_ids) or self.prompt_deep is None:
            raise SessionError(f"chunk of {size} at {start} does not fit, or no prompt states")
        ids = torch.tensor(self.prompt_ids[start : start + size])
        shallow = self.model.input(ids, self.input_cache)  # [S, H]
        before = torch.cat([torch.zeros_like(self.prompt_deep[:1]), self.prompt_deep[:-1]])  # [P, H]
        self._run_adapter(self.adapter_cache, shallow, ids, before[start : start + size].to(shallow.dtype))
        return start, shallow


def evaluate_accept_length(
    checkpoint: Checkpoint,
    adapter: DraftAdapter,
    prompts: list[str],
    eta: float = 0.6,
    max_new_tokens: int = 64,
    prompt_features: str = "zeros",
    tree_nodes: int = 0,
) -> dict:
    """Greedy tokens per verification round on chat prompts, its distribution, the rows each round sent
    (the root plus its drafts: what the verifier computes), a chain's share of rounds that accepted every
    drafted token (its drafting stopped at eta before a rejection) and the device's drafting cost per round.
    `tree_nodes` > 0 drafts trees of that many nodes (the device's other tree settings: DraftConfig's)."""
    m = adapter.split_layers
    device = DeviceModel.from_checkpoint(checkpoint, m, adapter)
    cloud = LocalCloud(MiddleSubmodel(checkpoint, m))
    lengths: list[int] = []
    rows: list[int] = []
    full_accepts = 0
    draft_seconds = 0.0
    for index, prompt in enumerate(prompts):
        ids = user_prompt_ids(checkpoint, prompt)
        config = DraftConfig(eta=eta, tree_nodes=tree_nodes)
        if prompt_features == "deep":
            deep = extract_states(checkpoint, [(ids, len(ids))], max_m=1)[0].deep.float()
            session: DeviceSession = PromptStateSession(
                device, ids, draft_config=config, max_new_tokens=max_new_tokens, prompt_deep=deep
            )
        else:
            session = DeviceSession(device, ids, draft_config=config, max_new_tokens=max_new_tokens)
        lengths += asyncio.run(generate(session, cloud, session_id=index + 1)).accept_lengths
        rows += session.round_rows
        full_accepts += session.full_accepts
        draft_seconds += sum(seconds for seconds, _ in session.draft_seconds)
    return {
        "eta": eta,
        **({"tree_nodes": tree_nodes} if tree_nodes else {}),
        "prompts": len(prompts),
        "rounds": len(lengths),
        "mean_accept_length": round(statistics.fmean(lengths), 3),
        "distribution": dict(sorted(Counter(lengths).items())),
        "mean_rows": round(statistics.fmean(rows), 3),
        "rows_distribution": dict(sorted(Counter(rows).items())),
        # per rows sent, the tokens those rounds yielded: a round cannot accept more than it drafted
        "by_rows": {
            r: dict(sorted(Counter(n for n, k in zip(lengths, rows) if k == r).items())) for r in sorted(set(rows))
        },
        **({} if tree_nodes else {"full_accept_rate": round(full_accepts / len(lengths), 4)}),
        "draft_ms_per_round": round(1e3 * draft_seconds / len(lengths), 2),
        "prompt_features": prompt_features,
    }
