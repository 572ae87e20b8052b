"""Chat client against the real token streamer in front of a *test double* device agent.

The double below speaks the device agent's NDJSON protocol (served by real
uvicorn on loopback); the end-to-end tests with real device agents live elsewhere.
"""

from __future__ import annotations

import asyncio
import io
import json
import re
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from services.token_streamer.app import create_app
from services.token_streamer.settings import load_settings
from tests.services.token_streamer.test_token_streamer import serve
from tophatctl import chat_client
from tophatctl.chat_client import ChatClientError, chat_turn, run_chat, stream_chat

TIMING = re.compile(r"^TTFT \d+\.\d ms \| TBT \d+\.\d ms \| accept length \d+\.\d\d \| \d+ tokens$")


def fake_device(prompts: list[Any]) -> FastAPI:
    """Echoes 'tok0 tok1 ...': one token first, then rounds of 2 tokens 10 ms apart."""
    app = FastAPI()

    @app.post("/generate")
    async def generate(request: Request) -> StreamingResponse:
        body = await request.json()
        prompts.append(body["messages"])  # a chat's turns: the device applies the template

        async def lines() -> AsyncIterator[str]:
            yield json.dumps({"type": "start", "request_id": body["request_id"], "prompt_tokens": 3}) + "\n"
            n, limit = 0, body["max_new_tokens"]
            while n < limit:
                k = 1 if n == 0 else min(2, limit - n)
                await asyncio.sleep(0.01)
                yield (
                    json.dumps(
                        {
                            "type": "tokens",
                            "token_ids": list(range(n, n + k)),
                            "text": "".join(f"tok{i} " for i in range(n, n + k)),
                            "t": 0.0,
                        }
                    )
                    + "\n"
                )
                n += k
            yield (
                json.dumps(
                    {
                        "type": "done",
                        "finish_reason": "length",
                        "stats": {"mean_accept_length": 2.0, "num_rounds": 2, "completion_tokens": n},
                    }
                )
                + "\n"
            )

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    return app


@asynccontextmanager
async def streamer(prompts: list[Any]) -> AsyncIterator[str]:
    async with serve(fake_device(prompts)) as device_url:
        async with serve(create_app(load_settings({}, device_urls=device_url, health_interval_s=0.0))) as url:
            yield url


async def test_stream_chat_events() -> None:
    async with streamer([]) as url:
        events = [e async for e in stream_chat(url + "/v1/", [{"role": "user", "content": "hi"}], max_tokens=5)]
    assert "".join(e.text for e in events if e.kind == "content") == "tok0 tok1 tok2 tok3 tok4 "
    finish = next(e for e in events if e.kind == "finish")
    assert finish.finish_reason == "length" and finish.tophat["mean_accept_length"] == 2.0
    assert events[-1].kind == "usage" and events[-1].usage["completion_tokens"] == 5


async def test_one_shot_prints_tokens_and_timing(capsys: pytest.CaptureFixture[str]) -> None:
    prompts: list[Any] = []
    async with streamer(prompts) as url:
        code = await run_chat(url, "hello", 5, 0.0)
    out = capsys.readouterr().out.splitlines()
    assert code == 0 and out[0] == "tok0 tok1 tok2 tok3 tok4 "
    assert TIMING.match(out[1]), out[1]
    assert out[1].endswith("accept length 2.00 | 5 tokens")
    assert prompts == [[{"role": "user", "content": "hello"}]]


async def test_timing_is_per_token_after_the_first() -> None:
    async with streamer([]) as url:
        result = await chat_turn(url, [{"role": "user", "content": "x"}], 7, 0.0, out=io.StringIO())
    assert result.tokens == 7 and len(result.content_times) == 4  # 1 + 2 + 2 + 2 tokens per chunk
    assert result.timeline.tokens == [1, 2, 2, 2]  # the streamer's per-delivery counts, one per chunk
    span = result.content_times[-1] - result.content_times[0]
    assert result.tbt_s == pytest.approx(span / 6) and 0 < result.ttft_s < 5


async def test_repl_keeps_history_and_exits(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts: list[Any] = []
    answers = iter(["first", "", "second", "/exit"])  # input() runs on the client's reader thread
    monkeypatch.setattr("builtins.input", lambda _prompt="": next(answers))
    async with streamer(prompts) as url:
        code = await run_chat(url, None, 2, 0.0)
    assert code == 0
    first = {"role": "user", "content": "first"}
    assert prompts == [
        [first],
        [first, {"role": "assistant", "content": "tok0 tok1 "}, {"role": "user", "content": "second"}],
    ]
    assert sum(bool(TIMING.match(line)) for line in capsys.readouterr().out.splitlines()) == 2


async def test_errors_are_reported_not_raised(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as sock:  # nothing listens there
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    async with serve(create_app(load_settings({}, device_urls=dead, health_interval_s=0.0))) as url:
        with pytest.raises(ChatClientError, match="HTTP 503"):
            [e async for e in stream_chat(url, [{"role": "user", "content": "x"}], timeout=5)]
        assert await run_chat(url, "x", 4, 0.0, 5.0) == 1
    assert "error: HTTP 503" in capsys.readouterr().err
    assert chat_client.chat_url("http://h:1/v1") == "http://h:1/v1/chat/completions"
