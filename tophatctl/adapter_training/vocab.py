"""The truncated draft vocabulary: the tokens the model itself writes most, ranked by how often they
occur in its own answers in the distillation data (the positions >= prompt_len of each chat sequence).

The draft head then scores N rows instead of the whole vocabulary (49152 x 576 on SmolLM2); a draft
token outside them is never proposed, so the fraction of answer tokens the N cover bounds the first
draft's agreement. N is picked by that coverage measured out of sample (ranked on half the answers,
counted on the other half): in sample it reaches 1.0 as soon as N passes the number of distinct ids seen.
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


def coverage_of(sequences: Iterable, ids: torch.Tensor) -> float:
    """The fraction of these sequences' answer tokens that are among `ids` (e.g. held-out answers)."""
    counts = answer_token_counts(sequences)
    kept = set(ids.tolist())
    total = sum(counts.values())
    return sum(n for token, n in counts.items() if token in kept) / total if total else 0.0


def coverage_table(counts: Counter[int], ranked: Sequence[int], sizes: Sequence[int] = COVERAGE_SIZES) -> dict:
    return {str(size): round(coverage(counts, ranked, size), 5) for size in sizes}


def split_coverage_table(sequences: Sequence, sizes: Sequence[int] = COVERAGE_SIZES) -> dict:
    """Out-of-sample coverage: rank on every other sequence, count on the rest, and the other way
    round (pooled). In-sample coverage reaches 1.0 once N passes the distinct ids seen; this does not."""
    folds = [list(sequences)[0::2], list(sequences)[1::2]]
    counts = [answer_token_counts(fold) for fold in folds]
    ranked = [rank_tokens(c) for c in counts]
    total = sum(sum(c.values()) for c in counts)
    table = {}
    for size in sizes:
        covered = sum(counts[1 - i][t] for i in (0, 1) for t in ranked[i][:size])
        table[str(size)] = round(covered / total, 5) if total else 0.0
    return table


def choose_size(table: dict, target: float, vocab_size: int) -> int:
    """The smallest size in `table` whose coverage reaches `target` (else the largest), below the vocabulary."""
    sizes = sorted(int(size) for size in table if int(size) < vocab_size)
    for size in sizes:
        if table[str(size)] >= target:
            return size
    return sizes[-1] if sizes else vocab_size


def draft_vocabulary(
    sequences: Sequence,
    target: float,
    eos_token_id: int | None,
    vocab_size: int,
    sizes: Sequence[int] = COVERAGE_SIZES,
) -> tuple[torch.Tensor, dict]:
    """The chosen ids (int64, ranked on all the answers) and the report: coverage tables in sample and
    out of sample (2-fold), and N, the smallest size whose out-of-sample coverage reaches `target`."""
    counts = answer_token_counts(sequences)
    ranked = rank_tokens(counts, [] if eos_token_id is None else [eos_token_id])
    split = split_coverage_table(sequences, sizes)
    size = min(choose_size(split, target, vocab_size), vocab_size)
    ids = torch.tensor(ranked[:size], dtype=torch.long)
    report = {
        "size": int(ids.numel()),
        "coverage": round(coverage(counts, ranked, size), 5),
        "coverage_out_of_sample": split.get(str(size)),
        "target": target,
        "answer_tokens": sum(counts.values()),
        "distinct_answer_tokens": len(counts),
        "coverage_table": coverage_table(counts, ranked, sizes),
        "coverage_table_out_of_sample": split,
    }
    return ids, report
