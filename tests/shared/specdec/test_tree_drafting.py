"""GrownTree's region rows: each pass's tree attention and positions, made incrementally a level at a time, are
what TreeRows.for_rows makes from the whole region's parents (the mask a tree region must have)."""

from __future__ import annotations

import random

import pytest
import torch

from shared.model.tree_rows import TreeRows, ancestor_mask_from_parents
from shared.specdec.tree_drafting import GrownTree


def grow(seed: int, base: int) -> tuple[GrownTree, list[TreeRows], list[int]]:
    """A random tree grown level by level; each level's placed rows, and every region row's parent row."""
    rng = random.Random(seed)
    tree = GrownTree.rooted(7, 64, torch.zeros(1, 4), torch.zeros(1, 4))
    frontier, placed, region_parents = [0], [], [-1]
    for _ in range(rng.randint(1, 5)):
        children = [node for node in frontier for _ in range(rng.randint(1, 3))]  # 1-3 children each
        created = [tree.add(rng.randrange(100), node, -0.1, -0.1) for node in children]
        frontier = rng.sample(created, rng.randint(1, len(created)))
        frontier.sort()  # creation order, as draft_tree runs a level
        region_parents += [tree.row_of(tree.parents[node]) for node in frontier]
        placed.append(tree.place(frontier, base))
    return tree, placed, region_parents


@pytest.mark.parametrize("seed", range(20))
def test_each_level_sees_its_ancestors_at_base_plus_depth_as_the_whole_regions_mask_says(seed):
    base = 11 + seed
    tree, placed, region_parents = grow(seed, base)
    mask = ancestor_mask_from_parents(region_parents)  # [R, R]
    first = 1
    for rows in placed:
        want = TreeRows.for_rows(base, mask[: first + rows.n, : first + rows.n], first)
        assert torch.equal(rows.visible, want.visible)
        assert torch.equal(rows.positions, want.positions)
        assert rows.prior == first  # the rows already in the cache before this pass
        first += rows.n
    assert tree.runs == len(region_parents)


def test_a_node_whose_parent_never_ran_cannot_be_placed():
    tree = GrownTree.rooted(7, 8, torch.zeros(1, 4), torch.zeros(1, 4))
    child = tree.add(3, 0, -0.1, -0.1)
    grandchild = tree.add(4, child, -0.1, -0.2)
    with pytest.raises(ValueError, match="has not been run"):
        tree.place([grandchild], 5)
