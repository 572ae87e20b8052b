"""Sampled tree verification keeps the target's distribution exactly: checked by enumerating every
draw of a small tree and every accept/reject outcome (exact to rounding), and by chi-square tests
of the real sampler."""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from collections.abc import Iterator
from functools import cache

import numpy as np
import pytest
import torch

from shared.specdec.tree import (
    TreeVerdict,
    accept_tree_sampled,
    children,
    depths,
    draw_children,
    draw_with,
    sibling_rule,
)
from tests.stat_tools import assert_samples_follow

Prefix = tuple[int, ...]


class Toy:
    """A target p and a poor draft q over a small vocabulary that depend on the whole prefix (so
    p(x2 | x1) really depends on x1). q is peaky, puts mass where p has none, and misses some of p."""

    def __init__(self, vocab: int, seed: int, draft_support: int | None = None, perfect_draft: bool = False):
        self.vocab, self.seed, self.draft_support, self.perfect_draft = vocab, seed, draft_support, perfect_draft

    def _generator(self, prefix: Prefix, salt: int) -> torch.Generator:
        code = sum((token + 1) * (self.vocab + 1) ** i for i, token in enumerate(prefix))
        return torch.Generator().manual_seed(self.seed * 1_000_003 + code * 2 + salt)

    @cache  # noqa: B019 (a handful of small Toy objects live for one test)
    def p(self, prefix: Prefix) -> torch.Tensor:
        probs = torch.rand(self.vocab, generator=self._generator(prefix, 0), dtype=torch.float64) + 0.05
        probs[(len(prefix) + sum(prefix)) % self.vocab] = 0.0  # a token the target never emits
        return probs / probs.sum()

    @cache  # noqa: B019
    def q(self, prefix: Prefix) -> torch.Tensor:
        if self.perfect_draft:
            return self.p(prefix)
        probs = torch.rand(self.vocab, generator=self._generator(prefix, 1), dtype=torch.float64) ** 4
        probs[(len(prefix) + sum(prefix) + 1) % self.vocab] = 0.0  # a token the draft never proposes
        if self.draft_support is not None:
            probs[probs.argsort(descending=True)[self.draft_support :]] = 0.0
        return probs / probs.sum()


def ordered_draws(q: torch.Tensor, k: int) -> Iterator[tuple[tuple[int, ...], float]]:
    """Every sequence of min(k, |support of q|) distinct tokens, with its probability of being drawn
    one after another without replacement from q."""
    support = [token for token in range(len(q)) if q[token] > 0]
    for draw in itertools.permutations(support, min(k, len(support))):
        prob, left = 1.0, 1.0
        for token in draw:
            prob *= float(q[token]) / left
            left -= float(q[token])
        yield draw, prob


def exact_round(toy: Toy, branching: tuple[int, ...]):
    """The exact distribution of the first `limit` tokens one verification round emits after a prefix,
    for a tree whose depth-d nodes get branching[d] children drawn without replacement from q: a sum
    over every draw and every accept/reject outcome of the rule (sibling_rule), no sampling."""

    @cache
    def emitted(prefix: Prefix, depth: int, limit: int) -> dict[Prefix, float]:
        p, q = toy.p(prefix), toy.q(prefix)
        out: dict[Prefix, float] = defaultdict(float)
        if depth == len(branching):  # a leaf: the bonus token comes from p
            for token in range(toy.vocab):
                out[(token,)] += float(p[token])
            return out
        for draw, prob in ordered_draws(q, branching[depth]):
            chances, residual = sibling_rule(p, q, draw)
            assert len(chances) == len(draw)  # every child drawn is tried
            reach = prob  # the chance of this draw and of reaching this child
            for token, chance in zip(draw, chances):
                for rest, sub in emitted((*prefix, token), depth + 1, limit).items():
                    out[((token,) + rest)[:limit]] += reach * chance * sub
                reach *= 1 - chance
            for token in range(toy.vocab):
                out[(token,)] += reach * float(residual[token])
        return out

    return emitted


