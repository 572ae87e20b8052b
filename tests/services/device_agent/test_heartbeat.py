"""A request that waits is alive, a silent device is dead (issue 48 point 6).

shared/net/heartbeat.py's `with_heartbeats` by itself; then the streamer's line timeout against device doubles
that wait longer than it, with heartbeats (the request completes, plain and under a DiSCo dispatch) and
without (device_timeout); then a real device agent (demo model, real verifier) whose verifier keeps a reply
waiting longer than the streamer's line timeout.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import Any

import httpx
import pytest

from services.device_agent import app as device_app
from services.device_agent.agent import DeviceAgent
from shared.net.heartbeat import with_heartbeats
from tests.mesh_tools import loopback_agent_settings, verifier_on_loopback
from tests.services.token_streamer.test_token_streamer import (
    WORDS,
    FakeDevice,
    create_app,
    expected_text,
    load_settings,
    mesh,
    serve,
)

# the streamer gives up on a silent device this soon (a line), with room for a loaded CI box to answer at all
# (the first byte); DiSCo's idle timeout is their sum, 2.5 s: a queue wait of QUEUED_S outlasts both
SHORT = {"line_timeout_s": 0.5, "first_byte_timeout_s": 2.0}
QUEUED_S = 3.0


# -- with_heartbeats --------------------------------------------------------------------------------------
async def test_a_wait_is_filled_with_heartbeats_and_items_keep_their_order() -> None:
    async def source() -> AsyncIterator[int]:
        yield 1
        await asyncio.sleep(0.45)
        yield 2

    got = [x async for x in with_heartbeats(source(), 0.1)]
    assert [x for x in got if x is not None] == [1, 2]
    assert got[0] == 1 and got.count(None) >= 2


async def test_the_source_never_runs_ahead_of_the_consumer() -> None:
    produced = []

    async def source() -> AsyncIterator[int]:
        for i in range(3):
            produced.append(i)
            yield i

    beats = with_heartbeats(source(), 0.05)
    assert await anext(beats) == 0
    await asyncio.sleep(0.2)  # the consumer is busy: nothing more is asked of the source
    assert produced == [0]
    assert [x async for x in beats] == [1, 2]


async def test_an_error_of_the_source_reaches_the_consumer() -> None:
    async def source() -> AsyncIterator[int]:
        yield 1
        raise ValueError("verifier gone")

    got = []
    with pytest.raises(ValueError, match="verifier gone"):
        async for x in with_heartbeats(source(), 1.0):
            got.append(x)
    assert got == [1]


async def test_closing_stops_a_waiting_source_and_runs_its_cleanup() -> None:
    cleaned = asyncio.Event()

    async def source() -> AsyncIterator[int]:
        try:
            await asyncio.sleep(3600)
            yield 1
        finally:
            cleaned.set()

    beats = with_heartbeats(source(), 0.05)
    assert await anext(beats) is None  # waiting: a heartbeat
    await beats.aclose()
    assert cleaned.is_set()


async def test_the_interval_must_be_positive() -> None:
    async def source() -> AsyncIterator[int]:
        yield 1

    with pytest.raises(ValueError):
        await anext(with_heartbeats(source(), 0))


# -- the streamer's line timeout ------------------------------------------------------------------------
class QueuedDevice(FakeDevice):
    """A device-agent double whose requests wait `queued_s` before their first token (in the verifier's
    queue, say), sending a heartbeat line every `beat_s` meanwhile (None: silent, as a dead device is)."""

    def __init__(self, queued_s: float, beat_s: float | None) -> None:
        super().__init__("queued", per_round=1)
        self.queued_s, self.beat_s = queued_s, beat_s

    async def _lines(self, body: dict[str, Any]) -> AsyncIterator[str]:
        try:
            yield json.dumps({"type": "start", "request_id": body["request_id"], "prompt_tokens": 5}) + "\n"
            loop = asyncio.get_running_loop()
            until = loop.time() + self.queued_s
            while loop.time() < until:
                await asyncio.sleep(min(self.beat_s or self.queued_s, until - loop.time()))
                if self.beat_s is not None:
                    yield json.dumps({"type": "heartbeat", "t": 0.0}) + "\n"
            for i in range(body["max_new_tokens"]):
                yield json.dumps({"type": "tokens", "token_ids": [i], "text": WORDS[i % len(WORDS)]}) + "\n"
            yield json.dumps({"type": "done", "finish_reason": "length", "stats": {"num_rounds": 3}}) + "\n"
        finally:
            self.active -= 1


async def complete(url: str, tophat: dict[str, Any], stream: bool = False) -> httpx.Response:
    body = {"model": "m", "prompt": "hello", "max_tokens": 4, "stream": stream, "temperature": 0, "tophat": tophat}
    async with httpx.AsyncClient(timeout=20) as http:
        return await http.post(f"{url}/v1/completions", json=body)


@pytest.mark.parametrize("tophat", [{}, {"dispatch": "cloud", "reading_rate_tps": 0}], ids=["plain", "disco-cloud"])
async def test_a_request_waiting_longer_than_the_line_timeout_completes(tophat: dict[str, Any]) -> None:
    async with mesh(QueuedDevice(queued_s=QUEUED_S, beat_s=0.1), **SHORT) as url:
        response = await complete(url, tophat)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == expected_text(4)
        streamed = await complete(url, tophat, stream=True)
        assert "heartbeat" not in streamed.text and streamed.text.rstrip().endswith("data: [DONE]")
        chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
        assert "".join(c["choices"][0]["text"] for c in chunks if c.get("choices")) == expected_text(4)


@pytest.mark.parametrize("tophat", [{}, {"dispatch": "cloud", "reading_rate_tps": 0}], ids=["plain", "disco-cloud"])
async def test_a_silent_device_still_times_out(tophat: dict[str, Any]) -> None:
    async with mesh(QueuedDevice(queued_s=QUEUED_S, beat_s=None), **SHORT) as url:
        response = await complete(url, tophat)
        assert response.status_code == 502
        assert "device_timeout" in response.text


# -- a real device agent ------------------------------------------------------------------------------------
async def test_a_real_agent_waiting_on_its_verifier_keeps_the_stream_alive(demo_checkpoint) -> None:
    async with AsyncExitStack() as stack:
        _, ws_url = await stack.enter_async_context(verifier_on_loopback(demo_checkpoint, 2))
        settings = loopback_agent_settings(ws_url, heartbeat_s=0.1)
        agent = await asyncio.to_thread(DeviceAgent, settings)
        device_url = await stack.enter_async_context(serve(device_app.create_app(settings, agent)))
        streamer = load_settings({}, device_urls=device_url, health_interval_s=0.0, **SHORT)
        url = await stack.enter_async_context(serve(create_app(streamer)))
        plain = await complete(url, {})  # warm: the verifier answers at once
        assert plain.status_code == 200, plain.text

        replies = agent.cloud._wait
        waits = []

        async def queued(future, key):  # the verifier's reply waits 1.5 s (a long queue), once per request
            if not waits:
                waits.append(key)
                await asyncio.sleep(1.5)
            return await replies(future, key)

        agent.cloud._wait = queued  # type: ignore[method-assign]
        response = await complete(url, {})
        assert waits, "the request never waited on the verifier"
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]

        waits.clear()
        lines = []
        async with (
            httpx.AsyncClient(timeout=20) as http,
            http.stream("POST", f"{device_url}/generate", json={"prompt": "hello", "max_new_tokens": 4}) as direct,
        ):
            lines = [json.loads(line) async for line in direct.aiter_lines() if line.strip()]
        kinds = [e["type"] for e in lines]
        assert kinds[0] == "start" and kinds[-1] == "done" and kinds.count("heartbeat") >= 5
        assert kinds.index("heartbeat") < kinds.index("tokens")  # the wait came before the first token
