"""PicoSpec's expected-time model (shared/specdec/picospec_model.py) against brute force and simulation."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from shared.specdec import picospec_model as pm


def _brute_force_length(alpha: float, gamma: int, bonus: bool) -> float:
    """E[L] by enumerating every accept/reject pattern of gamma independent drafts."""
    total = 0.0
    for outcome in itertools.product((True, False), repeat=gamma):
        probability = math.prod(alpha if ok else 1 - alpha for ok in outcome)
        accepted = next((i for i, ok in enumerate(outcome) if not ok), gamma)  # before the first rejection
        total += probability * (accepted + 1 if bonus else min(accepted + 1, gamma))
    return total


@pytest.mark.parametrize("gamma", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("alpha", [0.0, 0.1, 0.5, 0.77, 0.999, 1.0])
def test_expected_length_equals_brute_force(alpha, gamma):
    assert pm.expected_accepted_length(alpha, gamma) == pytest.approx(
        _brute_force_length(alpha, gamma, False), abs=1e-12
    )
    assert pm.expected_accepted_length(alpha, gamma, bonus=True) == pytest.approx(
        _brute_force_length(alpha, gamma, True), abs=1e-12
    )


def test_expected_length_is_the_papers_closed_form():
    for alpha, gamma in [(0.3, 4), (0.8, 6), (0.95, 10)]:
        assert pm.expected_accepted_length(alpha, gamma) == pytest.approx((1 - alpha**gamma) / (1 - alpha))
        assert pm.expected_accepted_length(alpha, gamma, bonus=True) == pytest.approx(
            (1 - alpha ** (gamma + 1)) / (1 - alpha)
        )


def test_expected_length_matches_a_simulated_truncated_geometric():
    rng = random.Random(7)
    alpha, gamma, rounds = 0.7, 5, 200_000
    lengths = []
    for _ in range(rounds):
        accepted = 0
        while accepted < gamma and rng.random() < alpha:
            accepted += 1
        lengths.append(min(accepted + 1, gamma))
    mean = sum(lengths) / rounds
    # standard error ~ 0.003 here; 5 sigma
    assert mean == pytest.approx(pm.expected_accepted_length(alpha, gamma), abs=0.015)


def test_expected_length_limits():
    assert pm.expected_accepted_length(0.0, 6) == 1
    assert pm.expected_accepted_length(1.0, 6) == 6
    assert pm.expected_accepted_length(1.0, 6, bonus=True) == 7
    assert pm.expected_accepted_length(1 - 1e-12, 6) == pytest.approx(6)
    assert pm.expected_accepted_length(1e-12, 6) == pytest.approx(1)
    # monotone in alpha
    values = [pm.expected_accepted_length(a / 20, 5) for a in range(21)]
    assert values == sorted(values)


def test_eq9_against_a_simulation_of_hits_and_misses():
    rng = random.Random(11)
    alpha, gamma = 0.8, 4
    t_draft, t_rtt, t_verify = 0.040, 0.100, 0.020
    hit_time, miss_time = max(t_draft, t_rtt + t_verify), t_draft + t_rtt + t_verify
    total_time = total_tokens = 0.0
    rounds = 100_000
    for _ in range(rounds):
        outcome = [rng.random() < alpha for _ in range(gamma)]
        accepted = outcome.index(False) if False in outcome else gamma
        total_time += hit_time if accepted == gamma else miss_time
        total_tokens += min(accepted + 1, gamma)
    expected = pm.expected_async_time(alpha, gamma, t_draft, t_rtt, t_verify)
    assert expected == pytest.approx(alpha**gamma * hit_time + (1 - alpha**gamma) * miss_time)
    assert total_time / rounds == pytest.approx(expected, rel=0.01)
    # renewal-reward: tokens per second over many rounds -> E[L] / E[T_async]
    assert total_tokens / total_time == pytest.approx(
        pm.async_throughput(alpha, gamma, t_draft, t_rtt, t_verify), rel=0.01
    )


def test_eq1_eq2_eq3_relations_on_a_grid():
    times = [0.0, 0.005, 0.03, 0.1, 0.4]
    for t_draft, t_rtt, t_verify, t_pre in itertools.product(times, repeat=4):
        sync = pm.sync_step_time(t_draft, t_rtt, t_verify)
        assert sync == pytest.approx(t_draft + t_rtt + t_verify)
        assert pm.async_step_time(t_draft, t_rtt, t_verify) == max(t_draft, t_rtt + t_verify)
        assert pm.async_step_time(t_draft, t_rtt, t_verify, t_pre) <= pm.async_step_time(t_draft, t_rtt, t_verify)
        assert pm.async_step_time(t_draft, t_rtt, t_verify) <= sync
        b = pm.bubble(t_rtt, t_verify, t_draft, t_pre)
        assert b >= 0
        assert b == max(0.0, t_rtt + t_verify - t_draft - t_pre)
        for alpha in (0.0, 0.4, 0.9, 1.0):
            expected = pm.expected_async_time(alpha, 4, t_draft, t_rtt, t_verify, t_pre)
            assert expected <= sync + 1e-15
            assert expected >= pm.async_step_time(t_draft, t_rtt, t_verify, t_pre) - 1e-15


def test_compute_bound_pipeline_has_no_bubble():
    assert pm.bubble(t_rtt=0.02, t_verify=0.01, t_draft=0.05) == 0
    assert pm.bubble(t_rtt=0.10, t_verify=0.02, t_draft=0.05, t_pre=0.03) == pytest.approx(0.04)


def test_speedup_limits():
    t_draft, t_rtt, t_verify = 0.2, 0.1, 0.05  # compute-bound
    assert pm.speedup(0.0, 5, t_draft, t_rtt, t_verify) == pytest.approx(1.0)
    assert pm.speedup(1.0, 5, t_draft, t_rtt, t_verify) == pytest.approx(1 + (t_rtt + t_verify) / t_draft)  # eq. 10
    assert pm.speedup_limit(t_draft, t_rtt, t_verify) == pytest.approx(1 + (t_rtt + t_verify) / t_draft)
    # network-bound: the limit is L_sync / (T_RTT + T_verify), below eq. 10's formula
    assert pm.speedup_limit(0.05, 0.1, 0.02) == pytest.approx(0.17 / 0.12)
    speedups = [pm.speedup(a / 10, 5, t_draft, t_rtt, t_verify) for a in range(11)]
    assert speedups == sorted(speedups)
    assert all(1 - 1e-12 <= s <= pm.speedup_limit(t_draft, t_rtt, t_verify) + 1e-12 for s in speedups)


def test_predict_is_consistent_with_the_equations():
    prediction = pm.predict(alpha=0.85, gamma=6, t_draft_per_token=0.012, t_rtt=0.1, t_verify=0.03)
    t_draft = 6 * 0.012
    length = pm.expected_accepted_length(0.85, 6)
    assert prediction.t_draft_s == pytest.approx(t_draft)
    assert prediction.sync_step_s == pytest.approx(t_draft + 0.13)
    assert prediction.async_step_s == pytest.approx(pm.expected_async_time(0.85, 6, t_draft, 0.1, 0.03))
    assert prediction.bubble_s == pytest.approx(0.13 - t_draft)
    assert prediction.sync_tokens_per_s == pytest.approx(length / (t_draft + 0.13))
    assert prediction.async_tokens_per_s == pytest.approx(length / prediction.async_step_s)
    assert prediction.speedup == pytest.approx(prediction.async_tokens_per_s / prediction.sync_tokens_per_s)
    assert prediction.speedup > 1
    with_bonus = pm.predict(0.85, 6, 0.012, 0.1, 0.03, sync_bonus=True)
    assert with_bonus.sync_tokens_per_s == pytest.approx(pm.expected_accepted_length(0.85, 6, True) / (t_draft + 0.13))


def test_predict_with_all_times_zero_does_not_divide_by_zero():
    prediction = pm.predict(1.0, 3, 0.0, 0.0, 0.0)
    assert prediction.sync_tokens_per_s == math.inf
    assert prediction.speedup == 1.0


def test_alpha_from_verdicts_counts_only_tested_drafts():
    # 4 of 4 accepted; 1 of 4 accepted then a rejection (the 2 drafts after it were never tested)
    assert pm.alpha_from_verdicts([(4, 4), (4, 1)]) == pytest.approx(5 / 6)
    assert pm.alpha_from_verdicts([(3, 0)]) == 0.0
    assert pm.alpha_from_verdicts([(3, 3), (0, 0)]) == 1.0


def test_alpha_from_verdicts_recovers_a_simulated_alpha():
    rng = random.Random(3)
    alpha = 0.72
    verdicts = []
    for _ in range(20_000):
        drafts = rng.randint(1, 8)
        accepted = 0
        while accepted < drafts and rng.random() < alpha:
            accepted += 1
        verdicts.append((drafts, accepted))
    assert pm.alpha_from_verdicts(verdicts) == pytest.approx(alpha, abs=0.01)
    naive = sum(a for _, a in verdicts) / sum(d for d, _ in verdicts)
    assert naive < alpha - 0.05  # dividing by every drafted token would be biased low


@pytest.mark.parametrize("verdicts", [[], [(0, 0)], [(2, 3)], [(2, -1)], [(-1, 0)], [(2.0, 1)]])
def test_alpha_from_verdicts_rejects_bad_input(verdicts):
    with pytest.raises(ValueError):
        pm.alpha_from_verdicts(verdicts)


@pytest.mark.parametrize(
    "call",
    [
        lambda: pm.expected_accepted_length(-0.1, 3),
        lambda: pm.expected_accepted_length(1.1, 3),
        lambda: pm.expected_accepted_length(float("nan"), 3),
        lambda: pm.expected_accepted_length(0.5, 0),
        lambda: pm.expected_accepted_length(0.5, 2.5),
        lambda: pm.sync_step_time(-0.01, 0.1, 0.1),
        lambda: pm.async_step_time(0.1, -1.0, 0.1),
        lambda: pm.bubble(0.1, 0.1, 0.1, t_pre=-0.1),
        lambda: pm.expected_async_time(0.5, 3, 0.1, 0.1, float("inf")),
        lambda: pm.predict(0.5, 3, -0.001, 0.1, 0.1),
        lambda: pm.predict(2.0, 3, 0.01, 0.1, 0.1),
    ],
)
def test_invalid_inputs_raise_value_error(call):
    with pytest.raises(ValueError):
        call()
