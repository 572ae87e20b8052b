"""HAT planners (shared.planning.planners): eq. 3 chunk size and eq. 6 parallel-draft steps, pure functions."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.planning.compute_delay import ComputeDelayPredictor
from shared.planning.monitor_plans import (
    PlannerInputs,
    plan_draft_steps_from_state,
    plan_from_state,
    predictor_from_cloud_state,
)
from shared.planning.planners import (
    CHUNK_ALIGN,
    chunk_size_eq3,
    eq3_gap,
    hidden_bytes_per_token,
    parallel_draft_steps_eq6,
)
from shared.planning.state_model import CloudState

light = settings(max_examples=150, deadline=None)

A = hidden_bytes_per_token(256)  # 512 bytes/token: the demo model in fp16

# Realistic magnitudes: uplinks from 10 kB/s to 1 GB/s, batches of 0..4096 tokens.
betas = st.floats(1e4, 1e9)
mus = st.floats(0, 4096)
stages = st.integers(1, 8)
bounds = st.tuples(st.integers(1, 300), st.integers(0, 2000)).map(lambda t: (t[0], t[0] + t[1]))
prompts = st.integers(1, 5000)


def concave_g(c0: float, c1: float, c2: float) -> Callable[[float], float]:
    """g(μ) = c0 + c1·μ + c2·√μ: non-decreasing and concave, so eq. 3's gap f changes sign at most once."""
    return lambda m: c0 + c1 * m + c2 * math.sqrt(m)


coefs = st.tuples(st.floats(0, 0.1), st.floats(0, 1e-3), st.floats(0, 1e-2))


def solve(beta: float, g: Callable[[float], float], mu: float, p: int, lo: int, hi: int, prompt: int = 10**9) -> int:
    return chunk_size_eq3(A, beta, g, mu, p, lo, hi, prompt)


