"""The device's link probes: the first bulk probe gates readiness, so a fresh device's first requests are
planned from a measured link (beta_up, beta_down, round trip) rather than the planner's defaults."""

from __future__ import annotations

import asyncio

from services.device_agent.link_probes import LinkProbes
from shared.telemetry.client import TelemetryClient


class FakeCloud:
    """Answers bulk probes like the verifier connection: (up bytes, s), (down bytes, s), round trip s."""

    def __init__(self) -> None:
        self.ready = True
        self.probes = 0

    async def measure_link(self):
        self.probes += 1
        return (65536, 0.01), (65536, 0.005), 0.004


async def test_the_first_probe_is_what_readiness_waits_for() -> None:
    busy = False
    probes = LinkProbes("dev-1", TelemetryClient(None), lambda: busy, bandwidth_interval_s=30.0, rtt_interval_s=0)
    assert not probes.first_probe_done
    loop = asyncio.create_task(probes.bandwidth_loop())
    try:
        await asyncio.sleep(0.05)
        assert not probes.first_probe_done  # no connection yet: nothing measured
        cloud = FakeCloud()
        probes.cloud = cloud  # type: ignore[assignment]  # the probe reads only ready and measure_link
        for _ in range(40):
            if probes.first_probe_done:
                break
            await asyncio.sleep(0.05)
        assert probes.first_probe_done and cloud.probes == 1
        assert list(probes.recent_rtts) == [0.004]
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)


def test_a_device_that_does_not_probe_is_ready_without_it() -> None:
    probes = LinkProbes("dev-1", TelemetryClient(None), lambda: False, bandwidth_interval_s=0, rtt_interval_s=0)
    assert probes.first_probe_done
