"""TTFT, TBT and accept length, defined once (pure: no I/O, no clocks of its own).

Used by the engine, the device agent, the token streamer, the load generator and the
chat client, so a number called "TBT" means the same thing wherever it is printed.

A request's `Timeline` is its start and its deliveries: when each batch of tokens
arrived and how many tokens it carried (a speculative round makes several tokens
final at once). All times are seconds on one clock, whichever the caller uses.

* TTFT = first delivery - start.
* TBT samples: one per token after the first. A delivery of k tokens arriving G after
  the previous delivery counts as k gaps of G/k; the first delivery's extra k-1 tokens
  count as gaps of 0. The samples therefore sum to (last delivery - first delivery),
  so mean TBT = (last - first) / (tokens - 1), and TBT percentiles stay meaningful under
  speculative decoding (one gap per chunk, vllm's ITL, would count a 4-token round as
  one slow token).
* Accept length: tokens made final per verification round (accepted drafts + 1). A
  request's mean weights every round equally; pooled over requests, each request's mean
  is weighted by its number of rounds (which is the same mean over all rounds).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

SUMMARY_KEYS = ("mean", "median", "std", "p90", "p99")


@dataclass
class Timeline:
    """One request: its start and, per delivery, the arrival time and the number of tokens."""

    start_s: float = 0.0
    times_s: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.times_s) != len(self.tokens):
            raise ValueError(f"{len(self.times_s)} delivery times but {len(self.tokens)} token counts")
        if any(k < 1 for k in self.tokens):
            raise ValueError("every delivery carries at least one token")

    def deliver(self, t_s: float, num_tokens: int) -> None:
        """Record a delivery; one of no tokens is not a delivery (nothing reached the user)."""
        if num_tokens > 0:
            self.times_s.append(t_s)
            self.tokens.append(num_tokens)

    @property
    def num_tokens(self) -> int:
        return sum(self.tokens)

    @classmethod
    def from_token_times(cls, token_times_s: Sequence[float], start_s: float = 0.0) -> Timeline:
        """From one arrival time per token, where the tokens of one delivery share a time."""
        timeline = cls(start_s)
        for t in token_times_s:
            if timeline.times_s and timeline.times_s[-1] == t:
                timeline.tokens[-1] += 1
            else:
                timeline.deliver(t, 1)
        return timeline


def ttft_s(timeline: Timeline) -> float | None:
    """Start -> first delivery; None when nothing was delivered."""
    return timeline.times_s[0] - timeline.start_s if timeline.times_s else None


def tbt_samples_s(timeline: Timeline) -> list[float]:
    """One gap per token after the first (see the module docstring); [] for fewer than 2 tokens."""
    times, tokens = timeline.times_s, timeline.tokens
    if not times:
        return []
    samples = [0.0] * (tokens[0] - 1)
    for prev, now, k in zip(times, times[1:], tokens[1:]):
        samples.extend([(now - prev) / k] * k)
    return samples


def mean_tbt_s(timeline: Timeline) -> float | None:
    """The mean of `tbt_samples_s`, i.e. (last - first delivery) / (tokens - 1); None below 2 tokens."""
    n = timeline.num_tokens
    return (timeline.times_s[-1] - timeline.times_s[0]) / (n - 1) if n > 1 else None


def typical_tokens_per_s(timeline: Timeline) -> float | None:
    """Decoding speed of a typical round: tokens per delivery after the first, over the median gap between
    deliveries. A stall that holds up a few rounds (another session's prompt ahead in the verifier's queue)
    moves the mean TBT but not this; a cost every round pays moves both. None without two deliveries."""
    times = timeline.times_s
    if len(times) < 2:
        return None
    gap = float(np.median(np.diff(times)))
    tokens = timeline.tokens[1:]
    return sum(tokens) / len(tokens) / gap if gap > 0 else None


def mean_accept_length(accept_lengths: Sequence[int]) -> float | None:
    """One request's tokens per verification round; None when it had no round."""
    return sum(accept_lengths) / len(accept_lengths) if accept_lengths else None


def pooled_accept_length(per_request: Iterable[tuple[float, int]]) -> float | None:
    """Tokens per round over many requests from (mean accept length, rounds) pairs."""
    pairs = [(mean, rounds) for mean, rounds in per_request if rounds > 0]
    total_rounds = sum(rounds for _, rounds in pairs)
    return sum(mean * rounds for mean, rounds in pairs) / total_rounds if total_rounds else None


def summary(values: Iterable[float | None]) -> dict[str, float | None]:
    """mean, median, std (population), p90, p99 of the values that are not None; all None if none are."""
    xs = np.asarray([v for v in values if v is not None], dtype=float)
    if xs.size == 0:
        return dict.fromkeys(SUMMARY_KEYS)
    stats = (xs.mean(), np.median(xs), xs.std(), np.percentile(xs, 90), np.percentile(xs, 99))
    return {key: float(v) for key, v in zip(SUMMARY_KEYS, stats)}
