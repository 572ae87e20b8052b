"""Chunk planner: how many prompt tokens a device uploads per prefill chunk (HAT §3.3).

For now the answer is a fixed default. `plan_chunk_size` is the single place
that decides, so HAT's eq. 3 (X·A/β_up = (g(μ) + g(μ+X)) / P, from the state
monitor's telemetry) can replace it without touching the HTTP layer.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from services.chunk_planner.settings import Settings, load_settings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChunkPlan:
    chunk_size: int
    source: str  # "default" now; e.g. "eq3" once telemetry drives it


def plan_chunk_size(settings: Settings, device_id: str, prompt_tokens: int) -> ChunkPlan:
    """The chunk size for one prompt: the default clamped to [min, max], and never above the prompt.

    `device_id` is unused until eq. 3 needs that device's uplink bandwidth β_up.
    """
    size = min(max(settings.default_chunk_size, settings.min_chunk_size), settings.max_chunk_size)
    return ChunkPlan(chunk_size=min(size, prompt_tokens), source="default")


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or load_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.ready = True
        try:
            yield
        finally:
            app.state.ready = False

    app = FastAPI(title="tophat chunk planner", lifespan=lifespan)
    app.state.ready = False

    @app.exception_handler(RequestValidationError)
    async def on_invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        detail = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in exc.errors()[:3])
        return JSONResponse({"error": {"message": detail or "invalid request", "type": "invalid_request_error",
                                       "code": "invalid_request"}}, status_code=400)

    @app.get("/chunk-size")
    async def chunk_size(
        device_id: Annotated[str, Query(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.\-]+$")],
        prompt_tokens: Annotated[int, Query(ge=1, le=10_000_000)],
    ) -> dict[str, Any]:
        plan = plan_chunk_size(settings, device_id, prompt_tokens)
        return {"chunk_size": plan.chunk_size, "source": plan.source}

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz(request: Request) -> JSONResponse:
        ready = bool(request.app.state.ready)
        return JSONResponse({"ready": ready}, status_code=200 if ready else 503)

    return app
