"""Draft-tree speculation (EAGLE-2, SpecInfer, Sequoia) as pure functions: the tree's shape, which
nodes to keep, and the rule that verifies a whole tree in one target pass.

A tree is a parents array: node 0 is the root, the pending token (final, not yet run through the
model); nodes 1..N-1 are draft tokens; `parents[0] == -1` and `0 <= parents[i] < i`, so the array
is topologically ordered and has no cycle. `tokens[i]` is node i's token. Row i of the target's
logits / probabilities [N, V] is the target's distribution for the token after node i (for node
i's children); row i of the draft probabilities [N, V] is the q that node i's children were drawn
from.

Sampled verification is the multi-candidate recursive rejection rule (SpecInfer, Sequoia). At a
node with target p and children c_1..c_k drawn in that order without replacement from q, start
with r = p, s = q; for each c_j accept with probability min(1, r(c_j) / s(c_j)), else set
r = norm(max(0, r - s)) and s = norm(s with c_j zeroed). If every child is rejected the next token
is drawn from r; past the last accepted node (a leaf) from that node's p. Each step is the one-draft
rule with target r and draft s, whose output is r whatever s is; and since the residual after a
rejection does not depend on which token was rejected, the chain's output is p, exactly.

That holds only when each node's children are exactly its first k draws without replacement from
its q, in index order (draw_children gives that), with k not chosen by looking at those draws.
Pruning by draft score (select_nodes) keeps greedy verification exact but not sampled verification
(a kept child is then not a draw from q), unless the scores keep a prefix of every node's children
in draw order, as scores that fall with creation order do.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shared.specdec.sampling import residual_distribution


class TreeError(ValueError):
    """A malformed draft tree (the message says what is wrong)."""


@dataclass(frozen=True)
class TreeVerdict:
    path: list[int]  # accepted nodes, depth 1 first (empty: the root's children were all rejected)
    next_token: int  # the correction (after a rejection) or bonus (past a leaf) token

    @property
    def num_accepted(self) -> int:
        return len(self.path)

    def emitted(self, tokens: Sequence[int]) -> list[int]:
        """The tokens this verdict appends to the sequence: the accepted drafts, then next_token."""
        return [tokens[node] for node in self.path] + [self.next_token]


def validate_parents(parents: Sequence[int], max_nodes: int) -> None:
    """Raise TreeError unless `parents` is a tree of at most max_nodes nodes in topological order."""
    n = len(parents)
    if n == 0:
        raise TreeError("a draft tree needs at least its root (node 0); got no nodes")
    if n > max_nodes:
        raise TreeError(f"the draft tree has {n} nodes, more than the limit of {max_nodes}")
    for i, parent in enumerate(parents):
        # bool is an int subclass, but True as a parent index is a caller's mistake
        if not isinstance(parent, int) or isinstance(parent, bool):
            raise TreeError(f"parents[{i}] must be an int, got {type(parent).__name__} {parent!r}")
    if parents[0] != -1:
        raise TreeError(f"parents[0] must be -1 (node 0 is the root), got {parents[0]}")
    for i in range(1, n):
        parent = parents[i]
        if not 0 <= parent < n:
            raise TreeError(f"parents[{i}] = {parent} is not a node index (0..{n - 1})")
        if parent >= i:
            raise TreeError(
                f"parents[{i}] = {parent}: a parent must come before its child (parents[i] < i); "
                "this is a self-loop, a cycle, or nodes out of topological order"
            )


def depths(parents: Sequence[int]) -> list[int]:
    """Each node's depth; the root's is 0."""
    out = [0] * len(parents)
    for i in range(1, len(parents)):
        out[i] = out[parents[i]] + 1  # the parent comes first, so its depth is already known
    return out


def path_to(parents: Sequence[int], node: int) -> list[int]:
    """The nodes from depth 1 down to `node` (the root left out: it is already final)."""
    if not 0 <= node < len(parents):
        raise TreeError(f"node {node} is not in a tree of {len(parents)} nodes")
    path = []
    while node > 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def children(parents: Sequence[int]) -> list[list[int]]:
    """Each node's children, in increasing index (for a sampled tree: the order they were drawn)."""
    out: list[list[int]] = [[] for _ in parents]
    for i in range(1, len(parents)):
        out[parents[i]].append(i)
    return out


