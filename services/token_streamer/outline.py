"""Outline-based parallel decoding on one device agent (Jupiter §V-B), for the streamer.

`OutlineFlow.open(body, prompt)` answers a request with an outline when it can:
  1. the queue admits the request to a device (one reserved slot, like any request);
  2. the device's directive handle: the fixed outline directive, prefilled once per device with
     `max_new_tokens: 0, keep: true` and cached (a 404 later, the agent forgot it: made again, once);
  3. the outline: the question forked from the directive (`fork`, so the directive's KV is copied,
     not recomputed), generated and kept;
  4. the points parsed from it (shared/jupiter/outline.py), each expanded by its own request forked
     from the outline's handle, all running at once on the device;
  5. the answer streamed in outline order: point 1 live, each later point's tokens buffered until
     the points before it are done, each behind its heading.
It falls back to the normal sequential path (returns the plain DeviceStream) when the question is
not routed to it, the outline has fewer than 2 points, or the agent lacks keep/fork or a chat format.
Handles the request made are deleted when it ends, whatever the ending; the directive's stays.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx

from services.token_streamer.device_stream import DeviceStream
from services.token_streamer.dispatcher import Dispatcher
from services.token_streamer.router import DeviceError, DeviceState
from shared.jupiter.outline import MIN_POINTS, OUTLINE_OPENING, ChatFormat, heading, parse_outline, question_of, route
from shared.modes import KEPT_SESSIONS_MODE

log = logging.getLogger(__name__)

OUTLINE_MAX_TOKENS = 64  # the outline is 3-5 points of a few words each (~8 tokens a point)
UNSUPPORTED_RECHECK_S = 60.0  # an agent without keep/fork is asked again after this long
_UNKNOWN_HANDLE = ("unknown_kept_session", "http_404")


def hat_sampling(body: dict[str, Any]) -> dict[str, Any]:
    """What every request of an outline carries from the user's: its sampling, in mode hat (keep/fork need it)."""
    return {k: body[k] for k in ("temperature", "top_p", "seed") if k in body} | {"mode": KEPT_SESSIONS_MODE}


class _Fallback(Exception):
    """Internal: answer sequentially; `reason` goes to the response's stats."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _Point:
    """One point's expansion: its events buffered in order, its stream owned."""

    def __init__(self, index: int, text: str) -> None:
        self.index = index
        self.text = text
        self.events: asyncio.Queue[dict[str, Any] | DeviceError] = asyncio.Queue()
        self.task: asyncio.Task[None] | None = None


