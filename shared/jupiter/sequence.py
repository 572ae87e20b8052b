"""Jupiter's sequence partition (§IV-B2, eqs. 2-4): split a prompt into sub-sequences that enter the
pipeline one after another (intra-sequence pipelined prefill).

`t(S, c)` is a sub-sequence's time on the pipeline's bottleneck stage: S tokens after c cached
ones. Later sub-sequences attend to everything before them, so equal lengths are not equal times.

Eq. 2/3, the balanced partition: F(k, l) = min over j of max(F(k-1, j), t(l - j, j)), the slowest
sub-sequence when the first l tokens are cut into k parts of >= l_min tokens each (a prompt shorter
than l_min is one part). Prompt length L is the prefix [0, L), so ONE pass over l = 1..max_len
gives the exact answer for every length and every k <= k_max: O(k_max * max_len^2) evaluations of
t, done as numpy over column blocks (O(max_len * block) memory); ~0.1 s for max_len 2048.

Eq. 4, the count: T(L, k) = sum_i t_i + (P-1) * max_i t_i is the makespan of k jobs through P
identical stages. We compute that makespan exactly by the flow-shop recurrence, which equals
eq. 4 in that case and also covers what eq. 4 leaves out:
  - the LAN: after each of the P-1 stages but the last, a part's hidden states cross a hop that
    is busy for S * seconds_per_token (serialisation; one message at a time) and then take
    `hop_latency_s` in flight (propagation; does not block the next message);
  - unequal stages: `stage_scales[r]` <= 1 scales t for stage r (1 = the bottleneck), so the
    equal-layer baseline's unbalanced pipeline is costed honestly.
The count with the smallest makespan wins (ties, up to 1e-9 relative: fewer parts).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

LayerTimeFn = Callable[[object, object], Any]  # t(S, c): scalars or broadcasting numpy arrays
DEFAULT_K_MAX = 8
# l_min only prunes parts too short to use the hardware; eq. 4's makespan, costed with the profiled t(S, c),
# weighs what shorter parts lose. At 10 % the floor on this CPU was S = 512 for SmolLM2 (t(128)/128 is 11 %
# above the best), which kept every prompt under 1024 tokens unpipelined even where eq. 4 predicts pipelining
# wins (256 tokens: 1.08 s as 2 x 128 vs 1.51 s whole); 25 % keeps S = 128.
DEFAULT_L_MIN_TOLERANCE = 0.25
_BLOCK = 256
_TIE_TOLERANCE = 1e-9


def min_subsequence_length(
    lengths: Sequence[int], times: Sequence[float], tolerance: float = DEFAULT_L_MIN_TOLERANCE
) -> int:
    """l_min: the smallest profiled S whose per-token time t(S)/S is within `tolerance` (0.10 =
    10 %) of the best per-token time on the grid. Shorter parts underuse the accelerator: they
    cost nearly as much as longer ones. On a GPU the best is the longest S (per-token time only
    falls); on a CPU causal attention's S^2 makes it rise again past some S, and then the longest
    S would be a too-lenient reference, so the best one is used."""
    if len(lengths) != len(times) or not lengths:
        raise ValueError("lengths and times must be non-empty and of equal length")
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    per_token = [t / s for s, t in zip(lengths, times)]
    limit = min(per_token) * (1 + tolerance)
    return int(next(s for s, cost in zip(lengths, per_token) if cost <= limit))


def equal_sub_sequences(length: int, count: int) -> list[int]:
    """`count` near-equal parts summing to `length` (the first parts take the remainder); fewer
    parts when the prompt has fewer tokens than `count`."""
    if length < 1 or count < 1:
        raise ValueError(f"need length >= 1 and count >= 1, got {length}, {count}")
    count = min(count, length)
    base, extra = divmod(length, count)
    return [base + (1 if i < extra else 0) for i in range(count)]


def _makespan(stage_t: np.ndarray, hop_s: np.ndarray, hop_latency_s: float) -> np.ndarray:
    """Flow-shop makespan of in-order jobs. stage_t: [N, K, P] seconds per job per stage; hop_s:
    [N, K] serialisation per hop. Trailing all-zero jobs do not change the result (padding)."""
    n, k, p = stage_t.shape
    stage_free = np.zeros((n, p))  # when each stage finished its previous job
    link_free = np.zeros((n, max(p - 1, 0)))  # when each hop finished sending its previous job
    for job in range(k):
        arrive = np.zeros(n)
        for stage in range(p):
            stage_free[:, stage] = np.maximum(stage_free[:, stage], arrive) + stage_t[:, job, stage]
            if stage < p - 1:
                link_free[:, stage] = np.maximum(link_free[:, stage], stage_free[:, stage]) + hop_s[:, job]
                arrive = link_free[:, stage] + hop_latency_s
    return stage_free[:, p - 1]


def _stage_scales(num_stages: int, stage_scales: Sequence[float] | None) -> np.ndarray:
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    scales = np.ones(num_stages) if stage_scales is None else np.asarray(stage_scales, np.float64)
    if scales.shape != (num_stages,) or not np.all(np.isfinite(scales)) or np.any(scales < 0):
        raise ValueError(f"stage_scales must be {num_stages} finite numbers >= 0, got {stage_scales!r}")
    return scales


def pipeline_latency(
    parts: Sequence[int],
    t: LayerTimeFn,
    num_stages: int,
    hop_s_per_token: float = 0.0,
    hop_latency_s: float = 0.0,
    stage_scales: Sequence[float] | None = None,
) -> float:
    """Seconds until the last stage has processed every part (eq. 4 generalised; module docstring)."""
    scales = _stage_scales(num_stages, stage_scales)
    lengths = np.asarray(parts, np.float64)
    prefixes = np.concatenate([[0.0], np.cumsum(lengths)[:-1]])
    times = np.asarray(t(lengths, prefixes), np.float64)  # [K] on the bottleneck stage
    stage_t = (times[:, None] * scales[None, :])[None]  # [1, K, P]
    return float(_makespan(stage_t, (lengths * hop_s_per_token)[None], hop_latency_s)[0])


@dataclass(frozen=True)
class SequencePlan:
    """For every prompt length 1..max_len, the chosen parts and the predicted prefill makespan."""

    max_len: int
    l_min: int
    k_max: int
    table: tuple[tuple[int, ...], ...]  # table[L - 1]: the parts of a length-L prompt, in order
    latency_s: tuple[float, ...]  # latency_s[L - 1]: predicted makespan of those parts

    def __post_init__(self) -> None:
        if len(self.table) != self.max_len or len(self.latency_s) != self.max_len:
            raise ValueError(f"a sequence plan needs {self.max_len} entries")
        for length, parts in enumerate(self.table, start=1):
            if sum(parts) != length or any(p < 1 for p in parts) or not 1 <= len(parts) <= self.k_max:
                raise ValueError(f"sequence plan entry for length {length} is not a partition of it: {parts}")

    def sub_sequences(self, length: int) -> list[int]:
        """The parts of a length-`length` prompt: the table's entry, or beyond max_len the last
        entry scaled to `length` (largest-remainder rounding, so the parts still sum to it)."""
        if length < 1:
            raise ValueError(f"prompt length must be >= 1, got {length}")
        if length <= self.max_len:
            return list(self.table[length - 1])
        return scale_parts(self.table[-1], length)


def scale_parts(parts: Sequence[int], length: int) -> list[int]:
    """`parts` rescaled proportionally to sum to `length` (each >= 1)."""
    total = sum(parts)
    exact = [p * length / total for p in parts]
    scaled = [max(1, math.floor(e)) for e in exact]
    order = sorted(range(len(parts)), key=lambda i: exact[i] - math.floor(exact[i]), reverse=True)
    for i in itertools.islice(itertools.cycle(order), max(0, length - sum(scaled))):
        scaled[i] += 1
    return scaled


def _balanced_tables(t: LayerTimeFn, max_len: int, l_min: int, k_max: int) -> tuple[np.ndarray, np.ndarray]:
    """F[k, l] (eq. 2) for k <= k_max, l <= max_len, and the start of the last part it chose."""
    lengths = np.arange(max_len + 1)
    best = np.full((k_max + 1, max_len + 1), np.inf)
    last_start = np.zeros((k_max + 1, max_len + 1), dtype=np.int64)
    best[1, l_min:] = np.asarray(t(lengths[l_min:], 0), np.float64)  # one part; as a prefix it needs >= l_min
    for first in range(1, max_len + 1, _BLOCK):
        cols = lengths[first : min(first + _BLOCK, max_len + 1)]  # prompt lengths l in this block
        starts = np.arange(cols[-1])[:, None]  # j: where the last part starts
        part = cols[None, :] - starts  # [J, B] length of the last part
        cost = np.where(part >= l_min, np.asarray(t(np.maximum(part, 1), starts), np.float64), np.inf)
        for k in range(2, k_max + 1):
            # within the block, best[k-1] for j < l is already final: k-1 was done before k
            slowest = np.maximum(best[k - 1, : cols[-1], None], cost)  # [J, B]
            choice = slowest.argmin(axis=0)
            best[k, cols] = slowest[choice, np.arange(len(cols))]
            last_start[k, cols] = choice
    return best, last_start


def _parts(last_start: np.ndarray, k: int, length: int) -> list[int]:
    parts = []
    while k > 1:
        start = int(last_start[k, length])
        parts.append(length - start)
        length, k = start, k - 1
    parts.append(length)
    return parts[::-1]


def plan_sequences(
    t: LayerTimeFn,
    num_stages: int,
    max_len: int,
    l_min: int,
    k_max: int = DEFAULT_K_MAX,
    hop_s_per_token: float = 0.0,
    hop_latency_s: float = 0.0,
    stage_scales: Sequence[float] | None = None,
) -> SequencePlan:
    """The DP table for lengths 1..max_len (module docstring). `t` must accept numpy arrays."""
    if max_len < 1 or l_min < 1 or k_max < 1:
        raise ValueError(f"need max_len, l_min, k_max >= 1, got {max_len}, {l_min}, {k_max}")
    scales = _stage_scales(num_stages, stage_scales)
    best, last_start = _balanced_tables(t, max_len, l_min, k_max)
    candidates: list[list[int]] = []
    owners: list[int] = []
    for length in range(1, max_len + 1):
        candidates.append([length])  # one part is always allowed
        owners.append(length)
        for k in range(2, k_max + 1):
            if math.isfinite(best[k, length]):
                candidates.append(_parts(last_start, k, length))
                owners.append(length)
    # every candidate's parts padded to k_max jobs, costed in one vectorised pass
    lengths = np.zeros((len(candidates), k_max))
    for row, parts in enumerate(candidates):
        lengths[row, : len(parts)] = parts
    prefixes = np.cumsum(lengths, axis=1) - lengths
    times = np.where(lengths > 0, np.asarray(t(np.maximum(lengths, 1), prefixes), np.float64), 0.0)  # [N, K]
    latency = _makespan(times[:, :, None] * scales[None, None, :], lengths * hop_s_per_token, hop_latency_s)
    table: list[tuple[int, ...]] = [()] * max_len
    chosen = [math.inf] * max_len
    for row, length in enumerate(owners):
        # candidates of a length come in increasing k; more parts must win by more than rounding
        if latency[row] < chosen[length - 1] * (1 - _TIE_TOLERANCE):
            chosen[length - 1], table[length - 1] = float(latency[row]), tuple(candidates[row])
    return SequencePlan(max_len, l_min, k_max, tuple(table), tuple(chosen))


def brute_force_sequence(t: LayerTimeFn, length: int, k: int, l_min: int) -> tuple[float, list[int]]:
    """The balanced k-part partition by enumeration (for tests: exponential): (slowest part, parts)."""
    best: tuple[float, list[int]] = (math.inf, [])
    if k == 1:
        return float(t(length, 0)), [length]
    for cuts in itertools.combinations(range(1, length), k - 1):
        edges = (0, *cuts, length)
        parts = [b - a for a, b in zip(edges, edges[1:])]
        if min(parts) < l_min:
            continue
        slowest = max(float(t(p, a)) for p, a in zip(parts, edges))
        if slowest < best[0]:
            best = (slowest, parts)
    return best