def first_two(toy: Toy, branching: tuple[int, ...]) -> dict[Prefix, float]:
    """The exact distribution of the first two tokens: when the first round emits one token, the
    second is the first token of the next round, a new tree drafted after it."""
    emitted = exact_round(toy, branching)
    out: dict[Prefix, float] = defaultdict(float)
    for seq, prob in emitted((), 0, 2).items():
        if len(seq) == 2:
            out[seq] += prob
        else:
            for (second,), prob2 in emitted(seq, 0, 1).items():
                out[(seq[0], second)] += prob * prob2
    return out


CASES = [
    (4, (2,), None),
    (4, (3,), None),
    (5, (3,), None),
    (4, (4, 1), None),  # the root's children cover the draft's whole support
    (5, (2, 2), None),
    (4, (3, 2), None),
    (5, (2, 2, 1), None),
    (5, (3, 2), 2),  # the draft has 2 tokens: fewer children than asked for
    (4, (2, 1), 1),  # a one-token draft: a chain
]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(("vocab", "branching", "draft_support"), CASES)
def test_the_first_token_is_exactly_p(vocab, branching, draft_support, seed):
    toy = Toy(vocab, seed, draft_support)
    dist = exact_round(toy, branching)((), 0, 1)
    got = torch.tensor([dist.get((token,), 0.0) for token in range(vocab)], dtype=torch.float64)
    assert float((got - toy.p(())).abs().max()) < 1e-9, (got, toy.p(()))


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(("vocab", "branching", "draft_support"), CASES)
def test_the_first_two_tokens_are_exactly_p_x1_times_p_x2_given_x1(vocab, branching, draft_support, seed):
    toy = Toy(vocab, seed, draft_support)
    dist = first_two(toy, branching)
    for x1, x2 in itertools.product(range(vocab), repeat=2):
        expected = float(toy.p(())[x1] * toy.p((x1,))[x2])
        assert abs(dist.get((x1, x2), 0.0) - expected) < 1e-9, (x1, x2)
    assert abs(sum(dist.values()) - 1) < 1e-9


def test_sibling_rule_accepts_the_first_child_for_sure_when_the_draft_is_the_target():
    p = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    chances, _ = sibling_rule(p, p, [3, 1, 0])
    assert chances[0] == 1.0  # the later chances never come into play


def test_sibling_rule_rejects_tokens_the_target_never_emits_and_keeps_p():
    p = torch.tensor([0.5, 0.5, 0.0, 0.0], dtype=torch.float64)
    q = torch.tensor([0.0, 0.0, 0.7, 0.3], dtype=torch.float64)
    chances, residual = sibling_rule(p, q, [2, 3])
    assert chances == [0.0, 0.0]
    assert torch.equal(residual, p)


def test_sibling_rule_stops_where_the_draft_has_no_mass_left():
    p = torch.tensor([0.25, 0.25, 0.5], dtype=torch.float64)
    q = torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64)
    chances, residual = sibling_rule(p, q, [1, 0, 2])  # 0 and 2 could not have been drawn
    assert chances == [0.25]
    assert torch.allclose(residual, torch.tensor([1 / 3, 0.0, 2 / 3], dtype=torch.float64))


# --- the real sampler -----------------------------------------------------------------------------


def draw_tree(toy: Toy, prefix: Prefix, branching: tuple[int, ...], generator: torch.Generator):
    """A draft tree grown as a drafter would: each node's children drawn without replacement from q."""
    tokens, parents, prefixes = [0], [-1], [prefix]
    node = 0
    while node < len(tokens):
        depth = len(prefixes[node]) - len(prefix)
        if depth < len(branching):
            for token in draw_children(toy.q(prefixes[node]), branching[depth], generator):
                tokens.append(token)
                parents.append(node)
                prefixes.append((*prefixes[node], token))
        node += 1
    q_rows = torch.stack([toy.q(each) for each in prefixes])  # [N, V]
    p_rows = torch.stack([toy.p(each) for each in prefixes])  # [N, V]
    return tokens, parents, q_rows, p_rows


