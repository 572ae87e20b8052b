"""Chat client for the token streamer: streams an answer and shows TTFT/TBT as the user saw them.

`stream_chat` is the library half (async events from /v1/chat/completions over
SSE); `run_chat` (a coroutine: `asyncio.run(run_chat(...))`) is the CLI half
behind `tophat chat`: one-shot with a prompt, otherwise a small REPL that keeps
the conversation history. This module prints
(it is user-facing); the services never do.

The stream is read by tophatctl/sse.py, the SSE client the load generator uses too; its `Chunk`,
split into one piece per kind (`Chunk.parts`), is the event `stream_chat` yields.
Timing is measured here, on the client, from the stream itself, with the
definitions of shared/telemetry/latency_stats.py:
  * TTFT = request sent -> first chunk with non-empty content;
  * TBT  = mean time per token after the first:
           (last content chunk time - first content chunk time) / (completion_tokens - 1),
    with completion_tokens from the usage chunk (a chunk may carry several
    tokens under speculative decoding, so chunk gaps alone would overstate it);
  * accept length = the server's `tophat.mean_accept_length` from the final chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import httpx

from shared.telemetry import latency_stats
from shared.telemetry.latency_stats import Timeline
from tophatctl.chunk_tokens import chunk_token_counts
from tophatctl.sse import Chunk, StreamError, auth_headers, stream_chunks

EXIT_WORDS = {"/exit", "/quit"}


class ChatClientError(RuntimeError):
    """The streamer refused the request or the stream failed."""


@dataclass
class ChatResult:
    text: str
    finish_reason: str | None
    sent_at: float
    content_times: list[float] = field(default_factory=list)
    content_texts: list[str] = field(default_factory=list)
    completion_tokens: int | None = None
    tophat: dict[str, Any] | None = None

    @property
    def timeline(self) -> Timeline:
        """The content chunks, each with its tokens: the server's per-delivery counts when they
        match the chunks one to one, else the usage count split by text length."""
        rounds = (self.tophat or {}).get("rounds")
        rounds = rounds if isinstance(rounds, list) and all(isinstance(k, int) for k in rounds) else None
        texts = self.content_texts or [""] * len(self.content_times)
        return Timeline(
            self.sent_at, list(self.content_times), chunk_token_counts(texts, self.completion_tokens, rounds)
        )

    @property
    def ttft_s(self) -> float | None:
        return latency_stats.ttft_s(self.timeline)

    @property
    def tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else len(self.content_times)

    @property
    def tbt_s(self) -> float | None:
        return latency_stats.mean_tbt_s(self.timeline)

    @property
    def accept_length(self) -> float | None:
        value = (self.tophat or {}).get("mean_accept_length")
        return float(value) if isinstance(value, (int, float)) else None

    def timing_line(self) -> str:
        def ms(x: float | None) -> str:
            return f"{x * 1e3:.1f} ms" if x is not None else "n/a"

        accept = f"{self.accept_length:.2f}" if self.accept_length is not None else "n/a"
        return f"TTFT {ms(self.ttft_s)} | TBT {ms(self.tbt_s)} | accept length {accept} | {self.tokens} tokens"


def chat_url(url: str) -> str:
    """Accept the streamer's base URL with or without the /v1 suffix."""
    base = url.rstrip("/")
    return f"{base}/chat/completions" if base.endswith("/v1") else f"{base}/v1/chat/completions"


