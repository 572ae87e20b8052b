"""Batch-invariant attention: a row's bits do not depend on the other rows, sessions or padding of its call.

The reference for every row is `decode_row`: the row alone, against exactly the keys a decode step of its
path would hold, in a fresh contiguous tensor. Equality is exact (torch.equal), not approximate. Then the
same in the runner, on a quantized model (which runs this attention): a packed pass of several sessions,
one of them tree rows, gives each session the bits it gets alone.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.model import native_build
from shared.model.checkpoint import load_checkpoint
from shared.model.invariant_attention import (
    CHUNK,
    ROW_BLOCK,
    RowLayout,
    attend,
    attend_paths,
    causal_blocks,
    padded_length,
    pairwise_sum,
    uses_invariant_attention,
)
from shared.model.kv_cache import KVCacheError, LayerKV
from shared.model.split import LayerRange
from shared.model.tree_rows import TreeRows, ancestor_mask_from_parents
from tests.conftest import DEMO_MODEL_DIR

HEAD_DIM = 64
SCALE = HEAD_DIM**-0.5


@pytest.fixture(scope="module", autouse=True, params=["native", "torch"])
def implementation(request):
    """Every test twice: with the C++ kernels (native/attention.h, where `make install` built them) and with
    the torch version that serves where they are not built (switched off here)."""
    with pytest.MonkeyPatch.context() as patch:
        if request.param == "torch":
            patch.setenv(native_build.SWITCH_ENV, "off")
        else:
            assert native_build.native_module() is not None, "make install builds the extension"
        yield request.param


def decode_row(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One row alone: query [Hkv, G, D] against keys/values [Hkv, l, D] -> [Hkv, G, D]."""
    length = keys.shape[1]
    width = padded_length(length)
    padded_keys = torch.zeros(keys.shape[0], width, HEAD_DIM)
    padded_values = torch.zeros_like(padded_keys)
    padded_keys[:, :length], padded_values[:, :length] = keys, values
    bias = torch.full((1, width), float("-inf"))
    bias[:, :length] = 0.0
    return attend(query[None, :, :, None], padded_keys[None], padded_values[None], bias, SCALE)[0, :, :, 0]


def causal_bias(past: int, rows: int, width: int) -> torch.Tensor:
    seen = torch.arange(width)[None, :] <= past + torch.arange(rows)[:, None]  # [n, N]
    return torch.zeros(rows, width).masked_fill(~seen, float("-inf"))


