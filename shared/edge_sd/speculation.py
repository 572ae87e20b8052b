"""Edge SD speculation length (paper 001, eqs. 7, 8 and problem P3, eq. 33).

Symbols: α = acceptance rate (`alpha`), l = speculation length (`spec_len`), L = expected output
tokens per verification (`tokens_per_step`), O_m = a batch's max expected output length,
n_m = its decoding steps, l_max = the largest speculation length considered (10-20 in practice).
"""

from __future__ import annotations

import math
from collections.abc import Callable

# Absorbs float error in O/L when the ratio is an integer in exact arithmetic (e.g. L = 1.5, O = 3).
_CEIL_SLACK = 1e-9


def _check_alpha(alpha: float) -> None:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
        raise ValueError(f"acceptance rate alpha must be in [0, 1], got {alpha!r}")


def _check_spec_len(spec_len: int) -> None:
    if isinstance(spec_len, bool) or not isinstance(spec_len, int) or spec_len < 1:
        raise ValueError(f"speculation length must be an int >= 1, got {spec_len!r}")


def expected_tokens_per_step(alpha: float, spec_len: int) -> float:
    """Eq. 7: L = (1 - α^{l+1}) / (1 - α), the expected accepted drafts plus the bonus token.

    α = 1 (every draft accepted) is the limit L = l + 1; α = 0 gives L = 1 (only the bonus)."""
    _check_alpha(alpha)
    _check_spec_len(spec_len)
    if alpha == 1.0:
        return float(spec_len + 1)
    return (1.0 - alpha ** (spec_len + 1)) / (1.0 - alpha)


def decoding_steps(output_len: int, tokens_per_step: float) -> int:
    """Eq. 8: n_m = ceil(O_m / L), the decoding steps a batch whose longest expected output is
    O_m needs when each step yields L tokens."""
    if isinstance(output_len, bool) or not isinstance(output_len, int) or output_len < 1:
        raise ValueError(f"output length must be an int >= 1, got {output_len!r}")
    if not tokens_per_step >= 1.0 or not math.isfinite(tokens_per_step):
        raise ValueError(f"tokens per step L must be finite and >= 1, got {tokens_per_step!r}")
    return max(1, math.ceil(output_len / tokens_per_step - _CEIL_SLACK))


def choose_speculation_length(alpha: float, l_max: int, latency_of_l: Callable[[int], float]) -> tuple[int, float]:
    """Problem P3 (eq. 33): enumerate l = 1..l_max and keep the l with the least latency.

    `latency_of_l(l)` is the caller's latency for speculation length l (e.g. the batching DP's
    optimum T_inf at L = expected_tokens_per_step(alpha, l)); it may return math.inf for an l with
    no feasible plan. Ties go to the shorter l (fewer wasted drafts). `alpha` is validated here so
    a bad telemetry value fails before any planning. Raises ValueError when no l is feasible."""
    _check_alpha(alpha)
    _check_spec_len(l_max)
    best: tuple[int, float] | None = None
    for spec_len in range(1, l_max + 1):
        latency = float(latency_of_l(spec_len))
        if math.isnan(latency) or latency < 0:
            raise ValueError(f"latency_of_l({spec_len}) returned {latency!r}")
        if math.isfinite(latency) and (best is None or latency < best[1]):
            best = (spec_len, latency)
    if best is None:
        raise ValueError(f"no speculation length in 1..{l_max} has a finite latency")
    return best
