"""Tree attention (shared/model/layers.py TreeRows), KV compaction (SessionKV.compact) and the truncated
draft vocabulary (DraftAdapter.draft_vocab, DeviceModel.draft_logits).

A tree pass must give every node what its root-to-node path gives as a plain causal chain; after
compacting to one path the cache must be that chain's cache; sessions without a tree are untouched."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file, save_file

from shared.model.adapter import AdapterError, AdapterSpec, DraftAdapter
from shared.model.kv_cache import KVCacheError
from shared.model.native_build import native_module
from shared.model.quantized import dequantize, quantize_q8
from shared.model.split import InputSubmodel, LayerRange, MiddleSubmodel
from shared.model.tree_rows import TreeError, TreeRows, ancestor_mask_from_parents
from shared.specdec.device_model import DeviceModel, q8_blocks_if_exact

ATOL = 1e-5
PREFIX = 7
# node 0 is the root; 8 nodes over 4 levels, with branching at every level
PARENTS = [-1, 0, 0, 1, 1, 2, 3, 5]
LEVELS = [[0], [1, 2], [3, 4, 5], [6, 7]]


def path_to(node: int) -> list[int]:
    path = [node]
    while PARENTS[path[-1]] >= 0:
        path.append(PARENTS[path[-1]])
    return path[::-1]


def states(rows: int, hidden: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, hidden, generator=torch.Generator().manual_seed(seed))  # [rows, H]


def chain(layers: LayerRange, prefix: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The plain causal run: prefix, then `rows` as one chain, on a fresh cache -> the rows' outputs."""
    cache = layers.new_cache()
    layers.forward_batch([(cache, prefix)])
    return layers.forward_batch([(cache, rows)])[0]


def test_tree_pass_equals_every_root_to_node_chain(tiny_checkpoint):
    middle = MiddleSubmodel(tiny_checkpoint, 2)
    prefix, nodes = states(PREFIX, tiny_checkpoint.hidden_size, 0), states(8, tiny_checkpoint.hidden_size, 1)
    tree = TreeRows.for_new_tree(PREFIX, ancestor_mask_from_parents(PARENTS))
    assert tree.positions.tolist() == [PREFIX + len(path_to(i)) - 1 for i in range(8)]
    cache = middle.new_cache()
    middle.forward_batch([(cache, prefix)])
    deep = middle.forward_batch([(cache, nodes)], trees=[tree])[0]  # [8, H]
    assert cache.length == PREFIX + 8
    for node in range(8):
        expected = chain(middle, prefix, nodes[path_to(node)])[-1]
        torch.testing.assert_close(deep[node], expected, atol=ATOL, rtol=0)


def test_compaction_to_one_path_then_a_chain_step_equals_running_only_that_path(tiny_checkpoint):
    middle = MiddleSubmodel(tiny_checkpoint, 2)
    hidden = tiny_checkpoint.hidden_size
    prefix, nodes, after = states(PREFIX, hidden, 0), states(8, hidden, 1), states(2, hidden, 2)
    cache = middle.new_cache()
    middle.forward_batch([(cache, prefix)])
    middle.forward_batch([(cache, nodes)], trees=[TreeRows.for_new_tree(PREFIX, ancestor_mask_from_parents(PARENTS))])
    path = path_to(7)  # [0, 2, 5, 7]: not the rows already in place
    cache.compact(PREFIX, [PREFIX + node for node in path])
    assert cache.length == PREFIX + len(path)
    got = middle.forward_batch([(cache, after)])[0]

    reference = middle.new_cache()
    middle.forward_batch([(reference, prefix)])
    middle.forward_batch([(reference, nodes[path])])
    expected = middle.forward_batch([(reference, after)])[0]
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    for index in range(len(middle.layers)):
        mine, theirs = cache.layer(index), reference.layer(index)
        torch.testing.assert_close(mine.keys[:, : mine.length], theirs.keys[:, : theirs.length], atol=ATOL, rtol=0)


def test_sessions_without_a_tree_are_untouched_in_a_mixed_batch(tiny_checkpoint):
    middle = MiddleSubmodel(tiny_checkpoint, 2)
    hidden = tiny_checkpoint.hidden_size
    prefixes = [states(n, hidden, 10 + n) for n in (3, PREFIX, 5)]
    news = [states(4, hidden, 20), states(8, hidden, 1), states(1, hidden, 21)]
    tree = TreeRows.for_new_tree(PREFIX, ancestor_mask_from_parents(PARENTS))

    def batch(trees):
        caches = [middle.new_cache() for _ in prefixes]
        middle.forward_batch(list(zip(caches, prefixes)))
        return middle.forward_batch(list(zip(caches, news)), trees=trees)

    mixed, plain = batch([None, tree, None]), batch(None)
    assert torch.equal(mixed[0], plain[0]) and torch.equal(mixed[2], plain[2])  # same packing: bit-identical
    for index in (0, 2):
        torch.testing.assert_close(mixed[index], chain(middle, prefixes[index], news[index]), atol=ATOL, rtol=0)
    for node in range(8):
        expected = chain(middle, prefixes[1], news[1][path_to(node)])[-1]
        torch.testing.assert_close(mixed[1][node], expected, atol=ATOL, rtol=0)


