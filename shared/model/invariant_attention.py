"""Batch-invariant attention: every query row comes out in the same bits whatever else shares its pass.

Why: at int4/int8 every quantized matmul rounds its input (to int16 codes per group of 32, quantized.py), so a
difference of a few 1e-7 in one attention row can cross a rounding step and, where two logits are close, give
another greedy token. torch's CPU scaled-dot-product kernel gives a row such differences depending on how many rows
and keys its call holds (it blocks them by the call's shape). The quantized matmuls and the norms are
batch-invariant already (measured), so with this attention the unsplit model decoding one row per pass
(`generate_full`, the reference) and the mesh verifying many rows per pass compute the same logits.

How, with only operations whose per-element result was measured not to depend on the call's shape:
- every row's keys are laid out at their positions 0, 1, ... and padded with masked positions up to a
  multiple of CHUNK, so a row sees the same values at the same places in any call;
- scores: each key and query's elementwise products summed over the head dim in a fixed tree;
- softmax over each row's padded positions: masked ones are exact zeros in its sums;
- values: per CHUNK positions, the products of probabilities and values summed in a fixed tree, then the
  chunks' partial outputs added in a fixed pairwise tree, where padding chunks add exact zeros.
Both sums are elementwise additions, never a BLAS call: MKL's float32 matmuls gave a column other bits
with other columns beside it on an AMD EPYC box (2026-11-27), though not on the Intel boxes before.

Tree rows see their committed prefix and then their own ancestors, which the cache holds in tree order;
`attend_paths` gathers each row's path after the shared prefix, so it sits where a decode step of that
path would have it. The cost: more small operations than one SDPA call (docs/design/engine.md, precision).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shared.model.kv_cache import LayerKV
from shared.model.native_build import native_attention
from shared.model.tree_rows import TreeRows

CHUNK = 32  # positions per partial output: the values matmul's fixed reduction length
ROW_BLOCK = 64  # causal rows per call (`causal_blocks`)
IMPLEMENTATION = "tophat_batch_invariant"  # the HF attn_implementation name the reference model runs under


def padded_length(length: int) -> int:
    """The number of key positions a row of `length` visible keys is computed over: a multiple of CHUNK."""
    return -(-length // CHUNK) * CHUNK


def pairwise_sum(parts: torch.Tensor) -> torch.Tensor:
    """[C, ...] -> [...]: padded with zero parts to a power of two, then the second half added onto the first,
    level by level. Trailing zero parts change no bit: against a shorter padding they only add zeros."""
    padded = parts.new_zeros((1 << (parts.shape[0] - 1).bit_length(), *parts.shape[1:]))
    padded[: parts.shape[0]] = parts
    return _halve_in_place(padded)


PRODUCT_ELEMENTS = 1 << 18  # floats per elementwise product (1 MB, within a core's L2): longer inputs in slices


def _halve_in_place(parts: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Sum over `dim` (a power of two long) in `pairwise_sum`'s tree, in place: the second half added onto the
    first, level by level. Elementwise additions only, so each sum's bits depend on its own terms alone."""
    while parts.shape[dim] > 1:
        half = parts.shape[dim] // 2
        parts = parts.narrow(dim, 0, half).add_(parts.narrow(dim, half, half))
    return parts.squeeze(dim)


