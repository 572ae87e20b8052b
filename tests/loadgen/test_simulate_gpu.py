"""`tophat simulate --gpu-profile`: g(mu) from `tophat bench gpu`'s JSON, replicas, the draft budget per round."""

from __future__ import annotations

import copy
import json
import math

import pytest

from loadgen.simulate.budget import budget_options, chain_figures, choose_shape
from loadgen.simulate.calibration import Calibration, DeviceProfile, GTable
from loadgen.simulate.cloud import Cloud, ReplicatedCloud
from loadgen.simulate.events import EventLoop
from loadgen.simulate.gpu_profile import (
    DEFAULT_ADAPTER_REPORT,
    NAMED_PROFILES,
    GpuProfileError,
    accept_from_adapter_report,
    gpu_calibration,
    gpu_g_table,
    load_adapter_accept,
    load_gpu_profile,
    parse_gpu_profile,
)
from loadgen.simulate.modes import parse_mode
from loadgen.simulate.report import ratio_summary
from loadgen.simulate.run import SimConfig, run_simulation
from loadgen.simulate.session import SimRequest
from shared.net.links import PROFILES

PROFILE = {
    "meta": {"gpu": "Test GPU", "model": "tiny", "hidden_size": 512, "layers": 10},
    "stages": {
        "verify": {"status": "ok", "middle_layers": 8, "ms": {"1": 10.0, "4": 9.0, "8": 12.0, "32": 20.0}},
        "cuda_graphs": {"verify_1row": {"eager_ms": 8.0, "graph_ms": 2.0}},
        "decode": {"tok_s": {"1": 100.0, "8": 400.0}},
    },
}


def test_profile_parsed_and_curve_interpolated_monotone():
    profile = parse_gpu_profile(PROFILE, "test")
    assert (profile.hidden_size, profile.layers, profile.middle_layers, profile.split_layers) == (512, 10, 8, 2)
    assert profile.verify_ms == ((1, 10.0), (4, 9.0), (8, 12.0), (32, 20.0))
    assert profile.graph_factor == pytest.approx(0.25)
    assert profile.decode_step_ms == ((1, 10.0), (8, 20.0))
    g = GTable(gpu_g_table(profile, "eager"))
    assert g(1) == pytest.approx(0.010)
    assert g(4) == pytest.approx(0.010)  # running max: a pass never gets cheaper with more rows
    assert g(20) == pytest.approx(0.016)  # halfway between 8 (12 ms) and 32 (20 ms)
    values = [g(m) for m in range(1, 200)]
    assert values == sorted(values) and g(64) > g(32)  # extrapolated upward from the edge segment
    graph = GTable(gpu_g_table(profile, "graph"))
    assert graph(1) == pytest.approx(0.0025) and graph(20) == pytest.approx(0.004)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d["stages"].pop("verify"), "no stages.verify"),
        (lambda d: d["stages"]["verify"].pop("ms"), "stages.verify has no ms"),
        (lambda d: d["stages"]["verify"]["ms"].update({"1": "fast"}), "must be a positive number"),
        (lambda d: d["stages"]["verify"]["ms"].update({"1": -1.0}), "must be a positive number"),
        (lambda d: d["stages"]["verify"]["ms"].update({"many": 3.0}), "is not a row count"),
        (lambda d: d["stages"]["verify"].update(ms={}), "non-empty object"),
        (lambda d: d.pop("meta"), "no meta"),
        (lambda d: d["meta"].pop("hidden_size"), "meta.hidden_size"),
        (lambda d: d["stages"]["verify"].update(middle_layers=10), "need 0 < middle < layers"),
        (lambda d: d["stages"]["cuda_graphs"]["verify_1row"].update(eager_ms=None), "eager_ms"),
    ],
)
def test_schema_errors_are_typed_and_say_what(mutate, message):
    data = copy.deepcopy(PROFILE)
    mutate(data)
    with pytest.raises(GpuProfileError, match=message):
        parse_gpu_profile(data, "test")


