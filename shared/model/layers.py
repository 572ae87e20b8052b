"""Decoder-layer forward over a packed batch of sessions, each with its own KV.

The new tokens of every session in a batch are concatenated into one packed
sequence (like vLLM's varlen batches): projections and MLPs run once over all
of them, which is where batching pays; attention runs per session against that
session's own cache with a causal mask offset by its cached length.

A session may instead bring a token tree (`TreeRows`): its new rows are tree
nodes at positions base + depth, each attending to the committed rows < base
and to its own ancestors among the tree rows (SpecInfer/EAGLE-2 tree
attention). Sessions without one keep the plain causal path, unchanged.

The HF modules supply the weights (q/k/v/o projections, norms, MLP, rotary
embedding), so any Llama-family checkpoint works; this file owns only the
cache handling and the packing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from shared.model.kv_cache import LayerKV, SessionKV


class TreeError(ValueError):
    """Tree rows whose shapes do not fit each other, the new rows, or the session's cache."""


def ancestor_mask_from_parents(parents: Sequence[int]) -> torch.Tensor:
    """[n, n] bool, mask[i, j] = j is i or an ancestor of i; parents[i] < i, or -1 for a root."""
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise TreeError(f"node {i} has parent {parent}: parents must come before their children (-1: a root)")
        if parent >= 0:
            mask[i] |= mask[parent]
    return mask


@dataclass(frozen=True, eq=False)
class TreeRows:
    """The new rows of one session as tree nodes.

    Cache rows < base are committed: every new row sees all of them. Rows at or after base are the
    tree region: first the earlier tree rows already in the cache (`prior` of them), then the n new
    rows, in that order; visible[i, j] says whether new row i sees region row j.
    """

    base: int
    visible: torch.Tensor  # [n, prior + n] bool: over the region rows base..length_after-1
    positions: torch.Tensor  # [n] int64: absolute positions of the new rows (base + depth)

    def __post_init__(self) -> None:
        if self.base < 0:
            raise TreeError(f"tree base {self.base} is negative")
        if self.visible.dim() != 2 or self.visible.dtype != torch.bool:
            raise TreeError(f"visible must be a 2-D bool tensor, got {self.visible.dtype} {tuple(self.visible.shape)}")
        n, width = self.visible.shape
        if width < n:
            raise TreeError(f"visible {tuple(self.visible.shape)} cannot cover its own {n} new rows")
        if self.positions.shape != (n,) or self.positions.dtype != torch.int64:
            raise TreeError(f"positions must be [{n}] int64, got {self.positions.dtype} {tuple(self.positions.shape)}")
        # checked where trees are built (the CPU): a device copy (`to`) is not re-read, which would sync
        if n and self.visible.device.type == "cpu" and not bool(self.visible[:, width - n :].diagonal().all()):
            raise TreeError("every new tree row must see itself")

    @property
    def n(self) -> int:
        """How many new rows."""
        return self.visible.shape[0]

    @property
    def prior(self) -> int:
        """How many tree rows are already in the cache (at base..base+prior-1) before the new ones."""
        return self.visible.shape[1] - self.visible.shape[0]

    @classmethod
    def for_rows(cls, base: int, ancestor_mask: torch.Tensor, first: int = 0) -> "TreeRows":
        """Rows first.. of a tree region whose rows 0..first-1 are already in the cache (at base..).

        ancestor_mask: [R, R] bool over the whole region so far, mask[i, j] = j is i or an ancestor
        of i, in topological order (ancestors first); depth = number of ancestors.
        """
        if ancestor_mask.dim() != 2 or ancestor_mask.shape[0] != ancestor_mask.shape[1]:
            raise TreeError(f"ancestor mask must be square, got {tuple(ancestor_mask.shape)}")
        mask = ancestor_mask.to(dtype=torch.bool)  # [R, R]
        rows = mask.shape[0]
        if not 0 <= first <= rows:
            raise TreeError(f"first new row {first} outside a region of {rows} rows")
        if not bool(mask.diagonal().all()) or bool(mask.triu(diagonal=1).any()):
            raise TreeError("ancestor mask must hold every row itself and only earlier rows as ancestors")
        depth = mask[first:].sum(dim=1) - 1  # [n]
        return cls(base, mask[first:].clone(), (base + depth).to(torch.int64))

    @classmethod
    def for_new_tree(cls, base: int, ancestor_mask: torch.Tensor) -> "TreeRows":
        """A whole tree appended at once after `base` committed rows (row 0: the root, depth 0)."""
        return cls.for_rows(base, ancestor_mask, 0)

    def to(self, device: torch.device | str) -> "TreeRows":
        return TreeRows(self.base, self.visible.to(device), self.positions.to(device))

    def mask(self) -> torch.Tensor:
        """[n, base + prior + n] bool over the whole cache after the append: committed rows, then visible."""
        committed = torch.ones(self.n, self.base, dtype=torch.bool, device=self.visible.device)
        return torch.cat([committed, self.visible], dim=1)


