"""Edge SD pipeline timeline (paper 001, eqs. 20-23) against hand-checked cases and an event simulation."""

from __future__ import annotations

import heapq
import math
import random
from collections import deque

import pytest

from loadgen.edge_sd_timeline import (
    TimelineInputError,
    pipeline_timeline,
    sequential_timeline,
    step_completion,
)

# Two batches, two steps each. Hand-checked below.
DRAFT = [[1.0, 2.0], [1.0, 1.0]]
VERIFY = [[3.0, 1.0], [2.0, 2.0]]


def test_hand_checked_eq20_with_barrier():
    timeline = pipeline_timeline(DRAFT, VERIFY, [2, 2])
    # step 1: C^d = 1, 3; C_1 = max(1, 0) + 3 = 4; C_2 = max(3, 4) + 1 = 5 -> T_1 = 5
    # step 2 (from 5): C^d = 1, 2; C_1 = 1 + 2 = 3; C_2 = max(2, 3) + 2 = 5 -> T_2 = 5
    assert timeline.step_latencies == (5.0, 5.0)
    assert timeline.inference_latency == 10.0 and timeline.total_latency == 10.0
    second = timeline.entry(0, 1)
    assert (second.draft_start, second.draft_end, second.verify_start, second.verify_end) == (1.0, 3.0, 4.0, 5.0)
    last = timeline.entry(1, 1)
    assert (last.draft_start, last.draft_end, last.verify_start, last.verify_end) == (6.0, 7.0, 8.0, 10.0)
    assert timeline.batch_completion == (8.0, 10.0)
    assert step_completion([1.0, 2.0], [3.0, 1.0]) == [4.0, 5.0]


def test_hand_checked_relaxed_sequential_and_start_time():
    relaxed = pipeline_timeline(DRAFT, VERIFY, [2, 2], step_barrier=False)
    # draft (2,1) waits for verify (1,1) at 4 -> 4..5, verify 5..7; draft (2,2) 5..6, verify 7..9
    assert relaxed.entry(1, 0).draft_start == 4.0
    assert relaxed.entry(1, 1).verify_start == 7.0
    assert relaxed.total_latency == 9.0
    sequential = sequential_timeline(DRAFT, VERIFY, [2, 2])
    assert sequential.total_latency == 1 + 3 + 2 + 1 + 1 + 2 + 1 + 2
    assert sequential.step_latencies == (7.0, 6.0)
    # eq. 23: T = T_inf + T_com; the upload phase only shifts the schedule.
    shifted = pipeline_timeline(DRAFT, VERIFY, [2, 2], start_time=2.5)
    assert shifted.inference_latency == 10.0 and shifted.total_latency == 12.5
    assert shifted.entry(0, 0).draft_start == 2.5
    assert shifted.batch_completion == (10.5, 12.5)


def test_batches_finishing_early_leave_later_steps():
    # Batch 0 needs 1 step, batch 2 needs 2, batch 1 needs 3: M_1 = 3, M_2 = 2, M_3 = 1 (eq. 21).
    draft = [[1.0, 1.0, 1.0], [None, 2.0, 2.0], [None, 1.0, None]]
    verify = [[2.0, 2.0, 2.0], [None, 1.0, 3.0], [None, 4.0, None]]
    timeline = pipeline_timeline(draft, verify, [1, 3, 2])
    assert [(e.step, e.batch) for e in timeline.entries] == [(0, 0), (0, 1), (0, 2), (1, 1), (1, 2), (2, 1)]
    with pytest.raises(KeyError):
        timeline.entry(1, 0)
    # step 1: C = 3, 5, 7; step 2 over batches (1, 2): C = 2+1 = 3, max(4, 3)+3 = 7; step 3: 1+4 = 5
    assert timeline.step_latencies == (7.0, 7.0, 5.0)
    assert timeline.batch_completion == (3.0, 19.0, 14.0)
    for steps, batch in zip([1, 3, 2], range(3)):
        assert max(e.step for e in timeline.entries if e.batch == batch) == steps - 1


def _simulate(draft, verify, steps_per_batch, start, barrier):
    """Two single-server resources (SBS drafter, MBS verifier), FIFO in (n, m) order, as Fig. 4.

    A draft job is eligible when its inputs exist: with the barrier, once every job of step n-1 is
    verified (eqs. 21-22); without, once batch m's step n-1 is verified.
    """
    order = [(n, m) for n in range(max(steps_per_batch)) for m in range(len(steps_per_batch)) if steps_per_batch[m] > n]
    per_step = {n: {job for job in order if job[0] == n} for n in range(max(steps_per_batch))}
    draft_queue, verify_queue = deque(order), deque()
    verified: set = set()
    record = {job: {} for job in order}
    events = [(start, 0, "go", None)]
    sequence = 1
    drafter_busy = verifier_busy = False
    while events:
        now, _, kind, job = heapq.heappop(events)
        if kind == "draft_done":
            drafter_busy = False
            record[job]["draft_end"] = now
            verify_queue.append(job)
        elif kind == "verify_done":
            verifier_busy = False
            record[job]["verify_end"] = now
            verified.add(job)
        if not drafter_busy and draft_queue:
            n, m = draft_queue[0]
            ready = n == 0 or (per_step[n - 1] <= verified if barrier else (n - 1, m) in verified)
            if ready:
                job = draft_queue.popleft()
                drafter_busy = True
                record[job]["draft_start"] = now
                heapq.heappush(events, (now + draft[n][m], sequence, "draft_done", job))
                sequence += 1
        if not verifier_busy and verify_queue:
            job = verify_queue.popleft()
            verifier_busy = True
            record[job]["verify_start"] = now
            heapq.heappush(events, (now + verify[job[0]][job[1]], sequence, "verify_done", job))
            sequence += 1
    return record