def _padded_to_power_of_two(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    length = tensor.shape[dim]
    extra = (1 << (length - 1).bit_length()) - length
    if not extra:
        return tensor
    return torch.cat([tensor, tensor.new_zeros(*tensor.shape[:dim], extra, *tensor.shape[dim + 1 :])], dim=dim)


def _scores_t(keys: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """[X, N, D] keys and [X, M, D] queries -> [X, N, M] dot products, each the products of its own pair
    summed over d in a fixed tree (no BLAS call: a BLAS kernel may block, and so round, by the call's shape,
    as MKL does on AMD CPUs)."""
    batch, positions, head_dim = keys.shape
    keys = _padded_to_power_of_two(keys, 2)
    queries = _padded_to_power_of_two(queries, 2)
    rows = queries.shape[1]
    step = max(1, PRODUCT_ELEMENTS // max(1, batch * rows * keys.shape[2]))
    scores = keys.new_empty(batch, positions, rows)
    for start in range(0, positions, step):
        products = keys[:, start : start + step, None, :] * queries[:, None, :, :]  # [X, n, M, D]
        scores[:, start : start + step] = _halve_in_place(products, 3)
    return scores


def _chunk_products(probs: torch.Tensor, values: torch.Tensor, out: torch.Tensor) -> None:
    """[X, M, N] probabilities and [X, N, D] values -> out [N / CHUNK, X, D, M]: per chunk of CHUNK positions,
    the products of each probability and value row summed over the chunk in a fixed tree."""
    batch, rows, positions = probs.shape
    head_dim = values.shape[-1]
    per_chunk = batch * rows * CHUNK * head_dim
    step = max(1, PRODUCT_ELEMENTS // per_chunk) * CHUNK
    for start in range(0, positions, step):
        stop = min(start + step, positions)
        chunks = (stop - start) // CHUNK
        products = probs[:, :, start:stop, None] * values[:, None, start:stop, :]  # [X, M, n, D]
        sums = _halve_in_place(products.view(batch, rows, chunks, CHUNK, head_dim), 3)  # [X, M, chunks, D]
        out[start // CHUNK : stop // CHUNK] = sums.permute(2, 0, 3, 1)


def attend(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scale: float
) -> torch.Tensor:
    """Rows that see keys at positions 0..N-1 (bias 0) or not (-inf); N a multiple of CHUNK."""
    # queries: [B, Hkv, G, n, D] (each kv head's G query heads, n rows); keys, values: [B, Hkv, N, D]
    # bias: broadcastable to [B, Hkv, G, n, N] -> [B, Hkv, G, n, D]
    if keys.shape[-2] % CHUNK:
        raise ValueError(f"{keys.shape[-2]} key positions: batch-invariant attention takes a multiple of {CHUNK}")
    native = native_attention(queries, keys, values)  # the C++ kernels (native/attention.h), where built
    if native is not None:
        return native.attend(queries, keys, values, bias, scale)
    batch, heads, groups, rows, head_dim = queries.shape
    width, flat, columns = keys.shape[-2], batch * heads, groups * rows
    scores_t = _scores_t(keys.flatten(0, 1), queries.reshape(flat, columns, head_dim))  # [X, N, M]
    logits = queries.new_empty(batch, heads, groups, rows, width)  # rows contiguous, as softmax reads them
    # bias + scale * scores: with a bias of 0 or -inf, fused or not, every element rounds once
    torch.add(bias, scores_t.mT.view(logits.shape), alpha=scale, out=logits)
    probs = torch.softmax(logits.view(flat, columns, width), dim=-1)  # [X, M, N]
    chunks = width // CHUNK
    parts = queries.new_zeros(1 << (chunks - 1).bit_length(), flat, head_dim, columns)  # [P, X, D, M]
    _chunk_products(probs, values.flatten(0, 1), parts[:chunks])
    out = _halve_in_place(parts).view(batch, heads, head_dim, groups, rows)
    return out.permute(0, 1, 3, 4, 2)  # a view: callers copy once into the layout they need


def attend_paths(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    shared: int,
    tails: torch.Tensor,
    bias: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Rows that each see cache positions 0..shared-1, then their own rows of the cache (`tails`) in order."""
    # queries: [Hkv, G, n, D]; keys, values: one session's cache [Hkv, >= shared, D]; shared % CHUNK == 0
    # tails: [n, Nt] int64 cache rows after the shared ones (Nt % CHUNK == 0; padding: any row, masked by bias)
    # bias: [n, shared + Nt] 0 / -inf -> [Hkv, G, n, D]
    if shared % CHUNK or tails.shape[1] % CHUNK:
        raise ValueError(f"shared {shared} and tail {tails.shape[1]} positions must be multiples of {CHUNK}")
    native = native_attention(queries, keys, values)  # the C++ kernels (native/attention.h), where built
    if native is not None:
        return native.attend_paths(queries, keys, values, shared, tails, bias, scale)
    heads, groups, rows, head_dim = queries.shape
    tail_width = tails.shape[1]
    tail_keys = keys[:, tails.reshape(-1)].view(heads * rows, tail_width, head_dim)  # [Hkv n, Nt, D]
    tail_values = values[:, tails.reshape(-1)].view(heads * rows, tail_width, head_dim)
    row_queries = queries.transpose(1, 2).reshape(heads * rows, groups, head_dim)  # [Hkv n, G, D]
    tail_scores = _scores_t(tail_keys, row_queries).view(heads, rows, tail_width, groups).permute(0, 3, 1, 2)
    shared_scores = _scores_t(keys[:, :shared], queries.reshape(heads, groups * rows, head_dim))  # [Hkv, shared, G n]
    scores = torch.cat([shared_scores.mT.view(heads, groups, rows, shared), tail_scores], dim=-1)
    scores = torch.add(bias, scores, alpha=scale)  # [Hkv, G, n, shared + Nt], as `attend` scales and masks
    probs = torch.softmax(scores, dim=-1)
    shared_chunks, tail_chunks = shared // CHUNK, tail_width // CHUNK
    parts = queries.new_zeros(1 << (shared_chunks + tail_chunks - 1).bit_length(), heads, head_dim, groups, rows)
    if shared_chunks:
        shared_out = parts.new_empty(shared_chunks, heads, head_dim, groups * rows)
        _chunk_products(probs[..., :shared].reshape(heads, groups * rows, shared), values[:, :shared], shared_out)
        parts[:shared_chunks] = shared_out.view(shared_chunks, heads, head_dim, groups, rows)
    tail_out = parts.new_empty(tail_chunks, heads * rows, head_dim, groups)
    tail_probs = probs[..., shared:].permute(0, 2, 1, 3).reshape(heads * rows, groups, tail_width)  # [Hkv n, G, Nt]
    _chunk_products(tail_probs, tail_values, tail_out)
    parts[shared_chunks : shared_chunks + tail_chunks] = tail_out.view(
        tail_chunks, heads, rows, head_dim, groups
    ).permute(0, 1, 3, 4, 2)
    return _halve_in_place(parts).permute(0, 2, 3, 1)  # [Hkv, G, n, D]


@dataclass(frozen=True, eq=False)
class RowBlock:
    """Rows start..stop-1 of a session's pass, computed in one call over the first `width` key positions."""

    start: int
    stop: int
    width: int  # a multiple of CHUNK: what the block's last row sees, padded
    bias: torch.Tensor  # [stop - start, width]: 0 where a row sees the position, -inf where not


def causal_blocks(past: int, rows: int, device: torch.device | str = "cpu") -> tuple[RowBlock, ...]:
    """Rows past, past+1, ... that each see every position up to their own, ROW_BLOCK rows per call: a block
    reads only the positions its last row sees, so a long prefill holds a bounded slice of probabilities and
    does about half the work of one call over every position. Rows do not depend on their call: no bit changes."""
    blocks = []
    for start in range(0, rows, ROW_BLOCK):
        stop = min(start + ROW_BLOCK, rows)
        width = padded_length(past + stop)
        positions = torch.arange(width, device=device)[None, :]
        blocks.append(
            RowBlock(start, stop, width, _bias(positions <= past + torch.arange(start, stop, device=device)[:, None]))
        )
    return tuple(blocks)


@dataclass(frozen=True, eq=False)
class RowLayout:
    """Where one session's new rows of a pass look, built once per pass: a causal chain or tree rows."""

    rows: int
    blocks: tuple[RowBlock, ...]  # a chain: `causal_blocks`; tree rows: one block over shared + tail positions
    shared: int = 0  # tree rows: the first positions every row sees, read from the cache in place
    tails: torch.Tensor | None = None  # tree rows: [n, width - shared] cache rows each row sees after those

    @classmethod
    def build(cls, past: int, rows: int, tree: TreeRows | None, device: torch.device) -> "RowLayout":
        """`rows` new rows after `past` cached ones, causal (tree None) or as the tree's nodes."""
        if tree is None:
            return cls(rows, causal_blocks(past, rows, device))
        shared = tree.base // CHUNK * CHUNK
        committed = tree.base - shared  # rows shared..base-1: seen by every row, at the front of its tail
        visible = tree.visible.cpu()  # [n, W]
        counts = visible.sum(dim=1)  # [n]: the tree rows each row sees
        most = int(counts.max())
        # each row's seen tree rows, in increasing order: a stable sort puts the seen columns first, in order
        columns = torch.argsort((~visible).to(torch.int8), dim=1, stable=True)[:, :most]  # [n, most]
        used = torch.arange(most)[None, :] < counts[:, None]  # [n, most]
        tail_width = padded_length(committed + most)
        tails = torch.zeros(rows, tail_width, dtype=torch.int64)  # padding reads row 0: masked, any finite row
        tails[:, :committed] = torch.arange(shared, tree.base)
        tails[:, committed : committed + most] = torch.where(used, tree.base + columns, 0)
        seen = torch.zeros(rows, shared + tail_width, dtype=torch.bool)
        seen[:, : tree.base] = True
        seen[:, tree.base : tree.base + most] = used
        block = RowBlock(0, rows, shared + tail_width, _bias(seen).to(device))
        return cls(rows, (block,), shared, tails.to(device))


def _bias(seen: torch.Tensor) -> torch.Tensor:
    return torch.zeros(seen.shape, device=seen.device).masked_fill_(~seen, float("-inf"))


def attend_blocks(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, blocks: Sequence[RowBlock], scale: float
) -> torch.Tensor:
    """`attend` block by block: queries [B, Hkv, G, n, D], keys/values [B, Hkv, >= last width, D]."""
    outs = [
        attend(queries[..., b.start : b.stop, :], keys[..., : b.width, :], values[..., : b.width, :], b.bias, scale)
        for b in blocks
    ]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)


@dataclass(frozen=True, eq=False)
class InvariantPlan:
    """A packed pass's batch-invariant layout, built once and read by every layer."""

    layouts: tuple[RowLayout, ...]  # per session
    bounds: tuple[tuple[int, int], ...]  # per session: its rows in the packed pass
    batch_bias: torch.Tensor | None  # several sessions' chains of one block each: [B, 1, 1, nmax, Wmax], one call

    @classmethod
    def build(
        cls, pasts: Sequence[int], lengths: Sequence[int], trees: Sequence[TreeRows | None], device: torch.device
    ) -> "InvariantPlan":
        layouts = tuple(RowLayout.build(past, n, tree, device) for past, n, tree in zip(pasts, lengths, trees))
        ends = list(itertools.accumulate(lengths))
        bounds = tuple(zip([0, *ends[:-1]], ends))
        batch_bias = None
        if len(layouts) > 1 and all(layout.tails is None and len(layout.blocks) == 1 for layout in layouts):
            width, rows = max(layout.blocks[0].width for layout in layouts), max(lengths)
            batch_bias = torch.full((len(layouts), 1, 1, rows, width), float("-inf"), device=device)
            batch_bias[..., 0] = 0.0  # padding rows see one position: finite, and discarded
            for b, layout in enumerate(layouts):
                block = layout.blocks[0]
                batch_bias[b, 0, 0, : layout.rows, : block.width] = block.bias
        return cls(layouts, bounds, batch_bias)


def attend_sessions(
    plan: InvariantPlan,
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    layer_caches: Sequence[LayerKV],
    scale: float,
) -> torch.Tensor:
    """One layer's attention for a packed pass; appends each session's new keys and values to its cache."""
    # queries: [Hq, T, D]; keys, values: [Hkv, T, D] the new rows, sessions one after another -> [Hkv, G, T, D]
    heads, total, head_dim = keys.shape
    grouped = queries.view(heads, -1, total, head_dim)  # [Hkv, G, T, D]: query head h G + g reads kv head h
    for cache, (start, stop) in zip(layer_caches, plan.bounds):
        cache.append(keys[:, start:stop], values[:, start:stop])
    if plan.batch_bias is not None:
        return _attend_chains(plan, grouped, layer_caches, scale)
    outs = [grouped[:, :, :0]]  # a session may come with no new rows
    for layout, cache, (start, stop) in zip(plan.layouts, layer_caches, plan.bounds):
        rows = grouped[:, :, start:stop]  # [Hkv, G, n, D]
        if not layout.rows:
            continue
        if layout.tails is None:
            own_keys, own_values = cache.padded(layout.blocks[-1].width)  # [Hkv, width, D]
            outs.append(attend_blocks(rows[None], own_keys[None], own_values[None], layout.blocks, scale)[0])
        else:
            own_keys, own_values = cache.padded(cache.length)  # tails index rows anywhere in the cache
            bias = layout.blocks[0].bias
            outs.append(attend_paths(rows, own_keys, own_values, layout.shared, layout.tails, bias, scale))
    return outs[1] if len(outs) == 2 else torch.cat(outs, dim=2)


def _attend_chains(
    plan: InvariantPlan, grouped: torch.Tensor, layer_caches: Sequence[LayerKV], scale: float
) -> torch.Tensor:
    """Several sessions' causal rows in one call: queries and keys padded to the widest session."""
    assert plan.batch_bias is not None  # built with the plan when its sessions fit one call
    heads, groups, _, head_dim = grouped.shape
    sessions, _, _, rows, width = plan.batch_bias.shape
    padded_queries = grouped.new_zeros(sessions, heads, groups, rows, head_dim)
    padded_keys = grouped.new_zeros(sessions, heads, width, head_dim)
    padded_values = torch.zeros_like(padded_keys)
    for b, (layout, cache, (start, stop)) in enumerate(zip(plan.layouts, layer_caches, plan.bounds)):
        own_width = layout.blocks[0].width
        own_keys, own_values = cache.padded(own_width)
        padded_queries[b, :, :, : stop - start] = grouped[:, :, start:stop]
        padded_keys[b, :, :own_width], padded_values[b, :, :own_width] = own_keys, own_values
    out = attend(padded_queries, padded_keys, padded_values, plan.batch_bias, scale)  # [B, Hkv, G, n, D]
    return torch.cat([out[b, :, :, : stop - start] for b, (start, stop) in enumerate(plan.bounds)], dim=2)


def uses_invariant_attention(layers: Sequence[torch.nn.Module]) -> bool:
    """Whether the HF model these decoder layers belong to runs batch-invariant attention."""
    config = getattr(getattr(layers[0], "self_attn", None), "config", None) if layers else None
    return getattr(config, "_attn_implementation", None) == IMPLEMENTATION


def use_invariant_attention(model: torch.nn.Module) -> None:
    """Switch an HF model to batch-invariant attention: the model itself (the unsplit reference, decoding
    one row per pass) and every runner over its layers (`uses_invariant_attention`) compute the same bits."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(IMPLEMENTATION, hf_attention)
    AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)  # a bool mask (True: seen), or None when causal
    model.set_attn_implementation(IMPLEMENTATION)  # type: ignore[operator]


def hf_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """The HF attention-interface function: HF's cache holds exactly the keys, so they are padded here."""
    # query: [B, Hq, n, D]; key, value: [B, Hkv, L, D]; attention_mask: bool [B, 1, n, L] or None (causal)
    if kwargs.get("sliding_window") is not None:
        raise ValueError("batch-invariant attention does not implement sliding windows")
    batch, query_heads, rows, head_dim = query.shape
    heads, length = key.shape[1], key.shape[2]
    width = padded_length(length)
    keys = torch.nn.functional.pad(key, (0, 0, 0, width - length))
    values = torch.nn.functional.pad(value, (0, 0, 0, width - length))
    scale = scaling if scaling is not None else head_dim**-0.5
    grouped = query.reshape(batch, heads, query_heads // heads, rows, head_dim)
    if attention_mask is None:  # causal: the new rows are the last of the cache
        out = attend_blocks(grouped, keys, values, causal_blocks(length - rows, rows, query.device), scale)
    else:
        seen = torch.nn.functional.pad(attention_mask[..., :length].bool(), (0, width - length))[:, :, None]
        out = attend(grouped, keys, values, _bias(seen), scale)
    return out.reshape(batch, query_heads, rows, head_dim).transpose(1, 2), None
