"""Jupiter's sequence partition (§IV-B2, eqs. 2-4): balanced sub-sequences against brute force,
l_min, sums, later parts shorter when cost grows with the prefix, and the eq. 4 count choice."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from shared.jupiter.sequence import (
    SequencePlan,
    brute_force_sequence,
    equal_sub_sequences,
    min_subsequence_length,
    pipeline_latency,
    plan_sequences,
    scale_parts,
)


def attention_cost(a: float, b: float, overhead: float = 0.0):
    """t(S, c) = overhead + a*S + b*S*(c + S/2): linear projections/MLP plus causal attention."""

    def t(length, prefix):
        length = np.asarray(length, np.float64)
        prefix = np.asarray(prefix, np.float64)
        return overhead + a * length + b * length * (prefix + length / 2)

    return t


def _random_table_cost(rng: random.Random, size: int):
    """An arbitrary positive cost per (S, c) (no structure), for exactness against brute force."""
    table = np.array([[rng.uniform(0.1, 5.0) for _ in range(size + 1)] for _ in range(size + 1)])

    def t(length, prefix):
        return table[np.asarray(length, np.int64), np.asarray(prefix, np.int64)]

    return t


def test_dp_equals_brute_force_on_random_costs():
    rng = random.Random(2)
    for _ in range(60):
        max_len, l_min, k_max = rng.randint(1, 12), rng.randint(1, 4), rng.randint(1, 5)
        t = _random_table_cost(rng, max_len)
        plan = plan_sequences(t, num_stages=rng.randint(1, 4), max_len=max_len, l_min=l_min, k_max=k_max)
        from shared.jupiter.sequence import _balanced_tables

        best, _ = _balanced_tables(t, max_len, l_min, k_max)
        for length in range(1, max_len + 1):
            for k in range(2, k_max + 1):
                expected, _ = brute_force_sequence(t, length, k, l_min)
                assert best[k, length] == expected
            parts = plan.sub_sequences(length)
            assert sum(parts) == length
            assert len(parts) == 1 or min(parts) >= l_min


def test_chosen_count_minimises_the_pipeline_latency_over_balanced_partitions():
    rng = random.Random(5)
    for _ in range(25):
        max_len, l_min, k_max, stages = rng.randint(2, 12), rng.randint(1, 3), rng.randint(1, 5), rng.randint(1, 4)
        t = _random_table_cost(rng, max_len)
        hop, latency = rng.choice([0.0, 0.05]), rng.choice([0.0, 0.3])
        plan = plan_sequences(t, stages, max_len, l_min, k_max, hop, latency)
        for length in range(1, max_len + 1):
            options = [[length]] + [brute_force_sequence(t, length, k, l_min)[1] for k in range(2, k_max + 1)]
            best = min(pipeline_latency(p, t, stages, hop, latency) for p in options if p)
            assert plan.latency_s[length - 1] == pytest.approx(best, rel=1e-9)
            assert pipeline_latency(plan.sub_sequences(length), t, stages, hop, latency) == pytest.approx(
                best, rel=1e-9
            )


def test_later_parts_are_shorter_when_cost_grows_with_the_prefix():
    t = attention_cost(a=1.0, b=0.01)
    plan = plan_sequences(t, num_stages=4, max_len=600, l_min=16, k_max=6)
    parts = plan.sub_sequences(600)
    assert len(parts) >= 3
    assert parts[0] > parts[-1]
    assert all(x >= y for x, y in zip(parts, parts[1:]))
    # and the balanced split is no slower than the equal one on its slowest part
    equal = equal_sub_sequences(600, len(parts))
    slowest = lambda ps: max(float(t(p, sum(ps[:i]))) for i, p in enumerate(ps))  # noqa: E731
    assert slowest(parts) < slowest(equal)


def test_sums_and_l_min_for_every_length():
    plan = plan_sequences(attention_cost(1.0, 0.002, overhead=20.0), 3, 300, l_min=32, k_max=8)
    for length in range(1, 301):
        parts = plan.sub_sequences(length)
        assert sum(parts) == length
        if length < 32:
            assert parts == [length]
        else:
            assert min(parts) >= 32 and len(parts) <= 8


def test_pipelining_pays_off_only_when_the_pipeline_has_stages():
    t = attention_cost(1.0, 0.001, overhead=1.0)
    assert plan_sequences(t, 1, 256, l_min=1, k_max=8).sub_sequences(256) == [256]
    assert len(plan_sequences(t, 4, 256, l_min=8, k_max=8).sub_sequences(256)) > 1


def test_ties_in_exact_arithmetic_go_to_fewer_parts():
    # one stage, no per-part cost: every split has the same total (the attention triangle is the
    # same), up to rounding; the plan must not split for a rounding error
    plan = plan_sequences(attention_cost(1.0, 0.001), 1, 256, l_min=1, k_max=8)
    assert all(len(plan.sub_sequences(n)) == 1 for n in range(1, 257))


def test_a_per_part_overhead_limits_the_count():
    # a fixed cost per part (kernel launches, per-message LAN latency) makes many parts a loss
    t = attention_cost(1.0, 0.0, overhead=200.0)
    few = plan_sequences(t, 4, 256, l_min=1, k_max=8).sub_sequences(256)
    many = plan_sequences(attention_cost(1.0, 0.0), 4, 256, l_min=1, k_max=8).sub_sequences(256)
    assert len(few) < len(many) == 8


def test_pipeline_latency_is_eq4_for_identical_stages_without_links():
    t = attention_cost(1.0, 0.01)
    parts = [100, 60, 40]
    times = [float(t(p, c)) for p, c in zip(parts, (0, 100, 160))]
    for stages in (1, 2, 4):
        assert pipeline_latency(parts, t, stages) == pytest.approx(sum(times) + (stages - 1) * max(times))


def test_pipeline_latency_adds_the_lan():
    t = attention_cost(1.0, 0.0)
    # two stages, one part of 10 tokens: compute 10, hop 10*0.5 serialising + 2 in flight, compute 10
    assert pipeline_latency([10], t, 2, hop_s_per_token=0.5, hop_latency_s=2.0) == pytest.approx(27.0)
    # an unbalanced second stage (half the bottleneck's time)
    assert pipeline_latency([10], t, 2, stage_scales=[1.0, 0.5]) == pytest.approx(15.0)


def test_min_subsequence_length():
    lengths = [1, 4, 16, 64, 256]
    # per-token: 10, 2.5, 1.2, 1.05, 1.0 -> within 10 % of 1.0 from 64 on
    times = [10.0, 10.0, 19.2, 67.2, 256.0]
    assert min_subsequence_length(lengths, times, tolerance=0.10) == 64
    assert min_subsequence_length(lengths, times) == 16  # the default tolerance, 25 %
    assert min_subsequence_length(lengths, times, tolerance=0.0) == 256
    # a CPU: per-token time rises again past 128 (attention); the reference is the best S, not the longest
    assert min_subsequence_length([1, 32, 128, 512], [10.0, 32 * 1.4, 128 * 1.0, 512 * 1.3]) == 128


def test_equal_sub_sequences_and_scaling():
    assert equal_sub_sequences(10, 3) == [4, 3, 3]
    assert equal_sub_sequences(2, 4) == [1, 1]
    with pytest.raises(ValueError):
        equal_sub_sequences(0, 2)
    assert sum(scale_parts([300, 200, 100], 1001)) == 1001
    assert scale_parts([300, 200, 100], 1200) == [600, 400, 200]


def test_lengths_beyond_the_table_scale_the_last_entry():
    plan = plan_sequences(attention_cost(1.0, 0.01), 4, 200, l_min=8, k_max=4)
    last = plan.sub_sequences(200)
    beyond = plan.sub_sequences(450)
    assert sum(beyond) == 450 and len(beyond) == len(last)
    with pytest.raises(ValueError):
        plan.sub_sequences(0)


def test_sequence_plan_rejects_a_table_that_does_not_partition():
    with pytest.raises(ValueError):
        SequencePlan(2, 1, 4, ((1,), (1, 2)), (0.0, 0.0))


def test_planning_2048_is_fast_enough_to_run_in_tests():
    # not a timing assertion: the full table for a long context must simply be computable here
    plan = plan_sequences(attention_cost(1.0, 0.001, overhead=5.0), 3, 2048, l_min=32, k_max=8, hop_s_per_token=0.01)
    assert len(plan.table) == 2048 and all(math.isfinite(x) for x in plan.latency_s)
