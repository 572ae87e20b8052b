"""Telemetry plumbing: Redis key names, a best-effort Redis sink, an HTTP client.

Telemetry exists to steer the scheduler (HAT §3.2), never to gate serving. So
both halves are *lossy by design*: when Redis (or the state monitor) is
unreachable a record is dropped, one warning is logged for the whole outage
(not one per record), and a single owned background task retries with
exponential backoff; when the peer returns, one recovery line is logged and
records flow again. Every Redis call runs under a timeout.

Key layout (see docs/redis-keys.md for fields and retention):
    tophat:verifier:steps        stream  one entry per verifier step (raw)
    tophat:verifier:state        hash    derived cloud state: mu, eta, g (JSON)
    tophat:device:{id}:events    stream  raw draft/transfer records of a device
    tophat:device:{id}:state     hash    derived gamma, beta_up, beta_down
    tophat:devices               set     ids of devices that ever reported
    tophat:requests              stream  one entry per finished request
    tophat:request:{id}          hash    per-request summary, expires (TTL)
    tophat:disco:prompt_tokens   list    recent prompt lengths, newest first, capped (DiSCo eq. 3)
    tophat:disco:server_ttft_s   list    recent server-endpoint TTFTs, newest first, capped (DiSCo eq. 1)
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.typing import EncodableT, FieldT

from shared.net.backoff import Backoff
from shared.telemetry.outage import Outage

log = logging.getLogger(__name__)

PREFIX = "tophat"
VERIFIER_STEPS = f"{PREFIX}:verifier:steps"
VERIFIER_STATE = f"{PREFIX}:verifier:state"
DEVICES = f"{PREFIX}:devices"
REQUESTS = f"{PREFIX}:requests"
# DiSCo's two distributions: the prompt-length one behind l_th and the server TTFT CDF behind w_tail.
DISCO_PROMPT_TOKENS = f"{PREFIX}:disco:prompt_tokens"
DISCO_SERVER_TTFT = f"{PREFIX}:disco:server_ttft_s"

RECORD_KINDS = ("verifier_step", "verifier_calibration", "device_draft", "device_transfer", "device_rtt", "request")


def device_events_key(device_id: str) -> str:
    return f"{PREFIX}:device:{device_id}:events"


def device_state_key(device_id: str) -> str:
    return f"{PREFIX}:device:{device_id}:state"


def request_key(request_id: str) -> str:
    return f"{PREFIX}:request:{request_id}"


def redact_url(url: str) -> str:
    """Drop credentials from a URL before it reaches a log line or an API response."""
    parts = urlsplit(url)
    if parts.password is None and parts.username is None:
        return url
    host = parts.hostname or ""
    netloc = f"***@{host}:{parts.port}" if parts.port else f"***@{host}"
    return urlunsplit(parts._replace(netloc=netloc))


def encode_value(value: Any) -> str:
    """Redis stores strings: numbers as repr, bools as 1/0, None as '', containers as JSON."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(value, separators=(",", ":"), default=str)


_RedisFields = dict[FieldT, EncodableT]  # what redis-py's stubs take: invariant, so a dict[str, str] is cast to it


def encode_fields(fields: Mapping[str, Any]) -> dict[str, str]:
    return {str(k): encode_value(v) for k, v in fields.items()}


