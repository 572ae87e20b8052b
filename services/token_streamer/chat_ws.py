"""The WebSocket chat: one chat request per JSON message (the full history each time), the socket
open between them. A client that leaves while its request is queued or streaming cancels it.

Every message draws on its credential's rate bucket (limits.py meters the socket): one past the limit is
answered, in its turn, with a `rate_limit_exceeded` error frame (and `retry_after_s`) and not served.
Messages sent while one is being answered wait, at most `ws_max_pending` of them; one more gets a
`too_many_pending` error frame, its request is cancelled and the socket closed with 1008 (policy violation).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Any

from fastapi import WebSocket, WebSocketDisconnect
from pydantic import ValidationError
from starlette.types import Message

from services.token_streamer import openai_format as of
from services.token_streamer.lifecycle import TooManyPending, unless_gone
from services.token_streamer.limits import REFUSED, Refusal
from services.token_streamer.router import DeviceError
from services.token_streamer.run import Run
from services.token_streamer.settings import Settings
from services.token_streamer.starter import BadRequest, RequestStarter

log = logging.getLogger(__name__)


class ChatSocket:
    """One client's chat socket: its frames out (each send bounded by `send_timeout_s`) and its turns."""

    def __init__(self, ws: WebSocket, starter: RequestStarter, s: Settings) -> None:
        self.ws = ws
        self.starter = starter
        self.settings = s
        self.pending: deque[Message] = deque()  # what the client sent while a request was being answered

    async def send(self, message: dict[str, Any]) -> None:
        async with asyncio.timeout(self.settings.send_timeout_s):
            await self.ws.send_json(message)

    async def send_error(self, status: int, detail: str, code: str, param: str | None = None, **extra: Any) -> None:
        await self.send({"type": "error", **of.error_body(detail, of.error_type(status), code, param), **extra})

    async def close(self, code: int, reason: str) -> None:
        try:
            async with asyncio.timeout(self.settings.send_timeout_s):
                await self.ws.close(code=code, reason=reason)
        except (TimeoutError, RuntimeError, OSError) as exc:  # already closed or peer gone
            log.debug("closing chat websocket: %s", exc)

    async def next_message(self) -> Message | None:
        """The next message, a held one first; None when the client stayed idle too long (then closed) or left."""
        try:
            async with asyncio.timeout(self.settings.ws_idle_timeout_s):
                message = self.pending.popleft() if self.pending else await self.ws.receive()
        except TimeoutError:
            await self.close(1000, "idle")
            return None
        return None if message["type"] == "websocket.disconnect" else message

    async def start(self, message: Message) -> Run | None:
        """The message's request, validated and started; None when it was refused (its error frame sent)."""
        refusal: Refusal | None = message.get(REFUSED)
        if refusal is not None:  # it came past its credential's rate limit
            retry_after = int(refusal.headers["Retry-After"])
            await self.send_error(refusal.status, refusal.message, refusal.code, retry_after_s=retry_after)
            return None
        raw = message.get("text") or (message.get("bytes") or b"").decode("utf-8", "replace")
        try:
            req = of.ChatRequest.model_validate_json(raw)
            run, _ = await self.starter.start(req, req.requested_tokens, chat=True)
        except ValidationError as exc:
            detail, param = of.validation_error(exc.errors())
            await self.send_error(400, detail, "invalid_request", param)
        except BadRequest as exc:
            await self.send_error(400, exc.message, "invalid_request", exc.param)
        except DeviceError as exc:
            await self.send_error(exc.status, exc.message, exc.code)
        else:
            return run
        return None

    async def stream(self, run: Run) -> None:
        """The run's tokens as frames, then its done frame (or the device's error); its run closed either way."""
        try:
            async for text in run.deltas():
                await self.send({"type": "token", "text": text})
            await self.send(
                {"type": "done", "finish_reason": run.finish_reason, "usage": run.usage(), "stats": run.tophat()}
            )
        except DeviceError as exc:
            await self.send_error(exc.status, exc.message, exc.code)
        finally:
            await run.close()

    async def answer(self, message: Message) -> None:
        run = await self.start(message)
        if run is not None:
            await self.stream(run)

    async def turns(self) -> None:
        """Answer message after message until the client leaves or idles out."""
        while (message := await self.next_message()) is not None:
            # A client that leaves while its request is queued or streaming cancels it (and frees its slot).
            if not await unless_gone(self.answer(message), self.ws.receive, self.pending, self.settings.ws_max_pending):
                log.debug("chat websocket client went away mid-request; request cancelled")
                return

    async def refuse_pending(self, exc: TooManyPending) -> None:
        log.info("chat websocket client sent %s; closing", exc)
        try:
            await self.send_error(429, f"{exc}: send the next when an answer is done.".capitalize(), "too_many_pending")
        except (TimeoutError, WebSocketDisconnect, RuntimeError, OSError) as send_exc:  # it may not be reading
            log.debug("chat websocket: the too_many_pending frame was not sent: %r", send_exc)
        await self.close(1008, "too many pending messages")


async def serve_chat_ws(ws: WebSocket, starter: RequestStarter, s: Settings) -> None:
    """One chat request per JSON message (full history each time); the socket stays open between them."""
    async with asyncio.timeout(s.send_timeout_s):
        await ws.accept()
    chat = ChatSocket(ws, starter, s)
    try:
        await chat.turns()
    except TooManyPending as exc:
        await chat.refuse_pending(exc)
    except WebSocketDisconnect:
        log.debug("chat websocket closed by the client")
    except TimeoutError:
        log.info("chat websocket client too slow to receive; closing")
        await chat.close(1011, "send timeout")
