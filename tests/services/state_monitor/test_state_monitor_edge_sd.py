"""Edge SD telemetry in the state monitor: POST /edge-sd/telemetry appends measured passes and verdicts to
capped Redis lists, GET /state/edge-sd serves them newest first, 422 for bad shapes, 503 without Redis,
device credentials only for their own node. Real redis-server, the real app in-process (ASGI)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator

import httpx
import pytest
import redis

from services.state_monitor.app import create_app
from services.state_monitor.records import EDGE_SD_KEYS
from services.state_monitor.settings import load_settings
from shared.auth import verify as auth
from shared.auth.signing import KeyRing
from shared.edge_sd.plan_inputs import EdgeTelemetry
from shared.processes.redis_server import EmbeddedRedis
from shared.settings import SettingsError
from tests.auth_tools import bearer
from tests.services.state_monitor.test_state_monitor import fast_settings, running


@pytest.fixture
def server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as srv:
        yield srv


async def post_raw(client: httpx.AsyncClient, body: object) -> httpx.Response:
    """POST `body` as JSON that may hold NaN/Infinity literals."""
    return await client.post(
        "/edge-sd/telemetry", content=json.dumps(body), headers={"content-type": "application/json"}
    )


def test_history_setting_from_env() -> None:
    assert load_settings({}).edge_sd_history == 512
    assert load_settings({"TOPHAT_STATE_MONITOR_EDGE_SD_HISTORY": "7"}).edge_sd_history == 7
    with pytest.raises(SettingsError):
        load_settings({"TOPHAT_STATE_MONITOR_EDGE_SD_HISTORY": "0"})


async def test_samples_round_trip_newest_first_and_parse_as_planner_telemetry(server: EmbeddedRedis) -> None:
    async with running(fast_settings(server.url)) as client:
        first = {
            "node": "sbs-1",
            "draft": [[1, 1.0e9, 0.001], [4, 1.0e9, 0.002]],
            "verify": [[4, 2.0e10, 0.02]],
            "verdicts": [[4, 4], [4, 1]],
        }
        resp = await client.post("/edge-sd/telemetry", json=first)
        assert resp.status_code == 200 and resp.json() == {"accepted": 5, "persisted": True}
        # any list may be missing or empty
        resp = await client.post("/edge-sd/telemetry", json={"node": "sbs-1", "verdicts": [[3, 0]], "draft": []})
        assert resp.json() == {"accepted": 1, "persisted": True}
        state = (await client.get("/state/edge-sd")).json()
    assert state == {
        "draft": [[4, 1.0e9, 0.002], [1, 1.0e9, 0.001]],
        "verify": [[4, 2.0e10, 0.02]],
        "verdicts": [[3, 0], [4, 1], [4, 4]],
    }
    telemetry = EdgeTelemetry.from_dict(state)
    assert telemetry.verdicts == [(3, 0), (4, 1), (4, 4)] and telemetry.draft[0] == (4, 1.0e9, 0.002)


async def test_lists_are_capped_to_the_newest(server: EmbeddedRedis) -> None:
    async with running(fast_settings(server.url, edge_sd_history=3)) as client:
        await client.post("/edge-sd/telemetry", json={"node": "n", "draft": [[b, 1e9, b / 1000] for b in (1, 2)]})
        resp = await client.post(
            "/edge-sd/telemetry", json={"node": "n", "draft": [[b, 1e9, b / 1000] for b in (3, 4, 5, 6)]}
        )
        assert resp.json() == {"accepted": 4, "persisted": True}
        state = (await client.get("/state/edge-sd")).json()
    assert [row[0] for row in state["draft"]] == [6, 5, 4]
    r = redis.Redis.from_url(server.url)
    assert r.llen(EDGE_SD_KEYS["draft"]) == 3 and r.llen(EDGE_SD_KEYS["verify"]) == 0
    r.close()


async def test_bad_shapes_and_values_are_refused_and_keep_nothing(server: EmbeddedRedis) -> None:
    bad = [
        {"draft": [[1, 1e9, 0.1]]},  # no node
        {"node": "n", "draft": [[1, 1e9]]},  # 2 of 3 numbers
        {"node": "n", "draft": [[0, 1e9, 0.1]]},  # batch size 0
        {"node": "n", "draft": [[1.5, 1e9, 0.1]]},  # fractional batch size
        {"node": "n", "draft": [["2", 1e9, 0.1]]},  # a string for a count
        {"node": "n", "verify": [[1, -1.0, 0.1]]},  # negative FLOPs
        {"node": "n", "verify": [[1, 1e9, math.nan]]},  # NaN seconds
        {"node": "n", "verify": [[1, math.inf, 0.1]]},  # infinite FLOPs
        {"node": "n", "verdicts": [[2, 3]]},  # more accepted than drafted
        {"node": "n", "verdicts": [[-1, 0]]},
        {"node": "n", "verdicts": [[4, 2, 1]]},
        {"node": "n", "extra": []},  # unknown field
        {"node": "bad node!", "draft": []},
        [{"node": "n"}],  # not an object
    ]
    async with running(fast_settings(server.url)) as client:
        for body in bad:
            good_then_bad = (
                dict(body, draft=[[2, 1e9, 0.1], *body.get("draft", [])]) if isinstance(body, dict) else body
            )
            for sent in (body, good_then_bad):
                resp = await post_raw(client, sent)
                assert resp.status_code == 422, (sent, resp.text)
                assert resp.json()["detail"], sent
        state = (await client.get("/state/edge-sd")).json()
    assert state == {"draft": [], "verify": [], "verdicts": []}


async def test_unreadable_redis_entries_are_skipped(server: EmbeddedRedis) -> None:
    r = redis.Redis.from_url(server.url)
    r.lpush(EDGE_SD_KEYS["draft"], "[1, 1e9, 0.1]", "not json", "[1, 2]", '{"a": 1}', "[1, 1e9, NaN]")
    r.close()
    async with running(fast_settings(server.url)) as client:
        state = (await client.get("/state/edge-sd")).json()
    assert state["draft"] == [[1, 1e9, 0.1]]


async def test_503_without_redis(server: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch) -> None:
    async with running(fast_settings(server.url)) as client:
        server.stop()
        resp = await client.get("/state/edge-sd")
        assert resp.status_code == 503 and "redis" in resp.json()["detail"]
        resp = await client.post("/edge-sd/telemetry", json={"node": "n", "verdicts": [[1, 1]]})
        assert resp.status_code == 200 and resp.json() == {"accepted": 1, "persisted": False}
    monkeypatch.delenv("REDIS_URL", raising=False)
    async with running(load_settings({})) as client:
        resp = await client.get("/state/edge-sd")
        assert resp.status_code == 503 and "not configured" in resp.json()["detail"]


async def test_device_credential_writes_only_its_own_node(server: EmbeddedRedis, tmp_path) -> None:
    ring = KeyRing.generate()
    ring.save(tmp_path / "keys.json")
    app = create_app(fast_settings(server.url, auth_key_file=str(tmp_path / "keys.json")))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://monitor") as client:
            body = {"node": "sbs-1", "verdicts": [[2, 1]]}
            assert (await client.post("/edge-sd/telemetry", json=body)).status_code == 401
            own = bearer(ring, "sbs-1", "device", auth.ISSUER)
            other = bearer(ring, "sbs-2", "device", auth.ISSUER)
            assert (await client.post("/edge-sd/telemetry", json=body, headers=other)).status_code == 403
            assert (await client.post("/edge-sd/telemetry", json=body, headers=own)).status_code == 200
            assert (await client.get("/state/edge-sd")).json()["verdicts"] == [[2, 1]]  # reads stay open