def test_device_style_level_by_level_extension_equals_the_one_shot_tree(tiny_checkpoint):
    submodel = InputSubmodel(tiny_checkpoint, 2)
    prompt = torch.arange(3, 3 + PREFIX)
    tokens = torch.tensor([11, 4, 9, 30, 2, 17, 8, 5])  # one token per node
    mask = ancestor_mask_from_parents(PARENTS)

    one_shot_cache = submodel.new_cache()
    submodel(prompt, one_shot_cache)
    one_shot = submodel(tokens, one_shot_cache, tree=TreeRows.for_new_tree(PREFIX, mask))

    cache = submodel.new_cache()
    submodel(prompt, cache)
    pieces, first = [], 0
    for level in LEVELS:
        end = first + len(level)
        rows = TreeRows.for_rows(PREFIX, mask[:end, :end], first)
        assert rows.prior == first and rows.n == len(level)
        pieces.append(submodel(tokens[first:end], cache, tree=rows))
        first = end
    torch.testing.assert_close(torch.cat(pieces), one_shot, atol=ATOL, rtol=0)
    # and each node's shallow state is its root-to-node path's, run as a chain
    for node in range(8):
        fresh = submodel.new_cache()
        submodel(prompt, fresh)
        expected = submodel(tokens[path_to(node)], fresh)[-1]
        torch.testing.assert_close(one_shot[node], expected, atol=ATOL, rtol=0)


