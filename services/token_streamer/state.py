"""The token streamer's state: its settings, the clients it calls devices and the monitor with, the queue,
the metrics and its background loops (device health, discovery, DiSCo's history). One per app, on
`app.state.streamer`; the routes (routes.py) read it from there, and its `lifespan` is the app's."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI
from starlette.requests import HTTPConnection

from services.token_streamer.admission import Admission
from services.token_streamer.console import Console
from services.token_streamer.disco import DiscoController
from services.token_streamer.dispatcher import Dispatcher
from services.token_streamer.outline import OutlineFlow
from services.token_streamer.router import Router
from services.token_streamer.settings import Settings
from services.token_streamer.starter import RequestStarter
from shared.auth import client as auth_client
from shared.auth import verify as auth
from shared.auth.tls import client_context
from shared.telemetry.client import TelemetryClient
from shared.telemetry.metrics import StreamerMetrics

log = logging.getLogger(__name__)


def device_client(s: Settings, device_auth: httpx.Auth | None) -> httpx.AsyncClient:
    """The one client for device agents (and the console's calls): its read timeout outlasts the longest
    wait for a token, so the dispatcher's own bounds are the ones that fire."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(
            connect=s.connect_timeout_s,
            pool=s.connect_timeout_s,
            write=s.connect_timeout_s,
            read=max(s.first_byte_timeout_s, s.line_timeout_s) + 1.0,
        ),
        limits=httpx.Limits(max_connections=1000, max_keepalive_connections=64),
        trust_env=False,
        verify=client_context(s.tls_ca),  # https:// device agents: the mesh's CA
        auth=device_auth,
    )  # device agents answer /generate and /info to a service token for them only


class StreamerState:
    """Everything a request of the streamer reaches, built once from the settings."""

    def __init__(self, s: Settings) -> None:
        self.settings = s
        self.router = Router(s.device_url_list, down_s=s.device_down_s)
        # Its service credential buys, from the issuer, a token per device agent it calls (that device's audience
        # only: replayed at another device or the monitor it is refused) and one for the monitor (telemetry).
        self.broker = auth_client.broker_for(s, verify=client_context(s.tls_ca))
        broker = self.broker
        device_auth = (
            auth_client.BrokerAuth(broker, audiences={s.state_monitor_url: auth.ISSUER}, devices=True)
            if broker
            else None
        )
        self.client = device_client(s, device_auth)
        self.admission = Admission(self.router, max_waiting=s.queue_max_waiting, timeout_s=s.queue_timeout_s)
        self.dispatcher = Dispatcher(
            self.admission,
            self.client,
            first_byte_timeout_s=s.first_byte_timeout_s,
            line_timeout_s=s.line_timeout_s,
            probe_timeout_s=s.probe_timeout_s,
        )
        self.telemetry = TelemetryClient(
            s.state_monitor_url or None,
            timeout_s=s.telemetry_timeout_s,
            verify=client_context(s.tls_ca),
            auth=auth_client.BrokerAuth(broker, auth.ISSUER) if broker else None,
        )
        admission = self.admission
        self.metrics = StreamerMetrics(running=lambda: admission.running, waiting=lambda: admission.waiting)
        self.telemetry.count_into(self.metrics.registry)  # its drops show on /metrics
        self.disco = DiscoController(s, self.client)
        outlines = OutlineFlow(
            self.dispatcher,
            self.client,
            wait_timeout_s=s.first_byte_timeout_s + s.line_timeout_s,
            probe_timeout_s=s.probe_timeout_s,
        )
        self.console = Console(s, self.router, self.client) if s.console else None
        history = self.console.history if self.console else None
        self.starter = RequestStarter(s, self.dispatcher, outlines, self.disco, self.telemetry, self.metrics, history)
        self.started_at = int(time.time())

    async def health_loop(self) -> None:
        while True:
            try:
                await self.dispatcher.probe_all()
            except Exception:  # a supervision loop must survive bugs in one probe round
                log.exception("device health probe failed")
            await asyncio.sleep(self.settings.health_interval_s)

    async def discovery_loop(self) -> None:
        while True:
            try:
                if await self.dispatcher.discover(self.settings.state_monitor_url):
                    await self.dispatcher.probe_all()  # learn new devices' ids and capacity before routing to them
            except Exception:  # a supervision loop must survive bugs in one discovery round
                log.exception("device discovery failed")
            await asyncio.sleep(self.settings.discovery_interval_s)

    def background_loops(self) -> dict[str, Coroutine[Any, Any, None]]:
        """The loops this configuration runs, by task name."""
        s = self.settings
        loops: dict[str, Coroutine[Any, Any, None]] = {}
        if s.health_interval_s > 0:
            loops["device-health"] = self.health_loop()
        if s.discovers_devices:
            loops["device-discovery"] = self.discovery_loop()
        if s.state_monitor_url:  # DiSCo's history: any request may ask for a dispatch policy
            loops["disco-history"] = self.disco.refresh_loop()
        return loops

    def say_where_devices_come_from(self) -> None:
        s = self.settings
        if s.discovers_devices:
            log.info("discovering device agents from the state monitor at %s", s.state_monitor_url)
        elif not self.router.devices:
            log.warning(
                "no device agents configured (TOPHAT_STREAMER_DEVICE_URLS, or a state monitor to discover "
                "them from); every request will get 503"
            )

    async def aclose(self) -> None:
        await self.telemetry.aclose()
        await self.client.aclose()
        if self.broker is not None:
            await self.broker.aclose()

    @asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        self.say_where_devices_come_from()
        tasks = [asyncio.create_task(loop, name=name) for name, loop in self.background_loops().items()]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.aclose()


def streamer_of(connection: HTTPConnection) -> StreamerState:
    """The streamer's state for a route (a `Depends`), HTTP or WebSocket alike."""
    state: StreamerState = connection.app.state.streamer
    return state
