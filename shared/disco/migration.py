"""DiSCo's migration controller (paper 003, §4.3). Pure.

When the endpoint that won the race is the costlier decoder, decoding can be handed to the other
one by sending token ids (no KV transfer: the receiver prefills prompt + generated-so-far). It
pays when the decode saving over the tokens still expected exceeds that re-prefill (eq. 4), and
the streamer hides the hand-over behind a buffer of B = r_c x t_m tokens (eq. 5).
"""

from __future__ import annotations

import math

from shared.disco.cost import CostModel, Endpoint


def migration_target(cost: CostModel, winner: Endpoint, other: Endpoint) -> Endpoint | None:
    """`other` when it decodes cheaper than `winner` (worth weighing a hand-over), else None."""
    if other != winner and cost.decode_price(other) < cost.decode_price(winner):
        return other
    return None


def migration_saving(
    cost: CostModel, source: Endpoint, target: Endpoint, remaining_tokens: float, resume_tokens: int
) -> float:
    """Eq. 4: $ saved by moving decoding from `source` to `target`; > 0 means migrate.

    (c_source^d - c_target^d) x remaining_tokens minus the overhead, the target's prefill of
    `resume_tokens` (prompt + tokens generated so far). The difference is eq. 4's |delta c^d|
    whenever the target is the cheaper decoder (the only case migration_target proposes); it is
    kept signed so that a costlier target can never look like a saving.
    """
    if not (math.isfinite(remaining_tokens) and remaining_tokens >= 0):
        raise ValueError(f"remaining_tokens must be finite and >= 0, got {remaining_tokens!r}")
    delta = cost.decode_price(source) - cost.decode_price(target)
    return delta * remaining_tokens - cost.prefill_cost(target, resume_tokens)


def expected_remaining(generated: int, max_new_tokens: int, mean_output_tokens: float | None) -> float:
    """Tokens still expected from a request that has generated `generated` of `max_new_tokens`.

    With a known mean output length: min(max_new - generated, max(mean - generated, 1)), i.e. a
    request already past the mean is expected to need at least one more token. Without one:
    max_new - generated. Never below 0.
    """
    left = max(max_new_tokens - generated, 0)
    if mean_output_tokens is None or not math.isfinite(mean_output_tokens):
        return float(left)
    return float(min(left, max(mean_output_tokens - generated, 1.0)))


def buffer_tokens(reading_rate_tps: float, migration_s: float) -> int:
    """Eq. 5: B = ceil(r_c x t_m) tokens buffered before a hand-over starts; at least 1."""
    for name, value in (("reading_rate_tps", reading_rate_tps), ("migration_s", migration_s)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
    return max(math.ceil(reading_rate_tps * migration_s - 1e-9), 1)  # 1e-9: 0.1 * 30 is 3, not 4
