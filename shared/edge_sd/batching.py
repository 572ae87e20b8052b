"""Edge SD batching (paper 001 §III-B, Algorithm 1) and the pipeline latency it minimises.

Symbols (paper -> code): task k = (I_k, O_k) = (input_len, output_len), K tasks; batch m with
b = sum_k x_k^m tasks, padded input I_m = max I_k, max output O_m = max O_k; n_m = ceil(O_m / L)
decoding steps (eq. 8); T^d_{n,m}, T^v_{n,m} = draft / verify seconds of batch m at step n
(eqs. 19, 18); Γ_s = SBS memory budget for the draft model (constraint 24b, bytes).

Pipeline latency (eqs. 20-22): at step n only batches with n_m >= n run, in batch order;
    C^d_{n,m} = sum_{i<=m} T^d_{n,i}                     (draft stage finishes batch m)
    C_{n,m}   = max(C^d_{n,m}, C_{n,m-1}) + T^v_{n,m}    (eq. 20; C_{n,0} = 0)
    T_n = C_{n,M_n} (eq. 21),  T_inf = sum_n T_n (eq. 22).
A batch idle at step n has T^d = T^v = 0 there, which leaves C unchanged (C >= C^d always), so
batches can keep their place in the order and the recursion skips them.

Algorithm 1 sorts tasks by I_k and runs a DP over the last batch's first task j for every prefix
i (eqs. 29-32): Υ[i] keeps, per step n, the draft-stage and both-stage completion of the best
split of the first i tasks. Eq. 29 and line 15 of Algorithm 1 print the draft time on the wrong
side of the max (max{Υ0, Υ1 + T^d}); eqs. 20, 31 and 32 say max{Υ0 + T^d, Υ1}, used here.
The paper's DP keeps ONE state per prefix (the least sum_n C), so it is exact only when that
state also has the least draft-stage completions; `dp_batching(exact=True)` keeps every
non-dominated state instead, and `brute_force_batching` checks both.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from shared.edge_sd.runtime import ModelShape, RuntimeModel, batch_draft_memory
from shared.edge_sd.speculation import decoding_steps, expected_tokens_per_step

Task = tuple[int, int]  # (I_k input tokens, O_k expected output tokens)


class InfeasibleBatchingError(ValueError):
    """No batching fits the SBS memory budget Γ_s (some task alone exceeds it) or there are no tasks."""


@dataclass(frozen=True)
class BatchPlan:
    """Batches as task indices in the ORIGINAL task order, in pipeline order, and T_inf (s)."""

    batches: tuple[tuple[int, ...], ...]
    latency: float


@dataclass(frozen=True)
class EdgeCosts:
    """Everything a batch's step times and memory depend on, for one speculation length."""

    draft: ModelShape
    target: ModelShape
    draft_runtime: RuntimeModel  # c1^d, c2^d (SBS GPU)
    verify_runtime: RuntimeModel  # c1^v, c2^v (MBS GPU)
    spec_len: int  # l
    alpha: float  # α
    memory_budget: float  # Γ_s, bytes

    @property
    def tokens_per_step(self) -> float:
        return expected_tokens_per_step(self.alpha, self.spec_len)

    def fits(self, batch_size: int, input_len: int, output_len: int) -> bool:
        """Constraint 24b: Γ^d_m = Γ_p + b*4*J*h1*(I_m + O_m) <= Γ_s (eqs. 9-10)."""
        need = batch_draft_memory(self.draft, [input_len] * batch_size, [output_len] * batch_size)
        return need <= self.memory_budget

    def step_times(self, batch_size: int, input_len: int, output_len: int) -> tuple[np.ndarray, np.ndarray]:
        """(T^d_{n,m}, T^v_{n,m}) for n = 1..n_m, eqs. 18-19 with the FLOPs of eqs. 13-14.

        Vectorised over n; equals summing draft_pass_flops / verify_step_flops pass by pass."""
        l, big_l = self.spec_len, self.tokens_per_step  # noqa: E741 - the paper's l and L (eqs. 13-14)
        steps = np.arange(1, decoding_steps(output_len, big_l) + 1, dtype=float)  # n: [n_m]
        d, v = self.draft, self.target
        # Draft passes i = 1..l on a KV of I + (n-1)L - 1 + (i-1) (eq. 13, decoding branch);
        # sum_i (2h1 + kv_i + 1 + h2) = l*(2h1 + h2 + I + (n-1)L - 1) + l(l+1)/2.
        kv0 = input_len + (steps - 1) * big_l - 1  # [n_m]
        draft_flops = 4.0 * d.layers * d.hidden * (l * (2 * d.hidden + d.ffn + kv0) + l * (l + 1) / 2)
        # Step 1, pass 1 is the prefill instead (eq. 13, first branch): swap that one term.
        first_decode = 4.0 * d.layers * d.hidden * (2 * d.hidden + d.ffn + kv0[0] + 1)
        draft_flops[0] += d.prefill_flops(input_len) - first_decode
        draft_secs = self.draft_runtime.c1 * batch_size * draft_flops + l * self.draft_runtime.c2
        # Verify (eq. 14): step 1 prefills I + l tokens, later steps feed 1 + l on a KV of I + (n-1)L - 1.
        verify_flops = 4.0 * v.layers * v.hidden * (1 + l) * (2 * v.hidden + kv0 + l + 1 + v.ffn)
        verify_flops[0] = v.forward_flops(input_len + l, 0)
        verify_secs = self.verify_runtime.c1 * batch_size * verify_flops + self.verify_runtime.c2
        return draft_secs, verify_secs


