"""Which device agent serves a request, and the NDJSON stream it answers with.

`Router` is the placement policy (least outstanding requests, round-robin on
ties, skip devices that recently failed). It is deliberately tiny and has one
decision method, `pick()`, so a DiSCo-style cost-aware dispatcher (and later
token-level migration) can replace it without touching the HTTP layer.

`Dispatcher` does the network side: it asks the router for a device, POSTs
/generate, waits (bounded) for the first NDJSON line and fails over to the next
device when a device is unreachable or busy. Only failures *before* any token
reached the user are retried elsewhere; a failure mid-stream is reported.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import httpx

log = logging.getLogger(__name__)

_IDENT = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")  # what the state monitor accepts as a device id


class DeviceError(Exception):
    """A device refused or failed; `status`/`code` become the OpenAI-shaped error reply."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


class _TryElsewhere(Exception):
    """Internal: this device cannot take the request now; the dispatcher tries the next one."""

    def __init__(self, reason: str, *, busy: bool) -> None:
        super().__init__(reason)
        self.busy = busy


@dataclass
class DeviceState:
    """What the streamer knows about one device agent (all local, no coordination)."""

    url: str
    index: int
    outstanding: int = 0          # requests of this streamer currently on the device
    down_until: float = 0.0       # monotonic time before which pick() skips the device
    device_id: str | None = None  # from GET /info, when a probe has fetched it
    max_sessions: int | None = None
    served: int = 0
    failures: int = 0
    last_error: str | None = None