def tree_shape(branching: tuple[int, ...]) -> list[int]:
    """The parents array of a tree whose depth-d nodes have branching[d] children, breadth first."""
    parents, frontier = [-1], [0]
    for k in branching:
        parents_before = len(parents)
        parents += [node for node in frontier for _ in range(k)]
        frontier = list(range(parents_before, len(parents)))
    return parents


class Batched:
    """Many trials' trees at once: p and q of every prefix up to max_len in tables, rows by prefix code."""

    def __init__(self, toy: Toy, max_len: int):
        vocab = self.vocab = toy.vocab
        self.offset = [sum(vocab**i for i in range(length)) for length in range(max_len + 2)]
        prefixes = [x for length in range(max_len + 1) for x in itertools.product(range(vocab), repeat=length)]
        self.p, self.q = torch.stack([toy.p(x) for x in prefixes]), torch.stack([toy.q(x) for x in prefixes])

    def code(self, prefix: Prefix) -> int:
        return self.offset[len(prefix)] + sum(
            token * self.vocab ** (len(prefix) - 1 - i) for i, token in enumerate(prefix)
        )

    def child(self, code: torch.Tensor, length: int, token: torch.Tensor) -> torch.Tensor:
        return self.offset[length + 1] + (code - self.offset[length]) * self.vocab + token

    def draw(self, contexts: torch.Tensor, length: int, branching: tuple[int, ...], generator: torch.Generator):
        """Trees after the prefixes coded `contexts` (all of `length` tokens): tokens and prefix codes
        [T, N]. The same exponential race as draw_children (whose draws are tested on their own),
        batched over trials; q always has more tokens than branching asks for, so the shape is fixed."""
        parents = tree_shape(branching)
        kids, depth = children(parents), depths(parents)
        tokens = torch.zeros(len(contexts), len(parents), dtype=torch.long)  # [T, N]
        codes = tokens.clone()  # [T, N]
        codes[:, 0] = contexts
        for node in range(len(parents)):
            if kids[node]:
                q = self.q[codes[:, node]]  # [T, V]
                arrival = torch.empty_like(q).exponential_(generator=generator)
                drawn = (q / arrival).topk(len(kids[node]), dim=-1).indices  # [T, k], in draw order
                assert (q.gather(1, drawn) > 0).all()
                tokens[:, kids[node]] = drawn
                codes[:, kids[node]] = self.child(codes[:, node : node + 1], length + depth[node], drawn)
        return parents, tokens, codes

    def verdicts(self, parents: list[int], tokens: torch.Tensor, codes: torch.Tensor, generator: torch.Generator):
        q_rows, p_rows = self.q[codes], self.p[codes]  # [T, N, V]
        token_lists = tokens.tolist()
        with torch.inference_mode():  # as a verifier runs it; a third less per-op overhead
            return [
                accept_tree_sampled(token_lists[t], parents, q_rows[t], p_rows[t], generator)
                for t in range(len(tokens))
            ]


@pytest.mark.slow
def test_sampled_tree_gives_the_target_distribution_with_rejections_at_every_depth():
    # seed 11: each depth's children are all rejected in 13% to 36% of rounds (computed exactly)
    toy, branching, trials, vocab = Toy(vocab=5, seed=11), (2, 2, 1), 30_000, 5
    batched, generator = Batched(toy, max_len=1 + len(branching)), torch.Generator().manual_seed(11)
    parents, tokens, codes = batched.draw(torch.zeros(trials, dtype=torch.long), 0, branching, generator)
    verdicts = batched.verdicts(parents, tokens, codes, generator)
    emitted = [verdict.emitted(row) for verdict, row in zip(verdicts, tokens.tolist())]
    # where a round emitted one token, the second is the first of the next round, drafted after it
    short = [t for t in range(trials) if len(emitted[t]) == 1]
    contexts = torch.tensor([batched.code((emitted[t][0],)) for t in short])
    parents2, tokens2, codes2 = batched.draw(contexts, 1, branching, generator)
    for t, verdict, row in zip(short, batched.verdicts(parents2, tokens2, codes2, generator), tokens2.tolist()):
        emitted[t].append(verdict.emitted(row)[0])
    pairs = np.array([seq[:2] for seq in emitted])  # [T, 2]

    accepted = Counter(verdict.num_accepted for verdict in verdicts)
    kids = children(parents)
    later_child = Counter(
        depth for v in verdicts for depth, node in enumerate(v.path, 1) if kids[parents[node]][0] != node
    )
    for depth in range(len(branching) + 1):  # every depth's children all rejected, and whole paths accepted
        assert accepted[depth] > 0.05 * trials, accepted
    for depth in range(1, len(branching)):  # a child accepted after its sibling was rejected
        assert later_child[depth] > 0.03 * trials, later_child
    p0 = toy.p(())
    joint = torch.stack([p0[x1] * toy.p((x1,)) for x1 in range(vocab)]).flatten()  # [V * V]
    assert_samples_follow(pairs[:, 0], p0)
    assert_samples_follow(pairs[:, 0] * vocab + pairs[:, 1], joint)


