"""A packed pass with static shapes over a static KV pool: what a CUDA graph captures (cuda_graphs.py).

Every tensor a pass reads has a shape fixed by its bucket, (rows R, width W): the states [R, H], and per row
its slot, its rotary position, the cache row its key and value are written to, and the W cache rows it sees
(`index`) with a bias of 0 (seen) or -inf (not). Which sessions, how long their caches are and whether a row
is a chain's or a draft tree's node are values in those tensors, never shapes, so one captured pass serves any
sessions whose rows fit its bucket. Padding rows write and read the pool's scratch slot.

Each row gathers the keys it sees into its own [Hkv, W, D] and attends with one query: the attention's
shape does not depend on how many rows a session has, so chains, trees and decode rows of many sessions
share one call. For a dense model that changes the reduction order against the eager pass (SDPA over a
session's rows and its whole cache), so states agree closely, not bit for bit. A quantized model's
batch-invariant attention (`attend`) sums each row over its own keys in a fixed order whatever the call;
a tree row sees the committed prefix and then its own path, where `attend_paths` puts them.

The same function runs eagerly on any device (tests run it on the CPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from functools import partial

import torch
import torch.nn.functional as F

from shared.model.attention import AttentionWeights, rotate
from shared.model.invariant_attention import attend, padded_length, uses_invariant_attention
from shared.model.kv_cache import SessionKV
from shared.model.layers import layer_with_attention
from shared.model.rotary_table import ROTARY_TABLES
from shared.model.split import LayerRange
from shared.model.static_kv import SlotKV, StaticKVPool
from shared.model.tree_rows import TreeRows, check_trees


@dataclass(frozen=True, eq=False)
class StaticRows:
    """One static-shape pass's rows, padded to `rows`: where each reads and writes, as tensors."""

    slots: torch.Tensor  # [R] int64: the pool slot of each row's session (padding: the scratch slot)
    positions: torch.Tensor  # [R] int64: rotary positions (a tree node's: base + depth)
    writes: torch.Tensor  # [R] int64: the cache row its key and value go to
    index: torch.Tensor  # [R, W] int64: the cache rows it sees, in order (padding: row 0, masked)
    bias: torch.Tensor  # [R, W] float: 0 where it sees the row, -inf where not

    @property
    def rows(self) -> int:
        return self.slots.shape[0]

    @property
    def width(self) -> int:
        return self.index.shape[1]

    @classmethod
    def padding(
        cls, rows: int, width: int, scratch: int, dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> "StaticRows":
        """`rows` padding rows: each writes scratch row 0 and sees it alone (a finite, discarded softmax)."""
        bias = torch.full((rows, width), float("-inf"), dtype=dtype, device=device)
        bias[:, 0] = 0.0
        zeros = torch.zeros(rows, dtype=torch.int64, device=device)
        return cls(
            torch.full((rows,), scratch, dtype=torch.int64, device=device),
            zeros,
            zeros.clone(),
            torch.zeros(rows, width, dtype=torch.int64, device=device),
            bias,
        )

    def copy_from(self, other: "StaticRows") -> None:
        """Overwrite these tensors in place (a captured graph's inputs keep their addresses)."""
        for field in fields(self):
            getattr(self, field.name).copy_(getattr(other, field.name), non_blocking=True)


def seen_width(caches: Sequence[SessionKV], lengths: Sequence[int], trees: Sequence[TreeRows | None]) -> int:
    """The most cache rows any new row sees (its own included), padded to batch-invariant attention's CHUNK."""
    widest = 0
    for cache, n, tree in zip(caches, lengths, trees):
        if n:
            widest = max(widest, cache.length + n if tree is None else tree.base + int(tree.visible.sum(1).max()))
    return padded_length(widest)


def plan_rows(
    caches: Sequence[SlotKV],
    lengths: Sequence[int],
    trees: Sequence[TreeRows | None] | None,
    rows: int,
    width: int,
    dtype: torch.dtype,
) -> StaticRows:
    """The rows of a packed pass (sessions' new rows one after another, as run_layers packs them), padded to
    `rows` x `width`, on the CPU; each cache's length is the one before the pass."""
    trees = list(trees) if trees is not None else [None] * len(caches)
    check_trees(caches, lengths, trees)
    if sum(lengths) > rows or seen_width(caches, lengths, trees) > width:
        raise ValueError(f"{sum(lengths)} rows seeing {seen_width(caches, lengths, trees)} do not fit {rows}x{width}")
    planned = StaticRows.padding(rows, width, caches[0].pool.scratch if caches else 0, dtype)
    r = 0
    for cache, n, tree in zip(caches, lengths, trees):
        past = cache.length
        for j in range(n):
            if tree is None:
                seen = torch.arange(past + j + 1)
                position = past + j
            else:
                seen = torch.cat([torch.arange(tree.base), tree.base + tree.visible[j].nonzero()[:, 0].cpu()])
                position = int(tree.positions[j])
            planned.slots[r], planned.positions[r], planned.writes[r] = cache.slot, position, past + j
            planned.index[r, : len(seen)] = seen
            planned.bias[r, : len(seen)] = 0.0
            r += 1
    return planned


def static_attention(
    weights: AttentionWeights,
    x: torch.Tensor,
    keys_pool: torch.Tensor,
    values_pool: torch.Tensor,
    rows: StaticRows,
    cos: torch.Tensor,
    sin: torch.Tensor,
    invariant: bool,
) -> torch.Tensor:
    """One layer's attention for R rows: writes their keys and values into their slots, then each row
    attends over the W cache rows its `index` names."""
    # x: [R, H] (normed); keys_pool, values_pool: [S + 1, Hkv, C, D]; cos, sin: [R, D] -> [R, H]
    total, head_dim = x.shape[0], weights.head_dim
    qk, v = weights.project_qkv(x)
    turned = rotate(qk.view(total, -1, head_dim).transpose(0, 1), cos, sin)  # [Hq + Hkv, R, D]
    queries, keys = turned[: weights.num_q_heads], turned[weights.num_q_heads :]  # [Hq, R, D], [Hkv, R, D]
    values = v.view(total, -1, head_dim).transpose(0, 1)  # [Hkv, R, D]
    keys_pool[rows.slots, :, rows.writes] = keys.transpose(0, 1)  # [R, Hkv, D] into each row's slot and row
    values_pool[rows.slots, :, rows.writes] = values.transpose(0, 1)
    # a slice between two index tensors puts the indexed dims first: [R, W, Hkv, D] -> [R, Hkv, W, D]
    seen_keys = keys_pool[rows.slots[:, None], :, rows.index].transpose(1, 2)
    seen_values = values_pool[rows.slots[:, None], :, rows.index].transpose(1, 2)
    heads = keys.shape[0]
    if invariant:
        grouped = queries.transpose(0, 1).reshape(total, heads, -1, 1, head_dim)  # [R, Hkv, G, 1, D]
        bias = rows.bias.to(queries.dtype)[:, None, None, None, :]  # [R, 1, 1, 1, W]
        out = attend(grouped, seen_keys, seen_values, bias, weights.scaling)  # [R, Hkv, G, 1, D]
    else:
        out = F.scaled_dot_product_attention(
            queries.transpose(0, 1)[:, :, None, :],  # [R, Hq, 1, D]
            seen_keys,
            seen_values,
            attn_mask=rows.bias.to(queries.dtype)[:, None, None, :],  # [R, 1, 1, W]
            scale=weights.scaling,
            enable_gqa=queries.shape[0] != heads,
        )  # [R, Hq, 1, D]
    return weights.project_out(out.reshape(total, -1))


@torch.inference_mode()
def static_pass(layers: LayerRange, pool: StaticKVPool, hidden: torch.Tensor, rows: StaticRows) -> torch.Tensor:
    """The layer range over `rows` (their states [R, H]) with their KV in `pool`: [R, H]. The caches'
    lengths are the caller's to advance (the pass sees only tensors)."""
    invariant = uses_invariant_attention(list(layers.layers))
    cos, sin = ROTARY_TABLES.rows(layers.rotary_emb, hidden, rows.positions, pool.capacity)  # [R, D] each
    for index, layer in enumerate(layers.layers):
        attend_here = partial(
            static_attention,
            keys_pool=pool.keys[index],
            values_pool=pool.values[index],
            rows=rows,
            cos=cos,
            sin=sin,
            invariant=invariant,
        )
        hidden = layer_with_attention(layer, hidden, attend_here)
    return hidden
