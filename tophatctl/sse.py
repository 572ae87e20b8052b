"""The one client for the token streamer's server-sent events (`stream: true` on
`/v1/completions` and `/v1/chat/completions`), used by the load generator and the chat client.

It lives at the bottom layer because it is a pure client of the product's own SSE protocol:
the load generator (loadgen/runner.py) and the chat client (tophatctl/chat_client.py) both
read the stream through it, with the same event type.

`stream_chunks` POSTs a body and yields one `Chunk` per SSE event until `[DONE]`:
its arrival time (time.perf_counter(), taken as the event is parsed), its text (a
completion's `text` or a chat `delta.content`), the finish reason, and the
streamer's `tophat` statistics and `usage` when the chunk carries them.
`Chunk.parts` splits one into what the chat client shows: content, finish, usage.
`StreamStats.observe` folds those statistics (token counts, tokens per delivery,
accept length, the server's own TTFT/TBT) as they arrive.

Every wait (connecting, the status line, each next event) is bounded by
`timeout_s`; anything short of a complete stream raises a `StreamError` subclass
whose message says what happened, so callers can record it and go on.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
from httpx_sse import SSEError, aconnect_sse


class StreamError(Exception):
    """The request did not produce a complete stream."""


class HTTPStatusError(StreamError):
    """The streamer answered with a status other than 200 (its JSON error message is kept)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


