"""deploy/grafana/tophat.json, checked offline (issue 50): a Grafana dashboard's shape, and every metric name its
queries use is one a Tophat service exports (read from the services' own registries, suffixes included)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from shared.telemetry.metrics import (
    DeviceMetrics,
    MonitorMetrics,
    PlannerMetrics,
    StreamerMetrics,
    TelemetryMetrics,
    VerifierMetrics,
)

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "tophat.json"
METRIC = re.compile(r"tophat:[A-Za-z0-9_:]+")
PANEL_TYPES = {"timeseries", "stat", "gauge", "table", "bargauge", "heatmap", "text"}


def exported_names() -> set[str]:
    """Every sample name the services' /metrics can show: counters' _total, histograms' _bucket/_sum/_count."""
    telemetry = CollectorRegistry()
    TelemetryMetrics(telemetry)
    registries = [
        StreamerMetrics(lambda: 0, lambda: 0).registry,
        VerifierMetrics(lambda: 0, lambda: 0).registry,
        DeviceMetrics("d0", 2).registry,
        PlannerMetrics().registry,
        MonitorMetrics().registry,
        telemetry,
    ]
    names = set()
    for registry in registries:
        for family in registry.collect():
            names.add(family.name)
            for suffix in ("_total", "_bucket", "_sum", "_count", "_created"):
                names.add(family.name + suffix)
    return names


def test_the_dashboard_has_grafanas_shape():
    dashboard = json.loads(DASHBOARD.read_text())
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["schemaVersion"] >= 36
    assert dashboard["title"] and dashboard["uid"]
    assert [v["type"] for v in dashboard["templating"]["list"]] == ["datasource"]
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels) >= 10
    for panel in panels:
        assert panel["type"] in PANEL_TYPES and panel["title"]
        grid = panel["gridPos"]
        assert set(grid) == {"h", "w", "x", "y"} and 0 <= grid["x"] and grid["x"] + grid["w"] <= 24
        assert panel["targets"] and len({t["refId"] for t in panel["targets"]}) == len(panel["targets"])
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}" and target["expr"].strip()


def test_every_query_uses_metrics_the_services_export():
    exported = exported_names()
    used = set()
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            assert expr.count("(") == expr.count(")"), expr
            names = set(METRIC.findall(expr))
            assert names, expr
            assert names <= exported, f"{panel['title']}: {sorted(names - exported)} are not exported"
            used |= names
    # the latencies the console shows and the verifier's load are all on the dashboard
    for family in ("time_to_first_token_seconds", "inter_token_latency_seconds", "verifier_step_seconds"):
        assert any(name.startswith(f"tophat:{family}") for name in used)
