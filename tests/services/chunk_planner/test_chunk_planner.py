"""Chunk planner service: eq. 3 / eq. 6 from a live state monitor, fallbacks, HTTP contract (in-process ASGI)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from services.chunk_planner.app import create_app
from services.chunk_planner.monitor_client import Telemetry
from services.chunk_planner.plans import plan_chunk_size, plan_parallel_draft_steps, planner_inputs
from services.chunk_planner.settings import Settings, load_settings
from services.state_monitor.app import create_app as create_monitor
from services.state_monitor.settings import load_settings as load_monitor_settings
from shared.planning.compute_delay import ComputeDelayPredictor
from shared.planning.monitor_plans import plan_draft_steps_from_state, plan_from_state
from shared.planning.planners import chunk_size_eq3, hidden_bytes_per_token, parallel_draft_steps_eq6
from shared.processes.redis_server import free_port
from shared.settings import SettingsError

MONITOR = "http://monitor"
STEPS = [(64, 0.02), (512, 0.06), (8, 0.01), (128, 0.03)]
# jetson-1: 8192 B up in 10 ms (819.2 kB/s), down in 5 ms, 4 ms per draft step
JETSON = [
    {"kind": "device_draft", "device_id": "jetson-1", "step_s": 0.004},
    {"kind": "device_transfer", "device_id": "jetson-1", "direction": "up", "bytes": 8192, "seconds": 0.01},
    {"kind": "device_transfer", "device_id": "jetson-1", "direction": "down", "bytes": 8192, "seconds": 0.005},
]


@pytest.fixture(autouse=True)
def _no_redis(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REDIS_URL", raising=False)  # the monitor keeps its state in memory


@asynccontextmanager
async def running(
    settings: Settings, transport: httpx.AsyncBaseTransport | None = None
) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(settings, monitor_transport=transport)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://planner") as client:
            yield client


@asynccontextmanager
async def monitor() -> AsyncIterator[tuple[httpx.AsyncClient, httpx.ASGITransport]]:
    """A real state monitor (in memory), and the transport a planner reaches it through."""
    app = create_monitor(load_monitor_settings({}, redis_url=""))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url=MONITOR) as client:
            yield client, transport


async def post(client: httpx.AsyncClient, records: list[dict[str, Any]]) -> None:
    resp = await client.post("/telemetry", json=records)
    assert resp.status_code == 200, resp.text


def steps_records(steps: list[tuple[int, float]]) -> list[dict[str, Any]]:
    return [{"kind": "verifier_step", "batched_tokens": m, "compute_s": eta} for m, eta in steps]


def planner_settings(**kw: Any) -> Settings:
    return load_settings({}, state_monitor_url=MONITOR, **kw)


def plan(answer: dict[str, Any]) -> dict[str, Any]:
    """An answer without the inputs it echoes (A and P)."""
    return {k: v for k, v in answer.items() if k not in ("bytes_per_token", "stages")}


# -- defaults without a monitor ----------------------------------------------------------------


def test_plan_clamps_default_to_bounds_and_prompt() -> None:
    s = load_settings({})
    assert (s.port, s.default_chunk_size, s.min_chunk_size, s.max_chunk_size) == (8010, 128, 16, 1024)
    # No hidden size of its own: A (bytes per token) is the caller's to say.
    assert (s.pipeline_stages, s.hidden_size, s.wire_dtype_bytes, s.stale_after_s) == (1, 0, 2, 30.0)
    assert plan_chunk_size(s, "d", 1000).chunk_size == 128
    assert plan_chunk_size(s, "d", 50).chunk_size == 50  # never more than the prompt
    assert plan_chunk_size(s, "d", 3).chunk_size == 3  # even below min: the whole prompt
    assert plan_chunk_size(load_settings({}, default_chunk_size=4), "d", 1000).chunk_size == 16
    assert plan_chunk_size(load_settings({}, default_chunk_size=5000), "d", 9000).chunk_size == 1024
    assert plan_chunk_size(s, "d", 1000).source == "default:no-monitor"
    assert plan_parallel_draft_steps(s, "d", 8).steps == 2
    failed = Telemetry(failure="monitor-unreachable")
    assert plan_chunk_size(s, "d", 1000, failed).source == "default:monitor-unreachable"
    assert plan_parallel_draft_steps(s, "d", 8, failed).source == "default:monitor-unreachable"


def test_settings_from_env_and_validation() -> None:
    s = load_settings(
        {
            "TOPHAT_CHUNK_PLANNER_DEFAULT_CHUNK_SIZE": "256",
            "TOPHAT_CHUNK_PLANNER_PORT": "9010",
            "TOPHAT_CHUNK_PLANNER_PIPELINE_STAGES": "4",
            "TOPHAT_CHUNK_PLANNER_HIDDEN_SIZE": "4096",
        }
    )
    assert (s.default_chunk_size, s.port, s.pipeline_stages) == (256, 9010, 4)
    assert planner_inputs(s).bytes_per_token == hidden_bytes_per_token(4096, 2)
    for bad in (
        {"MIN_CHUNK_SIZE": "64", "MAX_CHUNK_SIZE": "32"},
        {"MIN_CHUNK_SIZE": "0"},
        {"PIPELINE_STAGES": "0"},
        {"STALE_AFTER_S": "0"},
        {"MONITOR_TIMEOUT_S": "-1"},
        {"DEFAULT_PARALLEL_DRAFT_STEPS": "20", "MAX_PARALLEL_DRAFT_STEPS": "8"},
    ):
        with pytest.raises(SettingsError):
            load_settings({f"TOPHAT_CHUNK_PLANNER_{k}": v for k, v in bad.items()})


async def test_endpoints_without_monitor() -> None:
    async with running(load_settings({}, default_chunk_size=256)) as client:
        resp = await client.get("/chunk-size", params={"device_id": "jetson-1", "prompt_tokens": 900})
        assert resp.status_code == 200 and plan(resp.json()) == {"chunk_size": 256, "source": "default:no-monitor"}
        resp = await client.get("/chunk-size", params={"device_id": "jetson-1", "prompt_tokens": 40})
        assert plan(resp.json()) == {"chunk_size": 40, "source": "default:no-monitor"}
        resp = await client.get("/parallel-draft-steps", params={"device_id": "jetson-1", "draft_len": 8})
        assert plan(resp.json()) == {"steps": 2, "source": "default:no-monitor"}
        for path, params in [
            ("/chunk-size", {"prompt_tokens": 10}),
            ("/chunk-size", {"device_id": "d"}),
            ("/chunk-size", {"device_id": "d", "prompt_tokens": 0}),
            ("/chunk-size", {"device_id": "d", "prompt_tokens": "many"}),
            ("/chunk-size", {"device_id": "bad id!", "prompt_tokens": 5}),
            ("/parallel-draft-steps", {"device_id": "d", "draft_len": -1}),
            ("/parallel-draft-steps", {"device_id": "d"}),
            ("/parallel-draft-steps", {"device_id": "../x", "draft_len": 1}),
        ]:
            resp = await client.get(path, params=params)
            assert resp.status_code == 400, (path, params)
            assert resp.json()["error"]["type"] == "invalid_request_error"
        assert (await client.get("/healthz")).json() == {"status": "ok"}
        assert (await client.get("/readyz")).status_code == 200


# -- eq. 3 / eq. 6 from a live monitor ---------------------------------------------------------


async def test_eq3_and_eq6_from_live_monitor() -> None:
    async with monitor() as (mon, transport):
        await post(mon, steps_records(STEPS) + JETSON)
        cloud = (await mon.get("/state/cloud")).json()
        device = (await mon.get("/state/device/jetson-1")).json()

        # the same observations, folded independently of the monitor's JSON
        g = ComputeDelayPredictor()
        for m, eta in STEPS:
            g.observe(m, eta)

        def g_fn(m: float) -> float:
            return g.predict(m) or 0.0

        mu = cloud["mu"]
        a = hidden_bytes_per_token(256, 2)
        for stages in (1, 4):
            settings = planner_settings(pipeline_stages=stages)
            async with running(settings, transport) as client:
                got = (
                    await client.get(
                        "/chunk-size", params={"device_id": "jetson-1", "prompt_tokens": 5000, "bytes_per_token": a}
                    )
                ).json()
                want = chunk_size_eq3(a, 819_200.0, g_fn, mu, stages, 16, 1024, 5000)
                assert got == {"chunk_size": want, "source": "eq3", "bytes_per_token": a, "stages": stages}
                assert (want, "eq3") == plan_from_state(cloud, device, planner_inputs(settings, a), 5000)
                assert 16 < want < 1024  # interior: the equation, not a bound, decided
                if stages == 1:
                    p1 = want
                else:
                    assert want < p1  # a longer pipeline hides less upload: smaller chunks

                short = (
                    await client.get(
                        "/chunk-size", params={"device_id": "jetson-1", "prompt_tokens": 10, "bytes_per_token": a}
                    )
                ).json()
                assert (short["chunk_size"], short["source"]) == (10, "eq3")

                got = (
                    await client.get(
                        "/parallel-draft-steps", params={"device_id": "jetson-1", "draft_len": 8, "bytes_per_token": a}
                    )
                ).json()
                want_steps = parallel_draft_steps_eq6(8, a, 819_200.0, 1_638_400.0, g_fn(mu), 0.004, 16)
                assert got == {"steps": want_steps, "source": "eq6", "bytes_per_token": a, "stages": stages}
                assert (want_steps, "eq6") == plan_draft_steps_from_state(cloud, device, planner_inputs(settings, a), 8)
                assert 0 < want_steps < 16


async def test_fallbacks_with_live_monitor() -> None:
    async with monitor() as (mon, transport):
        async with running(planner_settings(hidden_size=256), transport) as client:

            async def chunk(device: str) -> dict[str, Any]:
                return plan(
                    (await client.get("/chunk-size", params={"device_id": device, "prompt_tokens": 900})).json()
                )

            async def steps(device: str) -> dict[str, Any]:
                return plan(
                    (await client.get("/parallel-draft-steps", params={"device_id": device, "draft_len": 8})).json()
                )

            # nothing reported yet: unknown device (404) and no g(mu)
            assert await chunk("jetson-1") == {"chunk_size": 128, "source": "default:no-telemetry"}
            assert await steps("jetson-1") == {"steps": 2, "source": "default:no-telemetry"}
            await post(mon, JETSON)  # device known, cloud still silent
            assert await chunk("jetson-1") == {"chunk_size": 128, "source": "default:no-telemetry"}
            await post(mon, steps_records(STEPS))
            assert (await chunk("jetson-1"))["source"] == "eq3"
            assert await chunk("jetson-2") == {"chunk_size": 128, "source": "default:no-telemetry"}
            # only a draft time: no bandwidth for eq. 3 / eq. 6
            await post(mon, [{**JETSON[0], "device_id": "jetson-2"}])
            assert await chunk("jetson-2") == {"chunk_size": 128, "source": "default:missing-beta"}
            assert await steps("jetson-2") == {"steps": 2, "source": "default:missing-beta"}
            # only transfers: eq. 3 works, eq. 6 lacks gamma
            await post(mon, [{**r, "device_id": "jetson-3"} for r in JETSON[1:]])
            assert (await chunk("jetson-3"))["source"] == "eq3"
            assert await steps("jetson-3") == {"steps": 2, "source": "default:missing-gamma"}

        async with running(planner_settings(stale_after_s=0.01, hidden_size=256), transport) as client:
            await asyncio.sleep(0.05)
            resp = await client.get("/chunk-size", params={"device_id": "jetson-1", "prompt_tokens": 900})
            assert plan(resp.json()) == {"chunk_size": 128, "source": "default:stale"}
            resp = await client.get("/parallel-draft-steps", params={"device_id": "jetson-1", "draft_len": 8})
            assert plan(resp.json()) == {"steps": 2, "source": "default:stale"}


class Hang(httpx.AsyncBaseTransport):
    """A monitor that accepts the request and never answers."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(30)
        raise AssertionError("the planner should have given up")