def select_nodes(parents: Sequence[int], scores: Sequence[float] | torch.Tensor, budget: int) -> list[int]:
    """The root plus the `budget` best non-root nodes by score (EAGLE-2's reranking), ancestor-closed,
    in increasing original index (so the kept sub-tree is still topologically ordered).

    A score is a node's cumulative draft log-probability; it never grows from parent to child, so the
    top `budget` nodes are ancestor-closed already. Growing the kept set best-first from the root
    makes that hold for any scores, and ties go to the shallower, then earlier, node.
    """
    values = scores.tolist() if isinstance(scores, torch.Tensor) else list(scores)
    if len(values) != len(parents):
        raise TreeError(f"{len(values)} scores for a tree of {len(parents)} nodes")
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    if any(math.isnan(value) for value in values[1:]):
        raise ValueError("a node's score is NaN")
    kids, depth = children(parents), depths(parents)
    kept = [0]
    frontier = [(-values[child], depth[child], child) for child in kids[0]]
    heapq.heapify(frontier)
    while frontier and len(kept) <= budget:
        _, _, node = heapq.heappop(frontier)
        kept.append(node)
        for child in kids[node]:
            heapq.heappush(frontier, (-values[child], depth[child], child))
    return sorted(kept)


def reindex(parents: Sequence[int], kept: Sequence[int]) -> list[int]:
    """The parents array of the sub-tree of `kept` nodes (the root first, increasing, ancestor-closed),
    in the new indices 0..len(kept)-1. Tokens and rows follow with `tokens[kept]`, `rows[kept]`."""
    if not kept or kept[0] != 0:
        raise TreeError(f"the kept nodes must start with the root 0, got {list(kept)[:4]}")
    new_index: dict[int, int] = {}
    out = []
    for position, node in enumerate(kept):
        if not 0 <= node < len(parents):
            raise TreeError(f"kept node {node} is not in a tree of {len(parents)} nodes")
        if position > 0 and node <= kept[position - 1]:
            raise TreeError(f"the kept nodes must be strictly increasing, got {kept[position - 1]} then {node}")
        if position > 0 and parents[node] not in new_index:
            raise TreeError(f"node {node} is kept but its parent {parents[node]} is not")
        out.append(new_index[parents[node]] if position > 0 else -1)
        new_index[node] = position
    return out


def draw_children(q: torch.Tensor, k: int, generator: torch.Generator | None) -> list[int]:
    """k distinct tokens drawn one after another without replacement from q, in draw order (fewer
    when q has fewer than k tokens of nonzero probability)."""
    # q: [V]
    k = max(0, min(k, int((q > 0).sum())))
    # An exponential race: token t arrives at time E_t / q(t) with E_t ~ Exp(1); the first to arrive is
    # a draw from q, the next a draw from q without it, and so on. Largest q / E first = earliest first.
    arrival = torch.empty_like(q, dtype=torch.float64).exponential_(generator=generator)
    return (q.double() / arrival).topk(k).indices.tolist()


def acceptance_chance(residual: torch.Tensor, draft: torch.Tensor, token: int) -> float:
    """min(1, r(token) / s(token)): the chance a child carrying `token` is accepted under (r, s)."""
    # residual, draft: [V]
    r, s = float(residual[token]), float(draft[token])
    # s == 0: a token the draft could not have drawn; rejecting it keeps the output exact
    return min(1.0, r / s) if s > 0 else 0.0


