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
from services.token_streamer.settings import Settings
from services.token_streamer.starter import BadRequest, RequestStarter

log = logging.getLogger(__name__)


async def serve_chat_ws(ws: WebSocket, starter: RequestStarter, s: Settings) -> None:
    """One chat request per JSON message (full history each time); the socket stays open between them."""
    async with asyncio.timeout(s.send_timeout_s):
        await ws.accept()

    async def send(message: dict[str, Any]) -> None:
        async with asyncio.timeout(s.send_timeout_s):
            await ws.send_json(message)

    async def send_error(status: int, detail: str, code: str, param: str | None = None, **extra: Any) -> None:
        await send({"type": "error", **of.error_body(detail, of.error_type(status), code, param), **extra})

    async def close(code: int, reason: str) -> None:
        try:
            async with asyncio.timeout(s.send_timeout_s):
                await ws.close(code=code, reason=reason)
        except (TimeoutError, RuntimeError, OSError) as exc:  # already closed or peer gone
            log.debug("closing chat websocket: %s", exc)

    async def answer(message: Message) -> None:
        refusal: Refusal | None = message.get(REFUSED)
        if refusal is not None:  # it came past its credential's rate limit
            retry_after = int(refusal.headers["Retry-After"])
            await send_error(refusal.status, refusal.message, refusal.code, retry_after_s=retry_after)
            return
        raw = message.get("text") or (message.get("bytes") or b"").decode("utf-8", "replace")
        try:
            req = of.ChatRequest.model_validate_json(raw)
            run, _ = await starter.start(req, req.requested_tokens, chat=True)
        except ValidationError as exc:
            detail, param = of.validation_error(exc.errors())
            await send_error(400, detail, "invalid_request", param)
            return
        except BadRequest as exc:
            await send_error(400, exc.message, "invalid_request", exc.param)
            return
        except DeviceError as exc:
            await send_error(exc.status, exc.message, exc.code)
            return
        try:
            async for text in run.deltas():
                await send({"type": "token", "text": text})
            await send(
                {"type": "done", "finish_reason": run.finish_reason, "usage": run.usage(), "stats": run.tophat()}
            )
        except DeviceError as exc:
            await send_error(exc.status, exc.message, exc.code)
        finally:
            await run.close()

    pending: deque[Message] = deque()  # what the client sent while a request was being answered
    try:
        while True:
            try:
                async with asyncio.timeout(s.ws_idle_timeout_s):
                    message = pending.popleft() if pending else await ws.receive()
            except TimeoutError:
                await close(1000, "idle")
                return
            if message["type"] == "websocket.disconnect":
                return
            # A client that leaves while its request is queued or streaming cancels it (and frees its slot).
            if not await unless_gone(answer(message), ws.receive, pending, s.ws_max_pending):
                log.debug("chat websocket client went away mid-request; request cancelled")
                return
    except TooManyPending as exc:
        log.info("chat websocket client sent %s; closing", exc)
        try:
            await send_error(429, f"{exc}: send the next when an answer is done.".capitalize(), "too_many_pending")
        except (TimeoutError, WebSocketDisconnect, RuntimeError, OSError) as send_exc:  # it may not be reading
            log.debug("chat websocket: the too_many_pending frame was not sent: %r", send_exc)
        await close(1008, "too many pending messages")
    except WebSocketDisconnect:
        log.debug("chat websocket closed by the client")
    except TimeoutError:
        log.info("chat websocket client too slow to receive; closing")
        await close(1011, "send timeout")
