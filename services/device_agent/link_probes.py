"""The device's link to the verifier, measured in the background (HAT §3.2: devices report β_up, β_down and
the round trip): bulk probes while no request runs, tiny round trips busy or not, and every bulk transfer a
request makes. What it measures goes to the state monitor as telemetry; the planner and the draft budget use it."""

from __future__ import annotations

import asyncio
import logging
import statistics
from collections import deque
from collections.abc import Callable

from services.device_agent.cloud_client import CloudError, CloudUnavailable, WebSocketCloud
from shared.telemetry.client import TelemetryClient

log = logging.getLogger("services.device_agent")

MIN_BANDWIDTH_SAMPLE_BYTES = 16 * 1024  # smaller frames measure latency, not bandwidth
BUSY_RECHECK_S = 1.0  # a probe that must wait (verifier not ready, a request running) looks again this soon
RECENT_RTTS = 5


class LinkProbes:
    def __init__(
        self,
        device_id: str,
        telemetry: TelemetryClient,
        busy: Callable[[], bool],
        bandwidth_interval_s: float,
        rtt_interval_s: float,
    ) -> None:
        self.device_id, self.telemetry, self.busy = device_id, telemetry, busy
        self.bandwidth_interval_s, self.rtt_interval_s = bandwidth_interval_s, rtt_interval_s
        self.cloud: WebSocketCloud | None = None  # the connection it measures, given once built (it reports here)
        self.recent_rtts: deque[float] = deque(maxlen=RECENT_RTTS)
        # Whether the first bulk probe has run (or probing is off): until then the device is not ready, so its
        # first requests are planned from a measured link instead of the planner's defaults.
        self.first_probe_done = bandwidth_interval_s <= 0

    def on_transfer(self, direction: str, nbytes: int, seconds: float) -> None:
        """A bulk transfer's size and time (the connection's hook): a bandwidth sample."""
        if nbytes >= MIN_BANDWIDTH_SAMPLE_BYTES:
            self.telemetry.emit_device_transfer(self.device_id, direction, nbytes, seconds)

    def report_rtt(self, rtt_s: float) -> None:
        # The median of the last few: a probe that queued behind a prompt upload on the shared
        # link measures that upload (which the simulator models itself), not the message cost.
        self.recent_rtts.append(rtt_s)
        self.telemetry.emit_device_rtt(self.device_id, statistics.median(self.recent_rtts))

    async def bandwidth_loop(self) -> None:
        """Probe once the verifier answers, then every interval, only while no request runs (a probe shares
        the link, so it must not sit in front of a user's prefill)."""
        if self.bandwidth_interval_s <= 0:
            return
        while True:
            if self.cloud is None or not self.cloud.ready or self.busy():
                await asyncio.sleep(BUSY_RECHECK_S)
                continue
            await self.probe_bandwidth()
            self.first_probe_done = True  # measured or failed (logged): readiness never waits for a second try
            await asyncio.sleep(self.bandwidth_interval_s)

    async def rtt_loop(self) -> None:
        """Tiny round trips, busy or not: what a message costs under the load of the moment."""
        if self.rtt_interval_s <= 0:
            return
        while True:
            await asyncio.sleep(self.rtt_interval_s)
            if self.cloud is None:
                continue
            try:
                self.report_rtt(await self.cloud.measure_rtt())
            except (CloudUnavailable, CloudError) as exc:
                log.info("round-trip probe failed: %s", exc)

    async def probe_bandwidth(self) -> None:
        """Measure beta_up / beta_down with bulk probes."""
        assert self.cloud is not None  # the loops wait for it
        try:
            (up_bytes, up_s), (down_bytes, down_s), rtt_s = await self.cloud.measure_link()
        except (CloudUnavailable, CloudError) as exc:
            log.info("bandwidth probe failed: %s", exc)
            return
        self.on_transfer("up", up_bytes, up_s)
        self.on_transfer("down", down_bytes, down_s)
        self.report_rtt(rtt_s)
        log.info(
            "link probe: up %.0f KB/s, down %.0f KB/s, small-message round trip %.1f ms",
            up_bytes / up_s / 1e3,
            down_bytes / down_s / 1e3,
            rtt_s * 1e3,
        )
