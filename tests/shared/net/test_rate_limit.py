"""shared/net/rate_limit.py: the token bucket per credential, driven by a fake clock (no sleeping)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.net.rate_limit import RateLimiter, TokenBucket, address_key, retry_after_s


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_burst_then_refused_then_refilled_at_the_rate() -> None:
    clock = Clock()
    limiter = RateLimiter(2.0, 3, clock=clock)
    assert [limiter.acquire("k") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert limiter.acquire("k") == pytest.approx(0.5)  # one token every 1/2 s
    clock.now += 0.49
    assert limiter.acquire("k") > 0
    clock.now += 0.01
    assert limiter.acquire("k") == 0.0
    assert limiter.acquire("k") == pytest.approx(0.5)
    clock.now += 60  # a long idle refills to the burst, no further
    assert [limiter.acquire("k") for _ in range(4)][-1] > 0


def test_keys_are_independent_and_off_means_off() -> None:
    clock = Clock()
    limiter = RateLimiter(1.0, 1, clock=clock)
    assert limiter.acquire("a") == 0.0 and limiter.acquire("a") > 0
    assert limiter.acquire("b") == 0.0  # another credential has its own bucket
    off = RateLimiter(0.0, 0, clock=clock)
    assert not off.enabled and all(off.acquire("a") == 0.0 for _ in range(1000)) and len(off) == 0


def test_a_clock_stepping_back_refills_nothing() -> None:
    clock = Clock()
    bucket = TokenBucket(1.0, 1, clock.now)
    assert bucket.take(clock.now) == 0.0
    assert bucket.take(clock.now - 100) > 0 and bucket.take(clock.now) > 0


def test_table_of_keys_is_bounded_and_drops_full_buckets_first() -> None:
    clock = Clock()
    limiter = RateLimiter(1.0, 2, clock=clock, max_keys=3)
    limiter.acquire("busy")
    limiter.acquire("busy")  # empty bucket: state worth keeping
    for key in ("a", "b"):
        limiter.acquire(key)
    clock.now += 1.0  # a and b refill completely; busy is still one token short
    limiter.acquire("c")
    assert len(limiter) == 2 and limiter.acquire("busy") == 0.0 and limiter.acquire("busy") > 0
    for i in range(100):
        limiter.acquire(f"spray-{i}")
    assert len(limiter) <= 3


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError):
        RateLimiter(1.0, 0)
    with pytest.raises(ValueError):
        TokenBucket(0.0, 1, 0.0)


def test_an_ipv6_client_gets_one_bucket_per_64_and_an_ipv4_one_per_address() -> None:
    same_64 = ["2001:db8:1:2::1", "2001:db8:1:2:ffff:ffff:ffff:ffff", "2001:DB8:1:2:0:0:0:abcd", "2001:db8:1:2::9%eth0"]
    assert {address_key(a) for a in same_64} == {"2001:db8:1:2::/64"}
    assert address_key("2001:db8:1:3::1") == "2001:db8:1:3::/64"  # the next /64: another bucket
    assert address_key("::1") == "::/64"
    assert address_key("192.0.2.7") == "192.0.2.7" and address_key("192.0.2.8") == "192.0.2.8"
    assert address_key("::ffff:192.0.2.7") == "192.0.2.7"  # IPv4-mapped: the IPv4 client's own bucket
    assert address_key("unknown") == "unknown" and address_key("/run/tophat.sock") == "/run/tophat.sock"
    clock = Clock()
    limiter = RateLimiter(1.0, 1, clock=clock)
    assert limiter.acquire(address_key("2001:db8::1")) == 0.0
    assert limiter.acquire(address_key("2001:db8::2")) > 0  # a new address in the same /64 is no new bucket


def test_retry_after_is_whole_seconds_at_least_one() -> None:
    assert [retry_after_s(w) for w in (0.0, 0.001, 0.5, 1.0, 1.01, 7.9)] == [1, 1, 1, 1, 2, 8]


@settings(max_examples=200, deadline=None)
@given(
    rate=st.floats(0.1, 50.0),
    burst=st.integers(1, 20),
    steps=st.lists(st.tuples(st.floats(0.0, 2.0), st.sampled_from("abc")), min_size=1, max_size=200),
)
def test_no_key_ever_exceeds_burst_plus_rate_times_elapsed(
    rate: float, burst: int, steps: list[tuple[float, str]]
) -> None:
    clock = Clock()
    limiter = RateLimiter(rate, burst, clock=clock)
    start = clock.now
    granted: dict[str, list[float]] = {}
    for dt, key in steps:
        clock.now += dt
        wait = limiter.acquire(key)
        assert wait >= 0.0
        if wait == 0.0:
            granted.setdefault(key, []).append(clock.now)
    for times in granted.values():
        # Any window [t_i, t_j] of grants holds at most burst + rate * (t_j - t_i) of them.
        for i in range(len(times)):
            for j in range(i, len(times)):
                assert j - i + 1 <= burst + rate * (times[j] - times[i]) + 1e-6
    assert clock.now >= start


@settings(max_examples=200, deadline=None)
@given(rate=st.floats(0.1, 50.0), burst=st.integers(1, 10), used=st.integers(0, 30))
def test_the_wait_it_returns_is_exactly_when_a_token_is_back(rate: float, burst: int, used: int) -> None:
    clock = Clock()
    limiter = RateLimiter(rate, burst, clock=clock)
    for _ in range(used):
        limiter.acquire("k")
    wait = limiter.acquire("k")
    if used < burst:
        assert wait == 0.0
        return
    assert wait == pytest.approx(1.0 / rate)
    clock.now += wait * 0.99
    assert limiter.acquire("k") > 0  # refused again, nothing taken
    clock.now += wait * 0.011
    assert limiter.acquire("k") == 0.0