class ErrorEvent(StreamError):
    """The stream carried an `error` chunk (a failure after the 200 went out)."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(f"error chunk: {message}")
        self.message = message
        self.code = code


class StreamCut(StreamError):
    """The stream ended, or the connection dropped, before `[DONE]`."""


class MalformedEvent(StreamError):
    """An event whose data is not a JSON object."""


class StreamTimeout(StreamError, TimeoutError):
    """One wait (connect, status, next event) took longer than the timeout."""


class TransportError(StreamError):
    """The request could not be sent (connection refused, reset before the answer, ...)."""


ChunkKind = Literal["content", "finish", "usage", "stats"]


@dataclass(frozen=True)
class Chunk:
    """One parsed SSE event; `t` is time.perf_counter() when it was parsed."""

    t: float
    text: str = ""
    finish_reason: str | None = None
    tophat: dict[str, Any] | None = None
    usage: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.text, str):
            raise TypeError(f"Chunk.text must be a str, got {type(self.text).__name__}")

    @property
    def kind(self) -> ChunkKind:
        """What the chunk carries first: text, the end of the answer, the usage, or only statistics."""
        if self.text:
            return "content"
        if self.finish_reason:
            return "finish"
        return "usage" if self.usage else "stats"

    def parts(self) -> list[Chunk]:
        """The chunk as one piece per kind, in stream order: its content, its finish (with the
        `tophat` statistics, which the final chunk carries) and its usage. A chunk that carries
        only statistics has no parts: a reader of the answer has nothing to show for it."""
        parts = []
        if self.text:
            parts.append(Chunk(self.t, text=self.text))
        if self.finish_reason:
            parts.append(Chunk(self.t, finish_reason=self.finish_reason, tophat=self.tophat))
        if self.usage:
            parts.append(Chunk(self.t, usage=self.usage))
        return parts


@dataclass
class StreamStats:
    """What the streamer reported about the request, from its `tophat` and `usage` fields."""

    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    accept_length: float | None = None
    num_rounds: int | None = None
    rounds: list[int] | None = None  # tokens per delivery (the prefill's, then each round's)
    device_id: str | None = None
    server_ttft_s: float | None = None
    server_tbt_s: float | None = None
    finish_reason: str | None = None
    raw_tophat: dict[str, Any] | None = field(default=None, repr=False)

    def observe(self, chunk: Chunk) -> None:
        if chunk.finish_reason:
            self.finish_reason = chunk.finish_reason
        stats = chunk.tophat
        if stats is not None:
            self.raw_tophat = stats
            self.accept_length = _num(stats.get("mean_accept_length"))
            self.num_rounds = _int(stats.get("num_rounds"))
            device_id = stats.get("device_id")
            self.device_id = device_id if isinstance(device_id, str) else None
            self.server_ttft_s, self.server_tbt_s = _num(stats.get("ttft_s")), _num(stats.get("tbt_s"))
            self.completion_tokens = _int(stats.get("completion_tokens"), self.completion_tokens)
            self.prompt_tokens = _int(stats.get("prompt_tokens"), self.prompt_tokens)
            rounds = stats.get("rounds")
            if isinstance(rounds, list) and all(_int(k) is not None for k in rounds):
                self.rounds = [int(k) for k in rounds]
        if chunk.usage is not None:  # the usage chunk comes last and is authoritative
            self.completion_tokens = _int(chunk.usage.get("completion_tokens"), self.completion_tokens)
            self.prompt_tokens = _int(chunk.usage.get("prompt_tokens"), self.prompt_tokens)


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The streamer's API key as OpenAI clients send it (none when there is no key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def stream_chunks(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], *, timeout_s: float
) -> AsyncGenerator[Chunk, None]:
    """POST `body` to `url` and yield its chunks until `[DONE]`; a StreamError for anything less.

    Breaking out of the loop (or cancelling the consumer) closes the response, which is how
    a client tells the streamer to stop generating.
    """
    async with AsyncExitStack() as stack:
        try:
            async with asyncio.timeout(timeout_s):
                source = await stack.enter_async_context(aconnect_sse(client, "POST", url, json=body))
                response = source.response
                if response.status_code != 200:
                    await response.aread()
                    raise HTTPStatusError(response.status_code, _error_message(response))
        except TimeoutError as exc:
            raise StreamTimeout(f"no answer within {timeout_s:g} s") from exc
        except httpx.TimeoutException as exc:
            raise StreamTimeout(f"{type(exc).__name__} connecting to {url}") from exc
        except httpx.HTTPError as exc:
            raise TransportError(_describe(exc)) from exc
        events = source.aiter_sse()
        stack.push_async_callback(events.aclose)
        while True:
            try:
                async with asyncio.timeout(timeout_s):
                    event = await anext(events)
            except StopAsyncIteration:
                raise StreamCut("stream ended without [DONE]") from None
            except TimeoutError as exc:
                raise StreamTimeout(f"no event within {timeout_s:g} s") from exc
            except httpx.TimeoutException as exc:
                raise StreamTimeout(_describe(exc)) from exc
            except (httpx.HTTPError, httpx.StreamError) as exc:
                raise StreamCut(f"stream cut before [DONE]: {_describe(exc)}") from exc
            except SSEError as exc:
                raise MalformedEvent(str(exc)) from exc
            if event.data.strip() == "[DONE]":
                return
            yield parse_chunk(event.data, time.perf_counter())


def parse_chunk(data: str, t: float) -> Chunk:
    """One event's data as a Chunk; ErrorEvent for an `error` chunk, MalformedEvent for junk."""
    try:
        chunk = json.loads(data)
    except ValueError as exc:
        raise MalformedEvent(f"malformed chunk: {data[:80]!r}") from exc
    if not isinstance(chunk, dict):
        raise MalformedEvent("malformed chunk: not an object")
    if chunk.get("error"):
        err = chunk["error"]
        if isinstance(err, dict):
            raise ErrorEvent(
                str(err.get("message", err)), err.get("code") if isinstance(err.get("code"), str) else None
            )
        raise ErrorEvent(str(err))
    texts: list[str] = []
    finish_reason = None
    for choice in chunk.get("choices") or []:
        if not isinstance(choice, dict):
            raise MalformedEvent("malformed chunk: a choice is not an object")
        delta = choice.get("delta")
        text = choice.get("text") or (delta.get("content") if isinstance(delta, dict) else None)
        if isinstance(text, str) and text:
            texts.append(text)
        if choice.get("finish_reason"):
            finish_reason = str(choice["finish_reason"])
    tophat, usage = chunk.get("tophat"), chunk.get("usage")
    return Chunk(
        t,
        "".join(texts),
        finish_reason,
        tophat if isinstance(tophat, dict) else None,
        usage if isinstance(usage, dict) else None,
    )


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _int(v: Any, default: int | None = None) -> int | None:
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else default


def _describe(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _error_message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:200]
