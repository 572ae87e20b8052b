"""Chunk planner: the fixed-default policy and its HTTP contract (in-process ASGI)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest

from services.chunk_planner import Settings, create_app, load_settings, plan_chunk_size
from shared.settings import SettingsError


@asynccontextmanager
async def running(settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://planner") as client:
            yield client


def test_plan_clamps_default_to_bounds_and_prompt() -> None:
    s = load_settings({})
    assert (s.port, s.default_chunk_size, s.min_chunk_size, s.max_chunk_size) == (8010, 128, 16, 1024)
    assert plan_chunk_size(s, "d", 1000).chunk_size == 128
    assert plan_chunk_size(s, "d", 50).chunk_size == 50          # never more than the prompt
    assert plan_chunk_size(s, "d", 3).chunk_size == 3            # even below min: the whole prompt
    assert plan_chunk_size(load_settings({}, default_chunk_size=4), "d", 1000).chunk_size == 16
    assert plan_chunk_size(load_settings({}, default_chunk_size=5000), "d", 9000).chunk_size == 1024
    assert plan_chunk_size(s, "d", 1000).source == "default"


def test_settings_from_env_and_validation() -> None:
    s = load_settings({"TOPHAT_CHUNK_PLANNER_DEFAULT_CHUNK_SIZE": "256", "TOPHAT_CHUNK_PLANNER_PORT": "9010"})
    assert (s.default_chunk_size, s.port) == (256, 9010)
    with pytest.raises(SettingsError):
        load_settings({"TOPHAT_CHUNK_PLANNER_MIN_CHUNK_SIZE": "64", "TOPHAT_CHUNK_PLANNER_MAX_CHUNK_SIZE": "32"})
    with pytest.raises(SettingsError):
        load_settings({"TOPHAT_CHUNK_PLANNER_MIN_CHUNK_SIZE": "0"})


async def test_chunk_size_endpoint() -> None:
    async with running(load_settings({}, default_chunk_size=256)) as client:
        resp = await client.get("/chunk-size", params={"device_id": "jetson-1", "prompt_tokens": 900})
        assert resp.status_code == 200 and resp.json() == {"chunk_size": 256, "source": "default"}
        resp = await client.get("/chunk-size", params={"device_id": "jetson-1", "prompt_tokens": 40})
        assert resp.json() == {"chunk_size": 40, "source": "default"}
        for params in ({"prompt_tokens": 10}, {"device_id": "d"}, {"device_id": "d", "prompt_tokens": 0},
                       {"device_id": "d", "prompt_tokens": "many"}, {"device_id": "bad id!", "prompt_tokens": 5}):
            resp = await client.get("/chunk-size", params=params)
            assert resp.status_code == 400, params
            assert resp.json()["error"]["type"] == "invalid_request_error"
        assert (await client.get("/healthz")).json() == {"status": "ok"}
        assert (await client.get("/readyz")).status_code == 200
