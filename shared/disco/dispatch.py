"""DiSCo's dispatch controller (paper 003, §4.2 and Algorithms 1-3, appendix F). Pure.

Where to start a request, from two empirical distributions the monitor keeps: prompt lengths
p(l) and the server's TTFT F(t). The budget b in [0, 1] caps the constrained endpoint's expected
share of prompt tokens: E[I(l) l] <= b E[l].

* Server-constrained (the server's price dominates; Algorithm 3, eq. 3): prompts shorter than
  l_th run on the device only, and together carry (1 - b) of the expected prompt tokens; longer
  prompts start on both endpoints at once and the first token wins.
* Device-constrained (device energy dominates; Algorithm 2, eqs. 1-2): the server starts at
  once and the device starts after w(l) unless the server has already given its first token, so
  the device runs with probability P(TTFT > w(l)) = 1 - F(w(l)) (and surely when w(l) = 0).
  w(l) = 0 for l <= l_th, else min(beta * l, w_tail), with w_tail = F^{-1}(1 - min(alpha, b)).
  l_th is chosen greedily from the shortest length, then beta by bisection so that the device's
  expected share  sum_l p(l) l (1 - F(w(l))) / E[l]  is b (eq. 2; c_d^p multiplies both sides of
  the budget, so it cancels). With an empirical F the share is a step function of beta: beta is
  the smallest value whose share is <= b, so the share lands at b up to one step of F.
* No history (fewer than MIN_SAMPLES samples in a distribution the policy needs): race both
  endpoints at once, the best TTFT while the monitor learns.

Everything is computed in DispatchPolicy.build(); decide() is one compare and one multiply.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Literal

import numpy as np

from shared.disco.cost import CostModel

Constraint = Literal["device", "server"]
MIN_SAMPLES = 8  # fewer samples than this in a needed distribution: "no-history"
_BISECTION_STEPS = 100  # beta's bracket shrinks 2^-100: far below any step of F


@dataclass(frozen=True, eq=False)
class Distribution:
    """Empirical distribution of samples (prompt lengths, or server TTFT seconds); sorted inside."""

    values: np.ndarray  # [n] float64, ascending

    @classmethod
    def from_samples(cls, samples) -> Distribution:
        """Keep the finite samples >= 0; drop the rest (a failed request's NaN TTFT, say)."""
        values = np.asarray(list(samples) if not isinstance(samples, np.ndarray) else samples, dtype=np.float64).ravel()
        values = values[np.isfinite(values) & (values >= 0)]
        return cls(np.sort(values))

    def __len__(self) -> int:
        return int(self.values.size)

    def cdf(self, x: float) -> float:
        """F(x) = fraction of samples <= x (0 when empty)."""
        return float(self.cdfs(np.asarray([x], dtype=np.float64))[0]) if len(self) else 0.0

    def cdfs(self, xs: np.ndarray) -> np.ndarray:
        """F at each of xs: [k] -> [k]."""
        return np.searchsorted(self.values, xs, side="right") / max(len(self), 1)

    def quantile(self, p: float) -> float:
        """F^{-1}(p): the smallest sample x with F(x) >= p (p clipped to [0, 1])."""
        if not len(self):
            raise ValueError("quantile of an empty distribution")
        p = min(max(p, 0.0), 1.0)
        index = max(math.ceil(p * len(self) - 1e-9) - 1, 0)  # 1e-9: 0.95 * 20 must give 19
        return float(self.values[index])

    @property
    def mean(self) -> float:
        """Sample mean (0.0 when empty)."""
        return float(self.values.mean()) if len(self) else 0.0

    def support(self) -> tuple[np.ndarray, np.ndarray]:
        """(distinct values ascending, their probabilities): ([k], [k])."""
        values, counts = np.unique(self.values, return_counts=True)
        return values, counts / max(len(self), 1)


@dataclass(frozen=True)
class Decision:
    """Where one request starts.

    server: start the server endpoint (cloud or hat) at once.
    device_delay_s: None, the device does not run; 0, it starts at once; > 0, it starts after
      this wait unless the server has already given its first token.
    reason: "short-prompt", "race", "wait", "tail-wait", "no-history", "random-server",
      "random-device".
    """

    server: bool
    device_delay_s: float | None
    reason: str


def _as_distribution(samples) -> Distribution:
    return samples if isinstance(samples, Distribution) else Distribution.from_samples(samples)


def _check_fraction(name: str, value: float, low_open: bool = False) -> None:
    if not (math.isfinite(value) and (0 < value if low_open else 0 <= value) and value <= 1):
        raise ValueError(f"{name} must be in {'(0' if low_open else '[0'}, 1], got {value!r}")


def length_threshold_server(lengths: Distribution, budget: float) -> float:
    """Eq. 3 / Algorithm 3: the largest l_th with sum_{l < l_th} l p(l) <= (1 - b) E[l].

    Prompts with l < l_th run on the device only. On the discrete support l_th is the first
    length whose inclusion would pass (1 - b) E[l]; math.inf when none would (b = 0: everything on
    the device, even lengths never seen); b = 1 gives 0.0 (nothing device-only). Non-increasing in b.
    """
    _check_fraction("budget", budget)
    if not len(lengths):
        raise ValueError("no prompt lengths to take a threshold from")
    if budget >= 1.0:
        return 0.0
    values, probs = lengths.support()
    carried = np.cumsum(values * probs)  # [k] sum_{l <= values[i]} l p(l)
    target = (1.0 - budget) * carried[-1]
    within = int(np.searchsorted(carried, target * (1 + 1e-12), side="right"))  # how many fit
    return math.inf if within >= values.size else float(values[within])


def tail_wait(server_ttft: Distribution, alpha: float, budget: float) -> float:
    """Phase 1 of Algorithm 2: w_tail = F^{-1}(1 - min(alpha, b)) of the server's TTFT."""
    return server_ttft.quantile(1.0 - min(alpha, budget))


def _device_share(values, probs, ttft: Distribution, l_th: float, beta: float, w_tail: float) -> float:
    """The device's expected share of prompt tokens with w(l) = 0 for l <= l_th, else
    min(beta l, w_tail): sum_l p(l) l P(device runs | w(l)) / E[l]."""
    waits = np.where(values <= l_th, 0.0, np.minimum(beta * values, w_tail))  # [k]
    runs = np.where(waits <= 0.0, 1.0, 1.0 - ttft.cdfs(waits))  # [k] P(device runs)
    return float(np.sum(values * probs * runs) / np.sum(values * probs))


def device_wait_plan(lengths, server_ttft, budget: float, alpha: float) -> tuple[float, float, float]:
    """Algorithm 2 + eqs. 1-2: (l_th, beta, w_tail) for w(l) = 0 if l <= l_th else min(beta l, w_tail).

    b <= alpha: (0.0, inf, w_tail), every prompt waits w_tail. Otherwise the tail reserve costs
    r = 1 - F(w_tail) <= alpha of the share; starting length l at once instead costs
    p(l) l F(w_tail) / E[l] more; the shortest lengths are taken while what is left of b - r
    pays for them, and beta then spends the remainder over l > l_th (beta = 0 when every length
    fits). l_th is non-decreasing in b and w_tail non-increasing. w(l) for l > l_th is not
    monotone in b across a step of l_th: the newly immediate length takes budget beta had spread.
    """
    lengths, server_ttft = _as_distribution(lengths), _as_distribution(server_ttft)
    _check_fraction("budget", budget)
    _check_fraction("alpha", alpha, low_open=True)
    if not len(lengths) or not len(server_ttft):
        raise ValueError("a device-constrained plan needs prompt lengths and server TTFTs")
    w_tail = tail_wait(server_ttft, alpha, budget)
    if budget <= alpha:
        return 0.0, math.inf, w_tail
    values, probs = lengths.support()
    mass = values * probs / np.sum(values * probs)  # [k] each length's share of prompt tokens
    reserve = 1.0 - server_ttft.cdf(w_tail)
    extra = mass * (1.0 - reserve)  # [k] cost of starting each length at once
    spent = reserve + np.cumsum(extra)  # [k] share with lengths <= values[i] at once
    fit = int(np.searchsorted(spent, budget * (1 + 1e-12), side="right"))
    l_th = float(values[fit - 1]) if fit else 0.0
    if fit >= values.size or w_tail <= 0.0:
        return l_th, 0.0, w_tail
    # At `high` every l > l_th waits w_tail (share <= b); the 1e-9 keeps high * l >= w_tail in
    # floating point, else a lone length could wait a hair under w_tail and always run.
    low, high = 0.0, w_tail / values[fit] * (1 + 1e-9)
    for _ in range(_BISECTION_STEPS):
        mid = 0.5 * (low + high)
        if _device_share(values, probs, server_ttft, l_th, mid, w_tail) <= budget + 1e-12:
            high = mid
        else:
            low = mid
    return l_th, float(high), w_tail


@dataclass(frozen=True)
class DispatchPolicy:
    """A precomputed dispatch rule; `decide` is O(1). Build a fresh one as the monitor's
    distributions or the budget change."""

    constraint: Constraint
    budget: float
    length_threshold: float  # server: l < it -> device only; device: l <= it -> device at once
    beta: float  # device-constrained: seconds of wait per prompt token above l_th
    w_tail: float  # device-constrained: the longest wait, seconds
    alpha: float
    samples: int  # prompt-length samples the policy was built from
    history: bool = True  # False: too few samples, every request races

    @classmethod
    def build(
        cls, cost: CostModel, prompt_lengths, server_ttft_s, budget: float, alpha: float = 0.05
    ) -> DispatchPolicy:
        """The policy for this cost model's constraint (Algorithm 1), lengths, TTFTs and budget."""
        _check_fraction("budget", budget)
        _check_fraction("alpha", alpha, low_open=True)
        lengths, ttft = _as_distribution(prompt_lengths), _as_distribution(server_ttft_s)
        constraint = cost.constraint()
        needed = (lengths,) if constraint == "server" else (lengths, ttft)
        if any(len(d) < MIN_SAMPLES for d in needed):
            return cls(constraint, budget, 0.0, 0.0, 0.0, alpha, len(lengths), history=False)
        if constraint == "server":
            l_th = length_threshold_server(lengths, budget)
            return cls(constraint, budget, l_th, 0.0, 0.0, alpha, len(lengths))
        l_th, beta, w_tail = device_wait_plan(lengths, ttft, budget, alpha)
        return cls(constraint, budget, l_th, beta, w_tail, alpha, len(lengths))

    def decide(self, prompt_tokens: int) -> Decision:
        """Where a prompt of `prompt_tokens` tokens starts (see the module docstring)."""
        if not self.history:
            return Decision(True, 0.0, "no-history")
        if self.constraint == "server":
            if prompt_tokens < self.length_threshold:
                return Decision(False, 0.0, "short-prompt")
            return Decision(True, 0.0, "race")
        if prompt_tokens <= self.length_threshold:
            return Decision(True, 0.0, "race")
        wait = min(self.beta * prompt_tokens, self.w_tail)
        if wait >= self.w_tail:
            return Decision(True, self.w_tail, "tail-wait")
        return Decision(True, wait, "wait" if wait > 0 else "race")


def random_decision(constraint: Constraint, budget: float, rng: random.Random) -> Decision:
    """The Stoch-S / Stoch-D baselines: one endpoint, chosen at random within the budget.

    Server-constrained: the server alone with probability b, else the device alone.
    Device-constrained: the device alone with probability b, else the server alone.
    """
    _check_fraction("budget", budget)
    constrained_side = rng.random() < budget
    on_server = constrained_side if constraint == "server" else not constrained_side
    if on_server:
        return Decision(True, None, "random-server")
    return Decision(False, 0.0, "random-device")
