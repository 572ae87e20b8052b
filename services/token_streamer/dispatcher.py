"""Opening a generation on some device agent, failing over while nothing was delivered yet.

`Dispatcher` takes a device slot from the admission queue (admission.py: FCFS,
bounded, with a deadline), POSTs /generate, waits (bounded) for the first NDJSON
line and, when a device is unreachable, fails over to the next one; a device that
says busy sends the request back to the head of the queue. Only failures *before*
any token reached the user are retried; a failure mid-stream is reported by the
`DeviceStream` it returned. It also probes devices (/readyz, /info) and follows
the state monitor's device list.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import Any

import httpx

from services.token_streamer.admission import Admission, QueueTicket
from services.token_streamer.device_stream import DeviceStream, optional_int, parse_event_line
from services.token_streamer.router import DeviceError, DeviceState

log = logging.getLogger(__name__)

_IDENT = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")  # what the state monitor accepts as a device id


class _TryElsewhere(Exception):
    """Internal: this device cannot take the request now; the dispatcher tries the next one."""

    def __init__(self, reason: str, *, busy: bool) -> None:
        super().__init__(reason)
        self.busy = busy


def _error_of(response: httpx.Response) -> tuple[str, str]:
    """(code, message) from a device's JSON error body, with fallbacks for anything else."""
    try:
        err = response.json().get("error", {})
        return str(err.get("code") or f"http_{response.status_code}"), str(err.get("message") or response.reason_phrase)
    except (ValueError, AttributeError):
        return f"http_{response.status_code}", response.text[:200] or response.reason_phrase


class Dispatcher:
    """Opens a generation on some device, failing over while nothing was delivered yet."""

    def __init__(
        self,
        admission: Admission,
        client: httpx.AsyncClient,
        *,
        first_byte_timeout_s: float,
        line_timeout_s: float,
        probe_timeout_s: float,
    ) -> None:
        self.admission = admission
        self.router = admission.router
        self.client = client
        self.first_byte_timeout_s = first_byte_timeout_s
        self.line_timeout_s = line_timeout_s
        self.probe_timeout_s = probe_timeout_s
        self._ready: tuple[float, int] | None = None  # (monotonic time, ready devices) of ready_devices' last round
        self._probing = asyncio.Lock()

    async def open(self, body: dict[str, Any]) -> DeviceStream:
        """POST /generate on the best device with a free slot, waiting in the admission queue for one.

        DeviceError: 503 when no device is reachable, 429 `queue_full`, 503 `queue_timeout`."""
        if not self.router.devices:
            raise DeviceError(503, "no_device_configured", "no device agents are configured")
        started = time.monotonic()
        deadline = started + self.admission.timeout_s
        had_turn, ticket = False, QueueTicket()
        while True:
            device = await self.admission.acquire(deadline, front=had_turn, ticket=ticket)
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
                            first = parse_event_line(line)
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
            device.max_sessions = optional_int(info.get("max_sessions"))
            speed = info.get("speed")
            device.speed_class = speed if isinstance(speed, str) and _IDENT.match(speed) else None
            device.eos_token_id = optional_int(info.get("eos_token_id"))
        except (httpx.HTTPError, TimeoutError, ValueError, AttributeError) as exc:
            log.debug("GET %s/info failed: %s", device.url, exc)

    async def probe_all(self) -> int:
        """Probe every device concurrently; the number that are ready."""
        results = await asyncio.gather(*(self.probe(d) for d in self.router.devices if not d.retired))
        return sum(results)

    async def ready_devices(self, max_age_s: float) -> int:
        """How many devices are ready: from the last round this method ran if it is at most `max_age_s` old
        (callers meanwhile wait for it and share it), else from a new one. A flood of readiness checks thus
        costs at most one probe round per `max_age_s`. The health loop's rounds are not reused: the first
        check after the devices came up (`tophat serve` makes it) probes them all, so it finds them all up."""
        async with self._probing:
            if self._ready is None or time.monotonic() - self._ready[0] > max_age_s:
                self._ready = (time.monotonic(), await self.probe_all())
            return self._ready[1]

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