async def test_unreachable_or_broken_monitor() -> None:
    cases: list[tuple[str, httpx.AsyncBaseTransport | None, str]] = [
        (f"http://127.0.0.1:{free_port()}", None, "monitor-unreachable"),  # nothing listens
        (MONITOR, Hang(), "monitor-unreachable"),
        (MONITOR, httpx.MockTransport(lambda r: httpx.Response(500, text="boom")), "monitor-error"),
        (MONITOR, httpx.MockTransport(lambda r: httpx.Response(200, text="<html>")), "monitor-error"),
        (MONITOR, httpx.MockTransport(lambda r: httpx.Response(200, json=[1, 2])), "monitor-error"),
        (MONITOR, httpx.MockTransport(lambda r: httpx.Response(404, json={})), "monitor-error"),  # not a monitor
    ]
    for url, transport, reason in cases:
        async with running(load_settings({}, state_monitor_url=url, monitor_timeout_s=0.2), transport) as client:
            started = time.monotonic()
            resp = await client.get("/chunk-size", params={"device_id": "d", "prompt_tokens": 900})
            assert plan(resp.json()) == {"chunk_size": 128, "source": f"default:{reason}"}, url
            resp = await client.get("/parallel-draft-steps", params={"device_id": "d", "draft_len": 8})
            assert plan(resp.json()) == {"steps": 2, "source": f"default:{reason}"}, url
            assert time.monotonic() - started < 2.0  # every fetch is bounded by monitor_timeout_s


