"""An HTTP request's lifecycle in the streamer: noticing that its client went away,
and a streamed response that always releases what it holds, however it ends."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.requests import ClientDisconnect
from starlette.types import Message, Receive, Scope, Send

log = logging.getLogger(__name__)

QUEUE_WAIT_HEADER = "X-Tophat-Queue-Wait-Ms"  # how long the request waited for a device slot


async def client_gone(receive: Receive) -> None:
    """Returns when the client disconnects. Only called once the request body has been read,
    so the receive channel has nothing else to deliver (ASGI servers block until then)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class TooManyPending(Exception):
    """A WebSocket client sent more messages ahead of the one being answered than it may."""

    def __init__(self, max_pending: int) -> None:
        super().__init__(f"more than {max_pending} messages while one was being answered")
        self.max_pending = max_pending


async def unless_gone(
    work: Awaitable[None], receive: Callable[[], Awaitable[Message]], pending: deque[Message], max_pending: int
) -> bool:
    """Run `work` while watching a WebSocket's receive channel; False (and `work` cancelled) when the client
    disconnects first. Messages that arrive meanwhile are kept in `pending`, in order, for after `work`;
    TooManyPending (and `work` cancelled) when one would make them more than `max_pending`."""

    async def gone() -> None:
        while True:
            message = await receive()
            if message["type"] == "websocket.disconnect":
                return
            if len(pending) >= max_pending:
                raise TooManyPending(max_pending)
            pending.append(message)

    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(gone())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when the caller is cancelled: neither task outlives this call
        watcher.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(watcher, task, return_exceptions=True)
    if task in done:
        task.result()  # re-raise what `work` raised
        return True
    if isinstance(overflow := watcher.exception(), TooManyPending):
        raise overflow
    return False  # the client went away (or its channel failed): `work` was cancelled


class OwnedStreamingResponse(StreamingResponse):
    """Runs `on_close` however the response ends (done, client gone, server shutdown), and
    bounds every write so a client that stops reading cannot pin a device slot forever."""

    def __init__(
        self, content: AsyncIterator[str], on_close: Callable[[], Awaitable[None]], *, send_timeout_s: float, **kw: Any
    ) -> None:
        super().__init__(content, **kw)
        self._on_close = on_close
        self._send_timeout_s = send_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def timed_send(message: Message) -> None:
            async with asyncio.timeout(self._send_timeout_s):
                await send(message)

        try:
            await super().__call__(scope, receive, timed_send)
        except TimeoutError:  # (an OSError: ASGI >= 2.4 servers see it as ClientDisconnect below)
            log.info("client stopped reading the stream for %.1f s; dropping it", self._send_timeout_s)
        except ClientDisconnect:
            log.debug("client went away mid-stream")
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
            await self._on_close()
