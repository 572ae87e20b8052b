"""The web console the streamer serves: its page at GET /, its assets, and the JSON it polls.

The page and its assets (console_static/: plain HTML, CSS and JavaScript, no build step) hold no data and
are served to anyone, like /healthz: a browser fetches them before it can send a key. Everything with data
in it, GET /console/mesh and /console/history, sits behind the API key like every other route (limits.py),
and the page's chat goes through /v1/chat/completions with the same key.

/console/mesh gathers, at most once per `console_refresh_s` whoever asks, each device agent's GET /info
and the state monitor's /state/devices and /state/cloud, each call bounded by `probe_timeout_s`, and
hands them to shared/console/mesh.py; a part that does not answer in time shows as unknown, never stalls
the page. Each gathering also adds a point to the load history (shared/console/history.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from importlib import resources
from typing import Any

import httpx
from fastapi import FastAPI, HTTPException, Query
from fastapi.responses import HTMLResponse, Response

from services.token_streamer.router import Router
from services.token_streamer.settings import Settings
from shared.console.history import ConsoleHistory
from shared.console.mesh import mesh_view

log = logging.getLogger(__name__)

STATIC = "console_static"
ASSET_TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}
ASSET_PREFIX = "/console/static/"
PAGE_PATH = "/"


def is_public(path: str) -> bool:
    """The page and its assets: no data, so no key (the gate lets them through)."""
    return path == PAGE_PATH or path.startswith(ASSET_PREFIX)


def read_assets() -> dict[str, bytes]:
    """Every file of console_static/ by name, read once from the installed package."""
    folder = resources.files("services.token_streamer").joinpath(STATIC)
    return {entry.name: entry.read_bytes() for entry in folder.iterdir() if entry.is_file()}


class Console:
    """The console's state in the streamer: its history, the last gathering and what each device said."""

    def __init__(self, settings: Settings, router: Router, client: httpx.AsyncClient) -> None:
        self.settings = settings
        self.router = router
        self.client = client
        self.history = ConsoleHistory(settings.console_history_s)
        self.infos: dict[str, dict[str, Any] | None] = {}
        self.seen_at: dict[str, float] = {}  # device URL -> unix s of its last /info answer
        self._view: dict[str, Any] | None = None
        self._gathered = float("-inf")  # monotonic
        self._lock = asyncio.Lock()

    async def _get(self, url: str) -> Any:
        """GET `url`'s JSON within probe_timeout_s; None when it does not answer, fails or is not JSON."""
        try:
            async with asyncio.timeout(self.settings.probe_timeout_s):
                response = await self.client.get(url)
            response.raise_for_status()
            return response.json()
        except (httpx.HTTPError, TimeoutError, ValueError) as exc:
            log.debug("console: GET %s failed: %r", url, exc)
            return None

    async def _info(self, url: str) -> None:
        info = await self._get(f"{url}/info")
        self.infos[url] = info if isinstance(info, dict) else None
        if self.infos[url] is not None:
            self.seen_at[url] = time.time()

    async def _monitor(self) -> tuple[Any, Any, str]:
        base = self.settings.state_monitor_url.rstrip("/")
        if not base:
            return None, None, "not configured"
        devices, cloud = await asyncio.gather(self._get(f"{base}/state/devices"), self._get(f"{base}/state/cloud"))
        listed = devices.get("devices") if isinstance(devices, dict) else None
        ok = isinstance(listed, list) and isinstance(cloud, dict)
        return listed, cloud if isinstance(cloud, dict) else None, "ok" if ok else "unreachable"

    async def mesh(self) -> dict[str, Any]:
        """The mesh's rows, gathered again when the last gathering is older than console_refresh_s."""
        async with self._lock:  # callers at once share one gathering
            if self._view is not None and time.monotonic() - self._gathered < self.settings.console_refresh_s:
                return self._view
            routed = self.router.snapshot()
            live = {row["url"] for row in routed}
            for url in set(self.infos) - live:  # devices no longer routed to are forgotten
                self.infos.pop(url, None)
                self.seen_at.pop(url, None)
            (devices, cloud, monitor), *_ = await asyncio.gather(self._monitor(), *map(self._info, sorted(live)))
            now = time.time()
            accept = self.history.mean_accept(now)
            view = mesh_view(routed, self.infos, self.seen_at, devices, cloud, accept, now, monitor)
            verifier = view["verifiers"][0] if view["verifiers"] else {}
            self.history.load_seen(
                now,
                verifier.get("rows_per_step"),
                verifier.get("sessions"),
                verifier.get("step_ms"),
                {row["device_id"] or row["url"]: row["draft_shape"] for row in view["devices"]},
            )
            self._view, self._gathered = view, time.monotonic()
            return view


def install(app: FastAPI, console: Console) -> None:
    """GET / (the page), /console/static/<asset>, /console/mesh and /console/history on `app`."""
    assets = read_assets()
    page = assets.get("index.html", b"")

    @app.get(PAGE_PATH, include_in_schema=False)
    async def console_page() -> HTMLResponse:
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    @app.get(ASSET_PREFIX + "{name}", include_in_schema=False)
    async def console_asset(name: str) -> Response:
        suffix = name[name.rfind(".") :] if "." in name else ""
        if name not in assets or suffix not in ASSET_TYPES:
            raise HTTPException(404, f"no console asset {name!r}")
        return Response(assets[name], media_type=ASSET_TYPES[suffix], headers={"Cache-Control": "no-cache"})

    @app.get("/console/mesh")
    async def console_mesh() -> dict[str, Any]:
        """Every device and verifier row (behind the API key)."""
        return await console.mesh()

    @app.get("/console/history")
    async def console_history(since: float = Query(0.0, ge=0.0, allow_inf_nan=False)) -> dict[str, Any]:
        """The requests and load points newer than `since` (unix s), within console_history_s."""
        return console.history.to_dict(time.time(), since)