def after_rejection(
    residual: torch.Tensor, draft: torch.Tensor, token: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(r, s) once a child carrying `token` is rejected: r = norm(max(0, r - s)), s = norm(s without
    token); s is None when no token is left to draw (the next sibling could not exist)."""
    # residual, draft: [V]
    # Rejection only happens where r < s, so the new r puts no mass on the rejected token, and it does
    # not depend on which token that was: what keeps the chain's output exactly r. With no mass left
    # (r == s up to rounding) rejection could not have happened; residual_distribution then keeps r.
    residual = residual_distribution(residual, draft)
    draft = draft.clone()
    draft[token] = 0
    mass = float(draft.sum())
    return residual, (draft / mass if mass > 0 else None)


def sibling_rule(p: torch.Tensor, q: torch.Tensor, child_tokens: Sequence[int]) -> tuple[list[float], torch.Tensor]:
    """The rule at one node whose children carry `child_tokens` (drawn in that order without
    replacement from q): the chance child j is accepted once children 1..j-1 were rejected, and the
    distribution the next token is drawn from when all of them are. Fewer chances than children when q
    runs out of tokens: the rest could not have been drawn."""
    # p, q: [V]
    residual = p
    draft: torch.Tensor | None = q
    chances: list[float] = []
    for token in child_tokens:
        if draft is None:
            break
        chances.append(acceptance_chance(residual, draft, token))
        residual, draft = after_rejection(residual, draft, token)
    return chances, residual


def draw_with(probs: torch.Tensor, uniform: float) -> int:
    """The token whose interval of the cumulative distribution holds uniform * total (inverse CDF)."""
    # probs: [V]
    cdf = probs.double().cumsum(-1)  # [V]
    # right=True: a token of probability 0 has an empty interval and is never the answer
    index = int(torch.searchsorted(cdf, uniform * cdf[-1:], right=True))
    # uniform * total can round up to total: that draw belongs to the last token with mass
    return index if index < len(cdf) else int(probs.nonzero()[-1])


def _check(tokens: Sequence[int], parents: Sequence[int], *rows: torch.Tensor) -> list[list[int]]:
    validate_parents(parents, len(parents))
    if len(tokens) != len(parents):
        raise TreeError(f"{len(tokens)} tokens for a tree of {len(parents)} nodes")
    for table in rows:
        if table.dim() != 2 or table.shape[0] != len(parents):
            raise TreeError(f"expected one row per node, [{len(parents)}, V]; got {list(table.shape)}")
    return children(parents)


def accept_tree_greedy(tokens: Sequence[int], parents: Sequence[int], target_logits: torch.Tensor) -> TreeVerdict:
    """From the root, follow the child carrying the target's argmax; stop where none does. The next
    token is the argmax at the last accepted node: a correction, or a bonus past a leaf."""
    # target_logits: [N, V]
    kids = _check(tokens, parents, target_logits)
    target_tokens = target_logits.argmax(-1).tolist()
    path: list[int] = []
    node = 0
    while True:
        wanted = target_tokens[node]
        match = next((child for child in kids[node] if tokens[child] == wanted), None)
        if match is None:
            return TreeVerdict(path, wanted)
        path.append(match)
        node = match


def accept_tree_sampled(
    tokens: Sequence[int],
    parents: Sequence[int],
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> TreeVerdict:
    """Sampled verification of a whole tree whose emitted tokens follow the target exactly, provided
    each node's children are its first draws without replacement from its draft row, in index order.

    All randomness is one draw of N + 1 uniforms, so a seeded generator gives the same verdict:
    uniform c tests child c, the last one draws the next token.
    """
    # draft_probs: [N, V] (q per node); target_probs: [N, V] (p per node)
    kids = _check(tokens, parents, draft_probs, target_probs)
    device = generator.device if generator is not None else None
    uniforms = torch.rand(len(parents) + 1, generator=generator, device=device).tolist()  # [N + 1]
    path: list[int] = []
    node = 0
    while True:
        # sibling_rule, step by step: past the accepted child nothing more is computed
        residual = target_probs[node]
        draft: torch.Tensor | None = draft_probs[node]
        match = None
        for child in kids[node]:
            if draft is None:
                break
            # uniforms lie in [0, 1): a chance of 1 always accepts, a chance of 0 never does
            if uniforms[child] < acceptance_chance(residual, draft, tokens[child]):
                match = child
                break
            residual, draft = after_rejection(residual, draft, tokens[child])
        if match is None:
            # at a leaf (no children) residual is still target_probs[node]
            return TreeVerdict(path, draw_with(residual, uniforms[-1]))
        path.append(match)
        node = match
