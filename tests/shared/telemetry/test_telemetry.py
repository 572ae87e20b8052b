"""TelemetrySink against a real redis-server, including an outage; TelemetryClient over HTTP."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
import redis

from shared.processes.redis_server import EmbeddedRedis
from shared.telemetry import sink as tk
from shared.telemetry.client import TelemetryClient


@pytest.fixture
def server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as srv:
        yield srv


@pytest.fixture
async def sink(server: EmbeddedRedis) -> AsyncIterator[tk.TelemetrySink]:
    s = tk.TelemetrySink(server.url, stream_maxlen=20, timeout_s=0.5, initial_backoff_s=0.05, max_backoff_s=0.2)
    assert await s.start()
    yield s
    await s.close()


def _client(server: EmbeddedRedis) -> redis.Redis:
    return redis.Redis.from_url(server.url, decode_responses=True)


async def _wait_connected(sink: tk.TelemetrySink, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not sink.connected:
        assert time.monotonic() < deadline, "sink did not reconnect"
        await asyncio.sleep(0.02)


def test_key_names() -> None:
    assert tk.VERIFIER_STEPS == "tophat:verifier:steps"
    assert tk.VERIFIER_STATE == "tophat:verifier:state"
    assert tk.DEVICES == "tophat:devices"
    assert tk.REQUESTS == "tophat:requests"
    assert tk.device_events_key("d1") == "tophat:device:d1:events"
    assert tk.device_state_key("d1") == "tophat:device:d1:state"
    assert tk.request_key("r1") == "tophat:request:r1"


def test_encode_and_redact() -> None:
    assert tk.encode_fields({"a": None, "b": True, "c": 3, "d": 0.5, "e": [1, 2], "f": "x"}) == {
        "a": "",
        "b": "1",
        "c": "3",
        "d": "0.5",
        "e": "[1,2]",
        "f": "x",
    }
    assert tk.redact_url("redis://user:secret@h:6379/0") == "redis://***@h:6379/0"
    assert tk.redact_url("redis://h:6379/0") == "redis://h:6379/0"


async def test_write_events_states_members(server: EmbeddedRedis, sink: tk.TelemetrySink) -> None:
    ok = await sink.write(
        events=[(tk.VERIFIER_STEPS, {"batched_tokens": 8, "compute_s": 0.01})],
        states=[(tk.request_key("r1"), {"ttft_s": 0.2}, 60)],
        members=[(tk.DEVICES, "d1")],
    )
    assert ok
    c = _client(server)
    ((entry_id, fields),) = c.xrange(tk.VERIFIER_STEPS)
    assert fields == {"batched_tokens": "8", "compute_s": "0.01"}
    assert c.hgetall(tk.request_key("r1")) == {"ttft_s": "0.2"}
    assert 0 < c.ttl(tk.request_key("r1")) <= 60
    assert c.smembers(tk.DEVICES) == {"d1"}
    c.close()


async def test_streams_are_capped(server: EmbeddedRedis, sink: tk.TelemetrySink) -> None:
    for i in range(400):
        assert await sink.add_event(tk.REQUESTS, {"i": i})
    length = _client(server).xlen(tk.REQUESTS)
    # MAXLEN ~ trims whole radix-tree nodes (100 entries by default), so allow one node of slack.
    assert 20 <= length <= 20 + 100


async def test_sink_survives_outage_and_recovers(
    server: EmbeddedRedis, sink: tk.TelemetrySink, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="shared.telemetry.sink")
    assert await sink.set_state(tk.VERIFIER_STATE, {"mu": 1})
    server.stop()
    started = time.monotonic()
    results = [await sink.add_event(tk.VERIFIER_STEPS, {"i": i}) for i in range(50)]
    assert not any(results)
    assert time.monotonic() - started < 2.0  # dropped fast, not 50 timeouts
    assert not sink.connected and sink.dropped == 50
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]

    server.start()  # same port, empty server
    await _wait_connected(sink)
    assert await sink.add_event(tk.VERIFIER_STEPS, {"i": "back"})
    assert _client(server).xlen(tk.VERIFIER_STEPS) == 1
    assert sum("resumed" in r.getMessage() for r in caplog.records) == 1
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1


async def test_sink_without_server_never_raises() -> None:
    sink = tk.TelemetrySink("redis://127.0.0.1:1/0", timeout_s=0.2, initial_backoff_s=0.05)
    assert not await sink.start()
    assert not await sink.add_event(tk.REQUESTS, {"x": 1})
    assert await sink.read_hash(tk.VERIFIER_STATE) is None
    await sink.close()


async def test_every_call_has_a_timeout() -> None:
    """A peer that accepts connections but never answers must not stall the caller."""

    async def black_hole(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(-1)
        writer.close()

    srv = await asyncio.start_server(black_hole, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    sink = tk.TelemetrySink(f"redis://127.0.0.1:{port}/0", timeout_s=0.2, initial_backoff_s=10)
    try:
        started = time.monotonic()
        assert not await sink.add_event(tk.REQUESTS, {"x": 1})  # write path times out
        assert time.monotonic() - started < 1.0
        assert not sink.connected
        sink2 = tk.TelemetrySink(sink.url, timeout_s=0.2, initial_backoff_s=10)
        started = time.monotonic()
        assert not await sink2.start()  # probe path times out too
        assert time.monotonic() - started < 1.0
        await sink2.close()
    finally:
        await sink.close()
        srv.close()


async def test_client_posts_records_and_drops_on_failure(caplog: pytest.LogCaptureFixture) -> None:
    received: list[object] = []
    fail = {"on": False}

    def handler(request: httpx.Request) -> httpx.Response:
        if fail["on"]:
            raise httpx.ConnectError("monitor down", request=request)
        received.append(request.read())
        return httpx.Response(200, json={"accepted": 1})

    client = TelemetryClient("http://monitor", transport=httpx.MockTransport(handler))
    client.emit_verifier_step(32, 0.01, 4, {"verify": 4})
    client.emit_device_draft("d1", 0.003)
    client.emit_device_transfer("d1", "up", 4096, 0.002)
    client.emit_request("r1", ttft_s=0.1, token_times_s=[0.02], accept_lengths=[2])
    client.flush_batch()  # the step record waits for its batch otherwise
    await asyncio.sleep(0.05)
    assert len(received) == 4

    caplog.set_level(logging.WARNING, logger="shared.telemetry.sink")
    fail["on"] = True
    for _ in range(10):
        client.emit({"kind": "verifier_step", "batched_tokens": 1, "compute_s": 0.1})
    await client.aclose()
    assert client.dropped == 10
    assert len(caplog.records) == 1


async def test_client_without_url_is_noop() -> None:
    client = TelemetryClient(None)
    client.emit({"kind": "request", "request_id": "r"})
    assert not await client.send({"kind": "request", "request_id": "r"})
    await client.aclose()


@pytest.mark.slow
async def test_a_write_after_a_long_outage_reconnects_without_waiting_out_the_backoff(server: EmbeddedRedis) -> None:
    """The reconnect loop may be deep in a long backoff sleep when Redis returns; a write arriving then
    must trigger a ping at once, so telemetry resumes with the next record instead of seconds later."""
    sink = tk.TelemetrySink(server.url, timeout_s=0.5, initial_backoff_s=0.05, max_backoff_s=30.0)
    assert await sink.start()
    try:
        server.stop()
        assert not await sink.add_event(tk.VERIFIER_STEPS, {"i": 0})
        await asyncio.sleep(3.5)  # backoff sleeps 0.05, 0.1, ... 3.2 done: the loop is in a 6.4 s sleep now
        server.start()
        assert not sink.connected
        assert not await sink.add_event(tk.VERIFIER_STEPS, {"i": 1})  # dropped, but it wakes the loop
        await _wait_connected(sink, timeout=1.0)
        assert await sink.add_event(tk.VERIFIER_STEPS, {"i": 2})
    finally:
        await sink.close()
