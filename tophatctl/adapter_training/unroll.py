"""Training the adapter on what it sees while drafting: unrolled draft steps and a loss on tokens.

Unrolled steps (HASS's "harmonized context", EAGLE-3's training-time test). At run time a round
starts at the pending token's position t, which reads the cloud's exact deep state of t-1; the
j-th draft after it (position t+j) reads the adapter's own output at t+j-1, and attends to exact
positions up to t and to the adapter's own earlier drafts t+1..t+j-1. Step j of `unrolled_forward`
reproduces that for every t at once: its query at position s reads step j-1's output at s-1 as the
previous feature, and attends to step 0's keys at positions <= s-j and to step i's key at position
s-j+i (i = 1..j). A position is a j-th draft only from the answer's first position p on (s >= p+j).

Only a feature adapter has anything to unroll: hat and fusion read the shallow state (and the
token's embedding) that the device's input layers compute exactly for the drafted token, so
teacher forcing already is what they see when drafting.

The token loss scores the draft head's rows only (the truncated draft vocabulary, or all): the
teacher's distribution over them, cut to its top K and renormalised (HASS's top-K distillation),
against the student's log-softmax over the same rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from shared.model.adapter import DraftAdapter
from shared.model.checkpoint import Checkpoint


def step_mask(seq_len: int, step: int) -> torch.Tensor:
    """[S, (step+1)·S] bool: which keys of steps 0..step a step-`step` query at each position reads."""
    s = torch.arange(seq_len)[:, None]
    u = torch.arange(seq_len)[None, :]
    blocks = [u <= s - step] + [u == s - step + i for i in range(1, step + 1)]
    return torch.cat(blocks, dim=1)


def step_valid(answer_start: torch.Tensor, seq_len: int, step: int) -> torch.Tensor:
    """[B, S] bool: the positions that can be a step-`step` draft (s >= answer start + step)."""
    return torch.arange(seq_len, device=answer_start.device)[None, :] >= answer_start[:, None] + step


def rowwise(rows: torch.Tensor | None, fn, *tensors):
    """fn over the [B, S] rows marked in `rows` (all when None), [B, S, *] back with zeros elsewhere."""
    if rows is None:
        return fn(*tensors)
    picked = fn(*(None if t is None else t[rows] for t in tensors))  # [T, *]
    full = picked.new_zeros(*rows.shape, picked.shape[-1])
    full[rows] = picked
    return full


def _qkv(adapter: DraftAdapter, x_in: torch.Tensor) -> torch.Tensor:
    x = adapter.input_layernorm(x_in)
    attn = adapter.self_attn
    return torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1)


def unrolled_forward(
    adapter: DraftAdapter,
    shallow: torch.Tensor,
    side: torch.Tensor | None,
    answer_start: torch.Tensor,
    steps: int,
    detach: bool = False,
    lengths: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """Draft steps 0..steps-1 over a batch of whole sequences, with gradients.

    shallow: [B, S, H]; side: [B, S, H] (embeddings, or the exact previous deep states for step 0)
    or None; answer_start, lengths: [B]. Returns one [B, S, H] output per step; a feature adapter's
    step j reads step j-1's outputs (detached with `detach`), the other variants run step 0 only.
    With `lengths`, the position-wise work (projections, MLP) runs on the rows that matter only:
    step 0 on each sequence's positions, step j >= 1 on its positions >= answer start + j (the only
    ones a step-j query or a later step's key reads); the other rows of outputs >= 1 are zeros."""
    if adapter.spec.side_input != "feature":
        steps = 1
    batch, seq_len, _ = shallow.shape
    attn = adapter.self_attn
    head_dim = adapter.head_dim
    cos, sin = adapter.rotary_emb(shallow, torch.arange(seq_len, device=shallow.device)[None, :])  # [1, S, D]
    positions = torch.arange(seq_len, device=answer_start.device)[None, :]  # [1, S]
    later = (positions > answer_start[:, None])[..., None]  # [B, S, 1]: reads its own
    real = None if lengths is None else positions < lengths[:, None]  # [B, S]
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    outs: list[torch.Tensor] = []
    prev = side
    for step in range(steps):
        rows = real if real is None or step == 0 else real & step_valid(answer_start, seq_len, step)
        x_in = rowwise(rows, adapter._fused, shallow, prev)  # [B, S, H]
        q, k, v = rowwise(rows, lambda x: _qkv(adapter, x), x_in).split(
            [attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features], dim=-1
        )
        q = q.reshape(batch, seq_len, -1, head_dim).transpose(1, 2)  # [B, Hq, S, D]
        k = k.reshape(batch, seq_len, -1, head_dim).transpose(1, 2)  # [B, Hkv, S, D]
        v = v.reshape(batch, seq_len, -1, head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        keys.append(k)
        values.append(v)
        gqa = q.shape[1] != k.shape[1]
        if step == 0:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scaling, enable_gqa=gqa)
        else:
            mask = step_mask(seq_len, step).to(q.device)
            out = F.scaled_dot_product_attention(
                q, torch.cat(keys, dim=2), torch.cat(values, dim=2), attn_mask=mask, scale=attn.scaling, enable_gqa=gqa
            )  # [B, Hq, S, D]
        out = out.transpose(1, 2).reshape(batch, seq_len, -1)
        hidden = rowwise(rows, lambda x, o: adapter._finish(x, attn.o_proj(o)), x_in, out)
        outs.append(hidden)
        if step + 1 < steps:
            assert side is not None  # a feature adapter always has one
            own = hidden.detach() if detach else hidden
            shifted = torch.cat([torch.zeros_like(own[:, :1]), own[:, :-1]], dim=1).to(side.dtype)
            prev = torch.where(later, shifted, side)
    return outs


