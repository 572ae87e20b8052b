"""Draft trees: validation, shape helpers, EAGLE-2 node selection, and greedy tree verification
(sampled verification is in test_tree_sampling.py)."""

from __future__ import annotations

import random

import pytest
import torch

from shared.model.tree_rows import ancestor_mask_from_parents as ancestor_mask
from shared.specdec.sampling import accept_greedy
from shared.specdec.tree import (
    TreeError,
    TreeVerdict,
    accept_tree_greedy,
    children,
    depths,
    path_to,
    reindex,
    select_nodes,
    validate_parents,
)

#        0
#      / | \
#     1  2  3
#    / \    |
#   4   5   6
#   |
#   7
HAND_TREE = [-1, 0, 0, 0, 1, 1, 3, 4]


def random_parents(rng: random.Random, n: int) -> list[int]:
    return [-1] + [rng.randrange(i) for i in range(1, n)]


# --- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "parents",
    [[-1], [-1, 0], [-1, 0, 0, 1, 2, 2], HAND_TREE, [-1, 0, 1, 2, 3, 4, 5, 6, 7]],
)
def test_good_trees_pass(parents):
    validate_parents(parents, max_nodes=len(parents))


@pytest.mark.parametrize(
    ("parents", "max_nodes", "message"),
    [
        ([], 8, "at least its root"),
        ([0, 0], 8, "parents[0] must be -1"),
        ([3, 0], 8, "parents[0] must be -1"),
        ([-1, 0, 5], 8, "parents[2] = 5 is not a node index"),
        ([-1, 0, -1], 8, "parents[2] = -1 is not a node index"),
        ([-1, 0, -2], 8, "parents[2] = -2 is not a node index"),
        ([-1, 1], 8, "parents[1] = 1: a parent must come before its child"),  # self-loop
        ([-1, 2, 1], 8, "parents[1] = 2: a parent must come before its child"),  # cycle 1 <-> 2
        ([-1, 0, 3, 0], 8, "parents[2] = 3: a parent must come before its child"),  # out of order
        ([-1, 0, 0, 0], 3, "4 nodes, more than the limit of 3"),
        ([-1, 0, 1.0], 8, "parents[2] must be an int, got float"),
        ([-1, True], 8, "parents[1] must be an int, got bool"),
        ([-1, "0"], 8, "parents[1] must be an int, got str"),
        ([None, 0], 8, "parents[0] must be an int, got NoneType"),
    ],
)
def test_bad_trees_raise_a_tree_error_saying_what_is_wrong(parents, max_nodes, message):
    with pytest.raises(TreeError, match=message.replace("[", r"\[").replace("]", r"\]")):
        validate_parents(parents, max_nodes)


def test_tree_error_is_a_value_error():
    assert issubclass(TreeError, ValueError)


# --- shape helpers ------------------------------------------------------------------------------


def test_depths_children_and_paths_of_a_hand_built_tree():
    assert depths(HAND_TREE) == [0, 1, 1, 1, 2, 2, 2, 3]
    assert children(HAND_TREE) == [[1, 2, 3], [4, 5], [], [6], [7], [], [], []]
    assert path_to(HAND_TREE, 0) == []
    assert path_to(HAND_TREE, 2) == [2]
    assert path_to(HAND_TREE, 6) == [3, 6]
    assert path_to(HAND_TREE, 7) == [1, 4, 7]
    with pytest.raises(TreeError, match="node 8 is not in a tree of 8 nodes"):
        path_to(HAND_TREE, 8)


def test_ancestor_mask_of_a_hand_built_tree():
    expected = torch.zeros(8, 8, dtype=torch.bool)
    for row, seen in enumerate([[0], [0, 1], [0, 2], [0, 3], [0, 1, 4], [0, 1, 5], [0, 3, 6], [0, 1, 4, 7]]):
        expected[row, seen] = True
    mask = ancestor_mask(HAND_TREE)
    assert mask.dtype == torch.bool and mask.shape == (8, 8)
    assert torch.equal(mask, expected)


def test_ancestor_mask_of_a_chain_is_causal():
    assert torch.equal(ancestor_mask([-1, 0, 1, 2, 3]), torch.ones(5, 5, dtype=torch.bool).tril())