def _batch_key(tasks: Sequence[Task], members: Sequence[int]) -> tuple[int, int, int]:
    return len(members), max(tasks[k][0] for k in members), max(tasks[k][1] for k in members)


def _padded(times: np.ndarray, steps: int) -> np.ndarray:
    return np.pad(times, (0, steps - len(times)))


def pipeline_latency(costs: EdgeCosts, tasks: Sequence[Task], batches: Sequence[Sequence[int]]) -> float:
    """T_inf (eqs. 20-22) of `batches` (task indices, pipeline order); math.inf if one breaks Γ_s."""
    keys = [_batch_key(tasks, members) for members in batches]
    if any(not costs.fits(*key) for key in keys):
        return math.inf
    per_batch = [costs.step_times(*key) for key in keys]
    steps = max(len(td) for td, _ in per_batch)
    draft_done = np.zeros(steps)  # C^d_{n,m} so far: [N]
    both_done = np.zeros(steps)  # C_{n,m} so far: [N]
    for td, tv in per_batch:
        draft_done = draft_done + _padded(td, steps)
        both_done = np.maximum(draft_done, both_done) + _padded(tv, steps)
    return float(both_done.sum())


def _sorted_order(tasks: Sequence[Task]) -> list[int]:
    if not tasks:
        raise InfeasibleBatchingError("no tasks to batch")
    return sorted(range(len(tasks)), key=lambda k: (tasks[k][0], tasks[k][1], k))


def dp_batching(costs: EdgeCosts, tasks: Sequence[Task], exact: bool = False) -> BatchPlan:
    """Algorithm 1: sort by I_k, then for each prefix i try every last batch [j, i] (eqs. 29-32),
    skipping batches over Γ_s. Raises InfeasibleBatchingError.

    exact=False is the paper's DP: one state per prefix (the split with the least sum_n C),
    O(K^2 N). It can miss the optimum over consecutive splits, because a prefix with a larger
    sum_n C but earlier draft-stage completions can serve the next batch better (rare: 1 of ~300
    random cases in the tests, by 0.01%). exact=True keeps, per prefix, every state not dominated
    step by step in both completions; eq. 20 is monotone in both, so pruning dominated states is
    safe and the result equals `brute_force_batching`. Its cost grows with the surviving states,
    exponential in the worst case (K = 100 at the paper's settings did not finish in 5 minutes):
    a check for small K, not the planner's default."""
    order = _sorted_order(tasks)
    count = len(order)
    steps = decoding_steps(max(o for _, o in tasks), costs.tokens_per_step)  # N
    # fronts[i]: states for the first i sorted tasks, each (sum_n C, C^d per step [N], C per step [N],
    # start of the last batch, index of the predecessor state in fronts[start - 1]).
    fronts: list[list[tuple[float, np.ndarray, np.ndarray, int, int]]] = [
        [(0.0, np.zeros(steps), np.zeros(steps), 0, -1)]
    ]
    for end in range(1, count + 1):
        candidates = []
        for start in range(1, end + 1):
            if not fronts[start - 1]:
                continue  # the first start-1 tasks have no feasible split
            key = _batch_key(tasks, order[start - 1 : end])
            if not costs.fits(*key):
                continue  # Algorithm 1 lines 11-12: out of memory
            td, tv = (_padded(t, steps) for t in costs.step_times(*key))
            for index, (_, prev_draft, prev_both, _, _) in enumerate(fronts[start - 1]):
                new_draft = prev_draft + td  # eq. 31
                new_both = np.maximum(new_draft, prev_both) + tv  # eq. 32 / eq. 20
                candidates.append((float(new_both.sum()), new_draft, new_both, start, index))  # eq. 29
        if exact:
            fronts.append(_non_dominated(candidates))
        elif candidates:  # eq. 30; Algorithm 1 line 20: ties go to the later boundary
            fronts.append([min(reversed(candidates), key=lambda state: state[0])])
        else:
            fronts.append([])
    if not fronts[count]:
        raise InfeasibleBatchingError("some task alone exceeds the SBS memory budget Γ_s")
    best = min(range(len(fronts[count])), key=lambda index: fronts[count][index][0])
    latency = fronts[count][best][0]
    batches: list[tuple[int, ...]] = []
    end, index = count, best
    while end > 0:  # Algorithm 1 lines 24-26: backtrack S
        _, _, _, start, index = fronts[end][index]
        batches.append(tuple(order[start - 1 : end]))
        end = start - 1
    batches.reverse()
    return BatchPlan(batches=tuple(batches), latency=latency)


