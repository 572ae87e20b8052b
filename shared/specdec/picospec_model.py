"""PicoSpec's expected-time model (paper 004, §3.2 eqs. 1-3 and §3.4 eqs. 5-10), as pure functions.
(E[L] is eq. 5 by position: its number is lost in our copy of the text, between the top-K eq. 4
and eq. 6.)

Symbols, as in the paper:
    alpha     the per-token acceptance rate: the (independent) probability that a draft token is accepted
    gamma     the speculative step: draft tokens per round (>= 1)
    T_draft   seconds for the device to draft gamma tokens (= gamma * seconds per draft token)
    T_RTT     network round trip, serialization included
    T_verify  seconds for the cloud to verify gamma tokens in one pass
    T_pre     fast verification's lead: how much earlier the cloud starts on a known prefix (eq. 3)

L, the tokens a round produces, is PicoSpec's truncated geometric on {1..gamma}:
    P(L = k) = alpha^(k-1) (1 - alpha)  for k < gamma,   P(L = gamma) = alpha^(gamma-1)
i.e. L = min(A + 1, gamma) with A the drafts accepted before the first rejection. It counts the
CORRECTION token of a rejection but no BONUS token on full acceptance, and a rejection of the last
draft also gives gamma. That is exactly a pipelined chunk here (stream_engine.py): a chunk that
promises more gets no bonus, since its last target row verifies the next chunk's first draft.
The synchronous rounds of token-sd do get a bonus (L = A + 1 in {1..gamma+1}): `bonus=True`.

Note the paper's own loose end: eq. 8 calls the full hit "L = gamma" but gives it probability
alpha^gamma (all gamma drafts accepted, so the pre-drafted next batch is valid), whereas
P(L = gamma) above is alpha^(gamma-1). We follow the paper: P_hit = alpha^gamma.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass


def _check_alpha_gamma(alpha: float, gamma: int) -> None:
    if not (isinstance(alpha, (int, float)) and 0.0 <= alpha <= 1.0):
        raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")
    if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1:
        raise ValueError(f"gamma must be an integer >= 1, got {gamma!r}")


def _check_times(**times: float) -> None:
    for name, value in times.items():
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a finite time >= 0 seconds, got {value!r}")


def expected_accepted_length(alpha: float, gamma: int, bonus: bool = False) -> float:
    """E[L] (§3.4, eq. 5): sum_k k P(L=k) = (1 - alpha^gamma) / (1 - alpha); tokens per round.

    bonus=False is PicoSpec's definition (correction counted, no bonus; alpha -> 1 gives gamma,
    alpha -> 0 gives 1). bonus=True is the vanilla rule with a bonus token after full acceptance
    (Leviathan et al.): (1 - alpha^(gamma+1)) / (1 - alpha), gamma + 1 at alpha = 1."""
    _check_alpha_gamma(alpha, gamma)
    terms = gamma + 1 if bonus else gamma
    # The geometric sum 1 + alpha + ... + alpha^(terms-1), summed directly: no 0/0 at alpha == 1 and
    # no cancellation near it.
    return math.fsum(alpha**i for i in range(terms))


def sync_step_time(t_draft: float, t_rtt: float, t_verify: float) -> float:
    """L_sync (eq. 1 = eq. 6): stop-and-wait, every phase on the critical path."""
    _check_times(t_draft=t_draft, t_rtt=t_rtt, t_verify=t_verify)
    return t_draft + t_rtt + t_verify


def bubble(t_rtt: float, t_verify: float, t_draft: float, t_pre: float = 0.0) -> float:
    """T_bubble (eq. 3): the device's idle time per round of the full pipeline,
    max(0, T_RTT + T_verify - T_draft - T_pre)."""
    _check_times(t_rtt=t_rtt, t_verify=t_verify, t_draft=t_draft, t_pre=t_pre)
    return max(0.0, t_rtt + t_verify - t_draft - t_pre)


def async_step_time(t_draft: float, t_rtt: float, t_verify: float, t_pre: float = 0.0) -> float:
    """L_async (eq. 2): max(T_draft, T_RTT + T_verify), the amortized round of a full pipeline.
    With fast verification's lead t_pre it is T_draft + T_bubble (eq. 3); t_pre = 0 is eq. 2."""
    return t_draft + bubble(t_rtt, t_verify, t_draft, t_pre)


def expected_async_time(
    alpha: float, gamma: int, t_draft: float, t_rtt: float, t_verify: float, t_pre: float = 0.0
) -> float:
    """E[T_async] (eqs. 8-9): a hit (all gamma accepted, probability alpha^gamma) costs L_async; a
    miss flushes the pre-drafted batch and costs the serial L_sync."""
    _check_alpha_gamma(alpha, gamma)
    p_hit = alpha**gamma
    t_hit = async_step_time(t_draft, t_rtt, t_verify, t_pre)
    t_miss = sync_step_time(t_draft, t_rtt, t_verify)
    return p_hit * t_hit + (1.0 - p_hit) * t_miss