def _random_case(rng: random.Random, zero_ok: bool = True):
    batches = rng.randint(1, 6)
    steps = [rng.randint(1, 5) for _ in range(batches)]
    low = 0.0 if zero_ok else 0.01

    def duration():
        return 0.0 if zero_ok and rng.random() < 0.1 else rng.uniform(max(low, 0.01), 3.0)

    draft = [[duration() for _ in range(batches)] for _ in range(max(steps))]
    verify = [[duration() for _ in range(batches)] for _ in range(max(steps))]
    return draft, verify, steps, rng.choice([0.0, rng.uniform(0, 5)])


@pytest.mark.parametrize("barrier", [True, False])
def test_recursion_equals_event_simulation(barrier):
    rng = random.Random(20 if barrier else 21)
    for _ in range(300):
        draft, verify, steps, start = _random_case(rng)
        timeline = pipeline_timeline(draft, verify, steps, start, step_barrier=barrier)
        simulated = _simulate(draft, verify, steps, start, barrier)
        assert len(timeline.entries) == len(simulated) == sum(steps)
        for entry in timeline.entries:
            expected = simulated[(entry.step, entry.batch)]
            for field in ("draft_start", "draft_end", "verify_start", "verify_end"):
                assert getattr(entry, field) == pytest.approx(expected[field], abs=1e-9)
        assert timeline.total_latency == pytest.approx(max(r["verify_end"] for r in simulated.values()), abs=1e-9)
        if barrier:  # eq. 22: the total is the sum of per-step eq. 20 makespans
            per_step = [
                step_completion(
                    [draft[n][m] for m in range(len(steps)) if steps[m] > n],
                    [verify[n][m] for m in range(len(steps)) if steps[m] > n],
                )[-1]
                for n in range(max(steps))
            ]
            assert timeline.step_latencies == pytest.approx(per_step, abs=1e-9)
            assert timeline.inference_latency == pytest.approx(math.fsum(per_step), abs=1e-9)


def test_pipeline_never_slower_than_sequential_and_strictly_faster_with_two_batches():
    rng = random.Random(31)
    for _ in range(300):
        draft, verify, steps, start = _random_case(rng)
        sequential = sequential_timeline(draft, verify, steps, start)
        barrier = pipeline_timeline(draft, verify, steps, start)
        relaxed = pipeline_timeline(draft, verify, steps, start, step_barrier=False)
        assert relaxed.total_latency <= barrier.total_latency + 1e-9
        assert barrier.total_latency <= sequential.total_latency + 1e-9
        for n, (piped, serial) in enumerate(zip(barrier.step_latencies, sequential.step_latencies)):
            assert piped <= serial + 1e-9, n
    for _ in range(300):
        draft, verify, steps, start = _random_case(rng, zero_ok=False)
        if len(steps) < 2:
            steps.append(1)
            draft[0].append(1.0)
            verify[0].append(1.0)
            for row in draft[1:] + verify[1:]:
                row.append(None)
        sequential = sequential_timeline(draft, verify, steps, start)
        barrier = pipeline_timeline(draft, verify, steps, start)
        # Step 1 has every batch: batch 2's draft overlaps batch 1's verification.
        assert barrier.step_latencies[0] < sequential.step_latencies[0] - 1e-9
        assert barrier.total_latency < sequential.total_latency - 1e-9


def test_single_batch_pipeline_equals_sequential():
    draft, verify = [[1.5], [0.5], [2.0]], [[1.0], [3.0], [0.25]]
    assert pipeline_timeline(draft, verify, [3]).total_latency == sequential_timeline(draft, verify, [3]).total_latency


def test_as_dict_round_trips_the_numbers():
    timeline = pipeline_timeline(DRAFT, VERIFY, [2, 2])
    data = timeline.as_dict()
    assert data["total_latency"] == 10.0 and data["step_latencies"] == [5.0, 5.0]
    assert data["entries"][1] == {
        "step": 0,
        "batch": 1,
        "draft_start": 1.0,
        "draft_end": 3.0,
        "verify_start": 4.0,
        "verify_end": 5.0,
    }


@pytest.mark.parametrize(
    ("draft", "verify", "steps", "start"),
    [
        ([[1.0]], [[1.0]], [], 0.0),
        ([[1.0]], [[1.0]], [0], 0.0),
        ([[1.0]], [[1.0]], [1.5], 0.0),
        ([[1.0]], [[1.0]], [True], 0.0),
        ([[1.0]], [[1.0]], [2], 0.0),
        ([[1.0], [1.0]], [[1.0]], [2], 0.0),
        ([[1.0, 1.0]], [[1.0]], [1], 0.0),
        ([[-1.0]], [[1.0]], [1], 0.0),
        ([[1.0]], [[math.nan]], [1], 0.0),
        ([[1.0]], [[math.inf]], [1], 0.0),
        ([[None]], [[1.0]], [1], 0.0),
        ([[1.0]], [[1.0]], [1], -1.0),
        ([[1.0]], [[1.0]], [1], math.inf),
    ],
)
def test_bad_inputs_are_typed_errors(draft, verify, steps, start):
    for build in (
        lambda: pipeline_timeline(draft, verify, steps, start),
        lambda: pipeline_timeline(draft, verify, steps, start, step_barrier=False),
        lambda: sequential_timeline(draft, verify, steps, start),
    ):
        with pytest.raises(TimelineInputError):
            build()
    with pytest.raises(TimelineInputError):
        step_completion([1.0, 2.0], [1.0])
