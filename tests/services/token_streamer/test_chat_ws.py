"""The chat WebSocket's bounds (services/token_streamer/chat_ws.py, with the door of limits.py): every message
draws on its credential's rate bucket, the one HTTP requests draw on, and what a client sends ahead of its
answer is bounded. Real uvicorn, real `websockets` client; the device agent is the FakeDevice double."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
import websockets
from websockets.exceptions import ConnectionClosed

from tests.services.token_streamer.test_token_streamer import CHAT, FakeDevice, expected_text, mesh


def ws_url(url: str) -> str:
    return url.replace("http", "ws") + "/v1/chat/ws"


async def next_frame(ws: Any) -> dict[str, Any]:
    return json.loads(await asyncio.wait_for(ws.recv(), 5))


async def answer_of(ws: Any) -> dict[str, Any]:
    """The frame that ends an answer (done or error), the text before it under "text"."""
    texts: list[str] = []
    while (frame := await next_frame(ws))["type"] == "token":
        texts.append(frame["text"])
    return {**frame, "text": "".join(texts)}


@pytest.mark.timing  # its bounds are wall-clock times: make test runs it alone
async def test_every_message_draws_on_the_bucket_http_requests_draw_on() -> None:
    dev = FakeDevice("dev-a")
    async with mesh(dev, rate_limit_rps=0.01, rate_limit_burst=4) as url, httpx.AsyncClient(timeout=10) as http:
        async with websockets.connect(ws_url(url), open_timeout=5) as ws:  # the handshake: one token
            for _ in range(2):  # two more
                await ws.send(json.dumps({"messages": CHAT, "max_tokens": 3}))
                assert (await answer_of(ws))["text"] == expected_text(3)
            assert (await http.get(f"{url}/v1/models")).status_code == 200  # the last token, over HTTP
            for _ in range(2):  # past the limit: refused, the socket stays open
                await ws.send(json.dumps({"messages": CHAT, "max_tokens": 3}))
                refused = await answer_of(ws)
                assert refused["type"] == "error" and refused["text"] == ""
                assert refused["error"]["code"] == "rate_limit_exceeded"
                assert refused["error"]["type"] == "rate_limit_error" and refused["retry_after_s"] == 100
            assert (await http.get(f"{url}/v1/models")).status_code == 429  # the same bucket
    assert len(dev.requests) == 2  # nothing refused reached a device


async def test_messages_sent_ahead_of_an_answer_are_bounded_then_the_socket_is_closed_1008() -> None:
    dev = FakeDevice("dev-a")
    dev.gate = asyncio.Event()  # the first request's generation waits: everything else is sent ahead of it
    async with mesh(dev, ws_max_pending=2) as url:
        async with websockets.connect(ws_url(url), open_timeout=5) as ws:
            await ws.send(json.dumps({"messages": CHAT, "max_tokens": 3}))
            async with asyncio.timeout(5):
                while not dev.active:
                    await asyncio.sleep(0.01)
            for _ in range(3):  # two may wait; the third is one too many
                await ws.send(json.dumps({"messages": CHAT, "max_tokens": 3}))
            refused = await next_frame(ws)
            assert refused["type"] == "error" and refused["error"]["code"] == "too_many_pending"
            with pytest.raises(ConnectionClosed) as closed:
                await next_frame(ws)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008
        async with asyncio.timeout(5):  # the request it was answering was cancelled on the device
            while dev.active:
                await asyncio.sleep(0.01)
    assert len(dev.requests) == 1 and dev.finished == 0
