"""Device speed classes (HAT §4.1): heterogeneous, time-varying device compute.

HAT's testbed mixes Jetson AGX Orin (fast) and AGX Xavier (slow) boards and
changes their power modes every 5 requests, so device speed varies up to 10x.
We emulate that on one host with a *slowdown* factor s >= 1: device work that
took d seconds here is stretched to s·d of wall time by sleeping d·(s-1)
after it. We stretch wall time instead of burning CPU on purpose: on a 2-core
box, a busy-looping "slow device" would steal cycles from the cloud verifier
and the other devices and distort every measurement; a sleep costs nothing.

Named classes (``speed_schedule(name)``):
    orin    [1.0]            the reference (fast) device
    xavier  [3.0]            AGX Xavier vs Orin: ~1.5x memory bandwidth and
                             ~8x peak TOPS apart; LLM decode lands in between,
                             we take 3x (our choice; the paper gives no ratio)
    cycle   [1, 2, 5, 10]    power modes cycled every 5 requests (up to 10x)
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

log = logging.getLogger(__name__)

R = TypeVar("R")


def _check_slowdown(value: float) -> None:
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 1.0:
        raise ValueError(f"slowdown must be a finite number >= 1 (a device cannot be made faster), got {value!r}")


@dataclass(frozen=True)
class DeviceSpeed:
    """A fixed slowdown relative to this host (1.0 = as fast as we run)."""

    slowdown: float = 1.0

    def __post_init__(self) -> None:
        _check_slowdown(self.slowdown)

    def extra_s(self, measured_s: float) -> float:
        """Seconds to sleep after work that took ``measured_s``."""
        return max(0.0, measured_s) * (self.slowdown - 1.0)


@dataclass(frozen=True)
class SpeedSchedule:
    """Slowdown per request: ``modes`` in turn, each for ``switch_every`` requests, cycling."""

    modes: tuple[float, ...]
    switch_every: int = 5

    def __init__(self, modes: Sequence[float], switch_every: int = 5) -> None:
        modes = tuple(float(m) for m in modes)
        if not modes:
            raise ValueError("SpeedSchedule needs at least one mode")
        for mode in modes:
            _check_slowdown(mode)
        if not isinstance(switch_every, int) or switch_every < 1:
            raise ValueError(f"switch_every must be an int >= 1, got {switch_every!r}")
        object.__setattr__(self, "modes", modes)
        object.__setattr__(self, "switch_every", switch_every)

    def slowdown_for(self, request_index: int) -> float:
        """Slowdown of the ``request_index``-th request (0-based) this device serves."""
        if request_index < 0:
            raise ValueError(f"request_index must be >= 0, got {request_index}")
        return self.modes[(request_index // self.switch_every) % len(self.modes)]

    def speed_for(self, request_index: int) -> DeviceSpeed:
        return DeviceSpeed(self.slowdown_for(request_index))


SPEED_CLASSES: dict[str, SpeedSchedule] = {
    "orin": SpeedSchedule([1.0]),
    "xavier": SpeedSchedule([3.0]),
    "cycle": SpeedSchedule([1.0, 2.0, 5.0, 10.0], switch_every=5),
}


def speed_schedule(spec: str) -> SpeedSchedule:
    """Parse a speed spec: a class name (``orin``, ``xavier``, ``cycle``), a
    number (fixed slowdown, e.g. ``2.5``), or modes with an optional switch
    period, ``1,2,5,10@5``."""
    text = spec.strip().lower()
    if text in SPEED_CLASSES:
        return SPEED_CLASSES[text]
    modes_text, sep, every_text = text.partition("@")
    try:
        modes = [float(m) for m in modes_text.split(",") if m.strip()]
        every = int(every_text) if sep else 5
    except ValueError as exc:
        raise ValueError(
            f"bad device speed {spec!r}; use {', '.join(SPEED_CLASSES)}, a slowdown like 2.5, or modes like 1,2,5,10@5"
        ) from exc
    return SpeedSchedule(modes, switch_every=every)


async def slowed(fn: Callable[..., R], *args: Any, slowdown: float, **kwargs: Any) -> R:
    """Run ``fn(*args, **kwargs)`` in a worker thread, then sleep so it appears
    ``slowdown`` times slower: total wall time ~= slowdown x its duration.

    The event loop stays free meanwhile. Caveat: thread-local state of the
    caller does not follow ``fn`` into the worker thread — notably
    ``torch.no_grad()`` / ``torch.inference_mode()``; enter those inside ``fn``.
    If cancelled during the stretch sleep, the work has already happened.
    """
    _check_slowdown(slowdown)
    start = time.perf_counter()
    result = await asyncio.to_thread(fn, *args, **kwargs)
    extra = DeviceSpeed(slowdown).extra_s(time.perf_counter() - start)
    if extra > 0:
        await asyncio.sleep(extra)
    return result
