"""The device agent service's state: its settings, its agent once the model is loaded, the callers' trust, and
the lifespan that loads the agent and runs the background loops beside its HTTP API (app.py)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import torch
from fastapi import FastAPI, Request

from services.device_agent.agent import DeviceAgent
from services.device_agent.announce import announce_loop, own_url
from services.device_agent.settings import Settings
from shared.auth import client as auth_client
from shared.auth.client import TrustRefresher
from shared.auth.tls import client_context
from shared.auth.verify import TokenVerifier

log = logging.getLogger("services.device_agent")


class DeviceService:
    """What the routes share, reached as `request.app.state.service`. `agent` is None until the lifespan has
    loaded the model (or taken the one given to create_app): /readyz answers "starting" until then."""

    def __init__(self, settings: Settings, agent: DeviceAgent | None = None) -> None:
        self.settings = settings
        self.agent: DeviceAgent | None = None
        self._given = agent
        # Callers of /generate and /info are checked with the issuer's public keys, re-read by `trust_refresher`.
        self.trust: TokenVerifier | None
        self.trust_refresher: TrustRefresher | None
        self.trust, self.trust_refresher = auth_client.trust_for(settings, client_context(settings.tls_ca))

    @property
    def loaded(self) -> DeviceAgent:
        """The agent, for the routes that need the model (the probes answer before it loads)."""
        if self.agent is None:
            raise RuntimeError("the device agent's model is still loading")
        return self.agent

    @asynccontextmanager
    async def lifespan(self, _app: FastAPI) -> AsyncIterator[None]:
        settings = self.settings
        torch.set_num_threads(settings.torch_threads)
        agent = self._given if self._given is not None else await asyncio.to_thread(DeviceAgent, settings)
        self.agent = agent
        log.info(
            "device agent %s ready (model %s, m=%d, speculative=%s, mode %s)",
            settings.device_id,
            settings.model_dir,
            settings.split_layers,
            settings.speculative,
            settings.mode,
        )
        tasks = self._background_tasks(agent)
        if agent.plans is not None:
            agent.plans.refresh()  # the first plan, fetched before the first request needs it
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await agent.aclose()

    def _background_tasks(self, agent: DeviceAgent) -> list[asyncio.Task]:
        """The loops that run while the agent serves: readiness and link probes, kept-session expiry, and those
        its configuration asks for (auth trust refresh, edge SD rounds, announcing to the state monitor)."""
        tasks = [
            asyncio.create_task(agent.readiness_loop(), name="verifier-readiness"),
            asyncio.create_task(agent.probes.bandwidth_loop(), name="bandwidth-probe"),
            asyncio.create_task(agent.probes.rtt_loop(), name="rtt-probe"),
            asyncio.create_task(agent.kept.cleanup_loop(), name="kept-sessions"),
        ]
        if self.trust_refresher is not None:
            tasks.append(asyncio.create_task(self.trust_refresher.run(), name="auth-trust"))
        if agent.edge is not None:
            tasks.append(asyncio.create_task(agent.edge.run(), name="edge-sd-rounds"))
        settings = self.settings
        if settings.state_monitor_url and settings.announce_interval_s > 0:
            announcing = announce_loop(
                agent.http,
                settings.state_monitor_url,
                settings.device_id,
                own_url(settings),
                settings.max_sessions,
                settings.announce_interval_s,
            )
            tasks.append(asyncio.create_task(announcing, name="announce"))
        return tasks


def service_of(request: Request) -> DeviceService:
    """The route's dependency: the service create_app put on its app."""
    service: DeviceService = request.app.state.service
    return service
