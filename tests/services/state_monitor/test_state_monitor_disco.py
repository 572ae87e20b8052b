"""DiSCo's two distributions in the state monitor: prompt lengths and server TTFTs kept in Redis, served by
GET /disco/history; request records carrying endpoint, server TTFT and cost; cost metrics. Real redis-server,
the real app in-process (ASGI)."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from services.state_monitor.app import create_app
from services.state_monitor.settings import load_settings
from shared.processes.redis_server import EmbeddedRedis
from shared.settings import SettingsError
from shared.telemetry import sink as tk
from shared.telemetry.client import TelemetryClient
from tests.services.state_monitor.test_state_monitor import fast_settings, running

OLD_STYLE = {
    "kind": "request",
    "request_id": "old-1",
    "device_id": "jetson-1",
    "ttft_s": 0.3,
    "token_times_s": [0.03],
    "accept_lengths": [2],
    "prompt_tokens": 77,
}


@pytest.fixture
def server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as srv:
        yield srv


def request(i: int, **fields: object) -> dict[str, object]:
    return {"kind": "request", "request_id": f"r{i}", "prompt_tokens": 10 * i, **fields}


async def post_raw(client: httpx.AsyncClient, body: object) -> httpx.Response:
    """POST `body` as JSON that may hold NaN/Infinity literals (a sender httpx's own encoder would refuse)."""
    return await client.post("/telemetry", content=json.dumps(body), headers={"content-type": "application/json"})


def sample_value(metrics_text: str, name: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return None


def test_history_setting_from_env() -> None:
    assert load_settings({}).disco_history == 2000
    assert load_settings({"TOPHAT_STATE_MONITOR_DISCO_HISTORY": "50"}).disco_history == 50
    with pytest.raises(SettingsError):
        load_settings({"TOPHAT_STATE_MONITOR_DISCO_HISTORY": "0"})


async def test_client_fields_reach_the_history_and_the_request_record(server: EmbeddedRedis) -> None:
    """TelemetryClient.emit_request's new keywords travel to the real app and land in the lists and the record."""
    app = create_app(fast_settings(server.url))
    async with app.router.lifespan_context(app):
        client = TelemetryClient("http://monitor", transport=httpx.ASGITransport(app))
        assert await client.send({"kind": "request", "request_id": "warm"})  # old-style sender still accepted
        client.emit_request(
            "r1", prompt_tokens=120, ttft_s=0.05, endpoint="device", server_ttft_s=0.4, cost=0.0125, dispatch="race"
        )
        client.emit_request("r2", prompt_tokens=30, ttft_s=0.2, endpoint="cloud", server_ttft_s=0.2, cost=0.5)
        client.emit_request("r3", prompt_tokens=8, endpoint="device")  # server cancelled first: no server TTFT
        await client.aclose()
        assert client.dropped == 0
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://monitor") as http:
            history = (await http.get("/disco/history")).json()
    # emit_request sends concurrently, so arrival order is not the call order (newest-first order is
    # checked with sequential posts below)
    assert sorted(history["prompt_tokens"]) == [8, 30, 120] and sorted(history["server_ttft_s"]) == [0.2, 0.4]
    assert history["source"] == "redis"
    r = redis.Redis.from_url(server.url, decode_responses=True)
    record = r.hgetall(tk.request_key("r1"))
    assert (record["endpoint"], float(record["server_ttft_s"]), float(record["cost"]), record["dispatch"]) == (
        "device",
        0.4,
        0.0125,
        "race",
    )
    assert r.hgetall(tk.request_key("r3"))["server_ttft_s"] == ""
    r.close()


async def test_lists_are_capped_newest_first_and_limit_applies(server: EmbeddedRedis) -> None:
    async with running(fast_settings(server.url, disco_history=5)) as client:
        records = [request(i, server_ttft_s=i / 100) for i in range(1, 9)]
        assert (await client.post("/telemetry", json=records)).json() == {"accepted": 8, "persisted": 8}
        history = (await client.get("/disco/history")).json()
        assert history["prompt_tokens"] == [80, 70, 60, 50, 40]
        assert history["server_ttft_s"] == [0.08, 0.07, 0.06, 0.05, 0.04]
        limited = (await client.get("/disco/history", params={"limit": 2})).json()
        assert (limited["prompt_tokens"], limited["server_ttft_s"]) == ([80, 70], [0.08, 0.07])
        for bad in (0, 6, -1):
            assert (await client.get("/disco/history", params={"limit": bad})).status_code == 422
        spec = (await client.get("/openapi.json")).json()
        (limit,) = [p for p in spec["paths"]["/disco/history"]["get"]["parameters"] if p["name"] == "limit"]
        (bounds,) = [s for s in limit["schema"].get("anyOf", [limit["schema"]]) if s.get("type") == "integer"]
        assert (bounds["minimum"], bounds["maximum"]) == (1, 5)  # the setting's bound is documented, as checked
    r = redis.Redis.from_url(server.url)
    assert r.llen(tk.DISCO_PROMPT_TOKENS) == 5 and r.llen(tk.DISCO_SERVER_TTFT) == 5
    r.close()


async def test_bad_values_are_refused_and_nothing_else_is_lost(server: EmbeddedRedis) -> None:
    bad = [
        request(90, cost=-0.01),
        request(91, server_ttft_s=-1.0),
        request(92, endpoint="edge"),
        request(93, cost=math.inf),
        request(94, server_ttft_s=math.nan),
        request(95, prompt_tokens=-3),
        request(96, ttft_s=math.inf),  # an old field: its 422 used to crash encoding the echoed Infinity
    ]
    async with running(fast_settings(server.url)) as client:
        good = request(1, endpoint="hat", server_ttft_s=0.25, cost=0.1)
        assert (await client.post("/telemetry", json=good)).status_code == 200
        before = (await client.get("/metrics")).text
        for body in bad:
            # a lone bad record, and a batch where the bad one follows a good one: neither keeps anything
            assert (await post_raw(client, body)).status_code in (400, 422), body
            assert (await post_raw(client, [request(2, cost=0.2), body])).status_code in (400, 422), body
        history = (await client.get("/disco/history")).json()
        assert (history["prompt_tokens"], history["server_ttft_s"]) == ([10], [0.25])
        after = (await client.get("/metrics")).text
        for name, labels in (
            ("tophat:request_cost_dollars_total", {"endpoint": "hat"}),
            ("tophat:requests_total", {"endpoint": "hat"}),
        ):
            assert sample_value(after, name, **labels) == sample_value(before, name, **labels)


async def test_old_style_records_still_accepted(server: EmbeddedRedis) -> None:
    async with running(fast_settings(server.url)) as client:
        resp = await client.post("/telemetry", json=[OLD_STYLE, {"kind": "request", "request_id": "bare"}])
        assert resp.json() == {"accepted": 2, "persisted": 2}
        history = (await client.get("/disco/history")).json()
        assert (history["prompt_tokens"], history["server_ttft_s"]) == ([77], [])


async def test_history_survives_a_monitor_restart(server: EmbeddedRedis) -> None:
    async with running(fast_settings(server.url)) as client:
        await client.post("/telemetry", json=[request(1, server_ttft_s=0.5), request(2, server_ttft_s=0.25)])
    async with running(fast_settings(server.url)) as client:
        history = (await client.get("/disco/history")).json()
        assert (history["prompt_tokens"], history["server_ttft_s"]) == ([20, 10], [0.25, 0.5])
        await client.post("/telemetry", json=request(3))
        assert (await client.get("/disco/history")).json()["prompt_tokens"] == [30, 20, 10]


async def test_history_answers_503_without_redis(server: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch) -> None:
    async with running(fast_settings(server.url)) as client:
        await client.post("/telemetry", json=request(1))
        server.stop()
        resp = await client.get("/disco/history")
        assert resp.status_code == 503 and "redis" in str(resp.json()["detail"]).lower()
        server.start()  # fresh, empty redis on the same port: served again once the monitor reconnects
        for _ in range(100):
            resp = await client.get("/disco/history")
            if resp.status_code == 200:
                break
            await asyncio.sleep(0.05)
        assert resp.status_code == 200 and resp.json()["prompt_tokens"] == []
    monkeypatch.delenv("REDIS_URL", raising=False)
    async with running(load_settings({})) as client:
        resp = await client.get("/disco/history")
        assert resp.status_code == 503 and "redis" in str(resp.json()["detail"]).lower()


async def test_metrics_count_cost_and_requests_by_endpoint(server: EmbeddedRedis) -> None:
    async with running(fast_settings(server.url)) as client:
        await client.post(
            "/telemetry",
            json=[
                request(1, endpoint="cloud", cost=0.25),
                request(2, endpoint="cloud", cost=0.5),
                request(3, endpoint="device", cost=0.125),
                request(4, endpoint="hat"),
                OLD_STYLE,
            ],
        )
        text = (await client.get("/metrics")).text
    assert sample_value(text, "tophat:request_cost_dollars_total", endpoint="cloud") == pytest.approx(0.75)
    assert sample_value(text, "tophat:request_cost_dollars_total", endpoint="device") == pytest.approx(0.125)
    assert sample_value(text, "tophat:requests_total", endpoint="cloud") == 2
    assert sample_value(text, "tophat:requests_total", endpoint="device") == 1
    assert sample_value(text, "tophat:requests_total", endpoint="hat") == 1
    assert sample_value(text, "tophat:requests_total", endpoint="unknown") == 1