def _non_dominated(states):
    """States no other state beats (<=) in every step's draft-stage AND both-stage completion."""
    kept = []
    for state in sorted(states, key=lambda state: state[0]):
        if not any(np.all(other[1] <= state[1]) and np.all(other[2] <= state[2]) for other in kept):
            kept.append(state)
    return kept


def _best_of(costs: EdgeCosts, tasks: Sequence[Task], candidates) -> BatchPlan:
    best: BatchPlan | None = None
    for batches in candidates:
        latency = pipeline_latency(costs, tasks, batches)
        if math.isfinite(latency) and (best is None or latency < best.latency):
            best = BatchPlan(batches=tuple(tuple(b) for b in batches), latency=latency)
    if best is None:
        raise InfeasibleBatchingError("no batching fits the SBS memory budget Γ_s")
    return best


def _contiguous_splits(order: list[int]):
    for cuts in itertools.product((False, True), repeat=len(order) - 1):
        batches, current = [], [order[0]]
        for task, cut in zip(order[1:], cuts):
            if cut:
                batches.append(current)
                current = []
            current.append(task)
        batches.append(current)
        yield batches


def _set_partitions(items: list[int]):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in _set_partitions(rest):
        yield [[first], *partition]
        for index in range(len(partition)):
            yield [*partition[:index], [first, *partition[index]], *partition[index + 1 :]]


def _all_ordered_partitions(count: int):
    for partition in _set_partitions(list(range(count))):
        yield from itertools.permutations(partition)


def brute_force_batching(costs: EdgeCosts, tasks: Sequence[Task], contiguous: bool = True) -> BatchPlan:
    """Exhaustive optimum of T_inf. contiguous=True: every split of the input-sorted list into
    consecutive batches (2^(K-1), the space Algorithm 1 searches). contiguous=False: every set
    partition in every pipeline order (K <= 6 only), i.e. the unrestricted problem P2."""
    order = _sorted_order(tasks)
    if contiguous:
        return _best_of(costs, tasks, _contiguous_splits(order))
    if len(tasks) > 6:
        raise ValueError("unrestricted brute force is for K <= 6")
    return _best_of(costs, tasks, _all_ordered_partitions(len(tasks)))


def max_batching(costs: EdgeCosts, tasks: Sequence[Task]) -> BatchPlan:
    """Baseline: as few batches as memory allows. Walks the input-sorted tasks and grows each
    batch while it still fits Γ_s (for consecutive batches this greedy gives the fewest)."""
    order = _sorted_order(tasks)
    batches: list[list[int]] = []
    for task in order:
        if batches and costs.fits(*_batch_key(tasks, [*batches[-1], task])):
            batches[-1].append(task)
        elif costs.fits(*_batch_key(tasks, [task])):
            batches.append([task])
        else:
            raise InfeasibleBatchingError(f"task {task} alone exceeds the SBS memory budget Γ_s")
    return BatchPlan(batches=tuple(tuple(b) for b in batches), latency=pipeline_latency(costs, tasks, batches))
