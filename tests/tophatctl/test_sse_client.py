"""The shared SSE client against a raw HTTP/1.1 server on loopback.

The server writes bytes by hand, so the tests can send what a framework would not:
events split over several `data:` lines, a connection closed halfway through a
chunked body, a stream that stops sending and never ends.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager

import httpx
import pytest

from tophatctl import sse as sc

Script = Callable[[asyncio.StreamWriter], Awaitable[None]]


def _chunked(text: str) -> bytes:
    data = text.encode()
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


async def _head(writer: asyncio.StreamWriter, status: str = "200 OK", content_type: str = "text/event-stream") -> None:
    writer.write(
        f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nTransfer-Encoding: chunked\r\n"
        "Connection: close\r\n\r\n".encode()
    )
    await writer.drain()


async def _end(writer: asyncio.StreamWriter) -> None:
    writer.write(b"0\r\n\r\n")
    await writer.drain()


@asynccontextmanager
async def raw_server(script: Script) -> AsyncIterator[str]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")  # the body (small JSON) is not needed
            await script(writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/completions"
    finally:
        server.close()
        await asyncio.wait_for(server.wait_closed(), 5)


def _event(obj: object) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _content(text: str) -> dict:
    return {"choices": [{"index": 0, "text": text, "finish_reason": None}]}


async def _collect(url: str, timeout_s: float = 5.0) -> list[sc.Chunk]:
    async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client:
        async with aclosing(sc.stream_chunks(client, url, {"prompt": "x", "stream": True}, timeout_s=timeout_s)) as it:
            return [chunk async for chunk in it]


async def test_multi_line_events_stats_and_done() -> None:
    tophat = {
        "device_id": "dev-1",
        "ttft_s": 0.2,
        "tbt_s": 0.05,
        "mean_accept_length": 2.5,
        "num_rounds": 2,
        "completion_tokens": 6,
        "prompt_tokens": 9,
        "rounds": [1, 2, 3],
    }

    async def script(w: asyncio.StreamWriter) -> None:
        await _head(w)
        # One event whose JSON is split over two data lines (joined with "\n", still valid JSON).
        w.write(_chunked('data: {"choices": [{"index": 0,\ndata:  "text": "ab", "finish_reason": null}]}\n\n'))
        w.write(_chunked(": a comment line, ignored\n\n"))
        w.write(_chunked(_event({"choices": [{"index": 0, "delta": {"content": "cd"}, "finish_reason": None}]})))
        w.write(_chunked(_event({"choices": [{"index": 0, "text": "", "finish_reason": "length"}], "tophat": tophat})))
        w.write(_chunked(_event({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 7}})))
        w.write(_chunked("data: [DONE]\n\n"))
        w.write(_chunked(_event(_content("after done, never read"))))
        await _end(w)

    async with raw_server(script) as url:
        chunks = await _collect(url)
    assert [c.text for c in chunks] == ["ab", "cd", "", ""]
    assert all(a.t <= b.t for a, b in zip(chunks, chunks[1:]))
    stats = sc.StreamStats()
    for chunk in chunks:
        stats.observe(chunk)
    assert stats.finish_reason == "length" and stats.device_id == "dev-1" and stats.rounds == [1, 2, 3]
    assert (stats.accept_length, stats.num_rounds, stats.server_ttft_s, stats.server_tbt_s) == (2.5, 2, 0.2, 0.05)
    assert (stats.prompt_tokens, stats.completion_tokens) == (9, 7)  # usage, which comes last, wins


async def test_error_event_is_typed() -> None:
    async def script(w: asyncio.StreamWriter) -> None:
        await _head(w)
        w.write(_chunked(_event(_content("ab"))))
        w.write(_chunked(_event({"error": {"message": "device died", "type": "server_error", "code": "device_error"}})))
        w.write(_chunked("data: [DONE]\n\n"))
        await _end(w)

    async with raw_server(script) as url:
        with pytest.raises(sc.ErrorEvent, match="device died") as info:
            await _collect(url)
    assert info.value.code == "device_error"


async def test_http_status_keeps_the_server_message() -> None:
    async def script(w: asyncio.StreamWriter) -> None:
        await _head(w, "503 Service Unavailable", "application/json")
        w.write(_chunked(json.dumps({"error": {"message": "all devices busy", "code": "busy"}})))
        await _end(w)

    async with raw_server(script) as url:
        with pytest.raises(sc.HTTPStatusError, match="^HTTP 503: all devices busy$") as info:
            await _collect(url)
    assert info.value.status == 503


async def test_connection_cut_mid_stream_is_a_typed_error() -> None:
    async def script(w: asyncio.StreamWriter) -> None:
        await _head(w)
        w.write(_chunked(_event(_content("ab"))))
        w.write(b'40\r\ndata: {"choi')  # a chunk promising 64 bytes, then the connection goes
        await w.drain()

    async with raw_server(script) as url:
        with pytest.raises(sc.StreamCut, match="before \\[DONE\\]"):
            await _collect(url)


async def test_clean_end_without_done_is_a_cut_stream() -> None:
    async def script(w: asyncio.StreamWriter) -> None:
        await _head(w)
        w.write(_chunked(_event(_content("ab"))))
        await _end(w)

    async with raw_server(script) as url:
        with pytest.raises(sc.StreamCut, match="without \\[DONE\\]"):
            await _collect(url)


async def test_malformed_event_is_typed() -> None:
    async def script(w: asyncio.StreamWriter) -> None:
        await _head(w)
        w.write(_chunked("data: {not json\n\n"))
        await _end(w)

    async with raw_server(script) as url:
        with pytest.raises(sc.MalformedEvent, match="malformed chunk"):
            await _collect(url)


async def test_a_stalled_stream_times_out() -> None:
    stop = asyncio.Event()

    async def script(w: asyncio.StreamWriter) -> None:
        await _head(w)
        w.write(_chunked(_event(_content("ab"))))
        await w.drain()
        await stop.wait()  # never another byte until the test is over

    async with raw_server(script) as url:
        try:
            with pytest.raises(sc.StreamTimeout, match="no event within 0.2 s") as info:
                await _collect(url, timeout_s=0.2)
        finally:
            stop.set()
    assert isinstance(info.value, TimeoutError)


async def test_a_server_that_never_answers_times_out() -> None:
    stop = asyncio.Event()

    async def script(w: asyncio.StreamWriter) -> None:
        await stop.wait()  # reads the request, never writes the status line

    async with raw_server(script) as url:
        try:
            with pytest.raises(sc.StreamTimeout, match="no answer within 0.2 s"):
                await _collect(url, timeout_s=0.2)
        finally:
            stop.set()


async def test_nothing_listening_is_a_transport_error() -> None:
    async with raw_server(_end) as url:
        pass  # closed: the port is free again
    with pytest.raises(sc.TransportError, match="ConnectError"):
        await _collect(url)
