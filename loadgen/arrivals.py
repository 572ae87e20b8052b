"""Request arrival times for an open-loop benchmark (the `vllm bench serve` model).

Inter-arrival gaps are gamma distributed with shape `burstiness` and mean
`1/rate`, so the long-run rate is `rate` whatever the burstiness, and the
coefficient of variation of the gaps is `1/sqrt(burstiness)`: B = 1 is a
Poisson process (HAT's workload), B < 1 is burstier, B > 1 smoother.
`rate = inf` sends everything at t = 0 (a closed-loop "as fast as possible" run).

As in vllm, the first request is sent at t = 0 rather than after a first gap,
so a run does not start with an idle wait.
"""

from __future__ import annotations

import math

import numpy as np

# Separate RNG stream for arrivals, so the prompt draw and the arrival draw of one seed
# are independent and changing one does not reshuffle the other.
_ARRIVAL_STREAM = 1


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng([seed, _ARRIVAL_STREAM])


def arrival_times(
    rate: float, burstiness: float = 1.0, num_requests: int | None = None, duration: float | None = None, seed: int = 0
) -> np.ndarray:
    """Arrival offsets in seconds from the start of the run (sorted, first one 0).

    Give exactly one of `num_requests` (that many arrivals) or `duration` (every
    arrival in [0, duration)). Deterministic for a seed.
    """
    if (num_requests is None) == (duration is None):
        raise ValueError("give exactly one of num_requests or duration")
    if not rate > 0:
        raise ValueError(f"rate must be > 0 (inf for all at once), got {rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness must be a finite number > 0, got {burstiness}")
    if num_requests is not None:
        if num_requests < 0:
            raise ValueError("num_requests must be >= 0")
        if math.isinf(rate):
            return np.zeros(num_requests)
        gaps = _gaps(_rng(seed), rate, burstiness, max(0, num_requests - 1))
        return np.concatenate([[0.0], np.cumsum(gaps)])[:num_requests]
    assert duration is not None
    if not (duration > 0 and math.isfinite(duration)):
        raise ValueError(f"duration must be a finite number > 0, got {duration}")
    if math.isinf(rate):
        raise ValueError("rate=inf needs num_requests (a duration would mean infinitely many requests)")
    rng = _rng(seed)
    times = [np.zeros(1)]
    last = 0.0
    batch = max(16, int(rate * duration * 1.2))  # usually one draw is enough
    while last < duration:
        chunk = last + np.cumsum(_gaps(rng, rate, burstiness, batch))
        times.append(chunk)
        last = float(chunk[-1])
    out = np.concatenate(times)
    return out[out < duration]


def _gaps(rng: np.random.Generator, rate: float, burstiness: float, n: int) -> np.ndarray:
    # Gamma(shape=B, scale=1/(rate*B)): mean 1/rate, variance 1/(B*rate^2).
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
