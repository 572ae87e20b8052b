"""Jupiter's layer partition (§IV-B1, eq. 1): the DP against brute force, memory infinities, the
drafter's minimum on device 0, and the equal-layer baseline."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.jupiter.partition import (
    PartitionError,
    brute_force_partition,
    equal_partition,
    partition_layers,
)


def _cost_model(layer_costs, slowdowns, budgets=None, layer_bytes=None):
    """stage_cost(device, start, stop) = slowdown * sum(layer costs), inf over the device's budget."""

    def cost(device, start, stop):
        if budgets is not None and sum(layer_bytes[start:stop]) > budgets[device]:
            return math.inf
        return slowdowns[device] * sum(layer_costs[start:stop])

    return cost


def _check_partition(partition, num_layers, num_devices, first_min_layers=1):
    ranges = partition.ranges
    assert len(ranges) == num_devices
    assert ranges[0][0] == 0 and ranges[-1][1] == num_layers
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert all(stop > start for start, stop in ranges)
    assert ranges[0][1] - ranges[0][0] >= first_min_layers


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    num_layers=st.integers(1, 9),
    num_devices=st.integers(1, 4),
    first_min_layers=st.integers(1, 3),
)
def test_dp_equals_brute_force(data, num_layers, num_devices, first_min_layers):
    layer_costs = data.draw(st.lists(st.integers(1, 20), min_size=num_layers, max_size=num_layers))
    slowdowns = data.draw(st.lists(st.sampled_from([1.0, 1.5, 3.0, 10.0]), min_size=num_devices, max_size=num_devices))
    layer_bytes = data.draw(st.lists(st.integers(1, 5), min_size=num_layers, max_size=num_layers))
    budgets = data.draw(st.lists(st.integers(1, 25), min_size=num_devices, max_size=num_devices))
    cost = _cost_model(layer_costs, slowdowns, budgets, layer_bytes)
    try:
        expected = brute_force_partition(cost, num_layers, num_devices, first_min_layers)
    except PartitionError:
        with pytest.raises(PartitionError):
            partition_layers(cost, num_layers, num_devices, first_min_layers)
        return
    got = partition_layers(cost, num_layers, num_devices, first_min_layers)
    assert got.bottleneck == expected.bottleneck
    _check_partition(got, num_layers, num_devices, first_min_layers)
    # the ranges it returns really have the bottleneck it claims
    assert max(cost(d, a, b) for d, (a, b) in enumerate(got.ranges)) == got.bottleneck
    # and among the partitions with that bottleneck, the least total time (one part's trip through the pipeline)
    assert _total(cost, got.ranges) == pytest.approx(
        _least_total_at(cost, num_layers, num_devices, first_min_layers, got.bottleneck)
    )


def _total(cost, ranges):
    return sum(cost(d, a, b) for d, (a, b) in enumerate(ranges))


def _least_total_at(cost, num_layers, num_devices, first_min_layers, bottleneck):
    import itertools

    totals = []
    for cuts in itertools.combinations(range(first_min_layers, num_layers), num_devices - 1):
        edges = (0, *cuts, num_layers)
        ranges = list(zip(edges, edges[1:]))
        if max(cost(d, a, b) for d, (a, b) in enumerate(ranges)) == bottleneck:
            totals.append(_total(cost, ranges))
    return min(totals)


def test_dp_equals_brute_force_on_float_costs_seeded():
    rng = random.Random(15)
    for _ in range(200):
        num_layers, num_devices = rng.randint(2, 10), rng.randint(1, 4)
        if num_devices > num_layers:
            continue
        layer_costs = [rng.uniform(0.5, 2.0) for _ in range(num_layers)]
        slowdowns = [rng.choice([1.0, 3.0]) for _ in range(num_devices)]
        cost = _cost_model(layer_costs, slowdowns)
        assert partition_layers(cost, num_layers, num_devices).bottleneck == pytest.approx(
            brute_force_partition(cost, num_layers, num_devices).bottleneck, rel=1e-12
        )