# -- A and P are the caller's; eq. 6 for every draft length --------------------------------------


async def test_bytes_per_token_and_stages_come_from_the_caller() -> None:
    """The planner has no model of its own: a device with hidden 576 gets the answer for 576, not for
    a default 256, and an unknown A is a default that says so, never `eq3` from a guess."""
    async with monitor() as (mon, transport):
        await post(mon, steps_records(STEPS) + JETSON)
        async with running(planner_settings(), transport) as client:

            async def ask(path: str, **params: Any) -> dict[str, Any]:
                return (await client.get(path, params={"device_id": "jetson-1", **params})).json()

            narrow = await ask("/chunk-size", prompt_tokens=5000, bytes_per_token=hidden_bytes_per_token(256, 2))
            wide = await ask("/chunk-size", prompt_tokens=5000, bytes_per_token=hidden_bytes_per_token(576, 2))
            assert narrow["source"] == wide["source"] == "eq3"
            assert wide["bytes_per_token"] == 1152 and narrow["bytes_per_token"] == 512
            assert wide["chunk_size"] < narrow["chunk_size"]  # more bytes per token: less fits the window
            deep = await ask("/chunk-size", prompt_tokens=5000, bytes_per_token=512, stages=4)
            assert deep["stages"] == 4 and deep["chunk_size"] < narrow["chunk_size"]
            few = await ask("/parallel-draft-steps", draft_len=9, bytes_per_token=hidden_bytes_per_token(256, 2))
            many = await ask("/parallel-draft-steps", draft_len=9, bytes_per_token=hidden_bytes_per_token(576, 4))
            assert few["source"] == many["source"] == "eq6" and many["steps"] > few["steps"]
            unknown = await ask("/chunk-size", prompt_tokens=5000)
            assert plan(unknown) == {"chunk_size": 128, "source": "default:no-bytes-per-token"}
            assert (await ask("/parallel-draft-steps", draft_len=9))["source"] == "default:no-bytes-per-token"
            for bad in ({"bytes_per_token": 0}, {"bytes_per_token": "x"}, {"stages": 0}):
                resp = await client.get("/chunk-size", params={"device_id": "d", "prompt_tokens": 9, **bad})
                assert resp.status_code == 400, bad


