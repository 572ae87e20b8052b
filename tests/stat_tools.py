"""The chi-square check the sampling tests share: samples drawn from `probs` (and never outside its support)."""

from __future__ import annotations

import numpy as np
import torch
from scipy.stats import chisquare

ALPHA = 1e-4  # as vLLM tests its rejection sampler


def assert_samples_follow(samples: np.ndarray, probs: torch.Tensor, alpha: float = ALPHA) -> None:
    counts = np.bincount(samples, minlength=probs.shape[-1])
    support = probs.numpy() > 0
    assert counts[~support].sum() == 0, "a token of probability 0 was emitted"
    expected = probs.double().numpy()[support]
    expected = expected / expected.sum() * len(samples)
    assert chisquare(counts[support], expected).pvalue > alpha