@pytest.mark.slow
def test_draw_children_draws_without_replacement_in_draw_order():
    q = torch.tensor([0.4, 0.3, 0.0, 0.2, 0.1])
    generator = torch.Generator().manual_seed(3)
    draws = np.array([draw_children(q, 2, generator) for _ in range(30_000)])
    assert (draws[:, 0] != draws[:, 1]).all()
    expected = torch.zeros(25, dtype=torch.float64)
    for (first, second), prob in ordered_draws(q.double(), 2):
        expected[first * 5 + second] = prob
    assert_samples_follow(draws[:, 0] * 5 + draws[:, 1], expected)


def test_draw_children_gives_fewer_when_the_draft_has_fewer_tokens():
    generator = torch.Generator().manual_seed(0)
    q = torch.tensor([0.0, 0.5, 0.0, 0.5])
    for _ in range(20):
        assert sorted(draw_children(q, 3, generator)) == [1, 3]
    assert draw_children(q, 0, generator) == []
    assert draw_children(torch.tensor([0.0, 1.0, 0.0]), 2, generator) == [1]


def test_draw_with_inverts_the_cumulative_distribution_and_skips_empty_tokens():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.5])
    assert [draw_with(probs, u) for u in (0.0, 0.25, 0.4999, 0.5, 0.75, 0.999999)] == [1, 1, 1, 3, 3, 3]
    assert draw_with(probs, 1.0) == 3  # u * total rounded up to total: the last token with mass
    assert draw_with(torch.tensor([0.2, 0.8, 0.0]), 1.0) == 1


def test_a_draft_equal_to_the_target_is_accepted_down_to_a_leaf():
    toy = Toy(vocab=5, seed=2, perfect_draft=True)
    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        tokens, parents, q_rows, p_rows = draw_tree(toy, (), (2, 2), generator)
        verdict = accept_tree_sampled(tokens, parents, q_rows, p_rows, generator)
        assert verdict.num_accepted == 2 and verdict.path[0] == 1  # the first child, always
        assert float(p_rows[verdict.path[-1], verdict.next_token]) > 0


def test_a_root_alone_draws_from_p_and_never_emits_a_zero_probability_token():
    generator = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.0, 0.5, 0.5, 0.0]])
    for _ in range(50):
        verdict = accept_tree_sampled([7], [-1], torch.zeros(1, 4), p, generator)
        assert verdict.path == [] and verdict.next_token in (1, 2)


def test_a_seeded_generator_gives_the_same_verdicts():
    toy = Toy(vocab=5, seed=4)
    tokens, parents, q_rows, p_rows = draw_tree(toy, (), (3, 2, 1), torch.Generator().manual_seed(1))

    def verdicts(seed: int) -> list[TreeVerdict]:
        generator = torch.Generator().manual_seed(seed)
        return [accept_tree_sampled(tokens, parents, q_rows, p_rows, generator) for _ in range(40)]

    assert verdicts(5) == verdicts(5)
    assert verdicts(5) != verdicts(6)
    # and the draws of a tree too
    assert (
        draw_tree(toy, (), (3, 2), torch.Generator().manual_seed(8))[0]
        == (draw_tree(toy, (), (3, 2), torch.Generator().manual_seed(8))[0])
    )