async def test_draft_steps_for_every_draft_length_from_one_snapshot() -> None:
    """A device looks up each round's λ for the rows it actually sends (k + 1) in one table."""
    async with monitor() as (mon, transport):
        await post(mon, steps_records(STEPS) + JETSON)
        async with running(planner_settings(), transport) as client:
            got = (
                await client.get(
                    "/parallel-draft-steps",
                    params={"device_id": "jetson-1", "draft_len": 9, "bytes_per_token": 4096, "all_lengths": "true"},
                )
            ).json()
            singles = [
                (
                    await client.get(
                        "/parallel-draft-steps",
                        params={"device_id": "jetson-1", "draft_len": n, "bytes_per_token": 4096},
                    )
                ).json()["steps"]
                for n in range(10)
            ]
    assert got["steps_by_draft_len"] == singles and got["steps"] == singles[9]
    assert singles[1] < singles[9]  # the window grows with the rows moved: eq. 6 depends on k


async def test_stages_come_from_the_verifiers_telemetry_when_the_caller_does_not_say() -> None:
    """P is the verifier's: its steps report how many pipeline stages it runs, and the planner uses that over
    its own setting (a caller's explicit `stages` still wins)."""
    async with monitor() as (mon, transport):
        await post(mon, [{**r, "pipeline_stages": 4} for r in steps_records(STEPS)] + JETSON)
        async with running(planner_settings(pipeline_stages=1), transport) as client:

            async def ask(path: str, **params: Any) -> dict[str, Any]:
                return (
                    await client.get(path, params={"device_id": "jetson-1", "bytes_per_token": 512, **params})
                ).json()

            reported = await ask("/chunk-size", prompt_tokens=5000)
            assert reported["stages"] == 4 and reported["source"] == "eq3"
            assert reported["chunk_size"] == (await ask("/chunk-size", prompt_tokens=5000, stages=4))["chunk_size"]
            assert (await ask("/chunk-size", prompt_tokens=5000, stages=2))["stages"] == 2
            assert (await ask("/parallel-draft-steps", draft_len=9))["stages"] == 4
        for bad in (0, "x", 2000):
            resp = await mon.post("/telemetry", json=[{**steps_records(STEPS)[0], "pipeline_stages": bad}])
            assert resp.status_code in (400, 422), bad
