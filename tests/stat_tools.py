"""The chi-square check the sampling tests share: samples drawn from `probs` (and never outside its support)."""

from __future__ import annotations

import numpy as np
import torch
from scipy.stats import chisquare

from shared.specdec.sampling import logits_to_probs

ALPHA = 1e-4  # as vLLM tests its rejection sampler


def assert_samples_follow(samples: np.ndarray, probs: torch.Tensor, alpha: float = ALPHA) -> None:
    counts = np.bincount(samples, minlength=probs.shape[-1])
    support = probs.numpy() > 0
    assert counts[~support].sum() == 0, "a token of probability 0 was emitted"
    expected = probs.double().numpy()[support]
    expected = expected / expected.sum() * len(samples)
    assert chisquare(counts[support], expected).pvalue > alpha


def exact_marginals(checkpoint, ids, params, positions: int) -> list[np.ndarray]:
    """P(i-th generated token) for i < positions, summed exactly over every prefix the target can make."""
    prefixes, weights, marginals = [list(ids)], torch.ones(1, dtype=torch.float64), []
    with torch.inference_mode():
        for _ in range(positions):
            logits = torch.cat(
                [
                    checkpoint.model(input_ids=torch.tensor(prefixes[i : i + 512])).logits[:, -1]
                    for i in range(0, len(prefixes), 512)
                ]
            )  # [prefixes, V]
            probs = logits_to_probs(logits, params).double()  # [prefixes, V]
            joint = weights[:, None] * probs  # P(prefix, next token)
            marginals.append(joint.sum(0).numpy())
            rows, tokens = joint.nonzero(as_tuple=True)
            prefixes = [prefixes[r] + [t] for r, t in zip(rows.tolist(), tokens.tolist())]
            weights = joint[rows, tokens]
    return marginals


def assert_matches(counts: np.ndarray, probs: np.ndarray) -> None:
    expected = probs * counts.sum()
    assert counts[expected == 0].sum() == 0, "emitted a token the target gives probability 0"
    big, rare = expected >= 5, (expected > 0) & (expected < 5)  # pool rare categories for chi-square
    observed, expected_pooled = counts[big], expected[big]
    if rare.any():
        observed, expected_pooled = (
            np.append(observed, counts[rare].sum()),
            np.append(expected_pooled, expected[rare].sum()),
        )
    assert chisquare(observed, expected_pooled * observed.sum() / expected_pooled.sum()).pvalue > 1e-4
