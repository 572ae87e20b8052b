"""Device speed classes and the wall-time stretching helper."""

from __future__ import annotations

import asyncio
import time

import pytest

from shared.planning.device_speed import SPEED_CLASSES, DeviceSpeed, SpeedSchedule, slowed, speed_schedule


def test_schedule_switches_every_n_requests_and_cycles() -> None:
    sched = SpeedSchedule([1, 2, 5, 10], switch_every=5)
    got = [sched.slowdown_for(n) for n in range(45)]
    assert got[:5] == [1.0] * 5 and got[5:10] == [2.0] * 5 and got[15:20] == [10.0] * 5
    assert got[20:25] == [1.0] * 5 and got[40:45] == [1.0] * 5
    assert sched.speed_for(7) == DeviceSpeed(2.0)
    with pytest.raises(ValueError):
        sched.slowdown_for(-1)


def test_named_classes_and_spec_parsing() -> None:
    assert speed_schedule("orin").slowdown_for(123) == 1.0
    assert speed_schedule("Xavier").slowdown_for(0) == SPEED_CLASSES["xavier"].modes[0] > 1.0
    cycle = speed_schedule("cycle")
    assert max(cycle.modes) / min(cycle.modes) == 10.0 and cycle.switch_every == 5
    assert speed_schedule("2.5") == SpeedSchedule([2.5])
    assert speed_schedule("1,3@2") == SpeedSchedule([1.0, 3.0], switch_every=2)


@pytest.mark.parametrize("spec", ["", "fast", "0.5", "1,x", "1,2@0", "1@two", "nan", "inf"])
def test_bad_specs_rejected(spec: str) -> None:
    with pytest.raises(ValueError):
        speed_schedule(spec)


def test_device_speed_validation_and_extra_time() -> None:
    assert DeviceSpeed().extra_s(0.2) == 0.0
    assert DeviceSpeed(4.0).extra_s(0.2) == pytest.approx(0.6)
    with pytest.raises(ValueError):
        DeviceSpeed(0.9)


@pytest.mark.timing  # its bounds are wall-clock times: make test runs it alone
async def test_slowed_stretches_wall_time_without_blocking_the_loop() -> None:
    def work(x: int, *, scale: int) -> int:
        time.sleep(0.05)
        return x * scale

    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    tick_task = asyncio.create_task(ticker())
    start = time.perf_counter()
    result = await slowed(work, 3, scale=2, slowdown=3.0)
    elapsed = time.perf_counter() - start
    tick_task.cancel()
    assert result == 6
    assert 0.15 <= elapsed < 0.15 + 0.3  # upper bound loose: a loaded machine's threads run late
    assert ticks >= 8  # the loop kept running during both the work and the stretch

    start = time.perf_counter()
    await slowed(work, 1, scale=1, slowdown=1.0)
    assert time.perf_counter() - start < 0.05 + 0.1  # no stretch (3x would add >= 0.1)
    with pytest.raises(ValueError):
        await slowed(work, 1, scale=1, slowdown=0.5)