class Router:
    """Least-outstanding-requests placement with round-robin among ties."""

    def __init__(self, urls: Iterable[str], *, down_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.devices = [DeviceState(url, i) for i, url in enumerate(urls)]
        self.down_s = down_s
        self._clock = clock
        self._cursor = 0

    def healthy(self, device: DeviceState) -> bool:
        return self._clock() >= device.down_until

    def pick(self, exclude: Iterable[str] = ()) -> DeviceState | None:
        """The healthy device (not in `exclude`, by URL) with the fewest outstanding requests.

        Scanning starts just after the previous pick, so equally loaded devices
        take turns. None when every device is excluded or marked down.
        """
        skip = set(exclude)
        n = len(self.devices)
        best: DeviceState | None = None
        for k in range(n):
            device = self.devices[(self._cursor + k) % n]
            if device.url in skip or not self.healthy(device):
                continue
            if best is None or device.outstanding < best.outstanding:
                best = device
        if best is not None:
            self._cursor = (best.index + 1) % n
        return best

    def acquire(self, device: DeviceState) -> None:
        device.outstanding += 1

    def release(self, device: DeviceState) -> None:
        device.outstanding = max(0, device.outstanding - 1)

    def mark_down(self, device: DeviceState, reason: str) -> None:
        if self.healthy(device):
            log.warning("device %s marked down for %.1f s: %s", device.url, self.down_s, reason)
        device.down_until = self._clock() + self.down_s
        device.failures += 1
        device.last_error = reason

    def mark_up(self, device: DeviceState) -> None:
        if not self.healthy(device):
            log.info("device %s is back", device.url)
        device.down_until = 0.0

    def snapshot(self) -> list[dict[str, Any]]:
        return [{"url": d.url, "device_id": d.device_id, "healthy": self.healthy(d), "outstanding": d.outstanding,
                 "served": d.served, "failures": d.failures, "last_error": d.last_error} for d in self.devices]


class DeviceStream:
    """An open /generate response from one device; yields its NDJSON events.

    Owns the router slot: `aclose()` (idempotent) closes the HTTP response, which
    tells the device to stop generating, and releases the slot.
    """

    def __init__(self, router: Router, device: DeviceState, response: httpx.Response,
                 lines: AsyncIterator[str], first: dict[str, Any], line_timeout_s: float) -> None:
        self.router = router
        self.device = device
        self._response = response
        self._lines = lines
        self._line_timeout_s = line_timeout_s
        self._closed = False
        self.prompt_tokens: int | None = None
        self._pending: dict[str, Any] | None = None
        if first.get("type") == "start":
            self.prompt_tokens = _opt_int(first.get("prompt_tokens"))
        else:  # tolerate agents that skip the start line
            self._pending = first

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """tokens/done/error events; raises DeviceError on timeout, disconnect or garbage."""
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
                raise DeviceError(502, "device_stream_truncated",
                                  "the device closed the stream before 'done'") from None
            except TimeoutError:
                self.router.mark_down(self.device, "no output within line timeout")
                raise DeviceError(502, "device_timeout",
                                  f"no output from the device for {self._line_timeout_s:g} s") from None
            except httpx.HTTPError as exc:
                self.router.mark_down(self.device, f"stream broke: {type(exc).__name__}")
                raise DeviceError(502, "device_disconnected", f"the device stream broke: {exc}") from exc
            if not line.strip():
                continue
            event = _parse_line(line)
            yield event
            if event.get("type") in ("done", "error"):
                return

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.router.release(self.device)
        try:
            await asyncio.wait_for(self._response.aclose(), timeout=1.0)
        except (httpx.HTTPError, TimeoutError) as exc:
            log.debug("closing device stream: %s", exc)


def _parse_line(line: str) -> dict[str, Any]:
    try:
        event = json.loads(line)
    except ValueError:
        raise DeviceError(502, "device_bad_response", f"device sent a non-JSON line: {line[:80]!r}") from None
    if not isinstance(event, dict):
        raise DeviceError(502, "device_bad_response", "device sent a non-object JSON line")
    return event


def _opt_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _error_of(response: httpx.Response) -> tuple[str, str]:
    """(code, message) from a device's JSON error body, with fallbacks for anything else."""
    try:
        err = response.json().get("error", {})
        return str(err.get("code") or f"http_{response.status_code}"), str(err.get("message") or response.reason_phrase)
    except (ValueError, AttributeError):
        return f"http_{response.status_code}", response.text[:200] or response.reason_phrase


class Dispatcher:
    """Opens a generation on some device, failing over while nothing was delivered yet."""

    def __init__(self, router: Router, client: httpx.AsyncClient, *, first_byte_timeout_s: float,
                 line_timeout_s: float, probe_timeout_s: float) -> None:
        self.router = router
        self.client = client
        self.first_byte_timeout_s = first_byte_timeout_s
        self.line_timeout_s = line_timeout_s
        self.probe_timeout_s = probe_timeout_s

    async def open(self, body: dict[str, Any]) -> DeviceStream:
        """POST /generate on the best device; 503 DeviceError when none can take it."""
        if not self.router.devices:
            raise DeviceError(503, "no_device_configured", "no device agents are configured")
        tried: set[str] = set()
        busy = 0
        while (device := self.router.pick(exclude=tried)) is not None:
            tried.add(device.url)
            self.router.acquire(device)
            try:
                stream = await self._open_on(device, body)
            except _TryElsewhere as exc:
                self.router.release(device)
                busy += exc.busy
                log.info("device %s skipped for request %s: %s", device.url, body.get("request_id"), exc)
                continue
            except BaseException:
                self.router.release(device)
                raise
            device.served += 1
            return stream
        if busy:
            raise DeviceError(503, "devices_busy", "every reachable device is busy; retry later")
        raise DeviceError(503, "no_device_available", "no device agent is reachable")

    async def _open_on(self, device: DeviceState, body: dict[str, Any]) -> DeviceStream:
        request = self.client.build_request("POST", f"{device.url}/generate", json=body)
        try:
            async with asyncio.timeout(self.first_byte_timeout_s):
                response = await self.client.send(request, stream=True)
                try:
                    if response.status_code != 200:
                        await response.aread()
                        self._refused(device, response)
                    lines = response.aiter_lines()
                    first: dict[str, Any] | None = None
                    async for line in lines:
                        if line.strip():
                            first = _parse_line(line)
                            break
                    if first is None:
                        raise DeviceError(502, "device_stream_truncated", "the device sent no events")
                except BaseException:
                    await response.aclose()
                    raise
        except httpx.PoolTimeout:
            raise DeviceError(503, "streamer_overloaded", "too many open device connections") from None
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            self.router.mark_down(device, f"connect failed: {type(exc).__name__}")
            raise _TryElsewhere("unreachable", busy=False) from exc
        except TimeoutError:
            self.router.mark_down(device, "no first byte within timeout")
            raise _TryElsewhere("first-byte timeout", busy=False) from None
        except httpx.HTTPError as exc:
            self.router.mark_down(device, f"request failed: {type(exc).__name__}")
            raise _TryElsewhere(f"request failed: {exc}", busy=False) from exc
        if first.get("type") == "error":
            await response.aclose()
            code, message = str(first.get("code") or "device_error"), str(first.get("message") or "")
            if code in ("busy", "overloaded", "device_busy"):
                raise _TryElsewhere(f"busy ({code})", busy=True)
            raise DeviceError(502, code, message or "the device failed to start the generation")
        self.router.mark_up(device)
        return DeviceStream(self.router, device, response, lines, first, self.line_timeout_s)

    def _refused(self, device: DeviceState, response: httpx.Response) -> None:
        """Map a non-200 /generate reply: 503 -> try another device, 4xx -> the caller's fault."""
        code, message = _error_of(response)
        if response.status_code == 503:
            raise _TryElsewhere(f"busy ({code})", busy=True)
        if 400 <= response.status_code < 500:
            raise DeviceError(400, code, message)
        self.router.mark_down(device, f"HTTP {response.status_code} {code}")
        raise _TryElsewhere(f"HTTP {response.status_code}", busy=False)

    async def probe(self, device: DeviceState) -> bool:
        """GET /readyz and update the router's view; learn the device id from /info once."""
        try:
            async with asyncio.timeout(self.probe_timeout_s):
                response = await self.client.get(f"{device.url}/readyz")
        except (httpx.HTTPError, TimeoutError) as exc:
            self.router.mark_down(device, f"probe failed: {type(exc).__name__}")
            return False
        if response.status_code != 200:
            self.router.mark_down(device, f"/readyz answered {response.status_code}")
            return False
        self.router.mark_up(device)
        if device.device_id is None:
            await self._learn_identity(device)
        return True

    async def _learn_identity(self, device: DeviceState) -> None:
        """Best effort: telemetry names the device when /info answers with a usable id."""
        try:
            async with asyncio.timeout(self.probe_timeout_s):
                info = (await self.client.get(f"{device.url}/info")).json()
            device_id = str(info.get("device_id") or "")
            device.device_id = device_id if _IDENT.match(device_id) else None
            device.max_sessions = _opt_int(info.get("max_sessions"))
        except (httpx.HTTPError, TimeoutError, ValueError, AttributeError) as exc:
            log.debug("GET %s/info failed: %s", device.url, exc)

    async def probe_all(self) -> int:
        """Probe every device concurrently; the number that are ready."""
        results = await asyncio.gather(*(self.probe(d) for d in self.router.devices))
        return sum(results)
