"""The chunk planner's reads of the state monitor: `GET /state/cloud`, `GET /state/device/{id}` and
`GET /state/edge-sd`, each bounded by `monitor_timeout_s` as a whole. A fetch that yields no JSON is a
`Telemetry` with `failure` set to the reason the planners' answers name (see app.py's docstring)."""

from __future__ import annotations

import asyncio
import logging
import ssl
from dataclasses import dataclass
from typing import Any

import httpx

from shared.edge_sd.plan_inputs import EdgeTelemetry, EdgeTelemetryError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Telemetry:
    """What one fetch from the monitor produced.

    `failure` is set when no JSON could be had at all (no-monitor,
    monitor-unreachable, monitor-error); otherwise `device` is None for a device
    the monitor does not know (404).
    """

    cloud: dict[str, Any] | None = None
    device: dict[str, Any] | None = None
    failure: str | None = None


NO_MONITOR = Telemetry(failure="no-monitor")


class _FetchFailed(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class MonitorClient:
    """Reads the state monitor; every request is bounded by `timeout_s` as a whole.

    httpx's timeout bounds each phase (connect, each read) separately, so a slow
    trickle could outlast it; `asyncio.wait_for` bounds the total.
    """

    def __init__(
        self,
        base_url: str,
        timeout_s: float,
        transport: httpx.AsyncBaseTransport | None = None,
        verify: ssl.SSLContext | bool = True,
    ) -> None:
        self.timeout_s = timeout_s
        self.http = httpx.AsyncClient(
            base_url=base_url.rstrip("/"), timeout=timeout_s, transport=transport, verify=verify
        )

    async def aclose(self) -> None:
        await self.http.aclose()

    async def fetch(self, device_id: str) -> Telemetry:
        results = await asyncio.gather(
            self._get("/state/cloud"), self._get(f"/state/device/{device_id}"), return_exceptions=True
        )
        for result in results:
            if isinstance(result, _FetchFailed):
                log.warning("state monitor %s: %s", self.http.base_url, result)
                return Telemetry(failure=result.reason)
            if isinstance(result, BaseException):
                raise result
        cloud, device = results
        assert not isinstance(cloud, BaseException) and not isinstance(device, BaseException)  # raised above
        if cloud is None:  # every state monitor serves /state/cloud: this is some other server
            log.warning("state monitor %s: GET /state/cloud -> 404", self.http.base_url)
            return Telemetry(failure="monitor-error")
        return Telemetry(cloud=cloud, device=device)

    async def fetch_edge_sd(self) -> tuple[EdgeTelemetry | None, str | None]:
        """Edge SD's measured passes and verdicts, or (None, reason) when they cannot be had."""
        try:
            body = await self._get("/state/edge-sd")
        except _FetchFailed as exc:
            log.warning("state monitor %s: %s", self.http.base_url, exc)
            return None, exc.reason
        if body is None:  # a monitor without the route
            return None, "monitor-error"
        try:
            return EdgeTelemetry.from_dict(body), None
        except EdgeTelemetryError as exc:
            log.warning("state monitor %s: unreadable edge-sd telemetry: %s", self.http.base_url, exc)
            return None, "bad-telemetry"

    async def _get(self, path: str) -> dict[str, Any] | None:
        """JSON object at `path`; None for 404; _FetchFailed for anything else that is not a JSON object."""
        try:
            response = await asyncio.wait_for(self.http.get(path), self.timeout_s)
        except (TimeoutError, httpx.TimeoutException) as exc:
            raise _FetchFailed("monitor-unreachable", f"GET {path} timed out") from exc
        except httpx.TransportError as exc:
            raise _FetchFailed("monitor-unreachable", f"GET {path}: {type(exc).__name__}: {exc}") from exc
        except httpx.HTTPError as exc:  # protocol trouble after connecting (bad encoding, redirects)
            raise _FetchFailed("monitor-error", f"GET {path}: {type(exc).__name__}: {exc}") from exc
        if response.status_code == 404:
            return None
        if response.status_code != 200:
            raise _FetchFailed("monitor-error", f"GET {path} -> HTTP {response.status_code}")
        try:
            body = response.json()
        except ValueError as exc:
            raise _FetchFailed("monitor-error", f"GET {path}: not JSON") from exc
        if not isinstance(body, dict):
            raise _FetchFailed("monitor-error", f"GET {path}: not a JSON object")
        return body


def reported_stages(telemetry: Telemetry) -> int | None:
    """P as the verifier reports it with its steps (None: no report yet, or no monitor)."""
    stages = ((telemetry.cloud or {}).get("last") or {}).get("pipeline_stages")
    return stages if isinstance(stages, int) and not isinstance(stages, bool) and stages >= 1 else None