def test_bad_inputs_outside_the_schema(tmp_path):
    with pytest.raises(GpuProfileError, match="JSON object"):
        parse_gpu_profile([1, 2], "test")
    with pytest.raises(GpuProfileError, match="cannot read GPU profile"):
        load_gpu_profile(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(GpuProfileError, match="is not JSON"):
        load_gpu_profile(tmp_path / "bad.json")
    no_graphs = copy.deepcopy(PROFILE)
    del no_graphs["stages"]["cuda_graphs"]
    with pytest.raises(GpuProfileError, match="cuda_graphs"):
        gpu_g_table(parse_gpu_profile(no_graphs, "test"), "graph")
    with pytest.raises(GpuProfileError, match="passes"):
        gpu_g_table(parse_gpu_profile(PROFILE, "test"), "warp")
    with pytest.raises(GpuProfileError, match="held_out.distribution"):
        accept_from_adapter_report({"held_out": {}}, "report")
    assert issubclass(GpuProfileError, ValueError)  # the CLI reports it as a usage error


def test_committed_h100_profile_and_adapter_accepts():
    profile = load_gpu_profile("h100")
    assert profile.source == "docs/benchmarks/gpu-h100.json" and NAMED_PROFILES["h100"].is_file()
    assert (profile.hidden_size, profile.split_layers) == (576, 2)
    assert [rows for rows, _ in profile.verify_ms] == [1, 4, 8, 16, 32]
    assert all(10 < ms < 12 for _, ms in profile.verify_ms)  # launch-bound: the same for 1 and 32 rows
    assert 0.15 < profile.graph_factor < 0.2
    accept = load_adapter_accept(DEFAULT_ADAPTER_REPORT)
    report = json.loads(DEFAULT_ADAPTER_REPORT.read_text())
    assert len(accept) == 9 and sum((i + 1) * p for i, p in enumerate(accept)) == pytest.approx(
        report["held_out"]["mean_accept_length"], abs=2e-3
    )
    cal = gpu_calibration(profile, accept)
    assert (cal.hidden_size, cal.num_layers, cal.split_layers) == (576, 30, 2)
    assert cal.g(1) == pytest.approx(profile.verify_ms[0][1] / 1e3)
    near = cal.devices[0]
    assert near.beta_up == pytest.approx(PROFILES["near"].uplink_bytes_s * 576 / 4096)
    assert near.latency_s == PROFILES["near"].latency_s and near.gamma_s == Calibration().devices[0].gamma_s
    assert cal.max_draft == 8 and cal.mean_accept_length == pytest.approx(
        report["held_out"]["mean_accept_length"], abs=2e-3
    )


def test_accept_distribution_fills_gaps():
    assert accept_from_adapter_report({"held_out": {"distribution": {"1": 1, "3": 3}}}) == [0.25, 0.0, 0.75]


def test_replicas_pin_sessions_and_batch_apart():
    loop = EventLoop()
    replicas = [Cloud(loop, GTable([(1, 0.010), (100, 0.010)])) for _ in range(2)]
    cloud = ReplicatedCloud(replicas)
    assert cloud.for_session(1) is replicas[0] and cloud.for_session(2) is replicas[1]
    assert cloud.for_session(3) is replicas[0] and cloud.for_session(1) is replicas[0]  # pinned
    done = []
    for sid in (1, 2, 3):
        cloud.submit(sid, 1, lambda sid=sid: done.append((sid, loop.now)))
    loop.run()
    assert sorted(done) == [(1, 0.010), (2, 0.010), (3, 0.010)]  # 1 and 3 in one batch, 2 on the other GPU
    assert [len(r.steps) for r in replicas] == [1, 1] and replicas[0].last_sessions() == 2
    cloud.close(2)
    assert cloud.open == [2, 0] and cloud.for_session(4) is replicas[1]
    summary = cloud.summary()
    assert summary["replicas"] == 2 and summary["steps"] == 2 and summary["mean_batched_tokens"] == 1.5


def test_more_replicas_shorten_a_loaded_cloud():
    cal = Calibration(
        g_table=[(1, 0.010), (4096, 0.010 + 4095 * 1e-4)],
        accept_dist=[1.0],
        devices=[DeviceProfile("d", 0.0, 0.0, math.inf, math.inf, 0.0)],
        session_open_rtt=False,
    )
    reqs = [SimRequest(i, 0.0, 400, 4) for i in range(8)]
    mean = {}
    for n in (1, 4):
        config = SimConfig(devices=8, stages=1, heterogeneous=False, replicas=n)
        sim = run_simulation(cal, "ushape", math.inf, config, requests=reqs)
        mean[n] = sim.results["mean_ttft_ms"]
        assert sim.results["replicas"] == n and sim.results["cloud"]["replicas"] == n
    assert mean[4] < mean[1] / 2


def test_budget_options_and_choice():
    cal = Calibration(accept_dist=[0.5, 0.3, 0.2])  # L = 1, 2, 3; K = 2
    accept, rows = chain_figures(cal)
    assert accept == pytest.approx(1.7) and rows == pytest.approx(0.5 * 2 + 0.3 * 3 + 0.2 * 3)
    none, chain = budget_options(cal, 0.004)
    assert (none.rows, none.draft_s) == (1.0, 0.004) and chain.draft_s == pytest.approx(0.004 * rows)
    far = DeviceProfile("far", 0.004, 0.0, math.inf, math.inf, 0.050)
    flat = GTable([(1, 0.010), (4096, 0.011)])
    assert choose_shape(cal, far, 0.004, 30, flat) == "chain"  # long round trips, rows nearly free
    steep = GTable([(1, 0.010), (10, 0.100)])
    assert choose_shape(cal, far, 0.004, 30, steep) == "none"  # every row costs 30 sessions' compute
    slow = DeviceProfile("xavier", 0.2, 0.0, math.inf, math.inf, 0.001)
    assert choose_shape(cal, slow, 0.2, 1, flat) == "none"  # drafting costs more than round trips save


def test_budget_mode_parses_and_runs():
    mode = parse_mode("hat-budget")
    assert mode.draft_budget and mode.speculative and mode.client_chunking and mode.parallel_drafting
    assert parse_mode("hat-sd-budget").draft_budget and not parse_mode("hat").draft_budget
    with pytest.raises(ValueError, match="needs speculative"):
        parse_mode("hat-pc-budget")
    cal = gpu_calibration(load_gpu_profile("h100"), load_adapter_accept())
    config = SimConfig(devices=6, stages=1, replicas=2, num_requests=6, max_new_tokens=16)
    grid = {
        "rates": [2.0],
        "runs": [run_simulation(cal, name, 2.0, config).results for name in ("ushape", "hat", "hat-budget")],
    }
    budget = grid["runs"][2]
    assert set(budget["budget_rounds"]) <= {"none", "chain"} and sum(budget["budget_rounds"].values()) > 0
    table = ratio_summary(grid, "ushape", "hat", target=100.0)
    assert "hat-budget" in table and "at every rate: yes" in table
    assert "at every rate: no" in ratio_summary(grid, "ushape", "hat", target=1e-6)


def test_cli_with_gpu_profile(tmp_path):
    import typer
    from typer.testing import CliRunner

    from loadgen.simulate.cli import simulate_command

    app = typer.Typer()
    app.command("simulate")(simulate_command)
    app.command("other")(lambda: None)
    args = [
        "simulate",
        "--devices",
        "4",
        "--rates",
        "2",
        "--modes",
        "ushape,hat",
        "-n",
        "4",
        "--max-new-tokens",
        "8",
        "--gpu-profile",
        "h100",
        "--target",
        "0.6",
    ]
    result = CliRunner().invoke(app, [*args, "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "eager passes, 8 replicas" in result.output and "at every rate:" in result.output
    grid = json.loads((tmp_path / "simulation.json").read_text())
    assert grid["config"]["replicas"] == 8 and grid["config"]["stages"] == 1
    result = CliRunner().invoke(app, [*args[:-4], "--gpu-profile", str(tmp_path / "nope.json")])
    assert result.exit_code == 2 and "cannot read GPU profile" in result.output
