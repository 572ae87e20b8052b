"""HAT §3.2 state model: EMA (eq. 1), bucketed predictor g (eq. 2), device state."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.planning.compute_delay import ComputeDelayPredictor
from shared.planning.ema import Ema
from shared.planning.state_model import CloudState, DeviceState

finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False)
SETTINGS = settings(deadline=None, max_examples=150)


def test_ema_first_sample_initializes_then_blends() -> None:
    ema = Ema(0.8)
    assert ema.value is None
    assert ema.update(10.0) == 10.0
    assert ema.update(20.0) == pytest.approx(0.8 * 10 + 0.2 * 20)
    assert ema.count == 2


def test_ema_rejects_bad_alpha_and_samples() -> None:
    with pytest.raises(ValueError):
        Ema(1.0)
    with pytest.raises(ValueError):
        Ema().update(math.nan)


@SETTINGS
@given(st.lists(finite, min_size=1, max_size=50), st.floats(min_value=0, max_value=0.99))
def test_ema_stays_within_sample_range(samples: list[float], alpha: float) -> None:
    ema = Ema(alpha)
    for x in samples:
        ema.update(x)
    tol = 1e-9 * max(1.0, max(abs(x) for x in samples))
    assert min(samples) - tol <= ema.value <= max(samples) + tol


def test_ema_roundtrip() -> None:
    ema = Ema(0.5)
    ema.update(3)
    assert Ema.from_dict(ema.to_dict()) == ema


def test_bucket_of_is_log2() -> None:
    p = ComputeDelayPredictor(buckets_per_octave=1)
    assert [p.bucket_of(m) for m in (1, 2, 4, 8, 1024)] == [0, 1, 2, 3, 10]
    assert p.bucket_of(0) == 0


def test_predictor_eq2_per_bucket() -> None:
    p = ComputeDelayPredictor(alpha=0.8)
    assert p.predict(10) is None
    p.observe(64, 0.10)
    p.observe(64, 0.20)
    assert p.predict(64) == pytest.approx(0.8 * 0.10 + 0.2 * 0.20)
    assert p.predict(1) == p.predict(4096) == pytest.approx(0.12)  # one bucket: flat


def test_predictor_interpolates_and_extrapolates() -> None:
    p = ComputeDelayPredictor(buckets_per_octave=1)
    p.observe(8, 0.010)
    p.observe(512, 0.200)
    assert p.predict(8) == pytest.approx(0.010)
    assert p.predict(260) == pytest.approx(0.010 + (0.190) * (252 / 504))
    assert p.predict(1016) == pytest.approx(0.200 + 0.190 / 504 * 504)  # linear beyond
    assert p.predict(1) >= 0.0  # extrapolation below is clamped at zero
    p.observe(64, 0.050)
    assert p.predict(64) == pytest.approx(0.050)
    assert p.predict(36) == pytest.approx(0.010 + 0.040 * 28 / 56)


def test_predictor_running_max_keeps_it_monotone() -> None:
    p = ComputeDelayPredictor(buckets_per_octave=1)
    for mu, eta in [(4, 0.02), (32, 0.01), (256, 0.05)]:
        p.observe(mu, eta)
    values = [p.predict(m) for m in range(1, 2048, 7)]
    assert all(a <= b + 1e-12 for a, b in zip(values, values[1:]))
    raw = ComputeDelayPredictor(buckets_per_octave=1, monotone=False)
    for mu, eta in [(4, 0.02), (32, 0.01)]:
        raw.observe(mu, eta)
    assert raw.predict(32) == pytest.approx(0.01)


def test_predictor_fit_line_recovers_linear_costs() -> None:
    p = ComputeDelayPredictor()
    for mu in (2, 16, 128, 1024):
        p.observe(mu, 0.001 * mu + 0.005)
    c1, c2 = p.fit_line()
    assert c1 == pytest.approx(0.001) and c2 == pytest.approx(0.005)
    assert p.predict(2048) == pytest.approx(0.001 * 2048 + 0.005)


@SETTINGS
@given(st.integers(1, 4096), st.integers(1, 4096), st.floats(0, 10), st.floats(0, 10), st.floats(0, 1))
def test_interpolation_lies_between_neighbours(mu_a: int, mu_b: int, eta_a: float, eta_b: float, frac: float) -> None:
    p = ComputeDelayPredictor(monotone=False)
    if p.bucket_of(mu_a) == p.bucket_of(mu_b):
        return
    p.observe(mu_a, eta_a)
    p.observe(mu_b, eta_b)
    mu = min(mu_a, mu_b) + frac * abs(mu_a - mu_b)
    assert min(eta_a, eta_b) - 1e-9 <= p.predict(mu) <= max(eta_a, eta_b) + 1e-9


@SETTINGS
@given(
    st.lists(st.tuples(st.integers(1, 8192), st.floats(0, 5)), min_size=1, max_size=40),
    st.lists(st.floats(0, 20000), min_size=2, max_size=20),
)
def test_monotone_predictor_never_decreases(obs: list[tuple[int, float]], queries: list[float]) -> None:
    p = ComputeDelayPredictor()
    for mu, eta in obs:
        p.observe(mu, eta)
    qs = sorted(queries)
    preds = [p.predict(q) for q in qs]
    assert all(x >= 0 for x in preds)
    assert all(a <= b + 1e-9 for a, b in zip(preds, preds[1:]))


def test_predictor_roundtrip_and_validation() -> None:
    p = ComputeDelayPredictor(alpha=0.7, buckets_per_octave=3)
    for mu, eta in [(3, 0.01), (300, 0.1), (3000, 0.9)]:
        p.observe(mu, eta, now=123.0)
    q = ComputeDelayPredictor.from_dict(p.to_dict())
    assert q.to_dict() == p.to_dict()
    assert [q.predict(m) for m in (1, 50, 5000)] == [p.predict(m) for m in (1, 50, 5000)]
    with pytest.raises(ValueError):
        p.observe(0, 0.1)
    with pytest.raises(ValueError):
        p.observe(8, -1)


def test_cloud_state_eq1_and_roundtrip() -> None:
    c = CloudState()
    c.observe_step(100, 0.05, now=1.0, num_sessions=3)
    c.observe_step(200, 0.08, now=2.0, overhead_s=0.002)
    assert c.mu.value == pytest.approx(0.8 * 100 + 0.2 * 200)
    assert c.step_overhead.value == pytest.approx(0.002) and c.step_overhead.count == 1
    assert c.updated_at == 2.0 and c.g.observed_buckets == 2
    assert CloudState.from_dict(c.to_dict()).to_dict() == c.to_dict()


def test_device_state() -> None:
    d = DeviceState("dev-1")
    d.observe_draft(0.02, now=10.0)
    assert d.observe_transfer("up", 1_000_000, 0.2, now=11.0) == pytest.approx(5e6)
    d.observe_transfer("up", 1_000_000, 0.1, now=12.0)
    assert d.beta_up.value == pytest.approx(0.8 * 5e6 + 0.2 * 1e7)
    assert d.beta_down.value is None
    assert d.age(15.0) == 3.0 and not d.is_stale(15.0, 5) and d.is_stale(30.0, 5)
    assert DeviceState("x").is_stale(0.0, 1e9)
    assert DeviceState.from_dict(d.to_dict()) == d
    d.observe_draft(0.02, now=12.5, round_overhead_s=0.004, prefill_token_s=1e-4, pd_hit_rate=0.25)
    d.observe_draft(0.02, now=12.6, round_overhead_s=0.006)
    assert d.round_overhead.value == pytest.approx(0.8 * 0.004 + 0.2 * 0.006)
    assert d.prefill_token.value == pytest.approx(1e-4) and d.prefill_token.count == 1
    assert d.pd_hit.value == 0.25
    assert DeviceState.from_dict(d.to_dict()) == d
    with pytest.raises(ValueError):
        d.observe_draft(0.02, now=13.0, round_overhead_s=-1.0)
    with pytest.raises(ValueError):
        d.observe_draft(0.02, now=13.0, prefill_token_s=0.0)
    with pytest.raises(ValueError):
        d.observe_draft(0.02, now=13.0, pd_hit_rate=1.5)
    with pytest.raises(ValueError):
        d.observe_transfer("sideways", 1, 1.0, now=0)
    with pytest.raises(ValueError):
        d.observe_transfer("down", 1, 0.0, now=0)
