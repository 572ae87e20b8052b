"""Which device agent serves a request, and the NDJSON stream it answers with.

`Router` is the placement policy (least outstanding requests, round-robin on
ties, skip devices that recently failed). It is deliberately tiny and has one
decision method, `pick()`, so a DiSCo-style cost-aware dispatcher (and later
token-level migration) can replace it without touching the HTTP layer.

`Dispatcher` does the network side: it takes a device slot from the admission
queue (admission.py: FCFS, bounded, with a deadline), POSTs /generate, waits
(bounded) for the first NDJSON line and, when a device is unreachable, fails over
to the next one; a device that says busy sends the request back to the head of
the queue. Only failures *before* any token reached the user are retried; a
failure mid-stream is reported.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from services.token_streamer.admission import Admission

log = logging.getLogger(__name__)

_IDENT = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")  # what the state monitor accepts as a device id
BUSY_HOLD_S = 0.25  # a device that answered 'busy' gets no new request this long, unless it frees a slot


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
    max_sessions: int | None = None  # from /info; None: unknown, the device's 'busy' tells
    speed_class: str | None = None  # from /info: prices its energy (DiSCo's cost model)
    eos_token_id: int | None = None  # from /info: an answer that ended is never migrated
    held_until: float = 0.0       # after a 'busy' answer: not offered new requests until then
    opening: int = 0              # requests sent whose first line has not come back yet
    served: int = 0
    failures: int = 0
    last_error: str | None = None
    retired: bool = False         # discovery no longer lists it: never picked (kept while its streams finish)


class Router:
    """Least-outstanding-requests placement with round-robin among ties."""

    def __init__(self, urls: Iterable[str], *, down_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.devices = [DeviceState(url, i) for i, url in enumerate(urls)]
        self.down_s = down_s
        self._clock = clock
        self._cursor = 0

    def healthy(self, device: DeviceState) -> bool:
        return not device.retired and self._clock() >= device.down_until

    def sync(self, urls: Iterable[str]) -> tuple[list[str], list[str]]:
        """Make the announced devices the routable set: new URLs join, missing ones retire (a stream
        already on a retired device runs on; it gets no new request). Returns (added, retired) URLs."""
        wanted = list(dict.fromkeys(u.rstrip("/") for u in urls))
        known = {d.url: d for d in self.devices}
        added = [u for u in wanted if u not in known]
        for url in added:
            self.devices.append(DeviceState(url, len(self.devices)))
        retired = []
        for device in self.devices:
            gone = device.url not in wanted
            if gone and not device.retired:
                retired.append(device.url)
            device.retired = gone
        return added, retired

    def has_free_slot(self, device: DeviceState) -> bool:
        """Healthy, not held off after a 'busy', and below its known session count. A device of
        unknown capacity takes one new request at a time: its answer (started or busy) decides
        the next, so requests reach it in queue order."""
        if not self.healthy(device) or self._clock() < device.held_until:
            return False
        if device.max_sessions is None:
            return device.opening == 0
        return device.outstanding < device.max_sessions

    def capacity(self) -> int:
        """Sessions the healthy devices can hold (a device of unknown capacity: what it holds now)."""
        return sum(d.max_sessions if d.max_sessions is not None else max(1, d.outstanding)
                   for d in self.devices if self.healthy(d))

    def pick(self, exclude: Iterable[str] = (), *, free_only: bool = False) -> DeviceState | None:
        """The healthy device (not in `exclude`, by URL) with the fewest outstanding requests.

        Scanning starts just after the previous pick, so equally loaded devices
        take turns. None when every device is excluded or marked down (or, with
        `free_only`, has no free slot).
        """
        skip = set(exclude)
        n = len(self.devices)
        best: DeviceState | None = None
        for k in range(n):
            device = self.devices[(self._cursor + k) % n]
            if device.url in skip or not (self.has_free_slot(device) if free_only else self.healthy(device)):
                continue
            if best is None or device.outstanding < best.outstanding:
                best = device
        if best is not None:
            self._cursor = (best.index + 1) % n
        return best

    def acquire(self, device: DeviceState) -> None:
        """Take a slot for a request about to be sent; `opened()` once the device has answered."""
        device.outstanding += 1
        device.opening += 1

    def opened(self, device: DeviceState) -> None:
        device.opening = max(0, device.opening - 1)

    def release(self, device: DeviceState, *, busy: bool = False) -> None:
        """Give a slot back; `busy`: the device refused it, so hold it off for a moment."""
        device.outstanding = max(0, device.outstanding - 1)
        device.held_until = self._clock() + BUSY_HOLD_S if busy else 0.0

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
                 "max_sessions": d.max_sessions, "served": d.served, "failures": d.failures,
                 "last_error": d.last_error} for d in self.devices if not d.retired or d.outstanding]


class DeviceStream:
    """An open /generate response from one device; yields its NDJSON events.

    Owns the device slot: `aclose()` (idempotent) closes the HTTP response, which
    tells the device to stop generating, and gives the slot back to the queue.
    """

    def __init__(self, admission: Admission, device: DeviceState, response: httpx.Response,
                 lines: AsyncIterator[str], first: dict[str, Any], line_timeout_s: float) -> None:
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
        try:
            await asyncio.wait_for(self._response.aclose(), timeout=1.0)
        except (httpx.HTTPError, TimeoutError) as exc:
            log.debug("closing device stream: %s", exc)
        finally:  # after the close: the device has seen the disconnect before the slot is offered again
            self.admission.release(self.device, held_s=time.monotonic() - self.opened_at)


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

    def __init__(self, admission: Admission, client: httpx.AsyncClient, *, first_byte_timeout_s: float,
                 line_timeout_s: float, probe_timeout_s: float) -> None:
        self.admission = admission
        self.router = admission.router
        self.client = client
        self.first_byte_timeout_s = first_byte_timeout_s
        self.line_timeout_s = line_timeout_s
        self.probe_timeout_s = probe_timeout_s

    async def open(self, body: dict[str, Any]) -> DeviceStream:
        """POST /generate on the best device with a free slot, waiting in the admission queue for one.

        DeviceError: 503 when no device is reachable, 429 `queue_full`, 503 `queue_timeout`."""
        if not self.router.devices:
            raise DeviceError(503, "no_device_configured", "no device agents are configured")
        started = time.monotonic()
        deadline = started + self.admission.timeout_s
        had_turn = False
        while True:
            device = await self.admission.acquire(deadline, front=had_turn)
            waited_s = time.monotonic() - started
            had_turn = True
            try:
                stream = await self._open_on(device, body)
            except _TryElsewhere as exc:
                # Unreachable devices are marked down (pick skips them); a busy one is held off.
                self.admission.release(device, busy=exc.busy)
                log.info("device %s skipped for request %s: %s", device.url, body.get("request_id"), exc)
                continue
            except BaseException:
                self.admission.release(device)
                raise
            finally:
                self.router.opened(device)
                self.admission.pump()  # a device of unknown capacity may take the next one now
            device.served += 1
            stream.queue_wait_s = waited_s
            self.admission.record_wait(waited_s)
            return stream

    async def open_beside(self, device: DeviceState, body: dict[str, Any]) -> DeviceStream:
        """Open another generation on `device` now, without queueing (DiSCo's second endpoint of a
        request the queue already admitted there). DeviceError 503 `device_busy` when it cannot."""
        self.router.acquire(device)
        try:
            stream = await self._open_on(device, body)
        except _TryElsewhere as exc:
            self.admission.release(device, busy=exc.busy)
            raise DeviceError(503, "device_busy", f"device {device.url} cannot start another endpoint: {exc}") from None
        except BaseException:
            self.admission.release(device)
            raise
        finally:
            self.router.opened(device)
        device.served += 1
        return stream

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
        return DeviceStream(self.admission, device, response, lines, first, self.line_timeout_s)

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
            speed = info.get("speed")
            device.speed_class = speed if isinstance(speed, str) and _IDENT.match(speed) else None
            device.eos_token_id = _opt_int(info.get("eos_token_id"))
        except (httpx.HTTPError, TimeoutError, ValueError, AttributeError) as exc:
            log.debug("GET %s/info failed: %s", device.url, exc)

    async def probe_all(self) -> int:
        """Probe every device concurrently; the number that are ready."""
        results = await asyncio.gather(*(self.probe(d) for d in self.router.devices if not d.retired))
        return sum(results)

    async def discover(self, monitor_url: str) -> bool:
        """Route to the devices that announced themselves to the state monitor (GET /devices). False, and
        the set unchanged, when the monitor cannot answer: a monitor restart must not empty the mesh."""
        try:
            async with asyncio.timeout(self.probe_timeout_s):
                response = await self.client.get(f"{monitor_url.rstrip('/')}/devices")
            response.raise_for_status()
            urls = [str(d["url"]) for d in response.json()["devices"]]
        except (httpx.HTTPError, TimeoutError, ValueError, KeyError, TypeError) as exc:
            log.warning("device discovery at %s failed: %s", monitor_url, exc)
            return False
        urls = [u for u in urls if u.startswith(("http://", "https://"))]
        added, retired = self.router.sync(urls)
        for url in added:
            log.info("discovered device agent %s", url)
        for url in retired:
            log.info("device agent %s no longer announced; retired", url)
        return True
