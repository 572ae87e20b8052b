"""One open /generate response from a device agent, read as NDJSON events.

A `DeviceStream` owns its device slot: closing it closes the HTTP response (which
tells the device to stop generating) and only then gives the slot back to the
admission queue, so the device has seen the disconnect before it is offered again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx

from services.token_streamer.admission import Admission
from services.token_streamer.router import DeviceError, DeviceState

log = logging.getLogger(__name__)

HEARTBEAT = "heartbeat"  # a device's "still working on it" line (services/device_agent/agent.py)


class DeviceStream:
    """An open /generate response from one device; yields its NDJSON events.

    Owns the device slot: `aclose()` (idempotent) closes the HTTP response, which
    tells the device to stop generating, and gives the slot back to the queue.
    """

    def __init__(
        self,
        admission: Admission,
        device: DeviceState,
        response: httpx.Response,
        lines: AsyncIterator[str],
        first: dict[str, Any],
        line_timeout_s: float,
    ) -> None:
        self.admission = admission
        self.router = admission.router
        self.device = device
        self.opened_at = time.monotonic()
        self.queue_wait_s = 0.0  # set by the dispatcher: time spent waiting for this slot
        self._response = response
        self._lines = lines
        self._line_timeout_s = line_timeout_s
        self._closed = False
        self.prompt_tokens: int | None = None
        self._pending: dict[str, Any] | None = None
        if first.get("type") == "start":
            self.prompt_tokens = optional_int(first.get("prompt_tokens"))
        else:  # tolerate agents that skip the start line
            self._pending = first

    async def events(self, heartbeats: bool = False) -> AsyncIterator[dict[str, Any]]:
        """tokens/done/error events; raises DeviceError on timeout, disconnect or garbage.

        A device whose request is waiting (e.g. in the verifier's queue) sends a `heartbeat` line every few
        seconds: like any line it restarts the line timeout, so only a silent device times out. Heartbeats
        are yielded only to a reader that asks for them (`heartbeats`: a DiSCo leg, whose request has an
        idle timeout of its own); every other reader sees tokens, done and error alone."""
        if self._pending is not None:
            event, self._pending = self._pending, None
            yield event
            if event.get("type") in ("done", "error"):
                return
        while True:
            try:
                async with asyncio.timeout(self._line_timeout_s):
                    line = await anext(self._lines)
            except StopAsyncIteration:
                raise DeviceError(
                    502, "device_stream_truncated", "the device closed the stream before 'done'"
                ) from None
            except TimeoutError:
                self.router.mark_down(self.device, "no output within line timeout")
                raise DeviceError(
                    502, "device_timeout", f"no output from the device for {self._line_timeout_s:g} s"
                ) from None
            except httpx.HTTPError as exc:
                self.router.mark_down(self.device, f"stream broke: {type(exc).__name__}")
                raise DeviceError(502, "device_disconnected", f"the device stream broke: {exc}") from exc
            if not line.strip():
                continue
            event = parse_event_line(line)
            if event.get("type") == HEARTBEAT and not heartbeats:
                continue
            yield event
            if event.get("type") in ("done", "error"):
                return

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await asyncio.wait_for(self._response.aclose(), timeout=1.0)
        except (httpx.HTTPError, TimeoutError) as exc:
            log.debug("closing device stream: %s", exc)
        finally:  # after the close: the device has seen the disconnect before the slot is offered again
            self.admission.release(self.device, held_s=time.monotonic() - self.opened_at)


def parse_event_line(line: str) -> dict[str, Any]:
    try:
        event = json.loads(line)
    except ValueError:
        raise DeviceError(502, "device_bad_response", f"device sent a non-JSON line: {line[:80]!r}") from None
    if not isinstance(event, dict):
        raise DeviceError(502, "device_bad_response", "device sent a non-object JSON line")
    return event


def optional_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