class TelemetrySink:
    """Best-effort async writer: events go to capped streams, state to hashes.

    Write methods return True when Redis acknowledged, False when the record
    was dropped. They never raise for Redis trouble. While Redis is down,
    writes are dropped without touching the network and `_reconnect` pings
    with backoff (initial_backoff_s doubling up to max_backoff_s). A write that
    arrives while the loop sleeps a longer step than the first wakes it for an
    immediate ping, so telemetry resumes with the traffic that follows an outage
    rather than up to max_backoff_s later.
    """

    def __init__(
        self,
        url: str,
        *,
        stream_maxlen: int = 10_000,
        timeout_s: float = 0.5,
        request_ttl_s: int = 86_400,
        initial_backoff_s: float = 0.25,
        max_backoff_s: float = 5.0,
    ) -> None:
        if stream_maxlen < 1:
            raise ValueError("stream_maxlen must be >= 1")
        self.url = url
        self.stream_maxlen = stream_maxlen
        self.timeout_s = timeout_s
        self.request_ttl_s = request_ttl_s
        self.initial_backoff_s = initial_backoff_s
        self.max_backoff_s = max_backoff_s
        # A first wait longer than the cap (tests park the loop with initial 10 s) stays the wait: never shortened.
        self._backoff = Backoff(initial_backoff_s, max(max_backoff_s, initial_backoff_s))
        self._redis = aioredis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
            decode_responses=True,
            health_check_interval=0,
        )
        self._outage = Outage(f"redis at {redact_url(url)}")
        self._reconnect_task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()  # set by a write during an outage: ping now
        self._last_ping = 0.0  # time.monotonic() of the reconnect loop's last ping
        self._closed = False

    @property
    def connected(self) -> bool:
        return not self._outage.down

    @property
    def dropped(self) -> int:
        return self._outage.dropped

    async def start(self) -> bool:
        """Probe Redis once; on failure start the reconnect loop. Never raises."""
        try:
            async with asyncio.timeout(self.timeout_s):
                await self._redis.ping()
        except (RedisError, OSError, TimeoutError) as exc:
            self._mark_down(exc, dropped=False)
            return False
        return True

    async def close(self) -> None:
        self._closed = True
        if self._reconnect_task is not None:
            self._reconnect_task.cancel()
            await asyncio.gather(self._reconnect_task, return_exceptions=True)
            self._reconnect_task = None
        await self._redis.aclose()

    def _mark_down(self, exc: BaseException, dropped: bool = True) -> None:
        self._outage.failed(exc, dropped)
        if not self._closed and (self._reconnect_task is None or self._reconnect_task.done()):
            self._reconnect_task = asyncio.get_running_loop().create_task(
                self._reconnect(), name="telemetry-sink-reconnect"
            )

    async def _reconnect(self) -> None:
        delay = self._backoff.after(None)
        while not self._closed:
            self._wake.clear()
            try:
                async with asyncio.timeout(delay):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._last_ping = time.monotonic()
            try:
                async with asyncio.timeout(self.timeout_s):
                    await self._redis.ping()
            except (RedisError, OSError, TimeoutError) as exc:
                log.debug("redis still unavailable: %s", exc)
                delay = self._backoff.after(delay)
                continue
            self._outage.recovered()
            return

    async def write(
        self,
        *,
        events: Iterable[tuple[str, Mapping[str, Any]]] = (),
        states: Iterable[tuple[str, Mapping[str, Any], int | None]] = (),
        members: Iterable[tuple[str, str]] = (),
        lists: Iterable[tuple[str, Any, int]] = (),
    ) -> bool:
        """One round trip: XADD each event (MAXLEN ~), HSET each state (+EXPIRE), SADD members,
        LPUSH each (list, value, cap) and LTRIM it to its newest `cap` values."""
        if self._outage.down or self._closed:
            self._outage.dropped += 1
            if time.monotonic() - self._last_ping >= self.initial_backoff_s:
                self._wake.set()
            return False
        pipe = self._redis.pipeline(transaction=False)
        for stream, fields in events:
            pipe.xadd(stream, cast(_RedisFields, encode_fields(fields)), maxlen=self.stream_maxlen, approximate=True)
        for key, mapping, ttl in states:
            pipe.hset(key, mapping=cast(_RedisFields, encode_fields(mapping)))
            if ttl:
                pipe.expire(key, ttl)
        for key, member in members:
            pipe.sadd(key, member)
        for key, value, cap in lists:
            pipe.lpush(key, encode_value(value))
            pipe.ltrim(key, 0, cap - 1)
        try:
            async with asyncio.timeout(self.timeout_s):
                await pipe.execute()
        except (RedisError, OSError, TimeoutError) as exc:
            self._mark_down(exc)
            return False
        return True

    async def add_event(self, stream: str, fields: Mapping[str, Any]) -> bool:
        return await self.write(events=[(stream, fields)])

    async def set_state(self, key: str, mapping: Mapping[str, Any], ttl_s: int | None = None) -> bool:
        return await self.write(states=[(key, mapping, ttl_s)])

    async def read_hash(self, key: str) -> dict[str, str] | None:
        """HGETALL for state restore at startup; None if Redis is unavailable."""
        if self._outage.down:
            return None
        try:
            async with asyncio.timeout(self.timeout_s):
                return cast(dict[str, str], await self._redis.hgetall(key))  # decode_responses: str
        except (RedisError, OSError, TimeoutError) as exc:
            self._mark_down(exc, dropped=False)
            return None

    async def read_lists(self, keys: Sequence[str], count: int) -> list[list[str]] | None:
        """The first `count` values of each list in one round trip; None if Redis is unavailable. A read
        during an outage wakes the reconnect loop as a write does, so readers are served soon after it ends."""
        if self._outage.down:
            if time.monotonic() - self._last_ping >= self.initial_backoff_s:
                self._wake.set()
            return None
        pipe = self._redis.pipeline(transaction=False)
        for key in keys:
            pipe.lrange(key, 0, count - 1)
        try:
            async with asyncio.timeout(self.timeout_s):
                return list(await pipe.execute())
        except (RedisError, OSError, TimeoutError) as exc:
            self._mark_down(exc, dropped=False)
            return None

    async def read_members(self, key: str) -> set[str] | None:
        if self._outage.down:
            return None
        try:
            async with asyncio.timeout(self.timeout_s):
                return cast(set[str], set(await self._redis.smembers(key)))  # decode_responses: str
        except (RedisError, OSError, TimeoutError) as exc:
            self._mark_down(exc, dropped=False)
            return None
