"""In-process link shaper: bookkeeping with a fake clock, then real asyncio timing."""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from shared.net.links import UNSHAPED, LinkProfile
from shared.net.shaper import TIMER_SLACK_S, DelayLine, LinkShaper, shapers_for


def test_single_frame_pays_serialization_plus_latency() -> None:
    link = LinkShaper(1000.0, latency_s=0.05)
    assert link.delivery_delay(100, now=10.0) == pytest.approx(0.1 + 0.05)


def test_back_to_back_frames_serialize_but_latency_is_pipelined() -> None:
    link = LinkShaper(1000.0, latency_s=0.5)
    delays = [link.delivery_delay(100, now=0.0) for _ in range(10)]
    # frame k finishes serializing at 0.1*(k+1); latency is paid once, in parallel.
    assert delays == pytest.approx([0.1 * (k + 1) + 0.5 for k in range(10)])
    assert link.frames == 10 and link.bytes == 1000


def test_idle_link_does_not_bank_capacity() -> None:
    link = LinkShaper(1000.0, latency_s=0.01)
    link.delivery_delay(100, now=0.0)  # link busy until 0.1
    assert link.delivery_delay(100, now=0.05) == pytest.approx(0.05 + 0.1 + 0.01)  # waits for the link
    assert link.delivery_delay(100, now=5.0) == pytest.approx(0.1 + 0.01)  # idle: starts at once


def test_jitter_is_bounded_and_never_reorders() -> None:
    link = LinkShaper(1e6, latency_s=0.01, jitter_s=0.008, seed=7)
    arrivals, delays = [], []
    now = 0.0
    for _ in range(2000):
        now += 0.0005  # faster than the jitter: reordering would happen if unguarded
        d = link.delivery_delay(100, now)
        delays.append(d)
        arrivals.append(now + d)
    assert all(b >= a - 1e-12 for a, b in zip(arrivals, arrivals[1:]))
    assert min(delays) >= 0.01 - 0.008 + 100 / 1e6 - 1e-12
    assert max(delays) > 0.017  # jitter actually applied
    # same seed -> same sequence (reproducible runs)
    again = LinkShaper(1e6, latency_s=0.01, jitter_s=0.008, seed=7)
    assert again.delivery_delay(100, 0.0005) == pytest.approx(delays[0])


def test_unlimited_rate_is_latency_only() -> None:
    link = LinkShaper(math.inf, latency_s=0.02)
    assert [link.delivery_delay(10**9, now=1.0) for _ in range(3)] == pytest.approx([0.02] * 3)


@pytest.mark.parametrize(
    "kwargs", [{"rate_bytes_s": 0}, {"rate_bytes_s": math.nan}, {"rate_bytes_s": 1, "latency_s": -1}]
)
def test_rejects_bad_parameters(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        LinkShaper(**kwargs)


def test_shapers_for_profile() -> None:
    assert shapers_for(UNSHAPED) is None
    up, down = shapers_for(LinkProfile(1e3, 2e3, 0.004, 0.001))  # type: ignore[misc]
    assert (up.rate_bytes_s, down.rate_bytes_s, up.latency_s, down.jitter_s) == (1e3, 2e3, 0.004, 0.001)


async def test_timer_overshoot_of_the_caller_is_forgiven(monkeypatch: pytest.MonkeyPatch) -> None:
    # A fake clock whose sleeps all wake 1 ms late (a busy box): back-to-back
    # frames from one task still get the whole rate, because each booking
    # starts at the previous frame's intended finish, not at the late wake-up.
    fake_now = [100.0]
    overshoot = 0.001

    async def late_sleep(delay: float) -> None:
        fake_now[0] += delay + overshoot

    monkeypatch.setattr("shared.net.shaper.asyncio.sleep", late_sleep)
    link = LinkShaper(200_000.0, latency_s=0.0, clock=lambda: fake_now[0])
    for _ in range(12):
        await link.transmit(10_000)
    # 12 frames of 50 ms each: only the last wake-up's overshoot remains.
    assert fake_now[0] - 100.0 == pytest.approx(12 * 0.05 + overshoot)

    # Lateness beyond the slack is not forgiven: an idle link banks nothing.
    fake_now[0] += 1.0
    start = fake_now[0]
    await link.transmit(10_000)
    assert fake_now[0] - start == pytest.approx(0.05 + overshoot)


async def test_real_clock_never_exceeds_the_rate() -> None:
    # A loaded machine can only make the sleeps longer, so the rate is the
    # bound asserted here; that late wake-ups are forgiven is tested above
    # with a fake clock (a real-clock throughput target would be a timed test).
    rate = 200_000.0  # 0.6 s of traffic in 10 KB frames, sent by one task
    link = LinkShaper(rate, latency_s=0.0)
    start = time.monotonic()
    for _ in range(12):
        await link.transmit(10_000)
    elapsed = time.monotonic() - start
    assert elapsed >= 12 * 10_000 / rate - TIMER_SLACK_S
    assert (link.frames, link.bytes) == (12, 120_000)


async def test_real_clock_latency_added_and_order_kept_under_concurrency() -> None:
    link = LinkShaper(1e6, latency_s=0.05, jitter_s=0.02, seed=1)
    start = time.monotonic()
    await link.transmit(10)
    assert time.monotonic() - start >= 0.03 - 0.002  # latency - jitter, with timer slack

    done: list[int] = []

    async def send(i: int) -> None:
        await link.transmit(1000)
        done.append(i)

    start = time.monotonic()
    await asyncio.gather(*(send(i) for i in range(20)))
    assert done == list(range(20))
    # 20 frames x 1 ms serialization + one (pipelined) latency (~0.09 s), not
    # 20 latencies (>= 0.6 s); the margin is for a loaded machine's late timers
    assert time.monotonic() - start < 0.4


@pytest.mark.slow
async def test_delay_line_pipelines_latency_and_keeps_rate_and_order() -> None:
    rate, latency = 400_000.0, 0.1
    received: list[tuple[float, int]] = []

    async def deliver(frame: bytes) -> None:
        received.append((time.monotonic(), frame[0]))

    line: DelayLine[bytes] = DelayLine(LinkShaper(rate, latency_s=latency, jitter_s=0.01), deliver, max_backlog_s=0.05)
    start = time.monotonic()
    for i in range(100):  # 100 x 4 KB = 1 s of serialization
        await line.put(bytes([i]) * 4000)
    # put() only blocks while > 50 ms is queued, so the sender is not
    # stop-and-wait (that would take 100 x 0.11 s); ~0.95 s on an idle machine
    assert time.monotonic() - start < 4.0
    await line.drain()
    await line.aclose()
    assert [i for _, i in received] == list(range(100))
    first_arrival = received[0][0] - start
    assert first_arrival >= 4000 / rate + latency - 0.01 - 0.002
    elapsed = received[-1][0] - received[0][0]  # 99 frames' serialization between first and last
    assert elapsed >= 99 * 4000 / rate - 0.01 - 0.002  # never faster than the rate (jitter aside)
    # total ~ 1 s + one latency, far from 100 latencies (11 s); slack for a loaded machine
    assert received[-1][0] - start < 1.0 + latency + 3.0


async def test_delay_line_surfaces_deliver_errors() -> None:
    async def deliver(frame: bytes) -> None:
        raise ConnectionError("peer gone")

    line: DelayLine[bytes] = DelayLine(LinkShaper(math.inf, latency_s=0.001), deliver)
    await line.put(b"x")
    with pytest.raises(RuntimeError, match="broken"):
        await line.drain()
    with pytest.raises(RuntimeError, match="broken"):
        await line.put(b"y")
    await line.aclose()
