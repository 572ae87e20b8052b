"""Draft trees on the device (EAGLE-2's dynamic tree, in HAT's split): grow level by level, keep the best
nodes, send them in one verify frame, and keep only the accepted path afterwards.

Growing: the root is the pending token. Each level expands the frontier (the `tree_width` best nodes
of the last level) into `tree_width` children each, and runs the next frontier through the input
layers and the adapter in one pass with tree attention (each row sees the committed KV and its own
ancestors, at position commit_len + depth). After at most the draft budget's depth, the
`tree_nodes` best nodes by cumulative draft log-probability are kept (shared/specdec/tree.py's
`select_nodes`), the few kept leaves not yet run are run, and the frame holds the kept nodes' shallow
rows in their creation order (a topological order) with their parents.

Greedy trees take each node's top-k children and rank them by draft confidence. Sampled trees must
keep the target's distribution exactly, which holds when every node's children are its first draws
without replacement from q and the tree's shape does not depend on which tokens were drawn: so a
sampled tree expands the first-created nodes and keeps the first `tree_nodes` created, a shape fixed
before any draw (`accept_tree_sampled` then verifies it; chi-square tests in tests/shared/specdec/test_tree_session.py).

`TreeDrafting` is a mixin of `DeviceSession`, like `Drafting`: it reads and advances the session's state.
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass, field

import torch

from shared.model.tree_rows import TreeRows
from shared.specdec.draft import Draft
from shared.specdec.drafting import Drafting
from shared.specdec.sampling import logits_to_probs
from shared.specdec.tree import draw_children, reindex, select_nodes
from shared.specdec.verify_layout import VerifyLayout


@dataclass
class GrownTree:
    """Every node grown this round (node 0: the pending token), before the best are kept.

    The nodes that ran sit in the device caches' tree region in run order (their region rows). Each region row
    keeps what it sees as bits of a Python int (itself and its ancestors) and its depth, so a pass's tree attention
    and positions are two small tensors made in one go; its shallow and adapter states go to buffers sized for the
    round's most rows, written a pass at a time and read with one index."""

    tokens: list[int]
    parents: list[int]
    scores: list[float]  # cumulative draft log-probability (greedy) or minus the creation index (sampled)
    log_q: list[float]  # cumulative draft log-probability, both ways: when growing stops
    region_row: list[int | None]  # the node's row in the device caches after commit_len (None: not run)
    shallow: torch.Tensor  # [R, H]: each region row's shallow state
    hidden: torch.Tensor  # [R, H]: each region row's adapter state (rows of leaves never run through it: unset)
    seen: list[int] = field(default_factory=lambda: [1])  # per region row: bit j set = it sees region row j
    depth: list[int] = field(default_factory=lambda: [0])  # per region row (the root's: 0)
    q: dict[int, torch.Tensor] = field(default_factory=dict)  # node -> [V]: what its children were drawn from

    @classmethod
    def rooted(cls, token: int, rows: int, shallow: torch.Tensor, hidden: torch.Tensor) -> "GrownTree":
        """A tree of its root alone (its shallow and adapter states [1, H]), with room for `rows` region rows."""
        buffers = (shallow.new_empty(rows, shallow.shape[-1]), hidden.new_empty(rows, hidden.shape[-1]))
        tree = cls([token], [-1], [0.0], [0.0], [0], *buffers)
        tree.shallow[0], tree.hidden[0] = shallow[0], hidden[0]
        return tree

    @property
    def runs(self) -> int:
        """Region rows filled so far."""
        return len(self.seen)

    def row_of(self, node: int) -> int:
        row = self.region_row[node]
        if row is None:
            raise ValueError(f"tree node {node} has not been run")  # a parent always runs before its children
        return row

    def rows_of(self, nodes: list[int]) -> list[int]:
        return [self.row_of(node) for node in nodes]

    def add(self, token: int, parent: int, log_q: float, score: float) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.log_q.append(self.log_q[parent] + log_q)
        self.scores.append(score)
        self.region_row.append(None)
        return len(self.tokens) - 1

    def place(self, nodes: list[int], base: int) -> TreeRows:
        """Give the nodes (whose parents have run) the next region rows: their tree attention and positions."""
        first = self.runs
        for node in nodes:
            parent_row, row = self.row_of(self.parents[node]), self.runs
            self.region_row[node] = row
            self.seen.append(self.seen[parent_row] | 1 << row)  # what its parent sees, and itself
            self.depth.append(self.depth[parent_row] + 1)
        stop = self.runs
        seen = [[bits >> j & 1 for j in range(stop)] for bits in self.seen[first:]]
        visible = torch.tensor(seen, dtype=torch.bool)  # [n, stop]
        # built here, in topological order: TreeRows.for_rows's checks of an arbitrary mask are not needed
        return TreeRows(base, visible, torch.tensor([base + depth for depth in self.depth[first:]]))