def head_rows(checkpoint: Checkpoint, vocab_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The LM head's weight (and bias) for the scored rows: the draft vocabulary, or all."""
    head = checkpoint.lm_head
    weight, bias = head.weight.detach(), None if head.bias is None else head.bias.detach()
    if vocab_ids is None:
        return weight, bias
    vocab_ids = vocab_ids.to(weight.device)
    return weight[vocab_ids], None if bias is None else bias[vocab_ids]


def scored_logits(checkpoint: Checkpoint, f: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor | None]):
    """[N, H] deep states -> [N, R] logits over the scored rows (final norm, then the head's rows)."""
    return F.linear(checkpoint.decoder.norm(f), *rows).float()


def token_loss(
    checkpoint: Checkpoint,
    f_student: torch.Tensor,
    f_teacher: torch.Tensor,
    rows: tuple[torch.Tensor, torch.Tensor | None],
    top_k: int = 0,
) -> torch.Tensor:
    """Soft cross-entropy to the teacher over the scored rows; with top_k > 0 the teacher's
    distribution is cut to its top K rows and renormalised (KL to that, up to a constant)."""
    # f_student, f_teacher: [N, H] -> scalar
    with torch.no_grad():
        teacher_logp = torch.log_softmax(scored_logits(checkpoint, f_teacher, rows), dim=-1)  # [N, R]
    student_logp = torch.log_softmax(scored_logits(checkpoint, f_student, rows), dim=-1)
    if 0 < top_k < teacher_logp.shape[-1]:
        top_logp, index = teacher_logp.topk(top_k, dim=-1)  # [N, K]
        return -(torch.softmax(top_logp, dim=-1) * student_logp.gather(-1, index)).sum(-1).mean()
    return -(teacher_logp.exp() * student_logp).sum(-1).mean()


def state_loss(
    checkpoint: Checkpoint, f_student: torch.Tensor, f_teacher: torch.Tensor, normed: bool = True
) -> torch.Tensor:
    """HAT's eq. 4 regression. normed: on the states the head reads (after the final RMSNorm): a
    model with massive activations (SmolLM2: a few dimensions of f_L reach ~2700 against a mean
    |f_L| of 22) makes the raw SmoothL1 a fit of those few dimensions, which the norm divides away."""
    if normed:
        norm = checkpoint.decoder.norm
        return F.smooth_l1_loss(norm(f_student), norm(f_teacher))
    return F.smooth_l1_loss(f_student, f_teacher)