def _rate(tokens: float, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else math.inf


def sync_throughput(
    alpha: float, gamma: int, t_draft: float, t_rtt: float, t_verify: float, bonus: bool = False
) -> float:
    """R_sync (eq. 7): E[L] / L_sync, tokens per second (inf when every time is 0)."""
    return _rate(expected_accepted_length(alpha, gamma, bonus), sync_step_time(t_draft, t_rtt, t_verify))


def async_throughput(
    alpha: float, gamma: int, t_draft: float, t_rtt: float, t_verify: float, t_pre: float = 0.0
) -> float:
    """R_async = E[L] / E[T_async] (§3.4, after eq. 9), tokens per second."""
    return _rate(
        expected_accepted_length(alpha, gamma), expected_async_time(alpha, gamma, t_draft, t_rtt, t_verify, t_pre)
    )


def speedup(alpha: float, gamma: int, t_draft: float, t_rtt: float, t_verify: float, t_pre: float = 0.0) -> float:
    """S = R_async / R_sync = L_sync / E[T_async] (same E[L] on both sides); in [1, limit]."""
    expected = expected_async_time(alpha, gamma, t_draft, t_rtt, t_verify, t_pre)
    return _rate(sync_step_time(t_draft, t_rtt, t_verify), expected) if expected > 0 else 1.0


def speedup_limit(t_draft: float, t_rtt: float, t_verify: float) -> float:
    """lim_{alpha->1} S = L_sync / L_async. Compute-bound (T_draft >= T_RTT + T_verify) this is
    eq. 10's upper bound 1 + (T_RTT + T_verify) / T_draft; network-bound it is
    (T_draft + T_RTT + T_verify) / (T_RTT + T_verify)."""
    hit = async_step_time(t_draft, t_rtt, t_verify)
    return sync_step_time(t_draft, t_rtt, t_verify) / hit if hit > 0 else 1.0


@dataclass(frozen=True)
class PicoSpecPrediction:
    """What the model predicts for one (alpha, gamma, timings): the bench prints it as "modelled"."""

    alpha: float
    gamma: int
    expected_length: float  # E[L] per pipelined round (no bonus)
    sync_expected_length: float  # E[L] per token-sd round (with a bonus when sync_bonus)
    t_draft_s: float  # gamma drafts
    sync_step_s: float  # L_sync (eq. 1)
    async_step_s: float  # E[T_async] (eq. 9)
    bubble_s: float  # eq. 3
    sync_tokens_per_s: float  # token-sd (eq. 7)
    async_tokens_per_s: float  # picospec
    speedup: float  # picospec / token-sd


def predict(
    alpha: float,
    gamma: int,
    t_draft_per_token: float,
    t_rtt: float,
    t_verify: float,
    t_pre: float = 0.0,
    sync_bonus: bool = False,
) -> PicoSpecPrediction:
    """Tokens/s of token-sd (sync) and picospec (async) from measured timings and acceptance.
    sync_bonus=True counts token-sd's bonus token (this project's sync rounds have one; the paper's
    model does not)."""
    _check_alpha_gamma(alpha, gamma)
    _check_times(t_draft_per_token=t_draft_per_token, t_rtt=t_rtt, t_verify=t_verify, t_pre=t_pre)
    t_draft = gamma * t_draft_per_token
    sync_s = sync_step_time(t_draft, t_rtt, t_verify)
    async_s = expected_async_time(alpha, gamma, t_draft, t_rtt, t_verify, t_pre)
    length = expected_accepted_length(alpha, gamma)
    sync_length = expected_accepted_length(alpha, gamma, bonus=sync_bonus)
    sync_rate, async_rate = _rate(sync_length, sync_s), _rate(length, async_s)
    return PicoSpecPrediction(
        alpha=alpha,
        gamma=gamma,
        expected_length=length,
        sync_expected_length=sync_length,
        t_draft_s=t_draft,
        sync_step_s=sync_s,
        async_step_s=async_s,
        bubble_s=bubble(t_rtt, t_verify, t_draft, t_pre),
        sync_tokens_per_s=sync_rate,
        async_tokens_per_s=async_rate,
        speedup=async_rate / sync_rate if math.isfinite(sync_rate) and sync_rate > 0 else 1.0,
    )


def alpha_from_verdicts(verdicts: Iterable[tuple[int, int]]) -> float:
    """The per-token acceptance rate alpha from measured verdicts, each (drafts in the chunk, drafts
    accepted) as `DeviceSession.verdicts` records them.

    Estimator: under the model each draft is an independent Bernoulli(alpha) trial, and verification
    stops at the first failure. A chunk with a accepted of n drafts observed a successes and, when
    a < n, one failure; the drafts after the rejection were never tested (censored) and say nothing
    about alpha. The maximum-likelihood estimate is then successes / trials =
    sum(a) / (sum(a) + number of chunks with a rejection). Dividing by all drafted tokens instead
    would count the censored drafts as failures and bias alpha low. Chunks with no drafts count for
    nothing; with no trial at all the rate is undefined (ValueError)."""
    accepted = rejections = 0
    for drafts, num_accepted in verdicts:
        if (
            isinstance(drafts, bool)
            or isinstance(num_accepted, bool)
            or not (isinstance(drafts, int) and isinstance(num_accepted, int) and 0 <= num_accepted <= drafts)
        ):
            raise ValueError(
                f"a verdict must be (drafts, accepted) with 0 <= accepted <= drafts, got {(drafts, num_accepted)!r}"
            )
        accepted += num_accepted
        rejections += num_accepted < drafts
    if accepted + rejections == 0:
        raise ValueError("no draft was verified: alpha is undefined")
    return accepted / (accepted + rejections)
