"""Edge SD batching (paper 001, Algorithm 1, eqs. 18-22 and 28-32): step times, the pipeline
recursion, the DP against brute force, the memory budget Γ_s and the max-batching baseline."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from shared.edge_sd.batching import (
    EdgeCosts,
    InfeasibleBatchingError,
    brute_force_batching,
    dp_batching,
    max_batching,
    pipeline_latency,
)
from shared.edge_sd.runtime import ModelShape, RuntimeModel, draft_pass_flops, verify_step_flops
from shared.edge_sd.speculation import choose_speculation_length, decoding_steps

DRAFT = ModelShape(layers=22, hidden=2048, ffn=5632)  # LLaMA-1.1B (Table I)
TARGET = ModelShape(layers=32, hidden=4096, ffn=11008)  # LLaMA-7B
DRAFT_GPU = RuntimeModel(c1=4.11e-13, c2=0.56e-3)  # Table II
VERIFY_GPU = RuntimeModel(c1=2.08e-14, c2=1.28e-2)


def _costs(spec_len=4, alpha=0.8, budget=16e9, **overrides):
    fields = dict(
        draft=DRAFT,
        target=TARGET,
        draft_runtime=DRAFT_GPU,
        verify_runtime=VERIFY_GPU,
        spec_len=spec_len,
        alpha=alpha,
        memory_budget=budget,
    )
    fields.update(overrides)
    return EdgeCosts(**fields)


def _random_case(seed):
    rng = random.Random(seed)
    count = rng.randint(1, 7)
    tasks = [(rng.randint(1, 512), rng.randint(1, 256)) for _ in range(count)]
    if rng.random() < 0.5:  # the paper's simplification O_k = O_max for every task
        o_max = max(o for _, o in tasks)
        tasks = [(i, o_max) for i, _ in tasks]
    draft = ModelShape(rng.choice([2, 4]), rng.choice([256, 768]), rng.choice([1024, 3072]))
    target = ModelShape(rng.choice([8, 32]), rng.choice([1024, 4096]), rng.choice([4096, 11008]))
    costs = EdgeCosts(
        draft=draft,
        target=target,
        draft_runtime=RuntimeModel(rng.uniform(1e-13, 1e-12), rng.uniform(1e-4, 5e-3)),
        verify_runtime=RuntimeModel(rng.uniform(5e-15, 5e-14), rng.uniform(1e-3, 3e-2)),
        spec_len=rng.randint(1, 8),
        alpha=rng.uniform(0.3, 0.95),
        # Room for 600..4000 cached tokens: some cases force small batches.
        memory_budget=draft.weight_bytes + draft.kv_bytes_per_token * rng.randint(600, 4000),
    )
    return costs, tasks


def _feasible_cases(count):
    cases = []
    seed = 0
    while len(cases) < count:
        costs, tasks = _random_case(seed)
        seed += 1
        if all(costs.fits(1, i, o) for i, o in tasks):
            cases.append((seed - 1, costs, tasks))
    return cases


CASES = _feasible_cases(200)


def test_step_times_are_eqs_18_and_19_pass_by_pass():
    costs = _costs(spec_len=3, alpha=0.7)
    big_l = costs.tokens_per_step
    batch, i_m, o_m = 5, 200, 40
    draft_secs, verify_secs = costs.step_times(batch, i_m, o_m)
    steps = decoding_steps(o_m, big_l)
    assert len(draft_secs) == len(verify_secs) == steps
    for n in range(1, steps + 1):
        expected_draft = sum(DRAFT_GPU.seconds(batch, draft_pass_flops(DRAFT, i_m, n, i, big_l)) for i in (1, 2, 3))
        expected_verify = VERIFY_GPU.seconds(batch, verify_step_flops(TARGET, i_m, n, 3, big_l))
        assert draft_secs[n - 1] == pytest.approx(expected_draft, rel=1e-12)
        assert verify_secs[n - 1] == pytest.approx(expected_verify, rel=1e-12)


def test_pipeline_latency_is_the_eq_20_recursion():
    costs = _costs()
    tasks = [(50, 30), (300, 90), (120, 60)]
    batches = [[0], [2, 1]]
    first = costs.step_times(1, 50, 30)
    second = costs.step_times(2, 300, 90)
    total = 0.0
    for n in range(max(len(first[0]), len(second[0]))):
        active = [times for times in (first, second) if n < len(times[0])]  # M_n (eq. 21)
        draft_done = both_done = 0.0
        for draft_secs, verify_secs in active:
            draft_done += draft_secs[n]
            both_done = max(draft_done, both_done) + verify_secs[n]  # eq. 20
        total += both_done  # eq. 22
    assert pipeline_latency(costs, tasks, batches) == pytest.approx(total, rel=1e-12)
    # Pipelining helps: less than running the batches one after the other.
    serial = sum(float(np.sum(d) + np.sum(v)) for d, v in (first, second))
    assert pipeline_latency(costs, tasks, batches) < serial


@pytest.mark.parametrize("seed,costs,tasks", CASES[:100])
def test_exact_dp_equals_contiguous_brute_force(seed, costs, tasks):
    exact = dp_batching(costs, tasks, exact=True)
    brute = brute_force_batching(costs, tasks)
    assert exact.latency == pytest.approx(brute.latency, rel=1e-12)
    assert pipeline_latency(costs, tasks, exact.batches) == pytest.approx(exact.latency, rel=1e-12)


def test_paper_dp_matches_brute_force_on_nearly_all_cases():
    """Algorithm 1 keeps one state per prefix: never below the optimum, equal almost always."""
    misses = []
    for seed, costs, tasks in CASES:
        paper = dp_batching(costs, tasks)
        brute = brute_force_batching(costs, tasks)
        assert pipeline_latency(costs, tasks, paper.batches) == pytest.approx(paper.latency, rel=1e-12)
        assert paper.latency >= brute.latency * (1 - 1e-12)
        if paper.latency > brute.latency * (1 + 1e-12):
            misses.append((seed, paper.latency / brute.latency - 1))
    assert len(misses) <= len(CASES) // 50, misses
    assert all(gap < 0.01 for _, gap in misses), misses


def test_plans_cover_every_task_once_and_respect_memory():
    for _, costs, tasks in CASES[:60]:
        for plan in (dp_batching(costs, tasks), dp_batching(costs, tasks, exact=True), max_batching(costs, tasks)):
            assert sorted(k for batch in plan.batches for k in batch) == list(range(len(tasks)))
            for batch in plan.batches:
                assert costs.fits(len(batch), max(tasks[k][0] for k in batch), max(tasks[k][1] for k in batch))


def test_memory_budget_forces_small_batches():
    tasks = [(100, 100)] * 6
    # Γ_s holds the weights plus KV for exactly two tasks of 200 tokens.
    budget = DRAFT.weight_bytes + 2 * DRAFT.kv_bytes_per_token * 200
    costs = _costs(budget=budget)
    for plan in (dp_batching(costs, tasks), dp_batching(costs, tasks, exact=True), max_batching(costs, tasks)):
        assert max(len(batch) for batch in plan.batches) <= 2
    assert [len(b) for b in max_batching(costs, tasks).batches] == [2, 2, 2]
    # With unlimited memory the same tasks go in bigger batches.
    assert max(len(b) for b in max_batching(_costs(), tasks).batches) == 6


def test_infeasible_and_empty_inputs_are_typed_errors():
    tiny = _costs(budget=DRAFT.weight_bytes + DRAFT.kv_bytes_per_token * 100)
    tasks = [(10, 10), (80, 40)]  # the second task alone needs 120 tokens of KV
    for plan in (
        lambda: dp_batching(tiny, tasks),
        lambda: dp_batching(tiny, tasks, exact=True),
        lambda: brute_force_batching(tiny, tasks),
        lambda: max_batching(tiny, tasks),
        lambda: dp_batching(_costs(), []),
    ):
        with pytest.raises(InfeasibleBatchingError):
            plan()


def test_dp_never_worse_than_max_batching():
    for _, costs, tasks in CASES:
        assert dp_batching(costs, tasks).latency <= max_batching(costs, tasks).latency * (1 + 1e-12)


def test_dp_strictly_beats_max_batching_on_mixed_input_lengths():
    # Three short and three long prompts, memory for all six: max batching pads every short prompt
    # to 500 tokens in one batch; the DP splits them, so the two batches also pipeline.
    tasks = [(500, 64), (8, 64), (500, 64), (8, 64), (8, 64), (500, 64)]
    costs = _costs()
    dp, greedy = dp_batching(costs, tasks), max_batching(costs, tasks)
    assert len(greedy.batches) == 1
    assert sorted(map(sorted, dp.batches)) == [[0, 2, 5], [1, 3, 4]]
    assert dp.latency < 0.95 * greedy.latency


def test_sorting_can_lose_to_unrestricted_batching():
    """Algorithm 1 searches consecutive runs of the input-sorted tasks, pipelined shortest first.
    Over all set partitions in every pipeline order it can lose; this pins such a case
    (seeded random cases) so the limitation stays documented."""
    losses = 0
    for _, costs, tasks in CASES:
        if len(tasks) > 4:
            continue
        contiguous = brute_force_batching(costs, tasks)
        anything = brute_force_batching(costs, tasks, contiguous=False)
        assert anything.latency <= contiguous.latency * (1 + 1e-12)
        losses += anything.latency < contiguous.latency * (1 - 1e-9)
    assert losses > 0


def test_speculation_length_from_the_dp():
    tasks = [(64, 256), (300, 256), (120, 256), (500, 256)]

    def latency_of_l(l):
        try:
            return dp_batching(_costs(spec_len=l, alpha=0.8), tasks).latency
        except InfeasibleBatchingError:
            return math.inf

    chosen, best = choose_speculation_length(0.8, 12, latency_of_l)
    assert best == min(latency_of_l(l) for l in range(1, 13))
    assert 1 < chosen < 12


@pytest.mark.parametrize("seed", range(20))
def test_the_dp_latency_is_the_timeline_modules_eq_20_schedule(seed):
    """pipeline_latency is eq. 20 vectorised over steps for the DP's inner loop; loadgen/edge_sd_timeline.py is the same
    recursion step by step with every start and end: both must give the same T_inf."""
    from loadgen.edge_sd_timeline import pipeline_timeline

    costs, tasks = _random_case(seed)
    batches = dp_batching(costs, tasks).batches
    times = [costs.step_times(len(b), max(tasks[k][0] for k in b), max(tasks[k][1] for k in b)) for b in batches]
    steps = max(len(td) for td, _ in times)
    draft = [[float(td[n]) if n < len(td) else None for td, _ in times] for n in range(steps)]
    verify = [[float(tv[n]) if n < len(tv) else None for _, tv in times] for n in range(steps)]
    timeline = pipeline_timeline(draft, verify, [len(td) for td, _ in times])
    assert timeline.inference_latency == pytest.approx(pipeline_latency(costs, tasks, batches), rel=1e-9)
