"""Self-attention over a packed batch of sessions in one scaled-dot-product call.

The new rows of every session in a batch are concatenated into one packed sequence (like
vLLM's varlen batches): projections run once over all of them. What every layer of one pass
shares is built once, in `PassPlan`: the rows' positions and rotary tables, and the attention
layout. One session attends straight against its own cache (no copy). Several are padded to
[B, Hq, Nmax, D] queries against [B, Hkv, Lmax, D] keys, with a per-session bool mask: causal
after the session's cached rows, or its draft tree's visibility (`TreeRows`), so tree
verification and plain rows share the one call.

A quantized model's plan is batch-invariant instead (`invariant`, an `InvariantPlan`):
its rows go through shared/model/invariant_attention.py, which computes each as it would be alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from shared.model.invariant_attention import InvariantPlan, attend_sessions
from shared.model.kv_cache import LayerKV, SessionKV
from shared.model.rotary_table import ROTARY_TABLES
from shared.model.tree_rows import TreeRows, check_trees


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of [heads, T, D] rows (HF's formula, so the same bits): queries and keys at once."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@dataclass(frozen=True)
class AttentionWeights:
    """What attention needs of a layer: q/k/v from x (one fused matmul or three), and the output projection."""

    # [T, H] -> queries and keys side by side [T, (Hq + Hkv) D] (one rotary pass turns both), values [T, Hkv D]
    project_qkv: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    project_out: Callable[[torch.Tensor], torch.Tensor]  # [T, Hq*D] -> [T, H]
    num_q_heads: int
    head_dim: int
    scaling: float

    @classmethod
    def of_module(cls, attn: Any) -> "AttentionWeights":
        """An HF *Attention module's own q/k/v/o projections, unfused (e.g. a trainable adapter's)."""

        def project_qkv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.cat([attn.q_proj(x), attn.k_proj(x)], dim=-1), attn.v_proj(x)

        num_q_heads = attn.q_proj.weight.shape[0] // attn.head_dim
        return cls(project_qkv, attn.o_proj, num_q_heads, attn.head_dim, attn.scaling)


def _causal(past: int, n: int, device: torch.device) -> torch.Tensor:
    """[n, past + n] bool: new row i sits at past + i and sees keys 0..past + i."""
    return torch.ones(n, past + n, dtype=torch.bool, device=device).tril(diagonal=past)


@dataclass(eq=False)
class PassPlan:
    """One packed pass's positions, rotary tables and attention layout, shared by all its layers."""

    lengths: list[int]  # new rows per session
    pasts: list[int]  # cached rows per session before the pass
    cos: torch.Tensor  # [T, D]
    sin: torch.Tensor  # [T, D]
    mask: torch.Tensor | None  # one session: [n, L] or None (one causal row); several: [B, 1, Nmax, Lmax]
    scatter: torch.Tensor | None  # several sessions: [T] packed row -> b * Nmax + i
    invariant: InvariantPlan | None = None  # batch-invariant attention (int4/int8 models)
    _padded: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    @property
    def single(self) -> bool:
        return len(self.lengths) == 1

    @property
    def width(self) -> int:
        """Nmax: the most new rows of any session."""
        return max(self.lengths)

    @classmethod
    def build(
        cls,
        rotary_emb: torch.nn.Module,
        like: torch.Tensor,
        caches: Sequence[SessionKV],
        lengths: Sequence[int],
        trees: Sequence[TreeRows | None] | None = None,
        invariant: bool = False,
    ) -> "PassPlan":
        # like: [T, H], the states entering the pass (device and dtype of the rotary tables)
        # invariant: every row computed as it would be alone (invariant_attention.py), not in one SDPA call
        if sum(lengths) != like.shape[0]:
            raise ValueError(f"lengths {list(lengths)} do not add up to {like.shape[0]} packed tokens")
        check_trees(caches, lengths, trees)
        device = like.device
        lengths, pasts = list(lengths), [cache.length for cache in caches]
        trees = list(trees) if trees is not None else [None] * len(lengths)
        positions = torch.cat(
            [
                tree.positions.to(device) if tree is not None else torch.arange(past, past + n, device=device)
                for past, n, tree in zip(pasts, lengths, trees)
            ]
        )  # [T]
        # the pass's keys: every session's past + n (also above every position: a tree's nodes sit at past + depth)
        span = max((past + n for past, n in zip(pasts, lengths)), default=0)
        cos, sin = ROTARY_TABLES.rows(rotary_emb, like, positions, span)  # each [T, D]
        if invariant:
            invariant_plan = InvariantPlan.build(pasts, lengths, trees, device)
            return cls(lengths, pasts, cos, sin, None, None, invariant_plan)
        if len(lengths) == 1 and lengths[0] == 1 and trees[0] is None:
            return cls(lengths, pasts, cos, sin, None, None)  # a decode row sees its whole cache: no mask
        masks = [
            tree.mask().to(device) if tree is not None else _causal(past, n, device)
            for past, n, tree in zip(pasts, lengths, trees)
        ]  # [n_i, L_i] each
        if len(lengths) == 1:
            return cls(lengths, pasts, cos, sin, masks[0], None)
        width = max(lengths)
        mask = torch.zeros(len(lengths), 1, width, span, dtype=torch.bool, device=device)
        mask[:, :, :, 0] = True  # padding rows see one key, so their (discarded) softmax is finite
        scatter = []
        for b, (n, own) in enumerate(zip(lengths, masks)):
            mask[b, 0, :n] = False
            mask[b, 0, :n, : own.shape[1]] = own
            scatter.append(torch.arange(b * width, b * width + n, device=device))
        return cls(lengths, pasts, cos, sin, mask, torch.cat(scatter))

    def padded_kv(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, Hkv, Lmax, D] key and value buffers, zeroed once per pass: every layer writes the same rows."""
        # like: [Hkv, T, D], this layer's new keys
        if self._padded is None:
            span = max(p + n for p, n in zip(self.pasts, self.lengths))
            shape = (len(self.lengths), like.shape[0], span, like.shape[2])
            self._padded = (like.new_zeros(shape), like.new_zeros(shape))
        return self._padded


def attention(
    weights: AttentionWeights, x: torch.Tensor, layer_caches: Sequence[LayerKV], plan: PassPlan
) -> torch.Tensor:
    """Self-attention of one layer over the plan's sessions; appends each session's new keys to its cache."""
    # x: [T, H] (already normed) -> [T, H]
    total, head_dim = x.shape[0], weights.head_dim
    qk, v = weights.project_qkv(x)
    turned = rotate(qk.view(total, -1, head_dim).transpose(0, 1), plan.cos, plan.sin)  # [Hq + Hkv, T, D]
    queries, keys = turned[: weights.num_q_heads], turned[weights.num_q_heads :]  # [Hq, T, D], [Hkv, T, D]
    values = v.view(total, -1, head_dim).transpose(0, 1)  # [Hkv, T, D]
    gqa = queries.shape[0] != keys.shape[0]
    if plan.invariant is not None:
        out = attend_sessions(plan.invariant, queries, keys, values, layer_caches, weights.scaling)  # [Hkv, G, T, D]
        return weights.project_out(out.permute(2, 0, 1, 3).reshape(total, -1))
    if plan.single:
        all_keys, all_values = layer_caches[0].append(keys, values)  # [Hkv, L, D]
        out = F.scaled_dot_product_attention(
            queries[None],
            all_keys[None],
            all_values[None],
            attn_mask=plan.mask,
            scale=weights.scaling,
            enable_gqa=gqa,
        )[0]  # [Hq, T, D]
        return weights.project_out(out.transpose(0, 1).reshape(total, -1))
    assert plan.scatter is not None and plan.mask is not None  # built together for several sessions
    padded_keys, padded_values = plan.padded_kv(keys)  # [B, Hkv, Lmax, D]
    offset = 0
    for b, (cache, n) in enumerate(zip(layer_caches, plan.lengths)):
        own_keys, own_values = cache.append(keys[:, offset : offset + n], values[:, offset : offset + n])
        padded_keys[b, :, : own_keys.shape[1]] = own_keys
        padded_values[b, :, : own_values.shape[1]] = own_values
        offset += n
    batch, width = len(plan.lengths), plan.width
    padded_queries = queries.new_zeros(queries.shape[0], batch * width, head_dim)
    padded_queries[:, plan.scatter] = queries
    out = F.scaled_dot_product_attention(
        padded_queries.view(-1, batch, width, head_dim).transpose(0, 1),
        padded_keys,
        padded_values,
        attn_mask=plan.mask,
        scale=weights.scaling,
        enable_gqa=gqa,
    )  # [B, Hq, Nmax, D]
    merged = out.transpose(1, 2).reshape(batch * width, -1)[plan.scatter]  # [T, Hq*D]
    return weights.project_out(merged)