async def stream_chat(
    url: str,
    messages: Sequence[dict[str, str]],
    max_tokens: int = 64,
    temperature: float = 0.0,
    timeout: float = 60.0,
    *,
    client: httpx.AsyncClient | None = None,
    api_key: str | None = None,
) -> AsyncIterator[Chunk]:
    """Yield content/finish/usage pieces of the stream (`Chunk.parts`) until `[DONE]`; ChatClientError
    on any failure.

    `timeout` bounds connecting and each wait for the next chunk. Pass a `client`
    to reuse connections across turns (and keep its setup cost out of TTFT); `api_key` is sent as
    `Authorization: Bearer` when this function makes its own client (a passed one carries its own headers).
    Closing this generator early closes the stream, which stops the generation.
    """
    if client is None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), headers=auth_headers(api_key)) as own:
            async for event in stream_chat(url, messages, max_tokens, temperature, timeout, client=own):
                yield event
        return
    body = {
        "messages": list(messages),
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    try:
        async with contextlib.aclosing(stream_chunks(client, chat_url(url), body, timeout_s=timeout)) as chunks:
            async for chunk in chunks:
                for part in chunk.parts():
                    yield part
    except StreamError as exc:
        raise ChatClientError(str(exc)) from exc


async def chat_turn(
    url: str,
    messages: Sequence[dict[str, str]],
    max_tokens: int,
    temperature: float,
    timeout: float = 60.0,
    out: TextIO | None = None,
    client: httpx.AsyncClient | None = None,
    api_key: str | None = None,
) -> ChatResult:
    """Stream one answer, writing each delta to `out` (default stdout) as it arrives."""
    if client is None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), headers=auth_headers(api_key)) as own:
            return await chat_turn(url, messages, max_tokens, temperature, timeout, out, own)
    out = out or sys.stdout
    result = ChatResult(text="", finish_reason=None, sent_at=time.perf_counter())
    async for event in stream_chat(url, messages, max_tokens, temperature, timeout, client=client):
        if event.kind == "content":
            result.content_times.append(event.t)
            result.content_texts.append(event.text)
            out.write(event.text)
            out.flush()
        elif event.kind == "finish":
            result.finish_reason, result.tophat = event.finish_reason, event.tophat
        elif event.usage:
            result.completion_tokens = int(event.usage.get("completion_tokens", 0))
    result.text = "".join(result.content_texts)
    return result


async def run_chat(
    url: str = "http://127.0.0.1:8000",
    prompt: str | None = None,
    max_tokens: int = 64,
    temperature: float = 0.0,
    timeout: float = 60.0,
    api_key: str | None = None,
) -> int:
    """`tophat chat`: one-shot when `prompt` is given, else a REPL. Returns a process exit code.

    Ctrl-C is left to the caller (asyncio.run turns it into KeyboardInterrupt); the
    open stream is closed on the way out, which stops the generation server-side.
    """
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), headers=auth_headers(api_key)) as client:
        if prompt is None:
            return await _repl(client, url, max_tokens, temperature, timeout)
        try:
            messages = [{"role": "user", "content": prompt}]
            result = await chat_turn(url, messages, max_tokens, temperature, timeout, client=client)
        except ChatClientError as exc:
            print(f"\nerror: {exc}", file=sys.stderr, flush=True)
            return 1
        print(flush=True)
        print(result.timing_line(), flush=True)
        return 0


async def _read_line(prompt: str) -> str:
    """input() on a daemon thread: the event loop stays responsive to Ctrl-C, and a
    pending read never blocks interpreter exit (the default executor would)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[str] = loop.create_future()

    def settle(value: str | None, exc: BaseException | None) -> None:
        if future.done():
            return
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(value or "")

    def read() -> None:
        try:
            line = input(prompt)
        except (EOFError, KeyboardInterrupt, OSError) as exc:
            loop.call_soon_threadsafe(settle, None, EOFError(str(exc)))
            return
        loop.call_soon_threadsafe(settle, line, None)

    threading.Thread(target=read, name="chat-input", daemon=True).start()
    return await future


async def _repl(client: httpx.AsyncClient, url: str, max_tokens: int, temperature: float, timeout: float) -> int:
    history: list[dict[str, str]] = []
    print(f"chatting with {url} - /exit or Ctrl-D to quit, /reset to forget the conversation", flush=True)
    while True:
        try:
            line = (await _read_line("you> ")).strip()
        except EOFError:
            print(flush=True)
            return 0
        if not line:
            continue
        if line in EXIT_WORDS:
            return 0
        if line == "/reset":
            history.clear()
            print("(conversation cleared)", flush=True)
            continue
        turn = [*history, {"role": "user", "content": line}]
        print("assistant> ", end="", flush=True)
        try:
            result = await chat_turn(url, turn, max_tokens, temperature, timeout, client=client)
        except ChatClientError as exc:
            print(f"\nerror: {exc}", file=sys.stderr, flush=True)
            continue
        print(flush=True)
        print(result.timing_line(), flush=True)
        history = [*turn, {"role": "assistant", "content": result.text}]
