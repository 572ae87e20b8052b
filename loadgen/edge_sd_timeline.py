"""Edge SD's draft/verify pipeline across batches (paper 001, §II-B and §II-D 2, eqs. 20-23).

Tasks are split into M batches. Each decoding step n runs a two-stage pipeline over the batches
still active at that step, M_n = {m : n_m >= n} (eq. 21's definition, n_m from eq. 8): stage 1
is the SBS drafting batch m (T^d_{n,m}, eq. 19), stage 2 the MBS verifying it (T^v_{n,m}, eq. 18).
Within step n, taking the active batches in order m = 1..M_n and time from the step's start:

    C^d_{n,m} = Σ_{i<=m} T^d_{n,i}                              (drafter runs back to back)
    C_{n,m}   = max{C^d_{n,m}, C_{n,m-1}} + T^v_{n,m},  C_{n,0} = 0          (eq. 20)
    T_n       = C_{n,M_n}                                                      (eq. 21)
    T_inf     = Σ_{n=1..N} T_n,  N = max_m n_m                                 (eq. 22)
    T         = T_inf + T_com                                                  (eq. 23)

So the paper's model has a barrier between steps: step n+1's first draft starts when step n's
last verification ends (eq. 22 sums whole-step makespans), and inference starts once every upload
is in (T_com, eq. 16) — pass that as `start_time`. `pipeline_timeline` implements exactly this.
`step_barrier=False` gives the relaxed schedule a real draft server can run: draft (n, m) starts
when the drafter is free and batch m's verification of step n-1 is back (FIFO in (n, m) order on
both servers); it never ends later than the paper's.

`sequential_timeline` is the paper's "SD w/o pipeline" baseline (§IV-B): per step, each active
batch is drafted then verified, batch after batch, with no overlap.

Indices in the API are 0-based (`step` n-1, `batch` m-1); times are seconds (any unit works).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


class TimelineInputError(ValueError):
    """Stage times or step counts the recursion cannot run on."""


@dataclass(frozen=True)
class BatchStep:
    """Batch `batch` at decoding step `step` (0-based): absolute stage start/end times."""

    step: int
    batch: int
    draft_start: float
    draft_end: float
    verify_start: float
    verify_end: float


@dataclass(frozen=True)
class Timeline:
    """A schedule of every active (step, batch), in (step, batch) order.

    step_latencies[n] is T_n (eq. 21): for the barrier schedules the makespan of step n; for the
    relaxed one, the time from step n-1's last verification end to step n's. inference_latency is
    T_inf = Σ T_n (eq. 22); total_latency = start_time + T_inf (eq. 23 when start_time = T_com).
    batch_completion[m] is when batch m's last verification (step n_m) ends.
    """

    entries: tuple[BatchStep, ...]
    step_latencies: tuple[float, ...]
    start_time: float
    inference_latency: float
    total_latency: float
    batch_completion: tuple[float, ...]

    def entry(self, step: int, batch: int) -> BatchStep:
        """The (step, batch) entry; KeyError when that batch had finished before `step`."""
        for item in self.entries:
            if item.step == step and item.batch == batch:
                return item
        raise KeyError((step, batch))

    def as_dict(self) -> dict:
        """JSON-ready form (for the plan endpoint and the bench's predicted-vs-measured table)."""
        return {
            "start_time": self.start_time,
            "inference_latency": self.inference_latency,
            "total_latency": self.total_latency,
            "step_latencies": list(self.step_latencies),
            "batch_completion": list(self.batch_completion),
            "entries": [vars(item).copy() for item in self.entries],
        }


def _duration(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TimelineInputError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise TimelineInputError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def _active_batches(steps_per_batch: Sequence[int]) -> list[list[int]]:
    """M_n for n = 1..N (eq. 21): the batches with n_m >= n, in batch order."""
    if len(steps_per_batch) == 0:
        raise TimelineInputError("no batches: steps_per_batch is empty")
    for m, steps in enumerate(steps_per_batch):
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise TimelineInputError(f"steps_per_batch[{m}] must be an int >= 1 (eq. 8), got {steps!r}")
    total_steps = max(steps_per_batch)
    return [[m for m, steps in enumerate(steps_per_batch) if steps > n] for n in range(total_steps)]


def _checked_times(
    name: str, times: Sequence[Sequence[float]], active: list[list[int]], batches: int
) -> list[dict[int, float]]:
    """Per step, {batch: duration} for the active batches; entries of finished batches are ignored."""
    if len(times) != len(active):
        raise TimelineInputError(f"{name} has {len(times)} steps but max(steps_per_batch) is {len(active)}")
    checked = []
    for n, (row, batch_ids) in enumerate(zip(times, active)):
        if len(row) != batches:
            raise TimelineInputError(f"{name}[{n}] has {len(row)} batches, expected {batches}")
        checked.append({m: _duration(f"{name}[{n}][{m}]", row[m]) for m in batch_ids})
    return checked


def _prepare(draft_times, verify_times, steps_per_batch, start_time):
    active = _active_batches(steps_per_batch)
    draft = _checked_times("draft_times", draft_times, active, len(steps_per_batch))
    verify = _checked_times("verify_times", verify_times, active, len(steps_per_batch))
    return active, draft, verify, _duration("start_time", start_time)


def step_completion(draft_times: Sequence[float], verify_times: Sequence[float]) -> list[float]:
    """Eq. 20 for one step over its active batches in order: [C_{n,1}, ..., C_{n,M_n}] from 0.

    The last value is T_n (eq. 21). Pure arithmetic, for planners that price a step without
    building a whole Timeline.
    """
    if len(draft_times) != len(verify_times):
        raise TimelineInputError(f"{len(draft_times)} draft times but {len(verify_times)} verify times")
    drafted = 0.0  # C^d_{n,m}
    completed = 0.0  # C_{n,m-1}, C_{n,0} = 0
    out = []
    for m, (draft, verify) in enumerate(zip(draft_times, verify_times)):
        drafted += _duration(f"draft_times[{m}]", draft)
        completed = max(drafted, completed) + _duration(f"verify_times[{m}]", verify)
        out.append(completed)
    return out


def _finish(entries: list[BatchStep], step_ends: list[float], start: float, batches: int) -> Timeline:
    step_latencies = [end - before for before, end in zip([start, *step_ends[:-1]], step_ends)]
    completion = [0.0] * batches
    for item in entries:  # (step, batch) order: the last write per batch is its step n_m
        completion[item.batch] = item.verify_end
    end = step_ends[-1]  # = start + Σ T_n up to float rounding (eq. 22)
    return Timeline(tuple(entries), tuple(step_latencies), start, end - start, end, tuple(completion))


def pipeline_timeline(
    draft_times: Sequence[Sequence[float]],
    verify_times: Sequence[Sequence[float]],
    steps_per_batch: Sequence[int],
    start_time: float = 0.0,
    *,
    step_barrier: bool = True,
) -> Timeline:
    """The pipelined schedule: eqs. 20-23 (step_barrier=True) or the relaxed schedule (False).

    draft_times[n][m] = T^d_{n,m} and verify_times[n][m] = T^v_{n,m} for n < N = max n_m; each row
    has one entry per batch, and entries of batches already finished (n >= n_m) are ignored (may
    be None). steps_per_batch[m] = n_m (eq. 8). start_time = when inference may begin (T_com).
    """
    active, draft, verify, start = _prepare(draft_times, verify_times, steps_per_batch, start_time)
    entries: list[BatchStep] = []
    step_ends: list[float] = []
    if step_barrier:
        step_start = start
        for n, batch_ids in enumerate(active):
            drafted = step_start  # step_start + C^d_{n,m}
            completed = step_start  # step_start + C_{n,m-1}
            for m in batch_ids:
                draft_start = drafted
                drafted += draft[n][m]
                verify_start = max(drafted, completed)  # eq. 20's max{C^d_{n,m}, C_{n,m-1}}
                completed = verify_start + verify[n][m]
                entries.append(BatchStep(n, m, draft_start, drafted, verify_start, completed))
            step_start = completed  # eq. 21: T_n = C_{n,M_n}; the next step starts after it
            step_ends.append(completed)
        return _finish(entries, step_ends, start, len(steps_per_batch))

    drafter_free = verifier_free = start
    verified: dict[int, float] = {}  # batch -> end of its latest verification
    for n, batch_ids in enumerate(active):
        for m in batch_ids:
            # The draft of step n needs step n-1's verified tokens of the same batch.
            draft_start = max(drafter_free, verified.get(m, start))
            drafter_free = draft_start + draft[n][m]
            verify_start = max(drafter_free, verifier_free)
            verifier_free = verify_start + verify[n][m]
            verified[m] = verifier_free
            entries.append(BatchStep(n, m, draft_start, drafter_free, verify_start, verifier_free))
        step_ends.append(verifier_free)  # FIFO verifier: the step's last batch ends last
    return _finish(entries, step_ends, start, len(steps_per_batch))


def sequential_timeline(
    draft_times: Sequence[Sequence[float]],
    verify_times: Sequence[Sequence[float]],
    steps_per_batch: Sequence[int],
    start_time: float = 0.0,
) -> Timeline:
    """The "SD w/o pipeline" baseline (§IV-B): per step, each active batch drafted then verified,
    batch after batch, nothing overlapping; T_n = Σ_{m in M_n} (T^d_{n,m} + T^v_{n,m})."""
    active, draft, verify, start = _prepare(draft_times, verify_times, steps_per_batch, start_time)
    entries: list[BatchStep] = []
    step_ends: list[float] = []
    clock = start
    for n, batch_ids in enumerate(active):
        for m in batch_ids:
            draft_start = clock
            draft_end = draft_start + draft[n][m]
            clock = draft_end + verify[n][m]
            entries.append(BatchStep(n, m, draft_start, draft_end, draft_end, clock))
        step_ends.append(clock)
    return _finish(entries, step_ends, start, len(steps_per_batch))
