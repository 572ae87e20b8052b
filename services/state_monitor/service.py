"""The state monitor service's state: its settings, the Redis sink, the in-memory model, the device registry, the
issuer and the metrics, and the lifespan that connects the sink (restoring the model from it) and closes it.
The HTTP routes over them are in app.py."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Request

from services.state_monitor.issuer import Issuer
from services.state_monitor.monitor import Monitor
from services.state_monitor.settings import Settings
from shared.device_registry import DeviceRegistry
from shared.processes.redis_server import resolve_redis_url, with_password
from shared.telemetry import sink as tk
from shared.telemetry.metrics import MonitorMetrics

log = logging.getLogger("services.state_monitor.app")  # the name its lines were always logged under


class MonitorService:
    """What the routes share, reached as `request.app.state.service`. Redis URL = settings.redis_url, else env
    REDIS_URL, else none (in-memory only)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.redis_url = resolve_redis_url(settings.redis_url or None)
        if self.redis_url and settings.redis_password:
            self.redis_url = with_password(self.redis_url, settings.redis_password)
        self.sink = _sink(settings, self.redis_url) if self.redis_url else None
        self.monitor = Monitor(settings, self.sink)
        self.registry = DeviceRegistry(settings.announce_ttl_s)
        self.issuer = _issuer(settings, self.registry) if settings.authenticated else None
        self.metrics = MonitorMetrics()
        self.ready = False  # from the lifespan's start (the sink connected or given up on) to its end

    @asynccontextmanager
    async def lifespan(self, _app: FastAPI) -> AsyncIterator[None]:
        if self.sink is None:
            log.warning("no redis configured: state monitor keeps telemetry in memory only")
        elif await self.sink.start():
            await self.monitor.restore()
        self.ready = True
        try:
            yield
        finally:
            self.ready = False
            if self.sink is not None:
                await self.sink.close()

    async def redis_lists(self, keys: list[str], limit: int, what: str) -> list[list[str]]:
        """The newest `limit` values of each Redis list in `keys`; 503 when Redis is not configured or not
        reachable, saying that `what` lives there."""
        lists = await self.sink.read_lists(keys, limit) if self.sink is not None else None
        if lists is None:
            reason = "not configured" if self.sink is None else f"unreachable at {tk.redact_url(self.sink.url)}"
            raise HTTPException(503, f"{what} lives in redis, which is {reason}")
        return lists

    def redis_status(self) -> dict[str, Any]:
        """/readyz's view of the sink (the URL without its password)."""
        sink = self.sink
        return {
            "configured": sink is not None,
            "connected": bool(sink and sink.connected),
            "url": tk.redact_url(self.redis_url) if self.redis_url else None,
            "dropped": sink.dropped if sink else 0,
        }


def _sink(settings: Settings, url: str) -> tk.TelemetrySink:
    return tk.TelemetrySink(
        url,
        stream_maxlen=settings.stream_maxlen,
        timeout_s=settings.redis_timeout_s,
        request_ttl_s=settings.request_ttl_s,
        initial_backoff_s=settings.redis_backoff_initial_s,
        max_backoff_s=settings.redis_backoff_max_s,
    )


def _issuer(settings: Settings, registry: DeviceRegistry) -> Issuer:
    return Issuer.from_key_file(
        Path(settings.auth_key_file),
        registry,
        state_dir=Path(settings.auth_state_dir) if settings.auth_state_dir else None,
        leeway_s=settings.auth_leeway_s,
        device_ttl_s=settings.device_credential_ttl_s,
        service_ttl_s=settings.service_credential_ttl_s,
        access_ttl_s=settings.access_token_ttl_s,
        max_ttl_s=settings.max_token_ttl_s,
    )


def service_of(request: Request) -> MonitorService:
    """The route's dependency: the service create_app put on its app."""
    service: MonitorService = request.app.state.service
    return service
