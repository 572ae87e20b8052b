"""`tophat bench disco` (loadgen/bench_disco.py): aggregation, ratios, Pareto front, the CLI, one tiny real run."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from loadgen import bench_disco as bd
from loadgen.metrics import RequestRecord
from tests.conftest import DEMO_MODEL_DIR


def record(
    index: int,
    ttft_s: float,
    cost: float,
    *,
    endpoint: str = "device",
    legs=("device",),
    migrations=(),
    error: str | None = None,
    gaps_s=(0.2, 0.2),
) -> RequestRecord:
    """A finished request: first token `ttft_s` after its arrival at t=0, then one token per gap."""
    times = [ttft_s]
    for gap in gaps_s:
        times.append(times[-1] + gap)
    tophat = {
        "endpoint": endpoint,
        "endpoints": list(legs),
        "decision": "race" if len(legs) > 1 else "device-only",
        "cost": {"total": cost, "device": cost / 4, "server": cost * 3 / 4},
        "migrations": list(migrations),
    }
    return RequestRecord(
        index=index,
        arrival_s=0.0,
        max_tokens=3,
        chunk_times_s=times if error is None else [],
        chunk_tokens=[1] * len(times) if error is None else [],
        end_s=times[-1],
        tophat=None if error else tophat,
        error=error,
    )


def test_an_entry_holds_the_runs_latency_cost_and_migrations():
    migration = {"from": "cloud", "to": "device", "at_token": 2, "reason": "cost", "max_gap_s": 0.25}
    unfinished = {"from": "cloud", "to": "device", "at_token": 1, "reason": "cost"}  # no max_gap_s
    called_off = {**migration, "called_off": "would stall", "max_gap_s": 0.2}
    # a race (cloud, device) and three hand-over receivers, one of them called off
    records = [
        record(0, 0.1, 1e-6),
        record(
            1,
            0.3,
            3e-6,
            endpoint="cloud",
            legs=("cloud", "device") + ("device",) * 3,
            migrations=[called_off, migration, unfinished],
        ),
        record(2, 0.0, 0.0, error="HTTP 503: busy"),
    ]
    entry = bd.aggregate(records, mode="disco", budget=0.25, constraint="server", reading_rate_tps=5.0)
    assert entry["mode"] == "disco" and entry["budget"] == 0.25 and entry["constraint"] == "server"
    assert (entry["requests"], entry["completed"], entry["failed"]) == (3, 2, 1)
    assert entry["mean_ttft_ms"] == pytest.approx(200.0)
    assert entry["mean_cost"] == pytest.approx(2e-6)  # the failed request has no cost to average
    assert entry["mean_device_cost"] == pytest.approx(0.5e-6) and entry["mean_server_cost"] == pytest.approx(1.5e-6)
    assert entry["endpoints"] == {"device": 1, "cloud": 1} and entry["raced"] == 1
    assert entry["migrations"] == 2 and entry["handovers_called_off"] == 1 and entry["migrations_unfinished"] == 1
    assert entry["max_migration_gap_ms"] == pytest.approx(250.0)
    assert entry["migration_gap_limit_ms"] == pytest.approx(200.0)
    assert entry["migration_stalls"] == 1  # 250 ms > 200 ms * 1.1
    assert entry["p99_tbt_ms"] == pytest.approx(200.0)


def test_an_entry_without_migrations_or_pacing_has_no_gap():
    entry = bd.aggregate([record(0, 0.1, 1e-6)], mode="device", budget=None, constraint="device", reading_rate_tps=0)
    assert entry["migrations"] == 0 and entry["max_migration_gap_ms"] is None
    assert entry["migration_gap_limit_ms"] is None and entry["migration_stalls"] == 0


def entry(mode, budget, mean_ttft, p99_ttft, cost, constraint="server"):
    return {
        "mode": mode,
        "budget": budget,
        "constraint": constraint,
        "mean_ttft_ms": mean_ttft,
        "p99_ttft_ms": p99_ttft,
        "mean_cost": cost,
    }


def test_dominators_need_no_worse_in_both_and_better_in_one():
    point = entry("disco", 0.5, 100, 300, 2.0)
    others = [
        entry("device", None, 400, 900, 0.1),  # cheaper, slower: not dominating
        entry("cloud", None, 90, 290, 2.0),  # as cheap, faster: dominates
        entry("random", 0.5, 100, 300, 2.0),  # identical: does not dominate
        entry("random", 0.75, 100, 280, 1.5),
    ]  # mean equal, cheaper: dominates in both views
    assert bd.dominators(point, others, "mean_ttft_ms") == ["cloud", "random@0.75"]
    assert bd.dominators(point, others, "p99_ttft_ms") == ["cloud", "random@0.75"]
    assert bd.dominators(entry("disco", 0.5, None, 1, 1), others, "mean_ttft_ms") == []


def test_compare_takes_ratios_against_the_same_budget_and_regime():
    entries = [
        entry("device", None, 400, 1000, 1.0),
        entry("cloud", None, 200, 400, 10.0),
        entry("random", 0.25, 350, 900, 3.0),
        entry("disco", 0.25, 175, 500, 2.0),
        entry("random", 0.5, 300, 800, 5.0),
        entry("disco", 0.5, 150, 300, 6.0),
        entry("cloud", None, 1, 1, 0.0, constraint="device"),
    ]  # another regime: never compared with
    compared = {c["budget"]: c for c in bd.compare(entries)}
    assert set(compared) == {0.25, 0.5}
    low = compared[0.25]
    assert low["ratios"]["random"] == pytest.approx({"mean_ttft": 0.5, "p99_ttft": 500 / 900, "cost": 2 / 3})
    assert low["ratios"]["device"] == pytest.approx({"mean_ttft": 175 / 400, "p99_ttft": 0.5, "cost": 2.0})
    assert low["ratios"]["cloud"] == pytest.approx({"mean_ttft": 0.875, "p99_ttft": 1.25, "cost": 0.2})
    assert low["pareto_mean"] and low["pareto_p99"]
    high = compared[0.5]
    assert high["ratios"]["random"]["cost"] == pytest.approx(1.2)
    assert high["pareto_mean"] and high["pareto_p99"]  # faster than every baseline that is cheaper
    dominated = bd.compare(entries + [entry("disco", 0.75, 380, 950, 4.0)])[-1]
    assert not dominated["pareto_mean"] and dominated["dominated_by_mean"] == ["random@0.25"]
    assert dominated["ratios"]["random"] is None  # no random run at b = 0.75


def test_a_ratio_against_a_zero_or_missing_baseline_is_none():
    entries = [entry("device", None, 400, 1000, 0.0), entry("disco", 0.1, 100, 200, 1.0)]
    compared = bd.compare(entries)[0]
    assert compared["ratios"]["device"]["cost"] is None and compared["ratios"]["cloud"] is None


def test_the_plan_runs_the_baselines_first_then_random_and_disco_per_budget():
    plan = bd.policy_plan([0.1, 0.5])
    assert [p.label for p in plan] == ["device", "cloud", "random@0.1", "disco@0.1", "random@0.5", "disco@0.5"]
    assert bd.request_options(plan[3], 5.0) == {
        "dispatch": "disco",
        "reading_rate_tps": 5.0,
        "budget": 0.1,
        "migration": True,
    }
    assert "budget" not in bd.request_options(plan[0], 5.0)
    assert bd.mesh_env("server")["TOPHAT_VERIFIER_FULL_MODEL"] == "true"
    assert "TOPHAT_STREAMER_EXCHANGE_RATE" not in bd.mesh_env("server")
    assert float(bd.mesh_env("device")["TOPHAT_STREAMER_EXCHANGE_RATE"]) == bd.DEVICE_EXCHANGE_RATE


def test_the_mesh_gives_devices_room_for_paced_requests_and_the_verifier_the_full_model():
    from tophatctl.mesh import Mesh

    config = bd.mesh_config("device", model_dir=str(DEMO_MODEL_DIR), devices=2, link="lat=5ms", speed="3")
    device = Mesh(config)._device_env(1, str(DEMO_MODEL_DIR))  # what device agent 1's process is given
    assert device["TOPHAT_DEVICE_MAX_SESSIONS"] == str(bd.DEVICE_SESSIONS)
    assert device["TOPHAT_DEVICE_SPEED"] == "3" and device["TOPHAT_DEVICE_LINK"] == "lat=5ms"
    assert config.extra_env["TOPHAT_VERIFIER_FULL_MODEL"] == "true" and config.num_devices == 2


def test_the_device_exchange_rate_makes_the_streamers_cost_model_device_constrained():
    from services.token_streamer.settings import load_settings

    env = {k: v for k, v in bd.mesh_env("device").items() if k.startswith("TOPHAT_STREAMER_")}
    assert load_settings(env).cost_model().constraint() == "device"
    assert load_settings({}).cost_model().constraint() == "server"


@pytest.mark.parametrize("text, expected", [("0.1,0.25", [0.1, 0.25]), ("0.5,0.5", [0.5]), ("0,1", [0.0, 1.0])])
def test_budgets_parse(text, expected):
    assert bd.parse_budgets(text) == expected


@pytest.mark.parametrize("text", ["", "1.5", "-0.1", "nan", "a"])
def test_bad_budgets_are_refused(text):
    with pytest.raises(ValueError):
        bd.parse_budgets(text)


def test_constraints_parse():
    assert bd.parse_constraint("both") == ["server", "device"]
    assert bd.parse_constraint("device") == ["device"]
    with pytest.raises(ValueError):
        bd.parse_constraint("cheap")


def test_output_paths_take_a_json_name_or_a_folder(tmp_path):
    assert bd.output_paths(tmp_path / "x.json") == (tmp_path / "x.json", tmp_path / "x-runs")
    assert bd.output_paths(tmp_path) == (tmp_path / "disco.json", tmp_path / "disco-runs")


def test_the_cli_parses_disco_options_and_refuses_bad_ones(monkeypatch, tmp_path):
    from tophat import cli

    seen = {}

    def fake_bench(**kwargs):
        seen.update(kwargs)
        return "TABLE", tmp_path / "d.json", []

    monkeypatch.setattr(bd, "bench_disco", fake_bench)
    runner = CliRunner()
    result = runner.invoke(
        cli.app,
        [
            "bench",
            "disco",
            "--model",
            "demo",
            "--budget",
            "0.1,0.75",
            "--constraint",
            "both",
            "--reading-rate",
            "4",
            "--rate",
            "1.5",
            "--out",
            str(tmp_path / "d.json"),
            "--no-migration",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "TABLE" in result.output
    assert seen["budgets"] == [0.1, 0.75] and seen["constraints"] == ["server", "device"]
    assert seen["rate"] == 1.5 and seen["reading_rate_tps"] == 4.0 and seen["migration"] is False
    assert seen["link"] == bd.DEFAULT_LINK and seen["speed"] == bd.DEFAULT_SPEED
    for bad in (
        ["--budget", "2"],
        ["--constraint", "x"],
        ["--rate", "0"],
        ["--speed", "0.5"],
        ["--link", "lat=5"],
        ["--rates", "1"],
    ):
        result = runner.invoke(cli.app, ["bench", "disco", "--model", "demo", *bad])
        assert result.exit_code == 2, (bad, result.output)


@pytest.mark.slow
def test_a_tiny_bench_against_a_real_mesh_reports_every_policy(tmp_path):
    table, json_path, plots = bd.bench_disco(
        constraints=["server"],
        budgets=[0.5],
        workload="specbench",
        rate=4.0,
        num_requests=3,
        max_new_tokens=4,
        seed=0,
        out=tmp_path / "disco.json",
        devices=1,
        link="lat=5ms,jitter=2ms",
        speed="2",
        model_dir=str(DEMO_MODEL_DIR),
        reading_rate_tps=200.0,
    )
    saved = json.loads(json_path.read_text())
    entries = {(e["mode"], e["budget"]): e for e in saved["entries"]}
    assert set(entries) == {("device", None), ("cloud", None), ("random", 0.5), ("disco", 0.5)}
    for e in entries.values():
        assert e["completed"] == 3, e["errors"]
        for key in ("mean_ttft_ms", "p99_ttft_ms", "mean_cost", "p99_tbt_ms"):
            assert math.isfinite(e[key]), (e["mode"], key)
    assert entries[("cloud", None)]["endpoints"] == {"cloud": 3}
    assert entries[("device", None)]["endpoints"] == {"device": 3}
    assert "ratios" in entries[("disco", 0.5)] and "pareto_mean" in entries[("disco", 0.5)]
    assert saved["config"]["meshes"][0]["history_before_disco"]["prompt_tokens"] >= 6
    assert all(p.exists() for p in plots) and "disco@0.5" in table
    lines = (tmp_path / "disco-runs" / "server" / "disco@0.5" / "tophat.jsonl").read_text().splitlines()
    assert len(lines) == 3 and all(json.loads(line)["tophat"]["dispatch"] == "disco" for line in lines)
