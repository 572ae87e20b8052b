"""In-process link emulation: the fallback when network namespaces are unavailable.

`LinkShaper` models one direction of a serial link the way a NIC + propagation
delay behave: a frame of n bytes starts transmitting at max(now, link_free_at),
occupies the link for n / rate seconds, and arrives latency (+/- jitter) after
its last byte left. Latency is pipelined — frames are in flight concurrently,
so it is paid once per frame, not once per frame *in sequence* — while
serialization is not. Arrival order equals send order even with jitter
(a TCP stream never delivers out of order, so neither may we).

The shaper only does bookkeeping; it never touches sockets. The device's
WebSocket client calls ``await uplink.transmit(len(frame))`` before sending a
frame. On receipt it must book at once and deliver later, in order — awaiting
in the receive loop would serialize the latencies. The pattern::

    # receive loop                                   # one consumer task
    now = loop.time()                                arrive, frame = await q.get()
    arrive = now + downlink.delivery_delay(n, now)   await asyncio.sleep(max(0.0, arrive - loop.time()))
    q.put_nowait((arrive, frame))                    handle(frame)

Arrival times never decrease, so a FIFO consumer is both on time and in order.
Bandwidth may be ``math.inf`` (latency-only link, e.g. the remainder a kernel
shaper without netem cannot provide; see `tophatctl.netns`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from shared.net.links import LinkProfile

log = logging.getLogger(__name__)

T = TypeVar("T")

# asyncio.sleep wakes up late by up to ~1 ms on a busy box; transmit() forgives
# that much lateness of its own caller (see transmit).
TIMER_SLACK_S = 0.002


class LinkShaper:
    """One direction of an emulated link (see module docstring for the model).

    ``clock`` defaults to ``time.monotonic`` (what asyncio's loop uses), and is
    only read by `transmit`; `delivery_delay` takes ``now`` explicitly so tests
    can drive it with a fake clock.
    """

    def __init__(
        self,
        rate_bytes_s: float,
        latency_s: float = 0.0,
        jitter_s: float = 0.0,
        seed: int | None = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if math.isnan(rate_bytes_s) or rate_bytes_s <= 0:
            raise ValueError(f"rate_bytes_s must be > 0 (or inf), got {rate_bytes_s!r}")
        if not math.isfinite(latency_s) or latency_s < 0:
            raise ValueError(f"latency_s must be a finite number >= 0, got {latency_s!r}")
        if not math.isfinite(jitter_s) or jitter_s < 0:
            raise ValueError(f"jitter_s must be a finite number >= 0, got {jitter_s!r}")
        self.rate_bytes_s = float(rate_bytes_s)
        self.latency_s = float(latency_s)
        self.jitter_s = float(jitter_s)
        self._rng = random.Random(seed)
        self._clock = clock
        self._link_free_at = -math.inf  # when the last queued frame finishes serializing
        self._last_delivery = -math.inf  # arrival time of the last frame (keeps order)
        self._previous: asyncio.Future[None] | None = None  # completion of the last transmit()
        self._last_return_target = -math.inf  # when the last transmit() meant to return
        self.frames = 0
        self.bytes = 0

    def serialization_s(self, nbytes: int) -> float:
        """Seconds the link is busy with a frame of ``nbytes``."""
        return 0.0 if math.isinf(self.rate_bytes_s) else nbytes / self.rate_bytes_s

    def delivery_delay(self, nbytes: int, now: float) -> float:
        """Book a frame of ``nbytes`` sent at ``now``; return seconds until it arrives.

        Calls must be made in send order (each call occupies the link).
        """
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        start = max(now, self._link_free_at)
        finish = start + self.serialization_s(nbytes)
        self._link_free_at = finish
        delay = self.latency_s
        if self.jitter_s > 0:
            delay = max(0.0, delay + self._rng.uniform(-self.jitter_s, self.jitter_s))
        arrival = max(finish + delay, self._last_delivery)
        self._last_delivery = arrival
        self.frames += 1
        self.bytes += nbytes
        return arrival - now

    async def transmit(self, nbytes: int) -> None:
        """Sleep until a frame of ``nbytes`` sent now would have arrived.

        Booking happens before the first await, and each call also waits for
        the previous call to return, so concurrent callers finish in call
        order even when their arrival times tie (asyncio timers with equal
        deadlines have no guaranteed order).

        Note the caller is held for serialization *and* latency: a single task
        that transmits frame after frame behaves stop-and-wait (each frame pays
        the latency in sequence). To pipeline, transmit from several tasks or
        use `DelayLine`, which only holds the sender while the link is backed up.
        """
        now = self._clock()
        if 0.0 <= now - self._last_return_target < TIMER_SLACK_S:
            # Called straight after our own sleep returned late: book as of the
            # intended wake-up, or timer overshoot would idle the link (with
            # ~1 ms frames, that alone cost ~15% of throughput).
            now = self._last_return_target
        arrival = now + self.delivery_delay(nbytes, now)
        self._last_return_target = arrival
        previous, mine = self._previous, asyncio.get_running_loop().create_future()
        self._previous = mine
        try:
            delay = arrival - self._clock()
            if delay > 0:
                await asyncio.sleep(delay)
            if previous is not None and not previous.done():
                await asyncio.shield(previous)
        finally:
            mine.set_result(None)

    def now(self) -> float:
        """The shaper's clock (``time.monotonic`` by default, like asyncio's loop)."""
        return self._clock()

    @property
    def backlog_s(self) -> float:
        """Seconds of serialization still queued ahead of a frame sent now."""
        return max(0.0, self._link_free_at - self._clock())


def shapers_for(profile: LinkProfile, seed: int = 0) -> tuple[LinkShaper, LinkShaper] | None:
    """(uplink, downlink) shapers for a profile, or None when it is unshaped.

    The two directions get different seeds so their jitter is independent.
    """
    if not profile.shaped:
        return None
    uplink = LinkShaper(profile.uplink_bytes_s, profile.latency_s, profile.jitter_s, seed=seed)
    downlink = LinkShaper(profile.downlink_bytes_s, profile.latency_s, profile.jitter_s, seed=seed + 1_000_003)
    log.debug("in-process link shaping: %s", profile.describe())
    return uplink, downlink


class DelayLine(Generic[T]):
    """Frames through a `LinkShaper` into ``deliver``, each at its arrival time, in order.

    Why: like a socket send buffer, `put` returns as soon as the frame is
    queued (waiting only while more than ``max_backlog_s`` of serialization is
    already queued), so back-to-back frames pipeline their latency instead of
    paying it one after another. One consumer task sleeps until each frame's
    arrival and awaits ``deliver(frame)`` (e.g. ``ws.send`` for the uplink, or
    the frame handler for the downlink). If ``deliver`` raises, the line is
    broken and the error is re-raised by the next `put`/`drain`.
    """

    def __init__(
        self,
        shaper: LinkShaper,
        deliver: Callable[[T], Awaitable[object]],
        *,
        size: Callable[[T], int] = len,  # type: ignore[assignment]
        max_backlog_s: float = 0.25,
    ) -> None:
        if max_backlog_s < 0:
            raise ValueError(f"max_backlog_s must be >= 0, got {max_backlog_s}")
        self.shaper = shaper
        self._deliver = deliver
        self._size = size
        self.max_backlog_s = max_backlog_s
        self._queue: asyncio.Queue[tuple[float, T]] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._error: BaseException | None = None

    async def put(self, frame: T) -> None:
        """Book ``frame`` on the link; returns once the sender's buffer has room."""
        self._raise_if_broken()
        while (excess := self.shaper.backlog_s - self.max_backlog_s) > 0:
            await asyncio.sleep(excess)
            self._raise_if_broken()
        now = self.shaper.now()
        arrival = now + self.shaper.delivery_delay(self._size(frame), now)
        self._queue.put_nowait((arrival, frame))
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="delay-line")

    async def drain(self) -> None:
        """Wait until every queued frame has been delivered."""
        self._raise_if_broken()
        if self._task is None:
            return
        joined = asyncio.ensure_future(self._queue.join())
        try:
            await asyncio.wait({joined, self._task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            joined.cancel()
        self._raise_if_broken()

    async def aclose(self) -> None:
        """Stop delivering; frames still queued are dropped."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    def _raise_if_broken(self) -> None:
        if self._error is not None:
            raise RuntimeError("delay line broken: deliver() failed") from self._error

    async def _run(self) -> None:
        clock = self.shaper.now
        while True:
            arrival, frame = await self._queue.get()
            try:
                delay = arrival - clock()
                if delay > 0:
                    await asyncio.sleep(delay)
                await self._deliver(frame)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # surfaced to the sender via put()/drain()
                log.warning("delay line: deliver() failed: %r", exc)
                self._error = exc
                return
            finally:
                self._queue.task_done()
