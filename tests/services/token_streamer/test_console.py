"""The web console without a browser (issue 50): its rows and history as pure functions, its routes behind the
key, its assets small and shipped in the package. tests/e2e/test_console_browser.py drives it in Chromium."""

from __future__ import annotations

import math
import re
import tomllib
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from services.state_monitor.app import create_app as monitor_app
from services.state_monitor.settings import load_settings as monitor_settings
from services.token_streamer.app import create_app
from services.token_streamer.console import read_assets
from services.token_streamer.settings import load_settings
from shared.console.history import ConsoleHistory
from shared.console.mesh import device_rows, g_points, interpolate, mesh_view, verifier_rows
from shared.modes import MODES

ROOT = Path(__file__).resolve().parents[3]
MAX_ASSET_BYTES = 300_000


def test_interpolate_stays_within_what_was_measured():
    points = [(1.0, 2.0), (4.0, 8.0)]
    assert interpolate(points, 2.5) == 5.0
    assert interpolate(points, 0.5) == 2.0 and interpolate(points, 100.0) == 8.0  # never extrapolated
    assert interpolate([], 3.0) is None and interpolate(points, None) is None


def test_g_points_keep_measured_buckets_in_order():
    cloud = {"g": {"buckets": [{"mu": 8.0, "eta": 0.02}, {"mu": 1.0, "eta": 0.01}, {"mu": 2.0, "eta": None}]}}
    assert g_points(cloud) == [(1.0, 0.01), (8.0, 0.02)]


def test_a_device_row_from_router_info_and_monitor():
    routed = [{"url": "http://d0", "device_id": None, "healthy": True, "outstanding": 1, "served": 3}]
    info = {"device_id": "jetson-7", "speed": "orin", "mode": "hat", "active_sessions": 2, "max_sessions": 4,
            "draft_shape": "tree8", "draft_shape_source": "budget"}  # fmt: skip
    state = {"device_id": "jetson-7", "rtt_s": 0.025, "beta_up": 1.25e6, "beta_down": math.nan, "last_update": 95.0}
    [row] = device_rows(routed, {"http://d0": info}, {"http://d0": 99.0}, {"jetson-7": state}, {"jetson-7": 2.5}, 100.0)
    assert row["device_id"] == "jetson-7" and row["speed_class"] == "orin" and row["draft_shape"] == "tree8"
    assert row["rtt_ms"] == pytest.approx(25.0) and row["up_mbps"] == pytest.approx(10.0)
    assert row["down_mbps"] is None  # not measured: shown as "—", never made up
    assert row["sessions"] == 2 and row["max_sessions"] == 4 and row["mean_accept_length"] == 2.5
    assert row["ready"] is True and row["last_seen_s"] == pytest.approx(1.0)


def test_a_device_that_does_not_answer_is_not_ready_and_unmeasured():
    routed = [{"url": "http://d1", "device_id": "d1", "healthy": True, "outstanding": 0}]
    [row] = device_rows(routed, {"http://d1": None}, {}, {}, {}, 100.0)
    assert row["device_id"] == "d1" and row["ready"] is False
    assert row["rtt_ms"] is None and row["draft_shape"] is None and row["last_seen_s"] is None


def test_the_verifier_row_from_the_monitors_cloud_state():
    assert verifier_rows(None, 10.0) == [] and verifier_rows({"steps": 0}, 10.0) == []
    cloud = {
        "steps": 40, "mu": 4.0, "eta": 0.008, "updated_at": 9.5,
        "last": {"num_sessions": 3, "runs_on": "cuda:0", "pipeline_stages": 1},
        "g": {"buckets": [{"mu": 2.0, "eta": 0.004}, {"mu": 8.0, "eta": 0.010}]},
    }  # fmt: skip
    [row] = verifier_rows(cloud, 10.0)
    assert row["runs_on"] == "cuda:0" and row["sessions"] == 3 and row["rows_per_step"] == 4.0
    assert row["step_ms"] == pytest.approx(8.0) and row["g_at_mu_ms"] == pytest.approx(6.0)
    assert row["last_seen_s"] == pytest.approx(0.5) and row["g_points"] == [[2.0, 4.0], [8.0, 10.0]]


