"""A session's new rows as tree nodes (SpecInfer/EAGLE-2 tree attention).

Its new rows sit at positions base + depth, each attending to the committed rows < base and to
its own ancestors among the tree rows. Sessions without one keep the plain causal path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shared.model.kv_cache import SessionKV


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