def test_ties_on_the_bottleneck_go_to_the_least_total_time():
    # orin;xavier;xavier over 8 layers: 6/1/1, 5/1/2, 4/2/2 all have a bottleneck of 6; in total
    # they take 12, 14 and 16: a prompt crossing the pipeline once is fastest on 6/1/1
    partition = partition_layers(_cost_model([1] * 8, [1.0, 3.0, 3.0]), 8, 3)
    assert partition.bottleneck == 6.0 and partition.layer_counts == (6, 1, 1)
    partition = partition_layers(_cost_model([1] * 8, [3.0, 3.0, 1.0]), 8, 3)
    assert partition.bottleneck == 6.0 and partition.layer_counts == (1, 1, 6)


def test_infinite_stage_is_never_chosen():
    # device 1 can hold at most 2 layers: the fastest split without a budget would give it more
    layer_costs, slowdowns = [1] * 8, [10.0, 1.0]
    unbounded = partition_layers(_cost_model(layer_costs, slowdowns), 8, 2)
    assert unbounded.layer_counts[1] == 7
    bounded = partition_layers(_cost_model(layer_costs, slowdowns, budgets=[100, 2], layer_bytes=[1] * 8), 8, 2)
    assert bounded.layer_counts == (6, 2)
    assert bounded.bottleneck == 60.0


def test_nothing_fits_is_a_typed_error():
    cost = _cost_model([1] * 4, [1.0, 1.0], budgets=[1, 1], layer_bytes=[1] * 4)
    with pytest.raises(PartitionError, match="memory"):
        partition_layers(cost, 4, 2)
    with pytest.raises(PartitionError, match="one layer each"):
        partition_layers(_cost_model([1] * 2, [1.0] * 3), 2, 3)
    with pytest.raises(PartitionError, match="one layer each"):
        partition_layers(_cost_model([1] * 3, [1.0] * 2), 3, 2, first_min_layers=3)


def test_first_device_keeps_the_drafters_layers():
    # device 0 is 10x slower: alone it would get one layer; the drafter needs 3 there
    cost = _cost_model([1] * 8, [10.0, 1.0, 1.0])
    assert partition_layers(cost, 8, 3).layer_counts[0] == 1
    constrained = partition_layers(cost, 8, 3, first_min_layers=3)
    assert constrained.layer_counts[0] == 3
    assert constrained.bottleneck == 30.0


def test_devices_are_used_in_the_given_order():
    # reversing the device list changes which device holds the first layers: the DP may not reorder
    layer_costs = [1] * 8
    forward = partition_layers(_cost_model(layer_costs, [1.0, 3.0]), 8, 2)
    backward = partition_layers(_cost_model(layer_costs, [3.0, 1.0]), 8, 2)
    assert forward.layer_counts == (6, 2) and backward.layer_counts == (2, 6)


def test_equal_partition_counts():
    assert equal_partition(None, 8, 3).layer_counts == (3, 3, 2)
    assert equal_partition(None, 6, 3).ranges == ((0, 2), (2, 4), (4, 6))
    assert math.isnan(equal_partition(None, 6, 3).bottleneck)
    with pytest.raises(PartitionError):
        equal_partition(None, 2, 3)


def test_dp_beats_or_ties_equal_split_and_wins_on_heterogeneous_devices():
    rng = random.Random(7)
    for _ in range(100):
        num_layers, num_devices = rng.randint(3, 12), rng.randint(1, 3)
        cost = _cost_model(
            [rng.uniform(1, 2) for _ in range(num_layers)], [rng.choice([1.0, 3.0]) for _ in range(num_devices)]
        )
        assert (
            partition_layers(cost, num_layers, num_devices).bottleneck
            <= equal_partition(cost, num_layers, num_devices).bottleneck
        )
    # orin;xavier;xavier over 24 equal layers: equal split 8/8/8 -> 24 on a xavier; DP 14-15/5/4-5 -> 15
    cost = _cost_model([1] * 24, [1.0, 3.0, 3.0])
    assert equal_partition(cost, 24, 3).bottleneck == 24.0
    dp = partition_layers(cost, 24, 3)
    assert dp.bottleneck == 15.0
    assert dp.layer_counts[0] in (14, 15) and max(dp.layer_counts[1:]) == 5
    assert dp.boundaries == (dp.layer_counts[0], dp.layer_counts[0] + dp.layer_counts[1])