def test_bad_trees_are_typed_errors(tiny_checkpoint):
    middle = MiddleSubmodel(tiny_checkpoint, 2)
    hidden = tiny_checkpoint.hidden_size
    with pytest.raises(TreeError, match="parent"):
        ancestor_mask_from_parents([-1, 1])
    with pytest.raises(TreeError, match="square"):
        TreeRows.for_new_tree(0, torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(TreeError, match="earlier rows"):
        TreeRows.for_new_tree(0, torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(TreeError, match="positions"):
        TreeRows(0, torch.ones(2, 2, dtype=torch.bool), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(TreeError, match="itself"):
        TreeRows(0, torch.zeros(1, 1, dtype=torch.bool), torch.zeros(1, dtype=torch.int64))
    cache = middle.new_cache()
    middle.forward_batch([(cache, states(3, hidden, 0))])
    tree = TreeRows.for_new_tree(2, ancestor_mask_from_parents([-1, 0]))
    with pytest.raises(TreeError, match="cache length"):
        middle.forward_batch([(cache, states(2, hidden, 1))], trees=[tree])
    with pytest.raises(TreeError, match="new rows"):
        middle.forward_batch(
            [(cache, states(3, hidden, 1))], trees=[TreeRows.for_new_tree(3, torch.eye(2, dtype=torch.bool))]
        )
    with pytest.raises(TreeError, match="sessions"):
        middle.forward_batch([(cache, states(2, hidden, 1))], trees=[None, None])
    assert cache.length == 3  # nothing was appended by the refused passes


def test_compact_checks_its_rows_and_keeps_content(tiny_checkpoint):
    middle = MiddleSubmodel(tiny_checkpoint, 2)
    cache = middle.new_cache()
    middle.forward_batch([(cache, states(10, tiny_checkpoint.hidden_size, 0))])
    keys = [cache.layer(i).keys[:, :10].clone() for i in range(len(middle.layers))]  # [Hkv, 10, D] each
    for base, rows in ((4, [3, 5]), (4, [5, 5]), (4, [6, 5]), (4, [10]), (11, []), (-1, [])):
        with pytest.raises(KVCacheError):
            cache.compact(base, rows)
    assert cache.length == 10
    cache.compact(4, [4, 5])  # already in place: a truncation
    assert cache.length == 6
    cache.compact(2, [3, 5])
    assert cache.length == 4
    for index, before in enumerate(keys):
        assert torch.equal(cache.layer(index).keys[:, :4], before[:, [0, 1, 3, 5]])
    cache.compact(4, [])
    assert cache.length == 4
    cache.free()
    with pytest.raises(KVCacheError):
        cache.compact(0, [])


@pytest.mark.parametrize("spec", [AdapterSpec("hat"), AdapterSpec("feature", mlp=True)], ids=lambda s: s.name)
def test_adapter_tree_rows_equal_the_chain(tiny_checkpoint, spec):
    adapter = DraftAdapter(tiny_checkpoint, 2, spec).randomize(seed=4)
    hidden = tiny_checkpoint.hidden_size
    prefix, nodes = states(PREFIX, hidden, 0), states(8, hidden, 1)
    prefix_side, side = states(PREFIX, hidden, 2), states(8, hidden, 3)
    with_side = spec.side_input is not None
    cache = adapter.new_cache()
    adapter(prefix, cache, prefix_side if with_side else None)
    tree = TreeRows.for_new_tree(PREFIX, ancestor_mask_from_parents(PARENTS))
    drafted = adapter(nodes, cache, side if with_side else None, tree=tree)  # [8, H]
    for node in range(8):
        path = path_to(node)
        fresh = adapter.new_cache()
        adapter(prefix, fresh, prefix_side if with_side else None)
        expected = adapter(nodes[path], fresh, side[path] if with_side else None)[-1]
        torch.testing.assert_close(drafted[node], expected, atol=ATOL, rtol=0)


def test_draft_vocab_round_trips_and_bad_ones_are_typed_errors(tiny_checkpoint, tmp_path):
    adapter = DraftAdapter(tiny_checkpoint, 2).randomize(seed=1)
    assert adapter.draft_vocab is None
    adapter.set_draft_vocab([7, 3, 100, 0])
    assert "draft_vocab" not in adapter.state_dict()
    path = tmp_path / "a.safetensors"
    adapter.save(path)
    loaded = DraftAdapter.load(path, tiny_checkpoint, 2)
    assert loaded.draft_vocab is not None and loaded.draft_vocab.tolist() == [7, 3, 100, 0]
    assert loaded.draft_vocab.dtype == torch.int64
    adapter.set_draft_vocab(None)
    adapter.save(path)
    assert DraftAdapter.load(path, tiny_checkpoint, 2).draft_vocab is None
    for bad in (
        [1, 1],
        [tiny_checkpoint.vocab_size],
        [-1],
        [],
        torch.tensor([0.5]),
        torch.ones(2, 2, dtype=torch.int64),
    ):
        with pytest.raises(AdapterError):
            adapter.set_draft_vocab(bad)
    tensors = load_file(str(path))
    tensors["draft_vocab"] = torch.tensor([5, 5], dtype=torch.int64)
    save_file(tensors, str(path), metadata={"split_layers": "2", "variant": "hat", "mlp": "false"})
    with pytest.raises(AdapterError, match="unique"):
        DraftAdapter.load(path, tiny_checkpoint, 2)


def test_draft_logits_are_the_head_on_the_subset_and_minus_inf_elsewhere(tiny_checkpoint):
    adapter = DraftAdapter(tiny_checkpoint, 2)
    model = DeviceModel.from_checkpoint(tiny_checkpoint, 2, adapter)
    hidden = states(3, tiny_checkpoint.hidden_size, 5)
    full = model.output(hidden)  # [3, V]
    assert torch.equal(model.draft_logits(hidden), full)
    vocab = torch.tensor([9, 0, 57, 210, 33])
    adapter.set_draft_vocab(vocab)
    logits = model.draft_logits(hidden)  # [3, V]
    assert logits.shape == full.shape and logits.dtype == torch.float32
    torch.testing.assert_close(logits[:, vocab], full[:, vocab], atol=ATOL, rtol=0)
    outside = torch.ones(full.shape[1], dtype=torch.bool)
    outside[vocab] = False
    assert torch.isneginf(logits[:, outside]).all()
    assert (torch.softmax(logits, -1)[:, outside] == 0).all()
    assert set(logits.argmax(-1).tolist()) <= set(vocab.tolist())
    head = model._draft_head
    model.draft_logits(hidden)
    assert model._draft_head is head  # gathered once, not per call
    adapter.set_draft_vocab([1, 2])
    assert torch.isneginf(model.draft_logits(hidden)[:, 0]).all()  # a new vocabulary: a new head
    assert DeviceModel.from_checkpoint(tiny_checkpoint, 2, None).draft_logits(hidden).equal(full)


def test_a_float_head_on_the_q8_grid_drafts_through_the_int8_kernel_and_any_other_stays_float():
    torch.manual_seed(3)
    rows = torch.randn(40, 64)  # [N, H]
    on_grid = dequantize(*quantize_q8(rows))  # a GGUF model's head: Q8_0 blocks, dequantized
    codes, scales = q8_blocks_if_exact(on_grid)
    assert codes.dtype == torch.int8 and scales is not None
    assert torch.equal(dequantize(codes, scales), on_grid)  # the same weights, a quarter of the bytes
    kept, none = q8_blocks_if_exact(rows)  # off the grid: quantizing would change the draft head
    assert kept is rows and none is None


@pytest.mark.skipif(not native_module(), reason="the int8 kernel is the C++ extension's (make native)")
def test_draft_logits_of_a_q8_head_match_the_float_head(tiny_checkpoint):
    checkpoint = copy.deepcopy(tiny_checkpoint)  # its head is rewritten below; the fixture is shared
    adapter = DraftAdapter(checkpoint, 2)
    model = DeviceModel.from_checkpoint(checkpoint, 2, adapter)
    with torch.no_grad():
        head = model.output.lm_head.weight
        head.copy_(dequantize(*quantize_q8(head.float())).to(head.dtype))
    vocab = torch.tensor([9, 0, 57, 210, 33])
    adapter.set_draft_vocab(vocab)
    hidden = states(3, checkpoint.hidden_size, 5)
    logits = model.draft_logits(hidden)  # [3, V]
    assert model._draft_head is not None and model._draft_head[2].dtype == torch.int8
    full = model.output(hidden)  # [3, V]
    torch.testing.assert_close(logits[:, vocab], full[:, vocab], atol=1e-3, rtol=1e-4)  # int16 activation rows
