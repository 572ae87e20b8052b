"""Decoder-layer forward over a packed batch of sessions, each with its own KV.

The new tokens of every session in a batch are concatenated into one packed
sequence (like vLLM's varlen batches): projections and MLPs run once over all
of them, which is where batching pays; attention runs per session against that
session's own cache with a causal mask offset by its cached length.

The HF modules supply the weights (q/k/v/o projections, norms, MLP, rotary
embedding), so any Llama-family checkpoint works; this file owns only the
cache handling and the packing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from shared.model.kv_cache import LayerKV, SessionKV


def packed_positions(
    caches: Sequence[SessionKV], lengths: Sequence[int], device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Absolute positions of the new tokens: each session continues from its cache length."""
    # positions: [T], on the device of the states they index (the rotary tables are computed there)
    return torch.cat([torch.arange(c.length, c.length + n, device=device) for c, n in zip(caches, lengths)])


def rotary_tables(rotary_emb: torch.nn.Module, positions: torch.Tensor, like: torch.Tensor):
    cos, sin = rotary_emb(like, positions[None, :])  # each [1, T, D]
    return cos[0], sin[0]  # [T, D]


def attention_forward(
    attn: Any,  # an HF *Attention module: q/k/v/o_proj, head_dim and scaling are set at run time (untyped)
    x: torch.Tensor,
    layer_caches: Sequence[LayerKV],
    lengths: Sequence[int],
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """Self-attention of an HF attention module over packed sessions; appends to each cache."""
    # x: [T, H] (already normed); cos/sin: [T, D]
    total = x.shape[0]
    head_dim = attn.head_dim
    queries = attn.q_proj(x).view(total, -1, head_dim).transpose(0, 1)  # [Hq, T, D]
    keys = attn.k_proj(x).view(total, -1, head_dim).transpose(0, 1)  # [Hkv, T, D]
    values = attn.v_proj(x).view(total, -1, head_dim).transpose(0, 1)  # [Hkv, T, D]
    queries, keys = apply_rotary_pos_emb(queries, keys, cos, sin, unsqueeze_dim=0)
    enable_gqa = queries.shape[0] != keys.shape[0]

    outputs = []
    offset = 0
    for cache, n in zip(layer_caches, lengths):
        past = cache.length
        all_keys, all_values = cache.append(keys[:, offset : offset + n], values[:, offset : offset + n])
        q = queries[:, offset : offset + n]  # [Hq, n, D]
        mask = None
        if n > 1:
            # query i sits at position past+i and sees keys 0..past+i
            mask = torch.ones(n, past + n, dtype=torch.bool, device=x.device).tril(diagonal=past)
        out = F.scaled_dot_product_attention(
            q[None], all_keys[None], all_values[None], attn_mask=mask, scale=attn.scaling, enable_gqa=enable_gqa
        )  # [1, Hq, n, D]
        outputs.append(out[0])
        offset += n
    merged = torch.cat(outputs, dim=1).transpose(0, 1).reshape(total, -1)  # [T, Hq*D]
    return attn.o_proj(merged)


def decoder_layer_forward(
    layer: Any,  # an HF decoder layer: its norms, self_attn and mlp are set at run time (untyped)
    hidden: torch.Tensor,
    layer_caches: Sequence[LayerKV],
    lengths: Sequence[int],
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    # hidden: [T, H]
    residual = hidden
    hidden = attention_forward(layer.self_attn, layer.input_layernorm(hidden), layer_caches, lengths, cos, sin)
    hidden = residual + hidden
    residual = hidden
    hidden = layer.mlp(layer.post_attention_layernorm(hidden))
    return residual + hidden


def run_layers(
    layers: Iterable[torch.nn.Module],
    rotary_emb: torch.nn.Module,
    hidden: torch.Tensor,
    caches: Sequence[SessionKV],
    lengths: Sequence[int],
) -> torch.Tensor:
    """Run a contiguous range of decoder layers over packed sessions."""
    # hidden: [T, H]; sum(lengths) == T
    if sum(lengths) != hidden.shape[0]:
        raise ValueError(f"lengths {list(lengths)} do not add up to {hidden.shape[0]} packed tokens")
    positions = packed_positions(caches, lengths, hidden.device)
    cos, sin = rotary_tables(rotary_emb, positions, hidden)
    for index, layer in enumerate(layers):
        hidden = decoder_layer_forward(layer, hidden, [c.layer(index) for c in caches], lengths, cos, sin)
    return hidden