@pytest.mark.parametrize("seed", range(10))
def test_ancestor_mask_agrees_with_path_to_and_depths(seed):
    parents = random_parents(random.Random(seed), 20)
    mask = ancestor_mask(parents)
    for node in range(20):
        assert mask[node].nonzero().flatten().tolist() == sorted([0, *path_to(parents, node)])
        assert len(path_to(parents, node)) == depths(parents)[node]


# --- node selection -----------------------------------------------------------------------------


def is_ancestor_closed(parents: list[int], kept: list[int]) -> bool:
    return all(parents[node] in kept for node in kept if node > 0)


def monotone_scores(rng: random.Random, parents: list[int]) -> list[float]:
    """Cumulative draft log-probabilities: a child's score is its parent's plus a log-prob <= 0."""
    scores = [0.0] * len(parents)
    for i in range(1, len(parents)):
        # a few exact ties (log-prob 0, or equal values) so the tie-breaking matters
        scores[i] = scores[parents[i]] + rng.choice([0.0, -0.5, -1.0, -rng.random() * 3])
    return scores


@pytest.mark.parametrize("seed", range(20))
def test_select_nodes_keeps_the_best_budget_nodes_ancestor_closed_and_in_order(seed):
    rng = random.Random(seed)
    parents = random_parents(rng, 30)
    scores = monotone_scores(rng, parents)
    depth = depths(parents)
    for budget in (0, 1, 5, 12, 29, 40):
        kept = select_nodes(parents, scores, budget)
        assert kept[0] == 0 and kept == sorted(set(kept))
        assert len(kept) == min(budget, 29) + 1
        assert is_ancestor_closed(parents, kept)
        # with monotone scores this is exactly the top `budget` by (score desc, depth, index)
        best = sorted(range(1, 30), key=lambda i: (-scores[i], depth[i], i))[:budget]
        assert kept == sorted([0, *best])
        validate_parents(reindex(parents, kept), max_nodes=len(kept))


@pytest.mark.parametrize("seed", range(10))
def test_select_nodes_stays_ancestor_closed_for_scores_that_grow_down_the_tree(seed):
    rng = random.Random(seed)
    parents = random_parents(rng, 25)
    scores = torch.rand(25, generator=torch.Generator().manual_seed(seed))  # any order at all
    kept = select_nodes(parents, scores, 10)
    assert len(kept) == 11 and kept == sorted(kept) and is_ancestor_closed(parents, kept)


def test_select_nodes_prefers_the_shallower_then_earlier_node_on_a_tie():
    # nodes 1 and 2 tie, node 3 (child of 1) ties them too: shallower first, then earlier
    assert select_nodes([-1, 0, 0, 1], [0.0, -1.0, -1.0, -1.0], 1) == [0, 1]
    assert select_nodes([-1, 0, 0, 1], [0.0, -1.0, -1.0, -1.0], 2) == [0, 1, 2]


def test_select_nodes_rejects_bad_arguments():
    with pytest.raises(TreeError, match="2 scores for a tree of 3 nodes"):
        select_nodes([-1, 0, 0], [0.0, -1.0], 1)
    with pytest.raises(ValueError, match="budget must be >= 0"):
        select_nodes([-1, 0], [0.0, -1.0], -1)
    with pytest.raises(ValueError, match="NaN"):
        select_nodes([-1, 0], [0.0, float("nan")], 1)


def test_reindex_maps_parents_into_the_kept_sub_tree():
    assert reindex(HAND_TREE, [0, 1, 3, 4, 6, 7]) == [-1, 0, 0, 1, 2, 3]
    assert reindex(HAND_TREE, [0]) == [-1]
    assert reindex(HAND_TREE, list(range(8))) == HAND_TREE


@pytest.mark.parametrize(
    ("kept", "message"),
    [
        ([], "must start with the root"),
        ([1, 4], "must start with the root"),
        ([0, 3, 1], "strictly increasing"),
        ([0, 1, 1], "strictly increasing"),
        ([0, 4], "node 4 is kept but its parent 1 is not"),
        ([0, 9], "kept node 9 is not in a tree of 8 nodes"),
    ],
)
def test_reindex_rejects_a_kept_set_that_is_not_a_sub_tree(kept, message):
    with pytest.raises(TreeError, match=message):
        reindex(HAND_TREE, kept)


