"""The truncated draft vocabulary: the tokens the model itself writes most, ranked by how often they
occur in its own answers in the distillation data (the positions >= prompt_len of each chat sequence).

The draft head then scores N rows instead of the whole vocabulary (49152 x 576 on SmolLM2); a draft
token outside them is never proposed, so the fraction of answer tokens the N cover bounds the first
draft's agreement. N is picked by that measured coverage.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import torch

COVERAGE_SIZES = (1000, 2000, 4000, 8000, 16000)


def answer_token_counts(sequences: Iterable) -> Counter[int]:
    """How often each id occurs in the answers (ids[prompt_len:]) of these sequences."""
    counts: Counter[int] = Counter()
    for seq in sequences:
        counts.update(seq.ids[seq.prompt_len :].tolist())
    return counts


def rank_tokens(counts: Counter[int], always: Sequence[int] = ()) -> list[int]:
    """Ids by frequency, most frequent first (ties: smaller id first); `always` (end of turn) lead."""
    ranked = sorted(counts, key=lambda token: (-counts[token], token))
    return list(dict.fromkeys([*always, *ranked]))


def coverage(counts: Counter[int], ranked: Sequence[int], size: int) -> float:
    """The fraction of answer tokens whose id is among the first `size` of `ranked`."""
    total = sum(counts.values())
    return sum(counts[token] for token in ranked[:size]) / total if total else 0.0


def coverage_table(counts: Counter[int], ranked: Sequence[int], sizes: Sequence[int] = COVERAGE_SIZES) -> dict:
    return {str(size): round(coverage(counts, ranked, size), 5) for size in sizes}


def choose_size(
    counts: Counter[int],
    ranked: Sequence[int],
    target: float,
    sizes: Sequence[int] = COVERAGE_SIZES,
    vocab_size: int | None = None,
) -> int:
    """The smallest of `sizes` covering >= `target` of the answer tokens (else every ranked id)."""
    for size in sorted(sizes):
        if coverage(counts, ranked, size) >= target and (vocab_size is None or size < vocab_size):
            return size
    return len(ranked)


def draft_vocabulary(
    sequences: Iterable, target: float, eos_token_id: int | None, vocab_size: int, sizes: Sequence[int] = COVERAGE_SIZES
) -> tuple[torch.Tensor, dict]:
    """The chosen ids (int64, ranked) and the report: the coverage table, N, its coverage."""
    counts = answer_token_counts(sequences)
    ranked = rank_tokens(counts, [] if eos_token_id is None else [eos_token_id])
    size = min(choose_size(counts, ranked, target, sizes, vocab_size), vocab_size)
    ids = torch.tensor(ranked[:size], dtype=torch.long)
    report = {
        "size": int(ids.numel()),
        "coverage": round(coverage(counts, ranked, size), 5),
        "target": target,
        "answer_tokens": sum(counts.values()),
        "distinct_answer_tokens": len(counts),
        "coverage_table": coverage_table(counts, ranked, sizes),
    }
    return ids, report
