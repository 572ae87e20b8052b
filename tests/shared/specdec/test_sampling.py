"""The accept/reject rule as a pure function: its output has the target's distribution."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.specdec.sampling import (
    SamplingParams,
    accept_greedy,
    accept_sampled,
    logits_to_probs,
    residual_distribution,
    sample,
    sample_logits,
)
from tests.stat_tools import assert_samples_follow

VOCAB = 6


def random_dist(generator: torch.Generator, zero_mask: list[int] = ()) -> torch.Tensor:
    probs = torch.rand(VOCAB, generator=generator) + 0.05
    probs[list(zero_mask)] = 0.0
    return probs / probs.sum()


def simulate(target: list[torch.Tensor], draft: list[torch.Tensor], num_draft: int, runs: int, seed: int):
    """Speculative generation of len(target) tokens from a toy model whose distributions
    depend only on the position; returns emitted tokens [runs, positions] and acceptance rate."""
    generator = torch.Generator().manual_seed(seed)
    positions = len(target)
    out = np.zeros((runs, positions), dtype=np.int64)
    accepted = proposed = 0
    for run in range(runs):
        emitted: list[int] = []
        while len(emitted) < positions:
            start = len(emitted)
            k = min(num_draft, positions - start - 1)
            draft_tokens = [sample(draft[start + i], generator) for i in range(k)]
            q = torch.stack([draft[start + i] for i in range(k)]) if k else torch.zeros(0, VOCAB)
            p = torch.stack([target[start + i] for i in range(k + 1)])
            verdict = accept_sampled(draft_tokens, q, p, generator)
            emitted += draft_tokens[: verdict.num_accepted] + [verdict.next_token]
            accepted += verdict.num_accepted
            proposed += k
        out[run] = emitted[:positions]
    return out, accepted / max(1, proposed)


@pytest.mark.parametrize("num_draft", [1, 3])
@pytest.mark.slow
def test_random_draft_gives_target_distribution(num_draft):
    generator = torch.Generator().manual_seed(num_draft)
    target = [random_dist(generator, zero_mask=[i % VOCAB]) for i in range(3)]
    draft = [random_dist(generator) for _ in range(3)]
    samples, rate = simulate(target, draft, num_draft, runs=30_000, seed=42 + num_draft)
    for position in range(3):
        assert_samples_follow(samples[:, position], target[position])
    assert 0.05 < rate < 0.99  # a random draft is sometimes wrong


@pytest.mark.slow
def test_draft_equal_to_target_is_always_accepted():
    generator = torch.Generator().manual_seed(5)
    target = [random_dist(generator) for _ in range(2)]
    samples, rate = simulate(target, target, num_draft=1, runs=30_000, seed=9)
    assert rate >= 0.98
    for position in range(2):
        assert_samples_follow(samples[:, position], target[position])


def test_never_emits_zero_probability_tokens_even_when_draft_prefers_them():
    target = torch.tensor([0.0, 0.5, 0.5, 0.0, 0.0, 0.0])
    draft = torch.tensor([0.9, 0.02, 0.02, 0.06, 0.0, 0.0])
    samples, _ = simulate([target, target], [draft, draft], num_draft=1, runs=5_000, seed=1)
    assert set(np.unique(samples)) <= {1, 2}


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.floats(0.0, 1.0), min_size=VOCAB, max_size=VOCAB),
    st.lists(st.floats(0.0, 1.0), min_size=VOCAB, max_size=VOCAB),
    st.sets(st.integers(0, VOCAB - 1), min_size=1, max_size=VOCAB - 1),
)
def test_residual_is_a_distribution_inside_the_target_support(p_raw, q_raw, zeros):
    p = torch.tensor(p_raw) + 1e-3
    p[sorted(zeros)] = 0.0  # tokens the target rules out (top-p): the residual must rule them out too
    p = p / p.sum()
    q = torch.tensor(q_raw) + 1e-3
    q = q / q.sum()
    residual = residual_distribution(p, q)
    assert torch.isclose(residual.sum(), torch.tensor(1.0), atol=1e-5)
    assert bool((residual >= 0).all()) and bool((residual[p == 0] == 0).all())


def test_greedy_accepts_longest_agreeing_prefix_plus_target_token():
    logits = torch.full((4, VOCAB), -5.0)
    for row, token in enumerate([2, 4, 1, 3]):
        logits[row, token] = 5.0
    assert accept_greedy([2, 4, 0], logits).__dict__ == {"num_accepted": 2, "next_token": 1}
    assert accept_greedy([2, 4, 1], logits).__dict__ == {"num_accepted": 3, "next_token": 3}
    assert accept_greedy([5], logits[:2]).__dict__ == {"num_accepted": 0, "next_token": 2}
    assert accept_greedy([], logits[:1]).__dict__ == {"num_accepted": 0, "next_token": 2}


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert torch.allclose(probs, torch.tensor([0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]))
    greedy = logits_to_probs(logits, SamplingParams())
    assert greedy.tolist() == [1.0, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(-20.0, 20.0, width=32), min_size=2, max_size=40),
    st.sampled_from([0.0, 0.7, 1.0]),
    st.sampled_from([1.0, 0.9]),
    st.integers(0, 2**31 - 1),
)
def test_sample_logits_draws_what_sampling_the_probabilities_draws(values, temperature, top_p, seed):
    """Greedy takes the argmax without building the one-hot (ties included: the first index); sampled draws
    consume the generator exactly as `sample(logits_to_probs(...))` does."""
    logits = torch.tensor(values)
    params = SamplingParams(temperature=temperature, top_p=top_p, seed=seed)
    expected = sample(logits_to_probs(logits, params), torch.Generator().manual_seed(seed))
    assert sample_logits(logits, params, torch.Generator().manual_seed(seed)) == expected
    if params.is_greedy:
        assert expected == int(torch.argmax(logits))
