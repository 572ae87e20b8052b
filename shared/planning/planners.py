"""HAT planners as pure functions: prompt chunk size (eq. 3) and parallel-draft steps (eq. 6).

No I/O and no JSON here: `shared/planning/monitor_plans.py` feeds these equations from the
state monitor's telemetry and names the reason when it cannot.

Symbols (HAT §3.2-§3.5):
    A        hidden-state bytes per token on the wire (`hidden_bytes_per_token`): the caller's
             (the device knows its hidden size and wire dtype), never a guess of the planner's
    beta_up  device uplink bandwidth, bytes/s;  beta_down: downlink
    g(mu)    predicted cloud compute seconds for a batch of mu tokens (eq. 2)
    mu       the cloud's averaged batched token count (eq. 1)
    P        cloud pipeline length (stages)
    gamma    device seconds per draft step
"""

from __future__ import annotations

import math
from collections.abc import Callable

# Chunk sizes are multiples of this. GPU matmul/attention kernels work on token
# tiles of 16 (tensor-core fragments, FlashAttention blocks), so other sizes pay
# for padding; the grid also keeps small telemetry jitter from changing the chunk
# size on every request.
CHUNK_ALIGN = 16

# eq. 6 floors a ratio of measured seconds; a ratio that is an integer in exact
# arithmetic can land just below it in floating point (0.3 / 0.1 = 2.999...).
_FLOOR_REL_EPS = 1e-9


def hidden_bytes_per_token(hidden_size: int, wire_dtype_bytes: int = 2) -> int:
    """A in eq. 3 and eq. 6: one token's hidden state on the wire (fp16/bf16 = 2 bytes/element).

    Framing overhead is a few bytes per message, not per token, so it is left out.
    """
    if hidden_size < 1 or wire_dtype_bytes < 1:
        raise ValueError(f"need hidden_size >= 1 and wire_dtype_bytes >= 1, got {hidden_size}, {wire_dtype_bytes}")
    return int(hidden_size) * int(wire_dtype_bytes)


def fixed_chunks(num_tokens: int, chunk_size: int | None) -> list[int]:
    """Chunk sizes covering a prompt: all equal to chunk_size but the last (None = one chunk).

    Here (no torch) so the device's decode loop and the simulator share it."""
    if not chunk_size or chunk_size >= num_tokens:
        return [num_tokens]
    full, rest = divmod(num_tokens, chunk_size)
    return [chunk_size] * full + ([rest] if rest else [])


def _positive(x: float, name: str) -> float:
    x = float(x)
    if not (math.isfinite(x) and x > 0):
        raise ValueError(f"{name} must be finite and > 0, got {x!r}")
    return x