class OutlineStream:
    """Quacks like a DeviceStream (device, queue_wait_s, prompt_tokens, events(), aclose()) so the
    streamer's Run applies stop strings, timing and telemetry unchanged. Events: the points'
    'tokens' in outline order (each point's heading joined to its first text), then one 'done'."""

    def __init__(
        self,
        flow: OutlineFlow,
        device: DeviceState,
        fmt: ChatFormat,
        body: dict[str, Any],
        outline_handle: str,
        points: list[str],
        outline_ended_turn: bool,
        stats: dict[str, Any],
    ) -> None:
        self.flow = flow
        self.device = device
        self.queue_wait_s = 0.0
        self.prompt_tokens: int | None = None
        self.stats = stats
        self._outline_handle = outline_handle
        self._body = body
        per_point = max(1, int(body.get("max_new_tokens") or 1) // len(points))  # the request's budget, shared
        self._points = [_Point(i, p) for i, p in enumerate(points, 1)]
        self._bodies = [
            {
                **self._sampling(),
                "prompt": fmt.point_text(p.index, p.text, outline_ended_turn=outline_ended_turn),
                "fork": outline_handle,
                "max_new_tokens": per_point,
                "request_id": f"{body.get('request_id', 'outline')}-p{p.index}",
            }
            for p in self._points
        ]
        self._running = 0
        self._finished = 0
        self._freed = asyncio.Event()  # a point finished: a busy device may take a waiting one now
        self._closed = False

    def _sampling(self) -> dict[str, Any]:
        return hat_sampling(self._body)

    def start_points(self) -> None:
        for point, body in zip(self._points, self._bodies, strict=True):
            point.task = asyncio.create_task(self._run_point(point, body), name=f"outline-point-{point.index}")

    async def _open_point(self, body: dict[str, Any]) -> DeviceStream:
        """open_beside, waiting for another point to finish while the device says busy."""
        while True:
            finished = self._finished
            try:
                return await self.flow.dispatcher.open_beside(self.device, body)
            except DeviceError as exc:
                if exc.code != "device_busy" or self._running == 0:
                    raise
            if self._finished == finished:  # none ended while asking: wait for one
                self._freed.clear()
                async with asyncio.timeout(self.flow.wait_timeout_s):
                    await self._freed.wait()

    async def _run_point(self, point: _Point, body: dict[str, Any]) -> None:
        stream: DeviceStream | None = None
        try:
            stream = await self._open_point(body)
            self._running += 1
            async for event in stream.events():
                if event.get("type") == "error":
                    raise DeviceError(
                        502,
                        str(event.get("code") or "device_error"),
                        str(event.get("message") or "the device failed mid-generation"),
                    )
                point.events.put_nowait(event)
                if event.get("type") == "done":
                    return
            raise DeviceError(502, "device_stream_cut", "the device's stream ended before its done event")
        except DeviceError as exc:
            point.events.put_nowait(DeviceError(exc.status, exc.code, f"outline point {point.index}: {exc.message}"))
        except TimeoutError:
            point.events.put_nowait(
                DeviceError(503, "device_busy", f"outline point {point.index}: the device stayed busy")
            )
        except (httpx.HTTPError, ValueError) as exc:  # whatever else the device's stream can end in
            point.events.put_nowait(DeviceError(502, "device_error", f"outline point {point.index}: {exc!r}"))
        finally:
            if stream is not None:
                await stream.aclose()
                self._running -= 1
                self._finished += 1
                self._freed.set()

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        finish = "stop"
        completion = 0
        for point in self._points:
            head: str | None = heading(point.index, point.text)
            leading = True  # the heading ends its line: the expansion's leading whitespace is dropped
            while True:
                async with asyncio.timeout(self.flow.wait_timeout_s):  # a point task always ends with done or error
                    event = await point.events.get()
                if isinstance(event, DeviceError):
                    if head is None:
                        raise event
                    yield {"type": "tokens", "token_ids": [], "text": head}  # the heading of the point that failed
                    raise event
                if event.get("type") == "done":
                    finish = finish if event.get("finish_reason") == "stop" else "length"
                    stats = event.get("stats")
                    completion += int(stats.get("completion_tokens") or 0) if isinstance(stats, dict) else 0
                    if head is not None:
                        yield {"type": "tokens", "token_ids": [], "text": head}
                    break
                text = str(event.get("text") or "")
                if leading:
                    text = text.lstrip()
                    leading = not text
                if head is not None:
                    if not text and not event.get("token_ids"):
                        continue
                    text, head = head + text, None
                yield {"type": "tokens", "token_ids": event.get("token_ids") or [], "text": text}
        self.stats["completion_tokens"] = completion
        yield {"type": "done", "finish_reason": finish, "stats": {"outline": self.stats}}

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        tasks = [p.task for p in self._points if p.task is not None]
        for task in tasks:
            task.cancel()
        try:
            await asyncio.gather(*tasks, return_exceptions=True)  # each closes its own device stream
            await self.flow.delete_handle(self.device, self._outline_handle)
        finally:  # a cancelled close still gives the slot back (aclose runs once: a leak would be for good)
            self.flow.release(self.device)


class OutlineFlow:
    """Per-streamer state: each device's directive handle and chat format, and what it lacks."""

    def __init__(
        self, dispatcher: Dispatcher, client: httpx.AsyncClient, *, wait_timeout_s: float, probe_timeout_s: float
    ) -> None:
        self.dispatcher = dispatcher
        self.admission = dispatcher.admission
        self.client = client
        self.wait_timeout_s = wait_timeout_s
        self.probe_timeout_s = probe_timeout_s
        self.directives: dict[str, str] = {}  # device url -> the kept handle of its directive prefix
        self.formats: dict[str, ChatFormat] = {}
        self.unsupported: dict[str, float] = {}  # device url -> monotonic time to ask again
        self._locks: dict[str, asyncio.Lock] = {}

    async def open(self, body: dict[str, Any]) -> tuple[OutlineStream | DeviceStream, dict[str, Any]]:
        """The request's stream and its outline stats ({"used", "reason", "points"})."""
        decision = route(body.get("prompt"), body.get("messages"))
        if not decision.use_outline:
            return await self.dispatcher.open(body), {"used": False, "reason": decision.reason, "points": 0}
        started = time.monotonic()
        device = await self._reserve()
        waited_s = time.monotonic() - started
        self.admission.record_wait(waited_s)
        try:
            stream = await self._outline(device, body)
        except _Fallback as exc:
            self.release(device)
            log.info("request %s answered sequentially: %s", body.get("request_id"), exc.reason)
            return await self.dispatcher.open(body), {"used": False, "reason": exc.reason, "points": 0}
        except BaseException:
            self.release(device)
            raise
        stream.queue_wait_s = waited_s
        return stream, stream.stats

    async def _reserve(self) -> DeviceState:
        """A slot of the queue's: the outline's requests then open beside it on the same device
        (its handles live there)."""
        if not self.dispatcher.router.devices:
            raise DeviceError(503, "no_device_configured", "no device agents are configured")
        device = await self.admission.acquire(time.monotonic() + self.admission.timeout_s)
        self.dispatcher.router.opened(device)
        self.admission.pump()
        return device

    def release(self, device: DeviceState) -> None:
        self.admission.release(device)

    async def _outline(self, device: DeviceState, body: dict[str, Any]) -> OutlineStream:
        if time.monotonic() < self.unsupported.get(device.url, 0.0):
            raise _Fallback("device_lacks_fork")
        fmt = await self._format(device)
        question = question_of(body.get("prompt"), body.get("messages")) or ""
        outline_body = {
            **hat_sampling(body),
            "prompt": fmt.question_text(question) + OUTLINE_OPENING,
            "keep": True,
            "max_new_tokens": OUTLINE_MAX_TOKENS,
            "request_id": f"{body.get('request_id')}-outline",
        }
        directive = await self._directive(device, fmt)
        try:
            text, kept, finish = await self._generate(device, {**outline_body, "fork": directive})
        except DeviceError as exc:
            if exc.code not in _UNKNOWN_HANDLE:
                raise
            self.directives.pop(device.url, None)  # the agent forgot it (expired, restarted): once more
            directive = await self._directive(device, fmt)
            text, kept, finish = await self._generate(device, {**outline_body, "fork": directive})
        if kept is None:
            self._mark_unsupported(device, "no kept handle after the outline")
            raise _Fallback("device_lacks_fork")
        points = parse_outline(OUTLINE_OPENING + text)
        if len(points) < MIN_POINTS:
            await self.delete_handle(device, kept["handle"])
            raise _Fallback(f"outline_points<{MIN_POINTS}")
        stats = {
            "used": True,
            "reason": "open_ended",
            "points": len(points),
            "outline": points,
            "outline_tokens": int(kept.get("length") or 0),
        }
        stream = OutlineStream(self, device, fmt, body, str(kept["handle"]), points, finish == "stop", stats)
        stream.start_points()
        return stream

    async def _format(self, device: DeviceState) -> ChatFormat:
        """The device's chat template segments, from its /info (cached)."""
        if device.url in self.formats:
            return self.formats[device.url]
        try:
            async with asyncio.timeout(self.probe_timeout_s):
                info = (await self.client.get(f"{device.url}/info")).json()
        except (httpx.HTTPError, TimeoutError, ValueError) as exc:
            raise _Fallback(f"device_info_failed: {type(exc).__name__}") from None
        fmt = ChatFormat.from_dict(info.get("chat_format") if isinstance(info, dict) else None)
        if fmt is None:
            self._mark_unsupported(device, "no chat_format in /info")
            raise _Fallback("device_lacks_chat_format")
        self.formats[device.url] = fmt
        return fmt

    async def _directive(self, device: DeviceState, fmt: ChatFormat) -> str:
        """The device's kept directive prefix, prefilled the first time (one prefill at a time per device)."""
        lock = self._locks.setdefault(device.url, asyncio.Lock())
        async with asyncio.timeout(self.wait_timeout_s):
            await lock.acquire()
        try:
            if device.url in self.directives:
                return self.directives[device.url]
            try:
                _, kept, _ = await self._generate(
                    device,
                    {
                        "prompt": fmt.directive_text(),
                        "max_new_tokens": 0,
                        "keep": True,
                        "mode": KEPT_SESSIONS_MODE,
                        "temperature": 0.0,
                    },
                )
            except DeviceError as exc:
                if exc.status != 400:  # refused (an agent without keep/fork), not failed
                    raise
                kept = None
            if kept is None:
                self._mark_unsupported(device, "the directive prefill kept nothing")
                raise _Fallback("device_lacks_fork")
            self.directives[device.url] = str(kept["handle"])
            return self.directives[device.url]
        finally:
            lock.release()

    async def _generate(self, device: DeviceState, body: dict[str, Any]) -> tuple[str, dict[str, Any] | None, str]:
        """Run one request to its end on `device`: (text, its 'kept' object or None, finish reason)."""
        stream = await self.dispatcher.open_beside(device, body)
        text: list[str] = []
        try:
            async for event in stream.events():
                kind = event.get("type")
                if kind == "tokens":
                    text.append(str(event.get("text") or ""))
                elif kind == "error":
                    raise DeviceError(
                        502,
                        str(event.get("code") or "device_error"),
                        str(event.get("message") or "the device failed mid-generation"),
                    )
                elif kind == "done":
                    kept = event.get("kept")
                    valid = isinstance(kept, dict) and isinstance(kept.get("handle"), str) and kept["handle"]
                    return "".join(text), kept if valid else None, str(event.get("finish_reason") or "length")
        finally:
            await stream.aclose()
        raise DeviceError(502, "device_stream_truncated", "the device closed the stream before 'done'")

    def _mark_unsupported(self, device: DeviceState, why: str) -> None:
        log.info("device %s cannot run outlines (%s); sequential for %.0f s", device.url, why, UNSUPPORTED_RECHECK_S)
        self.unsupported[device.url] = time.monotonic() + UNSUPPORTED_RECHECK_S

    async def delete_handle(self, device: DeviceState, handle: str) -> None:
        """Best effort: a handle the agent cannot free now expires there on its own."""
        try:
            async with asyncio.timeout(self.probe_timeout_s):
                response = await self.client.delete(f"{device.url}/kept/{handle}")
            if response.status_code not in (200, 204, 404):
                log.info("DELETE kept %s on %s answered %d", handle, device.url, response.status_code)
        except (httpx.HTTPError, TimeoutError) as exc:
            log.info("DELETE kept %s on %s failed: %s", handle, device.url, exc)
