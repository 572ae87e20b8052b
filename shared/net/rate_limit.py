"""Token-bucket rate limiting per credential (an API key, or a client address).

Each key owns a bucket of `burst` tokens refilled at `rate_per_s`; a request takes one
token or is told how long until one is there. Pure: time comes from an injectable
clock, so tests drive it without sleeping. The table of buckets is bounded: a bucket
that has refilled completely carries no state worth keeping and is the first dropped.
`address_key` names a client address's bucket: one per IPv4 address, one per IPv6 /64 (a single
host is routinely handed a whole /64, so per address it could draw on 2^64 buckets).
"""

from __future__ import annotations

import ipaddress
import math
import time
from collections import OrderedDict
from collections.abc import Callable


class TokenBucket:
    """`burst` tokens, refilled continuously at `rate_per_s`; starts full."""

    __slots__ = ("rate_per_s", "burst", "tokens", "stamp")

    def __init__(self, rate_per_s: float, burst: int, now: float) -> None:
        if rate_per_s <= 0 or burst < 1:
            raise ValueError("a token bucket needs rate_per_s > 0 and burst >= 1")
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.tokens = float(burst)
        self.stamp = now

    def _refill(self, now: float) -> None:
        elapsed = max(0.0, now - self.stamp)  # a clock that steps back refills nothing
        self.tokens = min(float(self.burst), self.tokens + elapsed * self.rate_per_s)
        self.stamp = max(self.stamp, now)

    def take(self, now: float) -> float:
        """Take one token: 0.0 when taken, else the seconds until one is available (nothing taken)."""
        self._refill(now)
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate_per_s

    def full(self, now: float) -> bool:
        self._refill(now)
        return self.tokens >= self.burst


class RateLimiter:
    """One token bucket per key; `rate_per_s` <= 0 turns limiting off (every request passes)."""

    def __init__(
        self, rate_per_s: float, burst: int, *, clock: Callable[[], float] = time.monotonic, max_keys: int = 10_000
    ) -> None:
        if rate_per_s > 0 and burst < 1:
            raise ValueError("burst must be >= 1 when rate limiting is on")
        if max_keys < 1:
            raise ValueError("max_keys must be >= 1")
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.clock = clock
        self.max_keys = max_keys
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()  # least recently used first

    @property
    def enabled(self) -> bool:
        return self.rate_per_s > 0

    def __len__(self) -> int:
        return len(self._buckets)

    def acquire(self, key: str) -> float:
        """0.0 when `key` may go now (one token spent), else the seconds until it may try again."""
        if not self.enabled:
            return 0.0
        now = self.clock()
        bucket = self._buckets.get(key)
        if bucket is None:
            self._make_room(now)
            bucket = self._buckets[key] = TokenBucket(self.rate_per_s, self.burst, now)
        else:
            self._buckets.move_to_end(key)
        return bucket.take(now)

    def _make_room(self, now: float) -> None:
        """Keep the table under `max_keys`: drop full buckets (forgetting them changes nothing),
        then, if every key is mid-burst, the least recently used (which forgives it early)."""
        if len(self._buckets) < self.max_keys:
            return
        for key in [k for k, b in self._buckets.items() if b.full(now)]:
            del self._buckets[key]
        while len(self._buckets) >= self.max_keys:
            self._buckets.popitem(last=False)


IPV6_PREFIX_BITS = 64  # one subnet (RFC 4291): a host picks any of its 2^64 addresses itself (privacy addresses)


def address_key(address: str) -> str:
    """The bucket name for a client address: the IPv4 address itself (an IPv4-mapped IPv6 address as its
    IPv4), else the IPv6 address's /64. Anything that is not an IP address (a Unix socket's path) as it is."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])  # a zone index names a link, not a host
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, IPV6_PREFIX_BITS), strict=False))
    return str(ip)


def retry_after_s(wait_s: float) -> int:
    """A `Retry-After` header value: whole seconds, rounded up, at least 1."""
    return max(1, math.ceil(wait_s))