def _chunk_grid(min_size: int, max_size: int) -> tuple[int, Callable[[int], int]]:
    """Candidate sizes in increasing order: min_size, the multiples of CHUNK_ALIGN strictly between, max_size.

    Returned as (count, index -> size) so a huge max_size costs no memory.
    """
    if min_size == max_size:
        return 1, lambda _: min_size
    first = (min_size // CHUNK_ALIGN + 1) * CHUNK_ALIGN  # first multiple > min_size
    last = ((max_size - 1) // CHUNK_ALIGN) * CHUNK_ALIGN  # last multiple < max_size
    inner = max(0, (last - first) // CHUNK_ALIGN + 1)
    count = inner + 2

    def size(i: int) -> int:
        if i <= 0:
            return min_size
        if i >= count - 1:
            return max_size
        return first + CHUNK_ALIGN * (i - 1)

    return count, size


def eq3_gap(
    x: float, bytes_per_token: float, beta_up: float, g: Callable[[float], float], mu: float, stages: int
) -> float:
    """f(X) = X·A/β_up − (g(μ) + g(μ+X)) / P: upload time of a chunk minus the cloud time it overlaps (eq. 3).

    Negative: the upload finishes before the cloud would be ready for it (the chunk
    could be larger). Non-negative: the upload covers the cloud's wait + compute.
    """
    return x * bytes_per_token / beta_up - (g(mu) + g(mu + x)) / stages


def chunk_size_eq3(
    bytes_per_token: float,
    beta_up: float,
    g: Callable[[float], float],
    mu: float,
    stages: int,
    min_size: int,
    max_size: int,
    prompt_tokens: int,
) -> int:
    """Prompt chunk size X from HAT eq. 3: X·A/β_up = (g(μ) + g(μ+X)) / P.

    Intuition: while the cloud works on chunk j, the device uploads chunk j+1. A
    chunk arriving at the cloud waits up to one batch (≈ g(μ)) and is then computed
    in a batch of μ+X tokens (g(μ+X)); with P pipeline stages each GPU holds a
    batch for 1/P of that. The best X makes the upload time of one chunk equal to
    the cloud time it overlaps with: smaller, and chunks queue up in the cloud (more
    fragments, each paying the fixed per-batch cost); larger, and the cloud idles
    waiting for a long upload while the prefill pipeline loses its overlap.

    Solved on the grid min_size, multiples of CHUNK_ALIGN, max_size (see
    `CHUNK_ALIGN`) by bisection on f = `eq3_gap`, taking the smallest grid size
    with f >= 0, i.e. the equation's root rounded *up* to the grid, so the upload
    still covers the cloud time. If f(min_size) >= 0 the uplink is the bottleneck
    even for the smallest chunk: min_size. If f(max_size) < 0 even the largest
    chunk uploads faster than the cloud needs: max_size. Bisection finds the
    smallest root whenever f changes sign once, which holds for any concave
    non-decreasing g (affine g = c1·μ + c2 included, the usual compute model);
    for other g it returns a sign change of f, i.e. still a solution of eq. 3.
    The answer is then capped at prompt_tokens: a chunk is never longer than the
    prompt (a prompt shorter than min_size is sent whole).
    """
    a = _positive(bytes_per_token, "bytes_per_token")
    beta = _positive(beta_up, "beta_up")
    mu = float(mu)
    if not (math.isfinite(mu) and mu >= 0):
        raise ValueError(f"mu must be finite and >= 0, got {mu!r}")
    if stages < 1 or min_size < 1 or max_size < min_size or prompt_tokens < 1:
        raise ValueError(
            f"need stages >= 1, 1 <= min_size <= max_size, prompt_tokens >= 1; got "
            f"{stages}, {min_size}, {max_size}, {prompt_tokens}"
        )

    def f(x: int) -> float:
        return eq3_gap(x, a, beta, g, mu, stages)

    count, size = _chunk_grid(min_size, max_size)
    if f(size(0)) >= 0:
        chosen = size(0)
    elif f(size(count - 1)) < 0:
        chosen = size(count - 1)
    else:
        lo, hi = 0, count - 1  # invariant: f(size(lo)) < 0 <= f(size(hi))
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if f(size(mid)) >= 0:
                hi = mid
            else:
                lo = mid
        chosen = size(hi)
    return min(chosen, prompt_tokens)


def parallel_draft_steps_eq6(
    draft_len: int, bytes_per_token: float, beta_up: float, beta_down: float, g_mu: float, gamma: float, max_steps: int
) -> int:
    """Parallel-draft steps λ_i from HAT eq. 6: ⌊(μ_i·A/β_up + g(μ) + μ_i·A/β_down) / γ_i⌋.

    Why: while a verification of μ_i draft tokens is in flight, the device is idle
    for its upload, the cloud's compute (assuming no wait, g(μ)) and the download
    of μ_i deep hidden states. Pre-drafting must finish inside that window so it
    never delays acting on the verification result, so the step count is the
    window divided by the time per draft step γ_i. Clamped to [0, max_steps].
    """
    if draft_len < 0 or max_steps < 0:
        raise ValueError(f"need draft_len >= 0 and max_steps >= 0, got {draft_len}, {max_steps}")
    a = _positive(bytes_per_token, "bytes_per_token")
    up, down, step = _positive(beta_up, "beta_up"), _positive(beta_down, "beta_down"), _positive(gamma, "gamma")
    g_mu = float(g_mu)
    if not (math.isfinite(g_mu) and g_mu >= 0):
        raise ValueError(f"g_mu must be finite and >= 0, got {g_mu!r}")
    window = draft_len * a / up + g_mu + draft_len * a / down
    ratio = min(window / step * (1.0 + _FLOOR_REL_EPS), float(max_steps))  # min first: no huge int()
    return max(0, math.floor(ratio))