def grid_prev(x: int, lo: int) -> int:
    """The candidate just below x on the solver's grid (min, multiples of 16, max)."""
    below = ((x - 1) // CHUNK_ALIGN) * CHUNK_ALIGN
    return max(below, lo)


# -- eq. 3 -------------------------------------------------------------------------------------


def test_eq3_hand_computed() -> None:
    # g(x) = 0.01 + 1e-4·x, μ = 100: g(μ) = 0.02, g(μ+X) = 0.02 + 1e-4·X; upload 512 B/token at 1 MB/s.
    g = concave_g(0.01, 1e-4, 0.0)
    # P=1: 5.12e-4·X = 0.04 + 1e-4·X  ->  X = 97.09, rounded up to the 16-grid: 112
    assert solve(1e6, g, 100, 1, 16, 1024) == 112
    assert eq3_gap(96, A, 1e6, g, 100, 1) < 0 <= eq3_gap(112, A, 1e6, g, 100, 1)
    # P=4: 5.12e-4·X = 0.01 + 2.5e-5·X  ->  X = 20.5  ->  32
    assert solve(1e6, g, 100, 4, 16, 1024) == 32
    # never more than the prompt; a prompt under min_size goes whole
    assert solve(1e6, g, 100, 1, 16, 1024, prompt=50) == 50
    assert solve(1e6, g, 100, 1, 16, 1024, prompt=3) == 3
    # slow uplink (100 kB/s): even 16 tokens' upload outlasts the cloud time -> min
    assert solve(1e5, g, 100, 1, 16, 1024) == 16
    # fast uplink (100 MB/s): upload never catches up with the cloud -> max
    assert solve(1e8, g, 100, 1, 16, 1024) == 1024
    # bounds off the grid stay as given
    assert solve(1e6, g, 100, 1, 90, 1000) == 112
    assert solve(1e6, g, 100, 1, 100, 1000) == 100  # the root 97.09 is below min_size
    assert solve(1e6, g, 100, 1, 20, 100) == 100


def test_eq3_rejects_bad_inputs() -> None:
    g = concave_g(0.01, 1e-4, 0)
    for bad in (dict(beta=0), dict(beta=math.inf), dict(mu=-1), dict(p=0), dict(lo=0), dict(hi=5)):
        kw: dict[str, Any] = {"beta": 1e6, "mu": 10, "p": 1, "lo": 16, "hi": 1024, **bad}
        with pytest.raises(ValueError):
            solve(kw["beta"], g, kw["mu"], kw["p"], kw["lo"], kw["hi"])
    with pytest.raises(ValueError):
        chunk_size_eq3(0, 1e6, g, 10, 1, 16, 1024, 100)
    with pytest.raises(ValueError):
        hidden_bytes_per_token(0)
    assert hidden_bytes_per_token(4096) == 8192 and hidden_bytes_per_token(64, 4) == 256


@light
@given(betas, coefs, mus, stages, bounds, prompts)
def test_eq3_bounds_and_grid(
    beta: float, c: tuple[float, float, float], mu: float, p: int, b: tuple[int, int], prompt: int
) -> None:
    lo, hi = b
    x = solve(beta, concave_g(*c), mu, p, lo, hi, prompt)
    if prompt < lo:
        assert x == prompt
    else:
        assert lo <= x <= min(hi, prompt)
    assert x in (lo, hi, prompt) or x % CHUNK_ALIGN == 0


@light
@given(st.tuples(betas, betas).map(sorted), coefs, mus, stages, bounds)
def test_eq3_faster_uplink_never_smaller_chunk(
    beta: list[float], c: tuple[float, float, float], mu: float, p: int, b: tuple[int, int]
) -> None:
    g = concave_g(*c)
    assert solve(beta[0], g, mu, p, *b) <= solve(beta[1], g, mu, p, *b)


@light
@given(betas, coefs, st.floats(0, 0.1), st.floats(1, 10), mus, stages, bounds)
def test_eq3_slower_cloud_never_smaller_chunk(
    beta: float, c: tuple[float, float, float], shift: float, scale: float, mu: float, p: int, b: tuple[int, int]
) -> None:
    g = concave_g(*c)
    base = solve(beta, g, mu, p, *b)
    assert base <= solve(beta, lambda m: g(m) + shift, mu, p, *b)
    assert base <= solve(beta, lambda m: scale * g(m), mu, p, *b)


@light
@given(betas, coefs, mus, st.tuples(stages, stages).map(sorted), bounds)
def test_eq3_longer_pipeline_never_larger_chunk(
    beta: float, c: tuple[float, float, float], mu: float, p: list[int], b: tuple[int, int]
) -> None:
    g = concave_g(*c)
    assert solve(beta, g, mu, p[0], *b) >= solve(beta, g, mu, p[1], *b)


@light
@given(betas, coefs, mus, stages, bounds)
def test_eq3_solution_is_the_rounded_up_root(
    beta: float, c: tuple[float, float, float], mu: float, p: int, b: tuple[int, int]
) -> None:
    """Unclamped by the prompt, X is the first grid point with f >= 0: f(previous grid point) < 0 <= f(X)."""
    g, (lo, hi) = concave_g(*c), b
    x = solve(beta, g, mu, p, lo, hi)

    def f(n: int) -> float:
        return eq3_gap(n, A, beta, g, mu, p)

    if x < hi:
        assert f(x) >= 0
    if x > lo:
        assert f(grid_prev(x, lo)) < 0
    if lo <= x - CHUNK_ALIGN and x < hi:  # an interior answer is within one grid step of the real root
        assert f(x - CHUNK_ALIGN) < 0 <= f(x)  # (below lo there is no chunk: f(0) is 0, hypothesis found)


@light
@given(
    st.lists(st.tuples(st.integers(1, 4096), st.floats(0, 0.5)), min_size=1, max_size=12), betas, mus, stages, bounds
)
def test_eq3_sign_change_with_any_monotone_predictor(
    obs: list[tuple[int, float]], beta: float, mu: float, p: int, b: tuple[int, int]
) -> None:
    """For the monitor's piecewise-linear g (not necessarily concave) X still brackets a root of eq. 3."""
    pred = ComputeDelayPredictor()
    for m, eta in obs:
        pred.observe(m, eta)

    def g(m: float) -> float:
        value = pred.predict(m)
        assert value is not None
        return value

    lo, hi = b
    x = solve(beta, g, mu, p, lo, hi)
    assert lo <= x <= hi
    if lo < x < hi:
        assert eq3_gap(grid_prev(x, lo), A, beta, g, mu, p) < 0 <= eq3_gap(x, A, beta, g, mu, p)


# -- eq. 6 -------------------------------------------------------------------------------------


def test_eq6_hand_computed() -> None:
    # 8 tokens·512 B: up 4096/1e6 = 4.096 ms, down 4096/2e6 = 2.048 ms, cloud 20 ms -> 26.144 ms / 5 ms = 5.23
    assert parallel_draft_steps_eq6(8, A, 1e6, 2e6, 0.02, 0.005, 16) == 5
    assert parallel_draft_steps_eq6(8, A, 1e6, 2e6, 0.02, 0.005, 3) == 3  # clamped
    assert parallel_draft_steps_eq6(8, A, 1e6, 2e6, 0.02, 0.5, 16) == 0  # slow device: none
    assert parallel_draft_steps_eq6(0, A, 1e6, 2e6, 0.3, 0.1, 16) == 3  # 0.3/0.1 is 2.999... in floats
    assert parallel_draft_steps_eq6(8, A, 1e6, 2e6, 0.02, 1e-300, 16) == 16  # huge ratio: no overflow
    for bad in (
        (-1, A, 1e6, 1e6, 0.0, 0.1, 4),
        (1, A, 0, 1e6, 0.0, 0.1, 4),
        (1, A, 1e6, 1e6, -1, 0.1, 4),
        (1, A, 1e6, 1e6, 0.0, 0, 4),
        (1, A, 1e6, 1e6, math.nan, 0.1, 4),
    ):
        with pytest.raises(ValueError):
            parallel_draft_steps_eq6(*bad)


eq6_args = st.tuples(st.integers(0, 64), betas, betas, st.floats(0, 1.0))


@light
@given(eq6_args, st.tuples(st.floats(1e-5, 1.0), st.floats(1e-5, 1.0)).map(sorted), st.integers(0, 64))
def test_eq6_slower_drafting_never_more_steps(
    args: tuple[int, float, float, float], gammas: list[float], max_steps: int
) -> None:
    n, up, down, g_mu = args
    fast = parallel_draft_steps_eq6(n, A, up, down, g_mu, gammas[0], max_steps)
    slow = parallel_draft_steps_eq6(n, A, up, down, g_mu, gammas[1], max_steps)
    assert 0 <= slow <= fast <= max_steps


@light
@given(eq6_args, st.floats(0, 1.0), st.floats(1e-5, 1.0), st.integers(0, 64))
def test_eq6_busier_cloud_never_fewer_steps(
    args: tuple[int, float, float, float], extra: float, gamma: float, max_steps: int
) -> None:
    n, up, down, g_mu = args
    assert parallel_draft_steps_eq6(n, A, up, down, g_mu, gamma, max_steps) <= parallel_draft_steps_eq6(
        n, A, up, down, g_mu + extra, gamma, max_steps
    )


# -- from the monitor's JSON -------------------------------------------------------------------


def cloud_json(samples: list[tuple[int, float]]) -> dict[str, Any]:
    """The fields of `GET /state/cloud` the planners read, built the way the monitor builds them."""
    cloud = CloudState()
    for i, (m, eta) in enumerate(samples):
        cloud.observe_step(m, eta, now=float(i))
    return {
        "mu": cloud.mu.value,
        "alpha": cloud.alpha,
        "g": {"buckets": cloud.g.table(), "line": None},
        "updated_at": cloud.updated_at,
    }


def device_json(**kw: Any) -> dict[str, Any]:
    base = {
        "device_id": "d",
        "gamma": 0.004,
        "beta_up": 8e5,
        "beta_down": 1.6e6,
        "last_update": 1.0,
        "age_s": 0.5,
        "stale": False,
    }
    return {**base, **kw}


SAMPLES = [(64, 0.02), (512, 0.06), (8, 0.01), (128, 0.03), (2048, 0.2)]
INPUTS = PlannerInputs(
    bytes_per_token=A,
    stages=1,
    min_chunk_size=16,
    max_chunk_size=1024,
    default_chunk_size=128,
    stale_after_s=30,
    default_draft_steps=2,
    max_draft_steps=16,
)


def test_predictor_rebuilt_from_cloud_json_matches_monitor() -> None:
    cloud = CloudState(g=ComputeDelayPredictor(buckets_per_octave=3))
    for i, (m, eta) in enumerate(SAMPLES * 3):
        cloud.observe_step(m, eta, now=float(i))
    rebuilt = predictor_from_cloud_state({"alpha": 0.8, "g": {"buckets": cloud.g.table()}})
    assert rebuilt is not None and rebuilt.buckets_per_octave == 3
    for m in (1, 7, 64, 100, 300, 2048, 5000):
        assert rebuilt.predict(m) == pytest.approx(cloud.g.predict(m))
    assert predictor_from_cloud_state({"g": {"buckets": []}}) is None
    assert predictor_from_cloud_state({"g": None}) is None
    assert predictor_from_cloud_state({"g": {"buckets": [{"bucket": 1, "mu": None, "eta": 0.1}]}}) is None


def test_plan_from_state_uses_eq3_and_eq6() -> None:
    cloud = cloud_json(SAMPLES)
    pred = predictor_from_cloud_state(cloud)
    assert pred is not None

    def g(m: float) -> float:
        return pred.predict(m) or 0.0

    size, source = plan_from_state(cloud, device_json(), INPUTS, 5000)
    assert source == "eq3" and size == chunk_size_eq3(A, 8e5, g, cloud["mu"], 1, 16, 1024, 5000)
    assert 16 < size < 1024
    assert plan_from_state(cloud, device_json(), INPUTS, 20) == (20, "eq3")
    steps, source = plan_draft_steps_from_state(cloud, device_json(), INPUTS, 8)
    assert source == "eq6" and steps == parallel_draft_steps_eq6(8, A, 8e5, 1.6e6, g(cloud["mu"]), 0.004, 16)


@pytest.mark.parametrize(
    ("cloud", "device", "reason"),
    [
        (cloud_json(SAMPLES), None, "no-telemetry"),
        (None, device_json(), "no-telemetry"),
        ({"mu": None, "g": {"buckets": []}}, device_json(), "no-telemetry"),
        (cloud_json(SAMPLES), device_json(last_update=None, age_s=None), "no-telemetry"),
        (cloud_json(SAMPLES), device_json(age_s=31.0), "stale"),
        (cloud_json(SAMPLES), device_json(age_s=None, stale=True), "stale"),
        (cloud_json(SAMPLES), device_json(beta_up=None), "missing-beta"),
        (cloud_json(SAMPLES), device_json(beta_up=-5.0), "bad-telemetry"),
        (cloud_json(SAMPLES), device_json(beta_up="fast"), "bad-telemetry"),
    ],
)
def test_plan_from_state_defaults(cloud: dict[str, Any] | None, device: dict[str, Any] | None, reason: str) -> None:
    assert plan_from_state(cloud, device, INPUTS, 5000) == (128, f"default:{reason}")
    assert plan_from_state(cloud, device, INPUTS, 50) == (50, f"default:{reason}")


@pytest.mark.parametrize(
    ("device", "reason"),
    [
        (device_json(beta_down=None), "missing-beta"),
        (device_json(gamma=None), "missing-gamma"),
        (device_json(gamma=0.0), "bad-telemetry"),
        (device_json(age_s=100.0), "stale"),
    ],
)
def test_plan_draft_steps_defaults(device: dict[str, Any], reason: str) -> None:
    assert plan_draft_steps_from_state(cloud_json(SAMPLES), device, INPUTS, 8) == (2, f"default:{reason}")


def test_defaults_are_clamped() -> None:
    inputs = PlannerInputs(
        bytes_per_token=A,
        min_chunk_size=32,
        max_chunk_size=64,
        default_chunk_size=8,
        default_draft_steps=9,
        max_draft_steps=4,
    )
    assert inputs.default_chunk(1000) == 32 and inputs.default_chunk(10) == 10 and inputs.default_steps() == 4


def test_a_verifier_that_only_calibrated_plans_as_idle():
    """The verifier's startup passes give g but serve no step: the planners answer from g at mu = 0 instead of
    falling back to the defaults until the first request has run."""
    calibrated = CloudState()
    for i, (m, eta) in enumerate(SAMPLES):
        calibrated.observe_calibration(m, eta, now=float(i))
    assert calibrated.mu.value is None and calibrated.g.observed_buckets > 0
    cloud = {
        "mu": None,
        "alpha": calibrated.alpha,
        "g": {"buckets": calibrated.g.table(), "line": None},
        "updated_at": calibrated.updated_at,
    }
    g = predictor_from_cloud_state(cloud)
    assert g is not None
    size, source = plan_from_state(cloud, device_json(), INPUTS, 5000)
    assert source == "eq3"
    assert size == chunk_size_eq3(A, 8e5, lambda m: g.predict(m) or 0.0, 0.0, 1, 16, 1024, 5000)