def check_trees(caches: Sequence[SessionKV], lengths: Sequence[int], trees: Sequence[TreeRows | None] | None) -> None:
    """Each session's tree, if any, must fit its new rows and its cache as it is before the append."""
    if trees is None:
        return
    if len(trees) != len(caches):
        raise TreeError(f"{len(trees)} trees for {len(caches)} sessions")
    for cache, n, tree in zip(caches, lengths, trees):
        if tree is None:
            continue
        if tree.n != n:
            raise TreeError(f"tree of {tree.n} rows for {n} new rows")
        if tree.base + tree.prior != cache.length:
            raise TreeError(
                f"tree base {tree.base} + {tree.prior} earlier tree rows does not match the cache length {cache.length}"
            )


def packed_positions(
    caches: Sequence[SessionKV],
    lengths: Sequence[int],
    device: torch.device | str = "cpu",
    trees: Sequence[TreeRows | None] | None = None,
) -> torch.Tensor:
    """Absolute positions of the new tokens: each session continues from its cache length, or a tree
    session's rows sit at their tree positions."""
    # positions: [T], on the device of the states they index (the rotary tables are computed there)
    check_trees(caches, lengths, trees)
    chunks = []
    for index, (cache, n) in enumerate(zip(caches, lengths)):
        tree = trees[index] if trees is not None else None
        if tree is None:
            chunks.append(torch.arange(cache.length, cache.length + n, device=device))
        else:
            chunks.append(tree.positions.to(device))
    return torch.cat(chunks)


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
    trees: Sequence[TreeRows | None] | None = None,
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
    for index, (cache, n) in enumerate(zip(layer_caches, lengths)):
        past = cache.length
        tree = trees[index] if trees is not None else None
        if tree is not None and tree.base + tree.prior != past:
            raise TreeError(
                f"tree base {tree.base} + {tree.prior} earlier tree rows does not match the cache length {past}"
            )
        all_keys, all_values = cache.append(keys[:, offset : offset + n], values[:, offset : offset + n])
        q = queries[:, offset : offset + n]  # [Hq, n, D]
        mask = None
        if tree is not None:
            mask = tree.mask().to(x.device)  # [n, past + n]: committed rows, then the tree rows each node sees
        elif n > 1:
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
    trees: Sequence[TreeRows | None] | None = None,
) -> torch.Tensor:
    # hidden: [T, H]
    residual = hidden
    normed = layer.input_layernorm(hidden)
    hidden = attention_forward(layer.self_attn, normed, layer_caches, lengths, cos, sin, trees)
    hidden = residual + hidden
    residual = hidden
    hidden = layer.mlp(layer.post_attention_layernorm(hidden))
    return residual + hidden


def trees_on(trees: Sequence[TreeRows | None] | None, device: torch.device) -> list[TreeRows | None] | None:
    """The trees with their tensors on `device`, once per pass rather than once per layer."""
    if trees is None or all(tree is None for tree in trees):
        return None
    return [tree.to(device) if tree is not None else None for tree in trees]


def run_layers(
    layers: Iterable[torch.nn.Module],
    rotary_emb: torch.nn.Module,
    hidden: torch.Tensor,
    caches: Sequence[SessionKV],
    lengths: Sequence[int],
    trees: Sequence[TreeRows | None] | None = None,
) -> torch.Tensor:
    """Run a contiguous range of decoder layers over packed sessions (trees[i]: session i's tree rows, or None)."""
    # hidden: [T, H]; sum(lengths) == T
    if sum(lengths) != hidden.shape[0]:
        raise ValueError(f"lengths {list(lengths)} do not add up to {hidden.shape[0]} packed tokens")
    positions = packed_positions(caches, lengths, hidden.device, trees)
    cos, sin = rotary_tables(rotary_emb, positions, hidden)
    on_device = trees_on(trees, hidden.device)
    for index, layer in enumerate(layers):
        layer_caches = [c.layer(index) for c in caches]
        hidden = decoder_layer_forward(layer, hidden, layer_caches, lengths, cos, sin, on_device)
    return hidden
