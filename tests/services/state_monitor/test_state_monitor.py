"""State-monitor HTTP API against a real redis-server (ASGI in-process, plus one real uvicorn run)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import redis

from services.state_monitor.app import create_app
from services.state_monitor.settings import Settings, load_settings
from shared.processes.redis_server import EmbeddedRedis, free_port
from shared.settings import SettingsError
from shared.telemetry import sink as tk

REPO_ROOT = Path(__file__).resolve().parents[3]
STEP = {
    "kind": "verifier_step",
    "batched_tokens": 64,
    "compute_s": 0.02,
    "num_sessions": 4,
    "step_kinds": {"verify": 4},
}


@pytest.fixture
def server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as srv:
        yield srv


@asynccontextmanager
async def running(settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://monitor") as client:
            yield client


def fast_settings(url: str, **kw: object) -> Settings:
    return load_settings(
        {}, redis_url=url, redis_timeout_s=0.3, redis_backoff_initial_s=0.05, redis_backoff_max_s=0.2, **kw
    )


def test_settings_from_env() -> None:
    s = load_settings({"TOPHAT_STATE_MONITOR_PORT": "9001", "TOPHAT_STATE_MONITOR_STREAM_MAXLEN": "50"})
    assert (s.port, s.stream_maxlen, s.redis_url) == (9001, 50, "")
    with pytest.raises(SettingsError):
        load_settings({"TOPHAT_STATE_MONITOR_ALPHA": "1.5"})


async def test_keys_appear_and_state_is_served(server: EmbeddedRedis) -> None:
    records = [
        STEP,
        {**STEP, "batched_tokens": 512, "compute_s": 0.2},
        {
            "kind": "device_draft",
            "device_id": "jetson-1",
            "step_s": 0.004,
            "round_overhead_s": 0.003,
            "rounds": 9,
            "prefill_token_s": 2e-5,
            "prefill_tokens": 300,
        },
        {"kind": "device_transfer", "device_id": "jetson-1", "direction": "up", "bytes": 8192, "seconds": 0.001},
        {"kind": "device_transfer", "device_id": "jetson-1", "direction": "down", "bytes": 8192, "seconds": 0.0005},
        {
            "kind": "request",
            "request_id": "req-1",
            "device_id": "jetson-1",
            "ttft_s": 0.3,
            "token_times_s": [0.03, 0.05],
            "accept_lengths": [2, 3],
            "prompt_tokens": 100,
        },
    ]
    async with running(fast_settings(server.url)) as client:
        resp = await client.post("/telemetry", json=records)
        assert resp.json() == {"accepted": 6, "persisted": 6}

        cloud = (await client.get("/state/cloud")).json()
        assert cloud["mu"] == pytest.approx(0.8 * 64 + 0.2 * 512)
        assert len(cloud["g"]["buckets"]) == 2 and cloud["g"]["line"] is not None
        assert cloud["predict"]["64"] == pytest.approx(0.02)
        pred = (await client.get("/predict", params={"mu": 288})).json()
        assert 0.02 < pred["g"] < 0.2 and pred["observed_buckets"] == 2

        dev = (await client.get("/state/device/jetson-1")).json()
        assert dev["gamma"] == pytest.approx(0.004)
        assert dev["round_overhead_s"] == pytest.approx(0.003) and dev["prefill_token_s"] == pytest.approx(2e-5)
        assert dev["beta_up"] == pytest.approx(8192 / 0.001) and dev["beta_down"] == pytest.approx(8192 / 0.0005)
        assert dev["stale"] is False
        assert [d["device_id"] for d in (await client.get("/state/devices")).json()["devices"]] == ["jetson-1"]

    r = redis.Redis.from_url(server.url, decode_responses=True)
    assert set(r.keys("tophat:*")) == {
        tk.VERIFIER_STEPS,
        tk.VERIFIER_STATE,
        tk.DEVICES,
        tk.REQUESTS,
        tk.request_key("req-1"),
        tk.device_events_key("jetson-1"),
        tk.device_state_key("jetson-1"),
        tk.DISCO_PROMPT_TOKENS,
    }
    assert r.type(tk.VERIFIER_STEPS) == "stream" and r.xlen(tk.VERIFIER_STEPS) == 2
    state = r.hgetall(tk.VERIFIER_STATE)
    assert float(state["mu"]) == pytest.approx(cloud["mu"]) and len(json.loads(state["g"])) == 2
    assert r.xlen(tk.device_events_key("jetson-1")) == 3
    assert float(r.hget(tk.device_state_key("jetson-1"), "gamma")) == pytest.approx(0.004)
    req = r.hgetall(tk.request_key("req-1"))
    assert float(req["mean_accept_len"]) == 2.5 and r.ttl(tk.request_key("req-1")) > 0
    r.close()


async def test_calibration_passes_give_g_but_no_load(server: EmbeddedRedis) -> None:
    """The verifier's startup passes: g gets their points, mu stays unknown (no step was served), and they are
    not in the step stream the console and the simulator read as served steps."""
    calibration = [
        {"kind": "verifier_calibration", "batched_tokens": rows, "compute_s": 0.001 * rows} for rows in (1, 4, 16, 64)
    ]
    async with running(fast_settings(server.url)) as client:
        assert (await client.post("/telemetry", json=calibration)).json()["accepted"] == 4
        cloud = (await client.get("/state/cloud")).json()
        assert cloud["mu"] is None and cloud["steps"] == 0
        assert cloud["predict"]["64"] == pytest.approx(0.064)
        await client.post("/telemetry", json=[STEP])
        assert (await client.get("/state/cloud")).json()["mu"] == pytest.approx(64)
    assert redis.Redis.from_url(server.url).xlen(tk.VERIFIER_STEPS) == 1


async def test_streams_capped_through_api(server: EmbeddedRedis) -> None:
    async with running(fast_settings(server.url, stream_maxlen=10)) as client:
        for _ in range(3):
            assert (await client.post("/telemetry", json=[STEP] * 200)).status_code == 200
    length = redis.Redis.from_url(server.url).xlen(tk.VERIFIER_STEPS)
    assert 10 <= length <= 110  # MAXLEN ~: at most one 100-entry node of slack


async def test_state_restored_after_restart(server: EmbeddedRedis) -> None:
    async with running(fast_settings(server.url)) as client:
        await client.post("/telemetry", json=[STEP, {"kind": "device_draft", "device_id": "d1", "step_s": 0.01}])
    async with running(fast_settings(server.url)) as client:
        assert (await client.get("/state/cloud")).json()["mu"] == 64
        assert (await client.get("/state/device/d1")).json()["gamma"] == 0.01


async def test_redis_outage_does_not_break_serving(server: EmbeddedRedis) -> None:
    async with running(fast_settings(server.url)) as client:
        assert (await client.post("/telemetry", json=STEP)).json()["persisted"] == 1
        server.stop()
        for _ in range(20):
            resp = await client.post("/telemetry", json=STEP)
            assert resp.status_code == 200 and resp.json() == {"accepted": 1, "persisted": 0}
        ready = (await client.get("/readyz")).json()
        assert ready["ready"] is True and ready["redis"]["connected"] is False and ready["redis"]["dropped"] >= 20
        assert (await client.get("/state/cloud")).json()["steps"] == 21  # in-memory model kept going

        server.start()  # fresh, empty redis on the same port
        deadline = time.monotonic() + 5
        while not (await client.get("/readyz")).json()["redis"]["connected"]:
            assert time.monotonic() < deadline, "monitor did not reconnect to redis"
            await asyncio.sleep(0.05)
        assert (await client.post("/telemetry", json=STEP)).json()["persisted"] == 1
    r = redis.Redis.from_url(server.url, decode_responses=True)
    assert r.xlen(tk.VERIFIER_STEPS) == 1 and r.hget(tk.VERIFIER_STATE, "steps") == "22"


async def test_validation_and_errors(server: EmbeddedRedis) -> None:
    async with running(fast_settings(server.url, max_batch=3)) as client:
        bad = [
            {"kind": "verifier_step", "batched_tokens": -1, "compute_s": 0.1},
            {"kind": "nonsense"},
            {"kind": "device_transfer", "device_id": "d", "direction": "up", "bytes": 1, "seconds": 0},
            {"kind": "device_draft", "device_id": "bad id!", "step_s": 0.1},
            {**STEP, "unexpected": 1},
        ]
        for body in bad:
            resp = await client.post("/telemetry", json=body)
            assert resp.status_code == 422, body
            assert isinstance(resp.json()["detail"], list)
        assert (await client.post("/telemetry", json=[STEP] * 4)).status_code == 413
        assert (await client.get("/state/device/nope")).status_code == 404
        assert (await client.get("/predict", params={"mu": -1})).status_code == 422
        assert (await client.get("/predict", params={"mu": 8})).json()["g"] is None


async def test_a_batch_is_bounded_before_it_is_parsed_and_bad_input_gets_a_typed_error() -> None:
    async with running(load_settings({}, embedded_redis=False, max_batch=50, max_body_bytes=4096)) as client:
        ok = await client.post("/telemetry", json=[STEP] * 20)
        assert ok.status_code == 200 and ok.json()["accepted"] == 20
        assert (await client.get("/state/cloud")).json()["steps"] == 20
        big = json.dumps([STEP] * 50)  # within max_batch, over max_body_bytes
        assert len(big) > 4096
        refused = await client.post("/telemetry", content=big, headers={"content-type": "application/json"})
        assert refused.status_code == 413 and "4096 bytes" in refused.json()["detail"]

        async def chunks():  # no Content-Length: refused once the bytes read pass the bound
            for _ in range(50):
                yield json.dumps(STEP).encode()

        assert (await client.post("/telemetry", content=chunks())).status_code == 413
        assert (await client.post("/telemetry", content=b"{not json")).status_code == 400
        empty = await client.post("/telemetry", json=[])
        assert empty.status_code == 422 and "empty" in empty.json()["detail"]
        mixed = await client.post("/telemetry", json=[STEP, {**STEP, "compute_s": -1}])
        assert mixed.status_code == 422 and mixed.json()["detail"][0]["loc"][0] == 1  # names the bad record
        assert (await client.get("/state/cloud")).json()["steps"] == 20  # nothing of a refused batch was kept


async def test_runs_in_memory_without_redis(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REDIS_URL", raising=False)
    async with running(load_settings({})) as client:
        assert (await client.get("/healthz")).json() == {"status": "ok"}
        assert (await client.post("/telemetry", json=STEP)).json() == {"accepted": 1, "persisted": 0}
        ready = (await client.get("/readyz")).json()
        assert ready["ready"] and ready["redis"]["configured"] is False


def test_python_dash_m_serves_over_real_uvicorn(server: EmbeddedRedis) -> None:
    port = free_port()
    env = {
        **os.environ,
        "REDIS_URL": server.url,
        "TOPHAT_STATE_MONITOR_PORT": str(port),
        "TOPHAT_STATE_MONITOR_LOG_LEVEL": "warning",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.state_monitor"],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(f"{base}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            assert time.monotonic() < deadline, "uvicorn did not come up"
            time.sleep(0.1)
        assert httpx.post(f"{base}/telemetry", json=STEP, timeout=5).json()["persisted"] == 1
        assert redis.Redis.from_url(server.url).xlen(tk.VERIFIER_STEPS) == 1
    finally:
        proc.terminate()
        proc.wait(timeout=10)
