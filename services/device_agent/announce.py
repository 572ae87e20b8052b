"""The agent's announcement loop: tell the state monitor where this device serves.

The token streamer discovers devices from the monitor's `GET /devices`
(shared/device_registry.py), so a deployment needs no list of device addresses.
An announcement that fails (monitor restarting, network blip) is retried on the
next tick; the monitor forgets an agent that has been silent for its TTL.
"""

from __future__ import annotations

import asyncio
import logging

import httpx

from services.device_agent.settings import Settings
from shared.device_registry import advertised_url

log = logging.getLogger("services.device_agent")


def own_url(settings: Settings) -> str:
    """The URL this agent announces and enrolls with: where the streamer reaches it."""
    url = advertised_url(settings.advertise_url, settings.host, settings.port, route_to=settings.state_monitor_url)
    if settings.tls_cert and not settings.advertise_url:  # this agent serves only https
        url = "https://" + url.removeprefix("http://")
    return url


async def announce_loop(
    client: httpx.AsyncClient, monitor_url: str, device_id: str, url: str, max_sessions: int, interval_s: float
) -> None:
    body = {"device_id": device_id, "url": url, "max_sessions": max_sessions}
    failing = False
    while True:
        try:
            response = await client.post(f"{monitor_url.rstrip('/')}/devices/announce", json=body)
            response.raise_for_status()
            if failing:
                log.info("announcing to %s again", monitor_url)
            failing = False
        except httpx.HTTPError as exc:  # covers timeouts (the client's) and 4xx/5xx answers
            if not failing:
                log.warning("cannot announce %s at %s to %s: %s", device_id, url, monitor_url, exc)
            failing = True
        await asyncio.sleep(interval_s)
