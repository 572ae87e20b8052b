"""How a verification's rows sit in the cloud's KV when they are a draft tree, and the one rollback both
clouds (the in-process `LocalCloud` and the verifier's model runner) do before running them.

A chain round: roll the KV back to commit_len, append the rows causally. A tree round: first move the
rows the device kept of the previous tree (its accepted path) down to the positions they now hold, then
roll back, then append the new rows as tree nodes (each sees the committed KV and its own ancestors, at
position commit_len + depth).
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.model.kv_cache import SessionKV
from shared.model.tree_rows import TreeRows, ancestor_mask_from_parents
from shared.specdec.tree import TreeError, validate_parents


@dataclass(frozen=True)
class VerifyLayout:
    """`parents[i - 1]`: the parent row of row i (row 0 is the pending token, the root); None: a chain.
    `kept`: the previous tree's accepted rows (absolute cache rows, increasing), which move to positions
    commit_len - len(kept) .. commit_len - 1 before the rollback; None: nothing to move."""

    parents: tuple[int, ...] | None = None
    kept: tuple[int, ...] | None = None

    @property
    def is_chain(self) -> bool:
        return self.parents is None and self.kept is None

    def without_kept(self) -> VerifyLayout:
        """The same rows on a cache that already holds the kept path in place (a replayed session)."""
        return VerifyLayout(self.parents, None)


async def verify_on(cloud, session_id: int, commit_len: int, shallow, layout: VerifyLayout | None):
    """`cloud.verify`, with the layout only when there is one: a wrapper forwards a tree without asking
    every cloud it may wrap (test doubles among them) to take the fourth argument."""
    if layout is None:
        return await cloud.verify(session_id, commit_len, shallow)
    return await cloud.verify(session_id, commit_len, shallow, layout)


def layout_refusal(layout: VerifyLayout | None, commit_len: int, num_rows: int, cache_length: int) -> str | None:
    """Why `layout` cannot apply to a cache of `cache_length` rows (None: it can)."""
    if layout is None:
        return None
    if layout.parents is not None:
        if len(layout.parents) != num_rows - 1:
            return f"a tree of {num_rows} rows needs {num_rows - 1} parents, got {len(layout.parents)}"
        try:
            validate_parents((-1, *layout.parents), num_rows)
        except TreeError as exc:
            return str(exc)
    if layout.kept:
        base = commit_len - len(layout.kept)
        kept = layout.kept
        if base < 0 or kept[0] < base or kept[-1] >= cache_length or any(b <= a for a, b in zip(kept, kept[1:])):
            return f"kept rows {list(kept[:8])} do not fit commit_len {commit_len} and {cache_length} cached rows"
    return None


def roll_back(cache: SessionKV, commit_len: int, layout: VerifyLayout | None) -> None:
    """Keep the previous tree's accepted path (if any), then drop everything after commit_len."""
    if layout is not None and layout.kept:
        cache.compact(commit_len - len(layout.kept), layout.kept)
    cache.truncate(commit_len)


def tree_rows(commit_len: int, layout: VerifyLayout | None) -> TreeRows | None:
    """The new rows as tree nodes after commit_len (None: a chain, the plain causal path)."""
    if layout is None or layout.parents is None:
        return None
    return TreeRows.for_new_tree(commit_len, ancestor_mask_from_parents((-1, *layout.parents)))
