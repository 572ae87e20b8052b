"""Admission to device slots: a bounded first-come-first-served queue with a deadline.

A burst larger than the devices' free sessions waits here instead of failing.
`acquire()` hands out one device slot (the router's `outstanding` is already
taken) to the oldest waiting request whenever one is free; a slot comes free when
a generation ends (`release`) or, when the streamer does not know a device's
capacity, when a device that said "busy" is worth asking again. The queue is
bounded (`QueueFull`, answered 429 with Retry-After) and every request has a
deadline (`QueueTimeout`, 503 `queue_timeout`). A waiter that is cancelled (its
client went away) leaves the queue at once.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from services.token_streamer.router import DeviceError, DeviceState, Router
from shared.telemetry import latency_stats

log = logging.getLogger(__name__)

# How often the head of the queue re-checks devices held off after a 'busy' (a release wakes it at
# once); the others can only move after it, so they only look now and then (device back up, ...).
HEAD_POLL_S = 0.05
POLL_S = 1.0
RECENT_WAITS = 1024


class QueueFull(DeviceError):
    def __init__(self, waiting: int, retry_after_s: int) -> None:
        super().__init__(
            429, "queue_full", f"{waiting} requests are already waiting for a device; retry in {retry_after_s} s"
        )
        self.retry_after_s = retry_after_s


class QueueTimeout(DeviceError):
    def __init__(self, waited_s: float) -> None:
        super().__init__(
            503, "queue_timeout", f"no device slot came free within {waited_s:.1f} s in the streamer's queue"
        )


@dataclass
class QueueTicket:
    """One request's place in the counts across its turns in the queue."""

    queued: bool = False  # counted in Admission.queued


class Admission:
    """FCFS hand-out of device slots; every method runs on the event loop (no locks needed)."""

    def __init__(self, router: Router, *, max_waiting: int, timeout_s: float) -> None:
        self.router = router
        self.max_waiting = max_waiting
        self.timeout_s = timeout_s
        self._waiters: deque[asyncio.Future[DeviceState]] = deque()
        self._mean_hold_s = 1.0  # EWMA of how long a slot is held: the Retry-After estimate
        self.admitted = self.queued = self.rejected_full = self.timed_out = self.abandoned = 0
        self.recent_waits_s: deque[float] = deque(maxlen=RECENT_WAITS)

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @property
    def running(self) -> int:
        """Requests holding a device slot (being started or generating), on every device, retired ones included."""
        return sum(device.outstanding for device in self.router.devices)

    async def acquire(self, deadline: float, *, front: bool = False, ticket: QueueTicket | None = None) -> DeviceState:
        """A device with one slot taken for the caller, in arrival order.

        `deadline` is on `time.monotonic()`. `front` puts a request that already had its
        turn (the device then said busy) back at the head, so it keeps its place.
        `ticket` is the request's own across its turns: it is counted in `queued` the first time it waits, whether
        it waits on arrival or only after a device of unknown capacity said busy (without one, every wait counts).
        Raises DeviceError 503 `no_device_available` when no device is healthy at all
        (waiting would not help), QueueFull or QueueTimeout."""
        if not self._waiters or front:
            device = self._take()
            if device is not None:
                return device
        if not any(self.router.healthy(d) for d in self.router.devices):
            raise DeviceError(503, "no_device_available", "no device agent is reachable")
        if len(self._waiters) >= self.max_waiting and not front:
            self.rejected_full += 1
            raise QueueFull(len(self._waiters), self.retry_after_s())
        waiter = self._enqueue(front, ticket)
        granted = False
        try:
            while not waiter.done():
                left = deadline - time.monotonic()
                if left <= 0:
                    self.timed_out += 1
                    raise QueueTimeout(self.timeout_s)
                poll_s = HEAD_POLL_S if self._waiters and self._waiters[0] is waiter else POLL_S
                await asyncio.wait([waiter], timeout=min(left, poll_s))
                self.pump()
            granted = True
            return waiter.result()
        except asyncio.CancelledError:
            self.abandoned += 1
            raise
        finally:
            if granted:
                pass
            elif waiter.done() and not waiter.cancelled():
                device = waiter.result()  # granted just as its client left: pass the slot on
                self.router.opened(device)
                self.release(device)
            else:
                waiter.cancel()
                self._waiters.remove(waiter)
                self.pump()  # the new head may be served now rather than at its next poll

    def _enqueue(self, front: bool, ticket: QueueTicket | None) -> asyncio.Future[DeviceState]:
        """A waiter in line (at its head for a request that had its turn), counted once per request."""
        waiter: asyncio.Future[DeviceState] = asyncio.get_running_loop().create_future()
        if front:
            self._waiters.appendleft(waiter)
        else:
            self._waiters.append(waiter)
        if ticket is None or not ticket.queued:
            self.queued += 1
            if ticket is not None:
                ticket.queued = True
        return waiter

    def _take(self) -> DeviceState | None:
        device = self.router.pick(free_only=True)
        if device is not None:
            self.router.acquire(device)
        return device

    def pump(self) -> None:
        """Hand free slots to the oldest waiters."""
        while self._waiters:
            head = self._waiters[0]
            if head.done():
                self._waiters.popleft()
                continue
            device = self._take()
            if device is None:
                return
            self._waiters.popleft()
            head.set_result(device)

    def release(self, device: DeviceState, *, held_s: float | None = None, busy: bool = False) -> None:
        """Give a slot back. `busy`: the device refused (its capacity is lower than we thought)."""
        self.router.release(device, busy=busy)
        if held_s is not None:
            self._mean_hold_s += 0.1 * (held_s - self._mean_hold_s)
        self.pump()

    def record_wait(self, waited_s: float) -> None:
        """A request got its device after waiting `waited_s` (busy refusals on the way included)."""
        self.admitted += 1
        self.recent_waits_s.append(waited_s)

    def retry_after_s(self) -> int:
        """Seconds until the queue has likely drained by one place per waiting request."""
        slots = max(1, self.router.capacity())
        return max(1, math.ceil(self._mean_hold_s * (len(self._waiters) + 1) / slots))

    def stats(self) -> dict[str, Any]:
        waits = latency_stats.summary(self.recent_waits_s)  # the same percentiles loadgen reports
        return {
            "waiting": self.waiting,
            "max_waiting": self.max_waiting,
            "timeout_s": self.timeout_s,
            "admitted": self.admitted,
            "queued": self.queued,
            "rejected_full": self.rejected_full,
            "timed_out": self.timed_out,
            "abandoned": self.abandoned,
            "wait_p50_s": waits["median"],
            "wait_p99_s": waits["p99"],
        }