@dataclass
class TreeRound:
    """What the session keeps of a verified tree until its verdict: each frame row's node and cache row."""

    region_rows: list[int]  # frame row -> its row in the device caches (0 = the root, at commit_len)
    root_hidden: torch.Tensor  # [1, H]: the adapter's state at the root (a degraded finish starts there)


class TreeDrafting(Drafting):
    """Grow a draft tree and lay it out for the cloud (DeviceSession's; the host state is Drafting's)."""

    _tree_round: TreeRound | None

    def _node_stream(self, round_start: int, node: int) -> torch.Generator:
        """Fresh draws per (round, node): a seed fixes a sampled tree, whatever ran before it."""
        key = f"{self.generator.initial_seed()}:tree:{round_start}:{node}".encode()
        return self._draft_rng.manual_seed(int.from_bytes(hashlib.blake2b(key, digest_size=8).digest()) >> 1)

    def _run_nodes(self, tree: GrownTree, nodes: list[int], base: int, adapter: bool = True) -> None:
        """The nodes (whose parents have run) through the input layers and, unless they are leaves that will
        never be expanded (`adapter=False`), the adapter: one pass each."""
        first = tree.runs
        rows = tree.place(nodes, base)
        stop = tree.runs
        ids = torch.tensor([tree.tokens[node] for node in nodes])
        shallow = self.model.input(ids, self.input_cache, rows)  # [n, H]
        tree.shallow[first:stop] = shallow
        if not adapter:
            return
        prev = tree.hidden[tree.rows_of([tree.parents[node] for node in nodes])]  # [n, H]: parents' states
        assert self.adapter_cache is not None  # trees are drafted only with an adapter
        tree.hidden[first:stop] = self._run_adapter(self.adapter_cache, shallow, ids, prev, rows)  # [n, H]

    def _expand(self, tree: GrownTree, nodes: list[int], round_start: int) -> list[int]:
        """Children for each node (top-k greedy, or drawn without replacement from q); the new nodes."""
        width = self.draft_config.tree_width
        hidden = tree.hidden[tree.rows_of(nodes)]  # [n, H]
        created = []
        if self.params.is_greedy:
            logp, vocab = self.model.draft_log_probs(hidden)  # [n, N]: the draft vocabulary's columns only
            best = logp.topk(min(width, logp.shape[-1]), dim=-1)  # each node's children, most likely first
            ids = vocab[best.indices] if vocab is not None else best.indices  # [n, width]: token ids
            for node, values, tokens in zip(nodes, best.values.tolist(), ids.tolist()):
                for token, value in zip(tokens, values):
                    created.append(tree.add(token, node, value, tree.log_q[node] + value))
        else:
            for node, row in zip(nodes, self.model.draft_logits(hidden)):  # [V] each
                q = logits_to_probs(row, self.params)  # [V]
                tree.q[node] = q
                for token in draw_children(q, width, self._node_stream(round_start, node)):
                    created.append(tree.add(token, node, math.log(float(q[token])), -float(len(tree.tokens))))
        eos = self.model.eos_token_id
        return [node for node in created if tree.tokens[node] != eos]  # nothing follows an end of turn

    def draft_tree(self) -> Draft:
        """Grow, select and lay out this round's tree (the draft budget caps its depth)."""
        started = time.perf_counter()
        assert self.pending_token is not None and self.adapter_cache is not None  # draft() checked
        base, config = self.commit_len, self.draft_config
        depth_budget = self._draft_budget()
        root = torch.tensor([self.pending_token])
        shallow = self.model.input(root, self.input_cache)  # [1, H]: the root row, causal like a chain's
        hidden = self._run_adapter(self.adapter_cache, shallow, root, self._prev_feature)  # [1, H]
        # region rows: the root, at most tree_width expanded nodes per level below the last, the kept leaves
        rows = 1 + config.tree_width * depth_budget + config.tree_nodes
        tree = GrownTree.rooted(self.pending_token, rows, shallow, hidden)
        frontier, steps = [0], 1
        for depth in range(1, depth_budget + 1):
            created = self._expand(tree, frontier, base)
            if depth == depth_budget or not created:
                break
            frontier = self._frontier(tree, created)
            if not frontier:
                break  # no path likely enough to pay for another level of drafting (a tree's eta)
            frontier.sort()  # creation order: a parent's row comes before its children's
            self._run_nodes(tree, frontier, base)
            steps += 1
        kept = select_nodes(tree.parents, tree.scores, min(config.tree_nodes, len(tree.tokens) - 1))
        leaves = [node for node in kept if tree.region_row[node] is None]
        if leaves:
            # a leaf's adapter row would only draft its children; a feature adapter recomputes the accepted
            # path's rows from the cloud's deep states anyway (keep_tree_path), so leaves skip the adapter
            self._run_nodes(tree, leaves, base, adapter=not self._recomputes_adapter_path())
            steps += 1
        self.draft_seconds.append((time.perf_counter() - started, steps))
        return self._lay_out(tree, kept, base)

    def _frontier(self, tree: GrownTree, created: list[int]) -> list[int]:
        """The next level to run and expand: the `tree_width` best new nodes. A greedy tree keeps only those
        whose path's draft probability reaches `tree_min_prob` (each row costs a pass through the input
        layers, the adapter and the draft head, and a path this unlikely rarely repays it). A sampled
        tree's shape may not depend on its draws, so it expands all of them or, when even the likeliest
        path is under the bar, none."""
        config = self.draft_config
        best = sorted(created, key=lambda node: -tree.scores[node])[: config.tree_width]
        if self.params.is_greedy:
            best = [node for node in best if math.exp(tree.log_q[node]) >= config.tree_min_prob]
        elif best and max(math.exp(tree.log_q[node]) for node in best) < config.tree_min_prob:
            best = []
        return best

    def _lay_out(self, tree: GrownTree, kept: list[int], base: int) -> Draft:
        parents = reindex(tree.parents, kept)
        probs = None
        if not self.params.is_greedy:
            vocab = self.model.vocab_size
            # q per frame row: the distribution its children were drawn from (zeros: a node not expanded)
            probs = torch.stack([tree.q.get(node, torch.zeros(vocab)) for node in kept])  # [N, V]
        region_rows = tree.rows_of(kept)  # every kept node was run
        self._tree_round = TreeRound(region_rows, tree.hidden[:1].clone())
        return Draft(
            commit_len=base,
            tokens=[tree.tokens[node] for node in kept[1:]],
            probs=probs,
            shallow=tree.shallow[region_rows],  # [N, H]
            layout=VerifyLayout(tuple(parents[1:]) or None, self._take_kept()),
        )

    def keep_tree_path(self, draft: Draft, deep: torch.Tensor, path: list[int]) -> None:
        """After the verdict: both device caches keep the root and the accepted path (frame rows), and the
        cloud is told which of its rows to keep with the next request."""
        # deep: [N, H] in frame-row order
        tree_round, self._tree_round = self._tree_round, None
        assert tree_round is not None and self.adapter_cache is not None  # a tree draft set it
        base = draft.commit_len
        rows = [base + tree_round.region_rows[row] for row in path]
        self.input_cache.compact(base + 1, rows)
        if self._recomputes_adapter_path() and path:
            # the accepted rows were drafted from predicted deep states; the cloud's are known now
            self.adapter_cache.truncate(base + 1)
            ids = torch.tensor([draft.tokens[row - 1] for row in path])
            parents = [0, *path[:-1]]
            self._run_adapter(self.adapter_cache, draft.shallow[path], ids, deep[parents])
        else:
            self.adapter_cache.compact(base + 1, rows)
        in_place = path == list(range(1, len(path) + 1))
        self._cloud_kept = None if in_place else tuple(base + row for row in path)

    def degrade_tree(self, draft: Draft) -> torch.Tensor:
        """The cloud is gone mid-tree: back to the root, whose adapter state a lone finish drafts from."""
        tree_round, self._tree_round = self._tree_round, None
        assert tree_round is not None and self.adapter_cache is not None
        self.input_cache.truncate(draft.commit_len + 1)
        self.adapter_cache.truncate(draft.commit_len + 1)
        return tree_round.root_hidden
