"""The chunk planner's state: its settings, the monitor client (opened by the app's lifespan), the issuer's keys and
their refresher, the metrics, and the latest Edge SD plan. One per app, on `app.state.planner`; the routes
(routes.py) read it from there."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request

from services.chunk_planner.monitor_client import NO_MONITOR, MonitorClient, Telemetry
from services.chunk_planner.settings import Settings
from shared.auth import client as auth_client
from shared.auth.tls import client_context
from shared.auth.verify import TokenVerifier
from shared.telemetry.metrics import PlannerMetrics

log = logging.getLogger(__name__)


class PlannerState:
    """What the planner's requests share; `monitor_transport` (tests) replaces the network under the monitor
    client."""

    def __init__(self, settings: Settings, monitor_transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.settings = settings
        self.monitor_transport = monitor_transport
        self.monitor: MonitorClient | None = None
        self.metrics = PlannerMetrics()
        self.edge_sd_defaults = settings.edge_sd_defaults()
        self.latest_edge_sd_plan: dict[str, Any] | None = None
        self.ready = False
        # Callers are checked with the issuer's public keys, re-read by `trust_refresher` (None, None: open).
        trust, trust_refresher = auth_client.trust_for(settings, client_context(settings.tls_ca))
        self.trust: TokenVerifier | None = trust
        self.trust_refresher: auth_client.TrustRefresher | None = trust_refresher

    async def telemetry(self, device_id: str) -> Telemetry:
        return NO_MONITOR if self.monitor is None else await self.monitor.fetch(device_id)

    def open_monitor(self) -> None:
        s = self.settings
        if s.state_monitor_url:
            self.monitor = MonitorClient(
                s.state_monitor_url, s.monitor_timeout_s, self.monitor_transport, verify=client_context(s.tls_ca)
            )
        else:
            log.warning("no state_monitor_url: chunk sizes and draft steps are fixed defaults")

    async def close_monitor(self) -> None:
        if self.monitor is not None:
            await self.monitor.aclose()
            self.monitor = None

    async def refresh_trust(self) -> asyncio.Task[None] | None:
        """The issuer's keys read once (bounded by its timeout), then the loop that keeps them fresh."""
        if self.trust_refresher is None:
            return None
        await self.trust_refresher.refresh()  # ready with the issuer's keys when it is up
        return asyncio.create_task(self.trust_refresher.run(), name="auth-trust")

    @asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        self.open_monitor()
        refreshing = await self.refresh_trust()
        self.ready = True
        try:
            yield
        finally:
            self.ready = False
            if refreshing is not None:
                refreshing.cancel()
                await asyncio.gather(refreshing, return_exceptions=True)
            await self.close_monitor()


def planner_of(request: Request) -> PlannerState:
    """The planner's state for a route (a `Depends`)."""
    state: PlannerState = request.app.state.planner
    return state