def cache_with(kv_heads: int, length: int, capacity: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values in a larger buffer (as the KV cache holds them: strided views, zeros after length)."""
    generator = torch.Generator().manual_seed(seed)
    keys = torch.zeros(kv_heads, capacity, HEAD_DIM)
    values = torch.zeros_like(keys)
    keys[:, :length] = torch.randn(kv_heads, length, HEAD_DIM, generator=generator)
    values[:, :length] = torch.randn(kv_heads, length, HEAD_DIM, generator=generator)
    return keys, values


@settings(max_examples=25, deadline=None)
@given(
    past=st.integers(0, 200),
    rows=st.integers(1, 40),
    groups=st.sampled_from([1, 3]),
    extra_chunks=st.integers(0, 2),
    seed=st.integers(0, 2**16),
)
def test_chain_rows_equal_each_row_decoded_alone(past, rows, groups, extra_chunks, seed):
    length = past + rows
    width = padded_length(length) + extra_chunks * CHUNK
    keys, values = cache_with(3, length, width + 2 * CHUNK, seed)
    queries = torch.randn(3, groups, rows, HEAD_DIM, generator=torch.Generator().manual_seed(seed + 1))
    bias = causal_bias(past, rows, width)
    out = attend(queries[None], keys[None, :, :width], values[None, :, :width], bias, SCALE)[0]
    for i in range(rows):
        seen = past + i + 1
        assert torch.equal(out[:, :, i], decode_row(queries[:, :, i], keys[:, :seen], values[:, :seen])), i


def test_causal_blocks_give_the_rows_of_one_call():
    past, rows = 20, 2 * ROW_BLOCK + 22
    keys, values = cache_with(3, past + rows, padded_length(past + rows), seed=5)
    queries = torch.randn(1, 3, 3, rows, HEAD_DIM)
    whole = attend(queries, keys[None], values[None], causal_bias(past, rows, padded_length(past + rows)), SCALE)
    blocks = causal_blocks(past, rows)
    assert [(b.start, b.stop) for b in blocks] == [(0, ROW_BLOCK), (ROW_BLOCK, 2 * ROW_BLOCK), (2 * ROW_BLOCK, rows)]
    assert blocks[0].width == padded_length(past + ROW_BLOCK) < blocks[-1].width
    for block in blocks:
        out = attend(
            queries[..., block.start : block.stop, :],
            keys[None, :, : block.width],
            values[None, :, : block.width],
            block.bias,
            SCALE,
        )
        assert torch.equal(out, whole[..., block.start : block.stop, :])
    for i in (0, ROW_BLOCK, rows - 1):
        assert torch.equal(
            whole[0, :, :, i], decode_row(queries[0, :, :, i], keys[:, : past + i + 1], values[:, : past + i + 1])
        )


def test_sessions_batched_equal_each_session_alone():
    lengths, rows = [37, 5, 90], [4, 1, 7]
    width = padded_length(max(lengths))
    keys = torch.zeros(len(lengths), 3, width, HEAD_DIM)
    values = torch.zeros_like(keys)
    bias = torch.full((len(lengths), 1, 1, max(rows), width), float("-inf"))
    queries = torch.randn(len(lengths), 3, 3, max(rows), HEAD_DIM)  # [B, Hkv, G, n, D]
    for b, (length, n) in enumerate(zip(lengths, rows)):
        keys[b, :, :length], values[b, :, :length] = torch.randn(2, 3, length, HEAD_DIM)
        bias[b, 0, 0, :n] = causal_bias(length - n, n, width)
        bias[b, 0, 0, n:, 0] = 0.0  # padding rows see one key: finite, discarded
    out = attend(queries, keys, values, bias, SCALE)
    for b, (length, n) in enumerate(zip(lengths, rows)):
        for i in range(n):
            seen = length - n + i + 1
            alone = decode_row(queries[b, :, :, i], keys[b, :, :seen], values[b, :, :seen])
            assert torch.equal(out[b, :, :, i], alone), (b, i)


def test_close_to_scaled_dot_product_attention():
    keys, values = cache_with(3, 150, 160, seed=3)
    queries = torch.randn(3, 3, 12, HEAD_DIM)
    out = attend(queries[None], keys[None], values[None], causal_bias(138, 12, 160), SCALE)
    mask = torch.ones(12, 150, dtype=torch.bool).tril(diagonal=138)
    expected = F.scaled_dot_product_attention(
        queries.reshape(9, 12, HEAD_DIM)[None], keys[None, :, :150], values[None, :, :150], attn_mask=mask, scale=SCALE,
        enable_gqa=True,
    )[0]  # fmt: skip
    torch.testing.assert_close(out.reshape(9, 12, HEAD_DIM), expected, atol=1e-5, rtol=1e-5)


def tree_paths(parents: list[int]) -> list[list[int]]:
    paths: list[list[int]] = []
    for parent in parents:
        paths.append((paths[parent] if parent >= 0 else []) + [len(paths)])
    return paths


@settings(max_examples=20, deadline=None)
@given(
    base=st.integers(0, 150),
    parents=st.lists(st.integers(-1, 30), min_size=1, max_size=16).map(
        lambda raw: [min(p, i - 1) if i else -1 for i, p in enumerate(raw)]
    ),
    seed=st.integers(0, 2**16),
)
def test_tree_rows_equal_their_path_decoded_alone(base, parents, seed):
    rows = len(parents)
    paths = tree_paths(parents)
    keys, values = cache_with(3, base + rows, padded_length(base + rows) + CHUNK, seed)
    queries = torch.randn(3, 3, rows, HEAD_DIM, generator=torch.Generator().manual_seed(seed + 7))
    shared = base // CHUNK * CHUNK
    tail_width = padded_length(base - shared + max(len(path) for path in paths))
    tails = torch.zeros(rows, tail_width, dtype=torch.int64)
    bias = torch.full((rows, shared + tail_width), float("-inf"))
    bias[:, :shared] = 0.0
    for i, path in enumerate(paths):
        own = list(range(shared, base)) + [base + j for j in path]
        tails[i, : len(own)] = torch.tensor(own)
        bias[i, shared : shared + len(own)] = 0.0
    out = attend_paths(queries, keys, values, shared, tails, bias, SCALE)
    for i, path in enumerate(paths):
        seen = list(range(base)) + [base + j for j in path]
        alone = decode_row(queries[:, :, i], keys[:, seen], values[:, seen])
        assert torch.equal(out[:, :, i], alone), (i, path)


@settings(max_examples=40, deadline=None)
@given(
    base=st.integers(0, 150),
    parents=st.lists(st.integers(-1, 40), min_size=1, max_size=40).map(
        lambda raw: [min(p, i - 1) if i else -1 for i, p in enumerate(raw)]
    ),
    first=st.integers(0, 39),
)
def test_a_tree_pass_layout_reads_each_row_its_committed_rows_then_its_path(base, parents, first):
    """RowLayout.build for tree rows (the rows from `first` on; earlier ones already cached): row i's tail is
    the committed rows past the shared chunks, then its path's region rows in order; its bias is 0 exactly there."""
    first = min(first, len(parents) - 1)
    tree = TreeRows.for_rows(base, ancestor_mask_from_parents(parents), first)
    layout = RowLayout.build(base + first, tree.n, tree, "cpu")
    shared = base // CHUNK * CHUNK
    assert layout.shared == shared and layout.tails is not None
    bias = layout.blocks[0].bias  # [n, shared + tail width]
    for i, path in enumerate(tree_paths(parents)[first:]):
        own = list(range(shared, base)) + [base + j for j in path]
        assert layout.tails[i, : len(own)].tolist() == own
        assert bool((layout.tails[i, len(own) :] == 0).all())  # padding reads row 0, masked
        assert bool((bias[i, : shared + len(own)] == 0).all())
        assert bool((bias[i, shared + len(own) :] == float("-inf")).all())


@given(parts=st.integers(1, 9), zeros=st.integers(0, 9), seed=st.integers(0, 2**16))
def test_pairwise_sum_ignores_trailing_zero_parts(parts, zeros, seed):
    values = torch.randn(parts, 5, generator=torch.Generator().manual_seed(seed))
    padded = torch.cat([values, torch.zeros(zeros, 5)])
    assert torch.equal(pairwise_sum(values), pairwise_sum(padded))


def test_key_positions_must_come_in_whole_chunks():
    keys = torch.zeros(3, CHUNK + 1, HEAD_DIM)
    try:
        attend(torch.zeros(1, 3, 1, 1, HEAD_DIM), keys[None], keys[None], torch.zeros(1, CHUNK + 1), SCALE)
    except ValueError as exc:
        assert "multiple of" in str(exc)
    else:
        raise AssertionError("a key length that is not a whole number of chunks was accepted")


# -- in the runner: a quantized model's layers, several sessions in one packed pass ------------------------


@pytest.fixture(scope="module")
def quantized_layers():
    checkpoint = load_checkpoint(DEMO_MODEL_DIR, quantize="int4", with_tokenizer=False)
    assert uses_invariant_attention(list(checkpoint.decoder.layers))
    return LayerRange(checkpoint, 0, checkpoint.num_layers), checkpoint.hidden_size


def prefilled(layers: LayerRange, prefix: torch.Tensor):
    cache = layers.new_cache()
    layers.forward_batch([(cache, prefix)])
    return cache


def one_row_per_pass(layers: LayerRange, prefix: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The decode-step reference: `rows` after `prefix`, one row per pass -> [n, H]."""
    cache = prefilled(layers, prefix)
    return torch.cat([layers.forward_batch([(cache, rows[i : i + 1])])[0] for i in range(rows.shape[0])])


@pytest.mark.parametrize("with_tree", [False, True], ids=["chains", "chains-and-a-tree"])
def test_a_packed_pass_gives_every_row_the_bits_of_one_row_per_pass(quantized_layers, with_tree):
    layers, hidden = quantized_layers
    generator = torch.Generator().manual_seed(11)
    prefixes = [torch.randn(length, hidden, generator=generator) for length in (40, 7, 70)]
    rows = [torch.randn(n, hidden, generator=generator) for n in (1, 5, 6)]
    parents = [-1, 0, 0, 1, 2, 4]  # the third session's rows as a tree, when it is one
    tree = TreeRows.for_new_tree(70, ancestor_mask_from_parents(parents)) if with_tree else None
    packed = layers.forward_batch([(prefilled(layers, p), r) for p, r in zip(prefixes, rows)], [None, None, tree])
    for prefix, own, together in zip(prefixes[:2], rows[:2], packed[:2]):
        assert torch.equal(together, one_row_per_pass(layers, prefix, own))
    for node in range(len(parents)):
        path = [node]
        while tree is not None and parents[path[0]] >= 0:
            path.insert(0, parents[path[0]])
        if tree is None:
            path = list(range(node + 1))
        assert torch.equal(packed[2][node], one_row_per_pass(layers, prefixes[2], rows[2][path])[-1]), node


def test_a_session_without_new_rows_is_left_as_it_is(quantized_layers):
    layers, hidden = quantized_layers
    idle, busy = prefilled(layers, torch.randn(5, hidden)), layers.new_cache()
    rows = torch.randn(3, hidden)
    out = layers.forward_batch([(idle, torch.zeros(0, hidden)), (busy, rows)])
    assert out[0].shape == (0, hidden) and idle.length == 5
    assert torch.equal(out[1], layers.forward_batch([(layers.new_cache(), rows)])[0])


def test_a_padded_cache_view_is_finite_past_its_length():
    cache = LayerKV(3, HEAD_DIM, torch.float32, capacity=8)
    cache.append(torch.randn(3, 5, HEAD_DIM), torch.randn(3, 5, HEAD_DIM))
    keys, values = cache.padded(2 * CHUNK)  # grows past its capacity
    assert keys.shape == values.shape == (3, 2 * CHUNK, HEAD_DIM)
    assert torch.isfinite(keys).all() and torch.isfinite(values).all()
    assert torch.equal(keys[:, 5:], torch.zeros(3, 2 * CHUNK - 5, HEAD_DIM))
    with pytest.raises(KVCacheError):
        cache.padded(4)
