"""How many tokens each streamed chunk held.

The stream carries text, not tokens, and under speculative decoding one chunk can carry a whole
round, so a client that times tokens (the load generator, the chat client) needs each chunk's
token count. The streamer reports per-delivery counts (`tophat.rounds`); when they do not line
up with the chunks, the server's total is split over the chunks by their text.
"""

from __future__ import annotations

from typing import Callable

import numpy as np


def apportion(weights: list[float], total: int) -> list[int]:
    """Split `total` tokens over chunks in proportion to `weights` (largest remainder, so the
    counts sum exactly to `total`), then make sure every chunk has at least one token."""
    n = len(weights)
    if n == 0:
        return []
    if total <= n:
        return [1] * n  # the server said fewer tokens than chunks: trust the chunks
    w = np.maximum(np.asarray(weights, dtype=float), 0.0)
    w = np.ones(n) if w.sum() <= 0 else w
    share = w / w.sum() * total
    counts = np.floor(share).astype(int)
    order = np.argsort(-(share - counts), kind="stable")
    counts[order[: total - int(counts.sum())]] += 1
    for i in np.flatnonzero(counts == 0):  # a chunk was delivered, so it held a token
        counts[int(np.argmax(counts))] -= 1
        counts[i] = 1
    return counts.tolist()


def chunk_token_counts(
    texts: list[str],
    completion_tokens: int | None,
    server_rounds: list[int] | None = None,
    count: Callable[[str], int] | None = None,
) -> list[int]:
    """Tokens per content chunk: the server's per-round counts when they line up one-to-one with
    the chunks, else per-chunk estimates (re-tokenized text, or characters without a tokenizer)
    scaled so they sum to the server's completion token count."""
    if not texts:
        return []
    rounds = server_rounds
    if rounds and len(rounds) == len(texts) and min(rounds) >= 1 and completion_tokens in (None, sum(rounds)):
        return list(rounds)
    weights = [float(count(t)) if count else float(len(t)) for t in texts]
    total = completion_tokens
    if total is None:
        total = int(sum(weights)) if count else len(weights)
    return apportion(weights, total)
