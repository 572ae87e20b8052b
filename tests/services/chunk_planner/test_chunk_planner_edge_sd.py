"""Chunk planner's Edge SD plan: POST /edge-sd/plan from a live state monitor's GET /state/edge-sd (real
redis-server, both apps in-process over ASGI), the fallbacks when the monitor is down or says nothing usable,
the 422s, and GET /edge-sd/plan serving the latest."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from services.chunk_planner.settings import load_settings
from services.state_monitor.app import create_app as create_monitor
from shared.auth import verify as auth
from shared.auth.signing import KeyRing
from shared.edge_sd.plan_inputs import PlanDefaults
from shared.edge_sd.runtime import RuntimeModel
from shared.processes.redis_server import EmbeddedRedis, free_port
from shared.settings import SettingsError
from tests.auth_tools import bearer, jwks_server
from tests.services.chunk_planner.test_chunk_planner import MONITOR, Hang, running
from tests.services.state_monitor.test_state_monitor import fast_settings
from tests.shared.edge_sd.test_edge_sd_plan import body as plan_body

DRAFT_RUNTIME = RuntimeModel(c1=2e-12, c2=1e-3)
VERIFY_RUNTIME = RuntimeModel(c1=1e-13, c2=2e-2)
DEFAULT_SOURCES = ("alpha", "draft_runtime", "verify_runtime")


@pytest.fixture
def server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as srv:
        yield srv


@asynccontextmanager
async def live_monitor(redis_url: str) -> AsyncIterator[tuple[httpx.AsyncClient, httpx.ASGITransport]]:
    """A real state monitor on a real Redis, and the transport a planner reaches it through."""
    app = create_monitor(fast_settings(redis_url))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url=MONITOR) as client:
            yield client, transport


def edge_telemetry(count: int) -> dict[str, Any]:
    """`count` passes of each model on the runtime lines above and `count` verdicts (alpha = 3/4 by MLE)."""
    return {
        "node": "sbs-1",
        "draft": [[b, 1e8 * b, DRAFT_RUNTIME.seconds(b, 1e8 * b)] for b in range(1, count + 1)],
        "verify": [[b, 1e9 * b, VERIFY_RUNTIME.seconds(b, 1e9 * b)] for b in range(1, count + 1)],
        "verdicts": [[4, 3]] * count,
    }


def sources(answer: dict[str, Any]) -> tuple[str, ...]:
    return tuple(answer["sources"][key] for key in DEFAULT_SOURCES)


def test_settings_feed_plan_defaults() -> None:
    assert load_settings({}).edge_sd_defaults() == PlanDefaults()
    s = load_settings(
        {
            "TOPHAT_CHUNK_PLANNER_EDGE_SD_ALPHA": "0.6",
            "TOPHAT_CHUNK_PLANNER_EDGE_SD_L_MAX": "12",
            "TOPHAT_CHUNK_PLANNER_EDGE_SD_DRAFT_C1": "1e-12",
            "TOPHAT_CHUNK_PLANNER_EDGE_SD_MIN_SAMPLES": "3",
            "TOPHAT_CHUNK_PLANNER_EDGE_SD_SNR_DB": "7.5",
        }
    )
    assert s.edge_sd_defaults() == PlanDefaults(alpha=0.6, l_max=12, draft_c1=1e-12, min_samples=3, snr_db=7.5)
    for bad in (
        {"EDGE_SD_ALPHA": "1.5"},
        {"EDGE_SD_L_MAX": "0"},
        {"EDGE_SD_VERIFY_C2": "-1"},
        {"EDGE_SD_MIN_SAMPLES": "1"},
        {"EDGE_SD_SNR_DB": "nan"},
    ):
        with pytest.raises(SettingsError):
            load_settings({f"TOPHAT_CHUNK_PLANNER_{k}": v for k, v in bad.items()})


async def test_without_monitor_defaults_and_latest_plan() -> None:
    async with running(load_settings({}, edge_sd_alpha=0.7)) as client:
        resp = await client.get("/edge-sd/plan")
        assert resp.status_code == 404 and "no edge-sd plan" in resp.json()["detail"]
        resp = await client.post("/edge-sd/plan", json=plan_body())
        assert resp.status_code == 200, resp.text
        answer = resp.json()
        assert sources(answer) == ("default:no-monitor",) * 3 and answer["alpha"] == 0.7
        assert sorted(k for batch in answer["batches"] for k in batch) == list(range(len(plan_body()["tasks"])))
        assert (await client.get("/edge-sd/plan")).json() == answer
        second = (await client.post("/edge-sd/plan", json=plan_body(spec_len=2, bandwidth="uniform"))).json()
        assert second["spec_len"] == 2 and second["sources"]["shares"] == "uniform"
        assert (await client.get("/edge-sd/plan")).json() == second


async def test_plan_from_live_monitor_switches_to_telemetry(server: EmbeddedRedis) -> None:
    async with live_monitor(server.url) as (mon, transport):
        settings = load_settings({}, state_monitor_url=MONITOR, edge_sd_min_samples=4)
        async with running(settings, transport) as client:
            empty = (await client.post("/edge-sd/plan", json=plan_body())).json()
            assert sources(empty) == ("default:few-samples",) * 3
            assert (await mon.post("/edge-sd/telemetry", json=edge_telemetry(3))).json()["persisted"] is True
            few = (await client.post("/edge-sd/plan", json=plan_body())).json()
            assert sources(few) == ("default:few-samples",) * 3
            await mon.post("/edge-sd/telemetry", json=edge_telemetry(3))  # 6 samples, 3 distinct F*b: enough
            fitted = (await client.post("/edge-sd/plan", json=plan_body())).json()
    assert sources(fitted) == ("telemetry", "fitted:telemetry", "fitted:telemetry")
    assert fitted["alpha"] == pytest.approx(0.75)
    assert fitted["draft_runtime"] == pytest.approx({"c1": DRAFT_RUNTIME.c1, "c2": DRAFT_RUNTIME.c2})
    assert fitted["verify_runtime"] == pytest.approx({"c1": VERIFY_RUNTIME.c1, "c2": VERIFY_RUNTIME.c2})
    assert fitted["predicted"]["inference_s"] != empty["predicted"]["inference_s"]  # priced with what was measured


async def test_monitor_down_or_unusable_falls_back_with_the_reason(server: EmbeddedRedis) -> None:
    cases: list[tuple[str, httpx.AsyncBaseTransport | None, str]] = [
        (f"http://127.0.0.1:{free_port()}", None, "default:monitor-unreachable"),  # nothing listens
        (MONITOR, Hang(), "default:monitor-unreachable"),
        (
            MONITOR,
            httpx.MockTransport(lambda r: httpx.Response(404, json={"detail": "Not Found"})),
            "default:monitor-error",
        ),  # a monitor without the route
        (
            MONITOR,
            httpx.MockTransport(lambda r: httpx.Response(200, json={"draft": [[1, 2]]})),
            "default:bad-telemetry",
        ),
        (
            MONITOR,
            httpx.MockTransport(lambda r: httpx.Response(200, json={"verdicts": [[2, 3]]})),
            "default:bad-telemetry",
        ),
    ]
    for url, transport, reason in cases:
        async with running(load_settings({}, state_monitor_url=url, monitor_timeout_s=0.2), transport) as client:
            started = time.monotonic()
            resp = await client.post("/edge-sd/plan", json=plan_body())
            assert time.monotonic() - started < 10  # bounded by monitor_timeout_s, not Hang's 30 s
            assert resp.status_code == 200 and sources(resp.json()) == (reason,) * 3, (url, transport, resp.text)
    # a real monitor whose Redis is down answers 503
    async with live_monitor(server.url) as (_, transport):
        server.stop()
        async with running(load_settings({}, state_monitor_url=MONITOR), transport) as client:
            answer = (await client.post("/edge-sd/plan", json=plan_body())).json()
            assert sources(answer) == ("default:monitor-error",) * 3


async def test_bad_and_infeasible_requests_are_422_and_keep_the_latest() -> None:
    async with running(load_settings({})) as client:
        good = (await client.post("/edge-sd/plan", json=plan_body())).json()
        for bad in (
            plan_body(tasks=[]),
            plan_body(batching="static"),
            {"tasks": "x"},
            [1, 2],
            plan_body(draft_shape={"layers": 1}),
        ):
            resp = await client.post("/edge-sd/plan", json=bad)
            assert resp.status_code == 422 and resp.json()["error"]["code"] == "invalid_plan_request", bad
        resp = await client.post("/edge-sd/plan", content=b"{not json", headers={"content-type": "application/json"})
        assert resp.status_code == 422 and resp.json()["error"]["code"] == "invalid_plan_request"
        resp = await client.post("/edge-sd/plan", json=plan_body(memory_budget_bytes=1000))
        assert resp.status_code == 422 and resp.json()["error"]["code"] == "infeasible_batching"
        assert "memory" in resp.json()["error"]["message"]
        assert (await client.get("/edge-sd/plan")).json() == good


async def test_plan_needs_a_credential_for_the_planner_when_the_mesh_is_authenticated() -> None:
    ring = KeyRing.generate()
    async with jwks_server(ring) as issuer, running(load_settings({}, auth_issuer_url=issuer)) as client:
        assert (await client.post("/edge-sd/plan", json=plan_body())).status_code == 401
        elsewhere = bearer(ring, "sbs-1", "device", auth.VERIFIER)
        assert (await client.post("/edge-sd/plan", json=plan_body(), headers=elsewhere)).status_code == 401
        own = bearer(ring, "sbs-1", "device", auth.PLANNER)
        resp = await client.post("/edge-sd/plan", json=plan_body(), headers=own)
        assert resp.status_code == 200