def test_mesh_view_says_when_the_monitor_is_missing():
    view = mesh_view([], {}, {}, None, None, {}, 1.0, "not configured")
    assert view == {"now": 1.0, "monitor": "not configured", "devices": [], "verifiers": []}


def test_history_keeps_a_window_and_means_accept_per_device():
    history = ConsoleHistory(window_s=60.0, max_points=3)
    history.request_done(0.0, "a", 0.1, 0.01, 4.0, "hat")
    history.request_done(50.0, "a", 0.1, 0.01, 2.0, "hat")
    history.request_done(55.0, "b", math.nan, None, 1.0, "cloud")
    assert history.mean_accept(55.0) == {"a": 3.0, "b": 1.0}
    history.request_done(70.0, "a", 0.2, 0.02, 3.0, "hat")  # the first is now out of the window (and the ring)
    assert history.mean_accept(70.0) == {"a": 2.5, "b": 1.0}
    body = history.to_dict(70.0, since=52.0)
    assert [p["t"] for p in body["requests"]] == [55.0, 70.0] and body["requests"][0]["ttft_s"] is None


def test_history_skips_a_load_point_with_nothing_known():
    history = ConsoleHistory()
    history.load_seen(1.0, None, None, None, {"a": None})
    history.load_seen(2.0, 3.5, 2, 7.0, {"a": "chain", "b": None})
    assert history.to_dict(2.0)["load"] == [
        {"t": 2.0, "rows_per_step": 3.5, "sessions": 2, "step_ms": 7.0, "shapes": {"a": "chain"}}
    ]


@pytest.fixture
def client():
    settings = load_settings({}, api_key="k1", health_interval_s=0, device_urls="http://127.0.0.1:9")
    with TestClient(create_app(settings)) as test_client:
        yield test_client


def test_the_page_is_public_and_every_data_route_needs_the_key(client):
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for name in ("console.js", "plot.js", "console.css"):
        assert client.get(f"/console/static/{name}").status_code == 200
    assert client.get("/console/static/missing.js").status_code == 404
    for path in ("/console/mesh", "/console/history", "/stats", "/console/static/../../app.py"):
        assert client.get(path).status_code == 401, path
    key = {"Authorization": "Bearer k1"}
    mesh = client.get("/console/mesh", headers=key).json()
    assert [d["url"] for d in mesh["devices"]] == ["http://127.0.0.1:9"] and mesh["monitor"] == "not configured"
    assert client.get("/console/history?since=0", headers=key).json()["requests"] == []


def test_the_console_can_be_turned_off():
    settings = load_settings({}, health_interval_s=0, console=False)
    with TestClient(create_app(settings)) as test_client:
        assert test_client.get("/").status_code == 404
        assert test_client.get("/console/mesh").status_code == 404


def test_assets_are_small_referenced_and_shipped_in_the_package():
    assets = read_assets()
    assert sum(len(body) for body in assets.values()) < MAX_ASSET_BYTES
    page = assets["index.html"].decode()
    referenced = set(re.findall(r'(?:src|href)="/console/static/([^"]+)"', page))
    assert referenced == set(assets) - {"index.html"}  # every asset is used and every reference exists
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "console_static/*" in package_data["services.token_streamer"]


def test_the_page_offers_the_modes_the_api_takes():
    page = read_assets()["index.html"].decode()
    offered = set(re.findall(r"<option>([a-z-]+)</option>", page))
    assert offered and offered <= set(MODES)


async def test_the_monitor_keeps_where_the_verifier_runs():
    """A verifier step says its torch device (runs_on); the monitor's cloud state, which the console reads, has it."""
    app = monitor_app(monitor_settings({}))
    step = {"kind": "verifier_step", "batched_tokens": 8, "compute_s": 0.01, "num_sessions": 2, "runs_on": "cuda:0"}
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://monitor") as client:
            assert (await client.post("/telemetry", json=step)).status_code == 200
            bad = {**step, "runs_on": "cuda:0; rm -rf /"}
            assert (await client.post("/telemetry", json=bad)).status_code == 422
            cloud = (await client.get("/state/cloud")).json()
    [row] = verifier_rows(cloud, cloud["updated_at"])
    assert row["runs_on"] == "cuda:0" and row["sessions"] == 2 and row["rows_per_step"] == 8.0
