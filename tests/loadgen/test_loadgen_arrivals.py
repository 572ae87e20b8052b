"""Arrival process of the load generator: rate, dispersion, determinism, edge cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loadgen.arrivals import arrival_times


@pytest.mark.parametrize("burstiness", [0.25, 0.5, 1.0, 2.0, 8.0])
def test_mean_rate_and_dispersion(burstiness: float) -> None:
    rate = 7.0
    times = arrival_times(rate, burstiness, num_requests=100_001, seed=11)
    gaps = np.diff(times)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.02)
    # Gamma(B) gaps: coefficient of variation 1/sqrt(B) (1 for Poisson).
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.03)


def test_poisson_counts_in_windows_have_variance_equal_to_mean() -> None:
    times = arrival_times(4.0, 1.0, duration=5_000.0, seed=2)
    counts = np.bincount(times.astype(int), minlength=5_000)
    assert counts.mean() == pytest.approx(4.0, rel=0.03)
    assert counts.var() == pytest.approx(4.0, rel=0.08)  # index of dispersion 1


def test_duration_mode_stays_inside_the_window() -> None:
    times = arrival_times(50.0, 0.5, duration=200.0, seed=5)
    assert times[0] == 0.0 and times.max() < 200.0
    assert np.all(np.diff(times) >= 0)
    assert len(times) == pytest.approx(50 * 200, rel=0.05)


def test_infinite_rate_sends_everything_at_once() -> None:
    assert arrival_times(math.inf, 1.0, num_requests=5).tolist() == [0.0] * 5


def test_deterministic_per_seed() -> None:
    a = arrival_times(3.0, 1.0, num_requests=50, seed=1)
    assert np.array_equal(a, arrival_times(3.0, 1.0, num_requests=50, seed=1))
    assert not np.array_equal(a, arrival_times(3.0, 1.0, num_requests=50, seed=2))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(rate=1.0),  # neither n nor duration
        dict(rate=1.0, num_requests=3, duration=1.0),  # both
        dict(rate=0.0, num_requests=3),
        dict(rate=-1.0, num_requests=3),
        dict(rate=1.0, burstiness=0.0, num_requests=3),
        dict(rate=1.0, burstiness=math.inf, num_requests=3),
        dict(rate=math.inf, duration=1.0),  # infinitely many requests
        dict(rate=1.0, duration=0.0),
        dict(rate=1.0, num_requests=-1),
    ],
)
def test_rejects_bad_arguments(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        arrival_times(**kwargs)


@settings(max_examples=60, deadline=None)
@given(rate=st.floats(0.01, 1e4), burstiness=st.floats(0.05, 50), n=st.integers(0, 300), seed=st.integers(0, 2**31))
def test_shape_invariants(rate: float, burstiness: float, n: int, seed: int) -> None:
    times = arrival_times(rate, burstiness, num_requests=n, seed=seed)
    assert len(times) == n
    if n:
        assert times[0] == 0.0
        assert np.all(np.diff(times) >= 0) and np.all(np.isfinite(times))
