"""Jupiter's layer partition (§IV-B1, eq. 1): contiguous layer ranges over an ORDERED device list
minimising the slowest stage.

The devices are used in the order given (device 0 first: it embeds and drafts, so it holds the
first layers; the last device holds the last layers and the head); every device gets at least one
layer, and device 0 at least `first_min_layers` (the draft model is the LLM's own first m layers
plus an adapter, so those layers must live with the drafter). The DP is exact for that problem:

    B(j, l) = min over k of max(B(j-1, k), cost(j-1, k, l))     devices 0..j-1 cover layers [0, l)
    B(1, l) = cost(0, 0, l)                                     (l >= first_min_layers)

answer B(D, n); O(D n^2) calls of `stage_cost`. Ties on B go to the least total stage time (a
second DP of the same shape, over stages no slower than B). `stage_cost(device, start, stop)` returns the
seconds device `device` needs for layers [start, stop), or math.inf where that stage's weights +
KV exceed the device's memory budget; such a stage is never chosen.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass

StageCost = Callable[[int, int, int], float]


class PartitionError(ValueError):
    """No partition fits: too few layers for the devices, or every split exceeds a memory budget."""


@dataclass(frozen=True)
class Partition:
    """Layer ranges [start, stop) per device, in device order, and the slowest stage's cost."""

    ranges: tuple[tuple[int, int], ...]
    bottleneck: float

    @property
    def boundaries(self) -> tuple[int, ...]:
        """The stop layer of every stage but the last (the cut points)."""
        return tuple(stop for _, stop in self.ranges[:-1])

    @property
    def layer_counts(self) -> tuple[int, ...]:
        return tuple(stop - start for start, stop in self.ranges)


def _check(num_layers: int, num_devices: int, first_min_layers: int) -> None:
    if num_devices < 1:
        raise PartitionError(f"need at least one device, got {num_devices}")
    if first_min_layers < 1:
        raise PartitionError(f"first_min_layers must be >= 1, got {first_min_layers}")
    if num_layers < first_min_layers + num_devices - 1:
        raise PartitionError(
            f"{num_layers} layers cannot give {num_devices} devices one layer each with {first_min_layers} on the first"
        )


def _ranges(cuts: tuple[int, ...], num_layers: int) -> tuple[tuple[int, int], ...]:
    edges = (0, *cuts, num_layers)
    return tuple(zip(edges, edges[1:]))


def _bottleneck(stage_cost: StageCost, ranges: tuple[tuple[int, int], ...]) -> float:
    return max(stage_cost(device, start, stop) for device, (start, stop) in enumerate(ranges))


def _ordered_dp(
    stage_cost: StageCost,
    num_layers: int,
    num_devices: int,
    first_min_layers: int,
    combine: Callable[[float, float], float],
) -> tuple[float, tuple[int, ...]]:
    """min over ordered partitions of combine-folded stage costs (max or +; costs >= 0, so the
    fold never decreases and a prefix already >= the best cannot improve). (value, cuts)."""
    # best[j][l]: value when devices 0..j-1 cover layers [0, l); cut[j][l]: where device j-1 starts
    best = [[math.inf] * (num_layers + 1) for _ in range(num_devices + 1)]
    cut = [[-1] * (num_layers + 1) for _ in range(num_devices + 1)]
    for stop in range(first_min_layers, num_layers - num_devices + 2):
        best[1][stop] = stage_cost(0, 0, stop)
        cut[1][stop] = 0
    for j in range(2, num_devices + 1):
        lowest_stop = first_min_layers + j - 1
        highest_stop = num_layers - (num_devices - j)  # leave one layer per later device
        for stop in range(lowest_stop, highest_stop + 1):
            for start in range(lowest_stop - 1, stop):
                before = best[j - 1][start]
                if before >= best[j][stop]:
                    continue
                value = combine(before, stage_cost(j - 1, start, stop))
                if value < best[j][stop]:
                    best[j][stop], cut[j][stop] = value, start
    cuts, stop = [], num_layers
    for j in range(num_devices, 1, -1):
        stop = cut[j][stop]
        cuts.append(stop)
    return best[num_devices][num_layers], tuple(reversed(cuts))


def partition_layers(stage_cost: StageCost, num_layers: int, num_devices: int, first_min_layers: int = 1) -> Partition:
    """The ordered partition minimising the slowest stage (eq. 1; see the module docstring); among
    those, the one with the least total stage time (what one sub-sequence pays crossing the whole
    pipeline: a second DP over the stages no slower than that bottleneck). Costs must be >= 0.
    Raises PartitionError when nothing is feasible (finite)."""
    _check(num_layers, num_devices, first_min_layers)
    bottleneck, _ = _ordered_dp(stage_cost, num_layers, num_devices, first_min_layers, max)
    if not math.isfinite(bottleneck):
        raise PartitionError(
            f"no partition of {num_layers} layers over {num_devices} devices fits their memory budgets"
        )

    def within_bottleneck(device: int, start: int, stop: int) -> float:
        value = stage_cost(device, start, stop)
        return value if value <= bottleneck else math.inf

    _, cuts = _ordered_dp(within_bottleneck, num_layers, num_devices, first_min_layers, operator.add)
    return Partition(_ranges(cuts, num_layers), bottleneck)


def brute_force_partition(
    stage_cost: StageCost, num_layers: int, num_devices: int, first_min_layers: int = 1
) -> Partition:
    """Every composition of the layers over the devices (for tests: exponential)."""
    _check(num_layers, num_devices, first_min_layers)
    best: Partition | None = None
    for cuts in itertools.combinations(range(first_min_layers, num_layers), num_devices - 1):
        ranges = _ranges(cuts, num_layers)
        value = _bottleneck(stage_cost, ranges)
        if best is None or value < best.bottleneck:
            best = Partition(ranges, value)
    if best is None or not math.isfinite(best.bottleneck):
        raise PartitionError(f"no partition of {num_layers} layers over {num_devices} devices fits")
    return best


def equal_partition(stage_cost: StageCost | None, num_layers: int, num_devices: int) -> Partition:
    """Near-equal layer counts (the first stages take the remainder), the EdgeShard-style baseline.
    The bottleneck is costed with `stage_cost` (math.inf if a stage exceeds its budget; nan when no
    cost is given)."""
    _check(num_layers, num_devices, 1)
    base, extra = divmod(num_layers, num_devices)
    cuts, stop = [], 0
    for device in range(num_devices - 1):
        stop += base + (1 if device < extra else 0)
        cuts.append(stop)
    ranges = _ranges(tuple(cuts), num_layers)
    return Partition(ranges, math.nan if stage_cost is None else _bottleneck(stage_cost, ranges))
