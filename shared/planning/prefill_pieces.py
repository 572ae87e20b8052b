"""How much of a prompt one verifier step takes while other sessions are decoding (Sarathi's point, bounded in time).

A prompt computed in one pass holds every other session's next round for the whole pass: on a CPU verifier a
300-token prompt is a pass of about half a second, and every decoding session's round waits for it. Cutting the
prompt into fixed pieces (U-Sarathi's `server_chunk_tokens`) fixes that on a CPU and costs TTFT on a GPU, where a
pass of hundreds of rows costs about what a pass of one does. A piece bounded by its predicted pass time, from the
verifier's own measured g(mu), fits both: on a flat curve the whole prompt fits the bound and runs in one pass; on
a steep one the pieces are as large as the bound allows.
"""

from __future__ import annotations

from collections.abc import Callable

# The verifier's bound by default (TOPHAT_VERIFIER_MAX_PREFILL_STEP_MS): about two decode rounds on this CPU. At
# 100 ms four modes' TTFT rose 9-20 % at a 100 ms round trip; at 200 it did not, and the decoding rounds' gaps
# still fell from over a second to about half of one (docs/benchmarks/2026-11-29-prefill-pieces.md).
DEFAULT_MAX_PREFILL_STEP_MS = 200.0
# A piece never goes below this many tokens (unless fewer remain): every pass has a fixed cost, and a g(mu)
# inflated by a busy moment must not cut a prompt into single rows.
MIN_PIECE_TOKENS = 16
# A session that sent a verify or decode step this recently counts as decoding (it is between its rounds).
DECODING_WINDOW_S = 2.0


def is_decoding(last_step_at: float | None, now: float, busy: bool) -> bool:
    """Whether a session whose last verify or decode step came at `last_step_at` (None: none since its prompt
    began) is decoding: it sent one in the last DECODING_WINDOW_S, or has work queued or in flight."""
    return last_step_at is not None and (busy or now - last_step_at <= DECODING_WINDOW_S)


def prefill_piece_tokens(
    remaining: int,
    step_cost: Callable[[int], float | None],
    max_step_s: float,
    min_tokens: int = MIN_PIECE_TOKENS,
) -> int:
    """The most of a prefill's `remaining` tokens whose pass `step_cost` (seconds for that many rows, monotone;
    None: not measured yet) predicts within `max_step_s`, at least `min_tokens` (or all that remain)."""
    if remaining < 1 or min_tokens < 1 or not max_step_s > 0:
        raise ValueError(
            f"need remaining >= 1, min_tokens >= 1, max_step_s > 0; got {remaining}, {min_tokens}, {max_step_s}"
        )
    if remaining <= min_tokens:
        return remaining
    whole = step_cost(remaining)
    if whole is None or whole <= max_step_s:
        return remaining
    low, high = min_tokens, remaining - 1  # low: taken whatever it costs; high: the most that may still fit
    while low < high:
        mid = (low + high + 1) // 2
        cost = step_cost(mid)
        if cost is not None and cost <= max_step_s:
            low = mid
        else:
            high = mid - 1
    return low