# --- greedy verification ------------------------------------------------------------------------


def chain(k: int) -> list[int]:
    return [-1] + list(range(k))


@pytest.mark.parametrize("seed", range(50))
def test_greedy_on_a_chain_is_accept_greedy(seed):
    generator = torch.Generator().manual_seed(seed)
    k = seed % 6
    logits = torch.randn(k + 1, 7, generator=generator)  # [k+1, V]
    # drafts agree with the target's argmax for a random prefix, then are random
    agree = int(torch.randint(0, k + 1, (1,), generator=generator))
    drafts = logits.argmax(-1)[:k].tolist()
    drafts[agree:] = torch.randint(0, 7, (k - agree,), generator=generator).tolist()
    expected = accept_greedy(drafts, logits)
    verdict = accept_tree_greedy([3, *drafts], chain(k), logits)
    assert verdict.path == list(range(1, expected.num_accepted + 1))
    assert verdict.next_token == expected.next_token


def one_hot_logits(wanted: list[int], vocab: int = 10) -> torch.Tensor:
    """Target logits [N, V] whose argmax at row i is wanted[i]."""
    logits = torch.zeros(len(wanted), vocab)
    logits[torch.arange(len(wanted)), torch.tensor(wanted)] = 5.0
    return logits


def test_greedy_follows_the_second_then_third_child():
    #            0 (pending 9)
    #        /   |   \
    #       1:4  2:5  3:6         target wants 5 -> node 2 (second child)
    #          / | \
    #      4:1  5:2  6:3          target wants 3 -> node 6 (third child)
    #      |         |  \
    #     7:0      8:7  9:8       target wants 8 -> node 9 (second child), a leaf: bonus 2
    parents = [-1, 0, 0, 0, 2, 2, 2, 4, 6, 6]
    tokens = [9, 4, 5, 6, 1, 2, 3, 0, 7, 8]
    wanted = [5, 0, 3, 0, 0, 0, 8, 0, 0, 2]
    assert accept_tree_greedy(tokens, parents, one_hot_logits(wanted)) == TreeVerdict([2, 6, 9], 2)
    # the target wants a token no child of node 6 carries: a correction at depth 3
    wanted[6] = 1
    assert accept_tree_greedy(tokens, parents, one_hot_logits(wanted)) == TreeVerdict([2, 6], 1)
    # nothing at depth 1 matches: a correction straight from the root
    wanted[0] = 7
    verdict = accept_tree_greedy(tokens, parents, one_hot_logits(wanted))
    assert verdict == TreeVerdict([], 7) and verdict.emitted(tokens) == [7] and verdict.num_accepted == 0


def test_greedy_emits_the_path_tokens_then_the_next_token():
    verdict = accept_tree_greedy([9, 4, 5, 1], [-1, 0, 0, 2], one_hot_logits([5, 0, 1, 6]))
    assert verdict == TreeVerdict([2, 3], 6)
    assert verdict.emitted([9, 4, 5, 1]) == [5, 1, 6]


def test_greedy_on_a_pruned_tree_follows_the_same_path_when_it_is_kept():
    parents = [-1, 0, 0, 0, 2, 2, 2, 4, 6, 6]
    tokens = [9, 4, 5, 6, 1, 2, 3, 0, 7, 8]
    logits = one_hot_logits([5, 0, 3, 0, 0, 0, 8, 0, 0, 2])
    kept = [0, 2, 3, 6, 9]
    verdict = accept_tree_greedy([tokens[i] for i in kept], reindex(parents, kept), logits[kept])
    assert [kept[i] for i in verdict.path] == [2, 6, 9] and verdict.next_token == 2


def test_verification_rejects_inputs_that_do_not_match_the_tree():
    with pytest.raises(TreeError, match="3 tokens for a tree of 2 nodes"):
        accept_tree_greedy([1, 2, 3], [-1, 0], torch.zeros(2, 5))
    with pytest.raises(TreeError, match=r"one row per node, \[2, V\]; got \[3, 5\]"):
        accept_tree_greedy([1, 2], [-1, 0], torch.zeros(3, 5))
    with pytest.raises(TreeError, match="parents\\[0\\] must be -1"):
        accept_tree_greedy([1, 2], [0, 0], torch.zeros(2, 5))
