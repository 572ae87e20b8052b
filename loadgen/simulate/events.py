"""The discrete-event core: a heapq clock and FIFO resources (device compute, links).

Why continuation-passing instead of coroutines: every process in the mesh is a short
chain (compute -> upload -> cloud -> download -> next round), and plain callbacks on a
heap keyed by (time, sequence number) make the run exactly reproducible: two events at
the same instant always run in the order they were scheduled, whatever the platform.

Why FIFO resources need no queue object: a non-preemptive first-come-first-served
server whose job durations are known at submission starts each job at
max(now, when the previous job ends). Keeping only `free_at` is therefore exact, and a
link is the same thing with a propagation delay added after the bytes are on the wire.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from typing import Any

Callback = Callable[..., Any]


class EventLoop:
    """Simulated clock: `at(t, fn, *args)` runs fn(*args) at time t; `run()` drains the heap."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callback, tuple[Any, ...]]] = []
        self._seq = itertools.count()
        self.events = 0

    def at(self, t: float, fn: Callback, *args: Any) -> None:
        if t < self.now:
            raise ValueError(f"cannot schedule in the past ({t} < {self.now})")
        heapq.heappush(self._heap, (t, next(self._seq), fn, args))

    def after(self, delay: float, fn: Callback, *args: Any) -> None:
        self.at(self.now + max(0.0, delay), fn, *args)

    def run(self, until: float = math.inf) -> None:
        while self._heap and self._heap[0][0] <= until:
            t, _, fn, args = heapq.heappop(self._heap)
            self.now = t
            self.events += 1
            fn(*args)


class FifoServer:
    """One job at a time, first come first served (a device's compute, a link's serializer)."""

    def __init__(self, loop: EventLoop) -> None:
        self.loop = loop
        self.free_at = 0.0
        self.busy_s = 0.0
        self.jobs = 0

    def submit(self, duration: float, done: Callback, *args: Any, delay_after: float = 0.0) -> float:
        """Queue a job of `duration` s; `done(*args)` runs `delay_after` s after it ends. Returns the end."""
        if not duration >= 0:
            raise ValueError(f"duration must be >= 0, got {duration!r}")
        start = max(self.loop.now, self.free_at)
        end = start + duration
        self.free_at = end
        self.busy_s += duration
        self.jobs += 1
        self.loop.at(end + delay_after, done, *args)
        return end


class Link:
    """One direction of a device's link: bytes serialize at `bandwidth` (bytes/s, inf = free),
    then arrive `latency` s later. Messages leave in order, like frames on one WebSocket."""

    def __init__(self, loop: EventLoop, bandwidth: float, latency: float) -> None:
        if not bandwidth > 0 or not latency >= 0:
            raise ValueError(f"need bandwidth > 0 and latency >= 0, got {bandwidth!r}, {latency!r}")
        self.bandwidth = float(bandwidth)
        self.latency = float(latency)
        self.wire = FifoServer(loop)
        self.bytes = 0

    def transfer_s(self, nbytes: float) -> float:
        return 0.0 if math.isinf(self.bandwidth) else nbytes / self.bandwidth

    def send(self, nbytes: float, arrived: Callback, *args: Any) -> float:
        """Queue `nbytes`; `arrived(*args)` runs when the last byte lands. Returns the arrival time."""
        self.bytes += int(nbytes)
        return self.wire.submit(self.transfer_s(nbytes), arrived, *args, delay_after=self.latency) + self.latency
