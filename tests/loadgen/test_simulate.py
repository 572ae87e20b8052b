"""`tophat simulate`: hand-checkable timelines, batching, pipelining, PC/SD/PD, determinism,
and that the simulator replays the load generator's trace."""

from __future__ import annotations

import dataclasses
import json
import math
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import numpy as np
import pytest

from loadgen.arrivals import arrival_times
from loadgen.simulate.calibration import Calibration, DeviceProfile, GTable
from loadgen.simulate.cloud import Cloud
from loadgen.simulate.events import EventLoop
from loadgen.simulate.fit import calibration_from_state, from_telemetry
from loadgen.simulate.modes import parse_mode
from loadgen.simulate.report import compare_with_real
from loadgen.simulate.run import SimConfig, build_requests, run_simulation
from loadgen.simulate.session import SimRequest
from loadgen.workloads import BUILTIN, MIN_PROMPT_TOKENS, fit_lengths
from shared.planning.planners import chunk_size_eq3
from shared.planning.state_model import CloudState

A = 1000  # bytes per token on the wire: hidden 500 x fp16
LAT = 0.005
UP, DOWN = 1e6, 2e6
OPEN = 2 * LAT  # split modes open the cloud session first: one round trip (frames of 0 bytes here)


def g_lin(mu: float) -> float:
    return 0.010 + 0.0001 * (mu - 1)


def make_cal(**kw) -> Calibration:
    """One device, linear g(mu) = 10 ms + 0.1 ms/token, no frame overhead: every number by hand."""
    base = dict(
        g_table=[(1, g_lin(1)), (1001, g_lin(1001))],
        devices=[DeviceProfile("d0", gamma_s=0.002, prefill_token_s=1e-4, beta_up=UP, beta_down=DOWN, latency_s=LAT)],
        accept_dist=[1.0],
        hidden_size=500,
        frame_overhead_bytes=0,
    )
    base.update(kw)
    return Calibration(**base)


def run(cal: Calibration, mode: str, reqs: list[SimRequest], devices: int = 1, stages: int = 1, **cfg):
    config = SimConfig(devices=devices, stages=stages, heterogeneous=False, **cfg)
    return run_simulation(cal, mode, math.inf, config, requests=reqs)


def gaps(record) -> list[float]:
    t = record.chunk_times_s
    return [b - a for a, b in zip(t, t[1:])]


# -- hand-checkable single-request timelines ----------------------------------------------


@pytest.mark.parametrize("stages", [1, 4])
def test_ushape_single_request_timeline(stages):
    S, gamma, p = 200, 0.002, 1e-4
    sim = run(make_cal(), "ushape", [SimRequest(0, 0.0, S, 5)], stages=stages)
    rec = sim.records[0]
    ttft = OPEN + S * p + S * A / UP + LAT + g_lin(S) + A / DOWN + LAT
    assert rec.chunk_times_s[0] == pytest.approx(ttft, abs=1e-12)
    per_token = gamma + A / UP + LAT + g_lin(1) + A / DOWN + LAT
    assert gaps(rec) == pytest.approx([per_token] * 4, abs=1e-12)
    assert rec.chunk_tokens == [1] * 5 and rec.end_s == rec.chunk_times_s[-1]


def test_step_and_round_overheads_add_where_the_real_mesh_pays_them():
    S, gamma, p, step_o, round_o = 200, 0.002, 1e-4, 0.0015, 0.004
    rec = run(make_cal(step_overhead_s=step_o, round_overhead_s=round_o), "ushape", [SimRequest(0, 0.0, S, 3)]).records[
        0
    ]
    # every cloud step pays step_o; the device pays round_o after each answer (prefill included)
    ttft = OPEN + S * p + S * A / UP + LAT + g_lin(S) + step_o + A / DOWN + LAT + round_o
    assert rec.chunk_times_s[0] == pytest.approx(ttft, abs=1e-12)
    per_token = gamma + A / UP + LAT + g_lin(1) + step_o + A / DOWN + LAT + round_o
    assert gaps(rec) == pytest.approx([per_token] * 2, abs=1e-12)


def test_skewed_round_overhead_keeps_the_measured_mean_and_median():
    cal = make_cal(round_overhead_s=0.004, round_overhead_median_s=0.002)
    rec = run(cal, "ushape", [SimRequest(0, 0.0, 10, 3001)]).records[0]
    fixed = 0.002 + A / UP + LAT + g_lin(1) + A / DOWN + LAT
    overheads = np.array(gaps(rec)) - fixed
    assert overheads.min() > 0
    assert overheads.mean() == pytest.approx(0.004, rel=0.1) and np.median(overheads) == pytest.approx(0.002, rel=0.1)
    assert make_cal(round_overhead_s=0.004, round_overhead_median_s=0.005).round_overhead_sigma == 0.0  # constant


def test_ttft_is_upload_plus_compute_plus_download_exactly():
    cal = make_cal(devices=[DeviceProfile("d", 0.002, 0.0, UP, DOWN, 0.0)])
    rec = run(cal, "ushape", [SimRequest(0, 0.0, 300, 1)]).records[0]
    assert rec.chunk_times_s[0] == pytest.approx(300 * A / UP + g_lin(300) + A / DOWN, abs=1e-12)


def test_usarathi_server_chunks_run_in_successive_steps():
    S = 300
    sim = run(make_cal(), "usarathi-128", [SimRequest(0, 0.0, S, 1)])
    ttft = OPEN + S * 1e-4 + S * A / UP + LAT + g_lin(128) * 2 + g_lin(44) + A / DOWN + LAT
    assert sim.records[0].chunk_times_s[0] == pytest.approx(ttft, abs=1e-12)
    assert [s.tokens for s in sim.cloud.steps[:3]] == [128, 128, 44]


def test_cloud_mode_uploads_token_ids_and_runs_the_whole_model():
    cal = make_cal(cloud_compute_scale=1.5)
    S = 200
    ttft = OPEN + S * 4 / UP + LAT + 1.5 * g_lin(S) + 4 / DOWN + LAT  # 4-byte token ids
    rec = run(cal, "cloud", [SimRequest(0, 0.0, S, 4)]).records[0]  # one token per round trip
    assert rec.chunk_times_s[0] == pytest.approx(ttft, abs=1e-12)
    assert gaps(rec) == pytest.approx([4 / UP + LAT + 1.5 * g_lin(1) + 4 / DOWN + LAT] * 3, abs=1e-12)
    rec = run(cal, "cloud-stream", [SimRequest(0, 0.0, S, 4)]).records[0]  # the cloud decodes on its own
    assert rec.chunk_times_s[0] == pytest.approx(ttft, abs=1e-12)
    assert gaps(rec) == pytest.approx([1.5 * g_lin(1)] * 3, abs=1e-12)
    assert make_cal().compute_scale == pytest.approx(32 / 30)  # default n / (n - m)


# -- cloud: batching and pipeline stages ---------------------------------------------------


def test_concurrent_sessions_share_one_step():
    S, n = 100, 6
    reqs = [SimRequest(i, 0.0, S, n) for i in range(2)]
    devs = [DeviceProfile(f"d{i}", 0.002, 0.0, UP, DOWN, LAT) for i in range(2)]
    sim = run(make_cal(devices=devs), "ushape", reqs, devices=2)
    assert {r.device_id for r in sim.records} == {"d0", "d1"}
    assert [s.tokens for s in sim.cloud.steps] == [2 * S] + [2] * (n - 1)  # one g(mu) step per round for both
    ttft = OPEN + S * A / UP + LAT + g_lin(2 * S) + A / DOWN + LAT
    for rec in sim.records:
        assert rec.chunk_times_s[0] == pytest.approx(ttft, abs=1e-12)
        assert gaps(rec) == pytest.approx([0.002 + A / UP + LAT + g_lin(2) + A / DOWN + LAT] * (n - 1), abs=1e-12)


def g_cb(mu: float) -> float:
    """Compute-bound: cost grows with the batch, so splitting work over stages pays."""
    return 0.001 + 0.001 * mu


def _cloud_throughput(stages: int, sessions: int = 32, horizon: float = 1.0) -> tuple[int, Cloud]:
    loop = EventLoop()
    cloud = Cloud(loop, GTable([(1, g_cb(1)), (1001, g_cb(1001))]), stages=stages)
    done = [0]

    def again(sid: int) -> None:
        done[0] += 1
        if loop.now < horizon:
            cloud.submit(sid, 1, lambda: again(sid))

    for sid in range(sessions):
        cloud.submit(sid, 1, lambda sid=sid: again(sid))
    loop.run()
    return done[0], cloud


def test_pipeline_stages_overlap_micro_batches_and_raise_throughput():
    t1, c1 = _cloud_throughput(1)
    t2, c2 = _cloud_throughput(2)
    t4, c4 = _cloud_throughput(4)
    assert t1 < t2 < t4 and t4 > 2 * t1
    assert (c1.max_in_flight, c2.max_in_flight, c4.max_in_flight) == (1, 2, 4)
    # Micro-batch 2 enters stage 0 as soon as micro-batch 1 leaves it: g(mu)/P later.
    first, second = c4.steps[0], c4.steps[1]
    assert first.tokens == second.tokens == 8  # 32 ready tokens over 4 free slots
    assert second.start == pytest.approx(first.start + g_cb(8) / 4)
    assert first.end - first.start == pytest.approx(g_cb(8))


def test_one_session_items_never_overlap_unless_chunk_pipelining():
    for pipelined, expected_start in ((False, g_lin(64)), (True, g_lin(64) / 4)):
        loop = EventLoop()
        cloud = Cloud(loop, GTable([(1, g_lin(1)), (1001, g_lin(1001))]), stages=4, chunk_pipelining=pipelined)
        for _ in range(2):
            cloud.submit(7, 64, lambda: None, prefill=True)
        loop.run()
        assert cloud.steps[1].start == pytest.approx(expected_start)


# -- HAT mechanisms ----------------------------------------------------------------------


def test_prompt_chunking_hides_upload_behind_compute_on_a_slow_link():
    S, X = 1024, 128
    up = 1.024e6  # the whole prompt takes 1 s to upload ...
    cal = make_cal(
        g_table=[(1, 0.001), (2048, 2.048)],  # ... and g(S) = 1.024 s to compute
        devices=[DeviceProfile("slow", 0.002, 0.0, up, DOWN, LAT)],
        pc_chunk=X,
    )
    whole = run(cal, "ushape", [SimRequest(0, 0.0, S, 1)]).records[0].chunk_times_s[0]
    chunked = run(cal, "hat-pc", [SimRequest(0, 0.0, S, 1)]).records[0].chunk_times_s[0]
    assert whole == pytest.approx(OPEN + S * A / up + LAT + 1.024 + A / DOWN + LAT)
    # First chunk's upload, then the cloud is the bottleneck: 8 chunk steps back to back.
    assert chunked == pytest.approx(OPEN + X * A / up + LAT + 8 * 0.128 + A / DOWN + LAT)
    assert chunked < 0.6 * whole


def test_chunk_plan_uses_eq3_once_the_cloud_reports_load():
    cal = make_cal()
    sim = run(cal, "hat-pc", [SimRequest(0, 0.0, 900, 1), SimRequest(1, 10.0, 900, 1)])
    first, second = sim.processes
    assert first.chunks == [128] * 7 + [4]  # no telemetry yet: the planner's default chunk
    expected = chunk_size_eq3(A, UP, cal.g, sim.cloud.mu_ema, 1, cal.min_chunk, cal.max_chunk, 900)
    assert expected != 128 and set(second.chunks[:-1]) == {expected}


def test_speculation_with_accept_length_l_cuts_time_per_token():
    gamma, n = 0.002, 13
    cal = make_cal(accept_dist=[0.0, 0.0, 1.0])  # every round: k = 2 drafts, L = 3 tokens
    sd = run(cal, "hat-sd", [SimRequest(0, 0.0, 100, n)]).records[0]
    round_s = 3 * gamma + 3 * A / UP + LAT + g_lin(3) + 3 * A / DOWN + LAT
    assert sd.chunk_tokens == [1, 3, 3, 3, 3] and gaps(sd) == pytest.approx([round_s] * 4, abs=1e-12)
    token_s = gamma + A / UP + LAT + g_lin(1) + A / DOWN + LAT
    assert round_s / 3 < token_s
    assert (sd.end_s - sd.chunk_times_s[0]) / (n - 1) == pytest.approx(round_s / 3)
    assert sd.accept_length == 3


def test_a_fully_accepted_round_drafted_one_token_less():
    gamma = 0.002
    cal = make_cal(accept_dist=[0.0, 0.0, 1.0, 0.0])  # L = 3 every round, K = 3

    def round_s(k: int) -> float:
        return (k + 1) * gamma + (k + 1) * A / UP + LAT + g_lin(k + 1) + (k + 1) * A / DOWN + LAT

    ran_to_rejection = run(cal, "hat-sd", [SimRequest(0, 0.0, 100, 7)]).records[0]
    all_accepted = run(dataclasses.replace(cal, full_accept_rate=1.0), "hat-sd", [SimRequest(0, 0.0, 100, 7)]).records[
        0
    ]
    # k = 3 with the third rejected; the last round is capped by the tokens left (k = 2)
    assert gaps(ran_to_rejection) == pytest.approx([round_s(3), round_s(2)], abs=1e-12)
    assert gaps(all_accepted) == pytest.approx([round_s(2)] * 2, abs=1e-12)  # k = 2, both accepted, +1
    assert all_accepted.chunk_tokens == ran_to_rejection.chunk_tokens == [1, 3, 3]


def test_parallel_drafting_hits_skip_the_next_draft():
    cal = make_cal(accept_dist=[0.0, 1.0, 0.0], pd_steps=2)  # L = k = 2: the last draft token is corrected
    req = [SimRequest(0, 0.0, 100, 41)]

    def tbt(mode: str, hit: float) -> float:
        rec = run(dataclasses.replace(cal, pd_hit_rate=hit), mode, req).records[0]
        return (rec.end_s - rec.chunk_times_s[0]) / 40

    no_pd, miss, hit = tbt("hat-sd", 0.0), tbt("hat-sd-pd", 0.0), tbt("hat-sd-pd", 1.0)
    assert miss == pytest.approx(no_pd)  # 3 pre-draft steps fit the verify window: a miss costs nothing
    # Rounds 2..19 skip 3 draft steps, the last one (1 draft, the budget) skips 2; 40 tokens.
    assert no_pd - hit == pytest.approx((18 * 3 + 2) * 0.002 / 40)


def test_an_adopted_branch_shorter_than_the_chain_is_drafted_on():
    # L = k = 3 with K = 3: the last draft is corrected; pre-drafting fits one step, so an adopted branch holds one
    # draft and the device drafts the other two after the answer, to where the chain stops (_finish_ready_draft)
    cal = make_cal(accept_dist=[0.0, 0.0, 1.0, 0.0], pd_steps=1)
    req = [SimRequest(0, 0.0, 100, 31)]

    def record(hit: float):
        rec = run(dataclasses.replace(cal, pd_hit_rate=hit), "hat-sd-pd", req).records[0]
        return rec, (rec.end_s - rec.chunk_times_s[0]) / 30

    (miss, miss_tbt), (hit, hit_tbt) = record(0.0), record(1.0)
    assert hit.chunk_tokens == miss.chunk_tokens == [1] + [3] * 10  # adopted rounds are whole chains
    # rounds 2..10 skip the adopted root and its one draft: 2 steps of 2 ms each
    assert miss_tbt - hit_tbt == pytest.approx(9 * 2 * 0.002 / 30)


# -- runs: determinism, the load generator's trace, reports ----------------------------------


def test_same_seed_same_results_and_the_seed_matters():
    cal = Calibration()
    cfg = SimConfig(devices=4, stages=4, num_requests=12, seed=3, max_new_tokens=16)
    a, b = run_simulation(cal, "hat", 6.0, cfg), run_simulation(cal, "hat", 6.0, cfg)
    assert [r.chunk_times_s for r in a.records] == [r.chunk_times_s for r in b.records]
    assert json.dumps(a.results, sort_keys=True) == json.dumps(b.results, sort_keys=True)
    c = run_simulation(cal, "hat", 6.0, dataclasses.replace(cfg, seed=4))
    assert c.results["mean_ttft_ms"] != a.results["mean_ttft_ms"]


def test_requests_replay_the_load_generators_trace():
    seed, n, rate = 5, 40, 6.0
    reqs = build_requests("cnndm", n, rate, seed=seed, max_new_tokens=128, context_limit=2048, num_devices=3)
    assert [r.arrival_s for r in reqs] == arrival_times(rate, 1.0, num_requests=n, seed=seed).tolist()
    lengths = fit_lengths(BUILTIN["cnndm"], n, np.random.default_rng([seed, 2]), MIN_PROMPT_TOKENS, 2048 - 128)
    assert [r.prompt_tokens for r in reqs] == lengths.tolist()
    assert [r.device_hint for r in reqs] == [i % 3 for i in range(n)]
    sim = run_simulation(
        Calibration(),
        "ushape",
        rate,
        SimConfig(devices=3, num_requests=n, seed=seed, workload="cnndm", max_new_tokens=4),
    )
    assert [r.arrival_s for r in sim.records] == [r.arrival_s for r in reqs]


def test_heterogeneous_devices_and_mode_cycle():
    cal = Calibration()
    devs = cal.expand_devices(30)
    assert sum(d.slowdown == cal.slow_factor for d in devs) == 20 and sum(d.slowdown == 1 for d in devs) == 10
    assert len({d.beta_up for d in devs[:10]}) == 1 and devs[0].beta_up != devs[-1].beta_up  # 3 link groups
    assert cal.expand_devices(2) == cal.devices[:2]  # measured profiles are used as they are
    cycled = dataclasses.replace(cal, mode_cycle=[1.0, 10.0])  # speed mode changes every 5 requests
    reqs = [SimRequest(i, 10.0 * i, 500, 8) for i in range(10)]  # far apart: no interference
    slow = run(cycled, "ushape", reqs).records
    base = run(cal, "ushape", reqs).records
    assert [round(s.end_s - s.arrival_s, 9) > round(b.end_s - b.arrival_s, 9) for s, b in zip(slow, base)] == [
        False
    ] * 5 + [True] * 5


def test_modes_parse():
    hat = parse_mode("hat")
    assert (hat.speculative, hat.client_chunking, hat.parallel_drafting) == (True, True, True)
    assert parse_mode("usarathi", "cnndm").server_chunk == 256 and parse_mode("usarathi-64").server_chunk == 64
    for bad in ("hat-pd", "hat-xx", "medusa", "usarathi-x"):
        with pytest.raises(ValueError):
            parse_mode(bad)


def test_calibration_json_roundtrip_and_state_monitor_json(tmp_path):
    cal = make_cal(devices=[DeviceProfile("x", 0.003, 1e-4, math.inf, 2e6, 0.001, 2.0)], notes=["n"])
    cal.save(tmp_path / "c.json")
    back = Calibration.load(tmp_path / "c.json")
    assert back.to_dict() == cal.to_dict() and back.devices[0].beta_up == math.inf
    assert Calibration.from_dict({"base": "demo"}).hidden_size == 256
    with pytest.raises(ValueError):
        Calibration.from_dict({"hidden": 3})

    cloud = CloudState()
    for mu, eta in ((4, 0.004), (4, 0.006), (256, 0.030)):
        cloud.observe_step(mu, eta, 0.0)
    cloud_json = {"mu": cloud.mu.value, "alpha": 0.8, "g": {"buckets": cloud.g.table()}, "step_overhead_s": 0.0015}
    devices_json = {
        "devices": [
            {
                "device_id": "device-0",
                "gamma": 0.004,
                "beta_up": 5e5,
                "beta_down": None,
                "stale": False,
                "round_overhead_s": 0.004,
                "prefill_token_s": 3e-5,
                "rtt_s": 0.012,
                "pd_hit_rate": 0.7,
                "round_overhead_median_s": 0.002,
                "full_accept_rate": 0.4,
            },
            {"device_id": "device-1", "gamma": 0.008, "round_overhead_s": 0.006, "round_overhead_median_s": 0.003},
        ]
    }

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = json.dumps(cloud_json if self.path == "/state/cloud" else devices_json).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        got = from_telemetry(f"http://127.0.0.1:{server.server_port}", device_slowdowns={"device-0": 3.0})
    finally:
        server.shutdown()
    assert [round(p[1], 6) for p in got.g_table] == [round(p[1], 6) for p in cloud.g.points()]
    dev = got.devices[0]
    demo_cal = Calibration.from_dict({"base": "demo"})
    demo = demo_cal.devices[0]
    assert (dev.gamma_s, dev.beta_up, dev.beta_down, dev.slowdown) == (0.004, 5e5, demo.beta_down, 3.0)
    assert dev.prefill_token_s == 3e-5  # measured; device-1 reported none, so it is scaled from the base by gamma
    assert got.devices[1].prefill_token_s == pytest.approx(demo.prefill_token_s * 0.008 / demo.gamma_s)
    assert dev.latency_s == 0.006 and got.devices[1].latency_s == demo.latency_s  # half the probed round trip
    assert got.round_overhead_s == pytest.approx(0.005) and got.step_overhead_s == 0.0015
    assert got.pd_hit_rate == 0.7  # only device-0 pre-drafted
    assert got.round_overhead_median_s == pytest.approx(0.0025) and got.full_accept_rate == 0.4
    assert any("beta_down" in n for n in got.notes)
    empty = calibration_from_state(None, None)
    assert empty.g_table == Calibration.from_dict({"base": "demo"}).g_table
    assert (empty.round_overhead_s, empty.step_overhead_s) == (demo_cal.round_overhead_s, demo_cal.step_overhead_s)


def test_g_is_fitted_to_the_steps_between_two_reads_of_the_monitor():
    """sim-check's g(mu): the plain means of the steps one run made (both reads of /state/cloud), not the EMAs,
    which weigh the last few steps; non-decreasing like the planner's curve; the EMAs where nothing ran between."""
    cloud = CloudState()
    for mu, eta in ((1, 0.100), (4, 0.200)):  # an earlier run's steps
        cloud.observe_step(mu, eta, 0.0)

    def read():
        return json.loads(json.dumps({"g": {"buckets": cloud.g.table()}}))  # as the monitor serves it

    before = read()
    for mu, eta in ((1, 0.010), (1, 0.012), (1, 0.050), (2, 0.004), (64, 0.040)):
        cloud.observe_step(mu, eta, 0.0)
    cal = calibration_from_state(read(), None, cloud_before=before)
    flat = [x for point in cal.g_table for x in point]
    assert flat == pytest.approx([1.0, 0.024, 2.0, 0.024, 64.0, 0.040])  # 2's mean (4 ms) kept monotone
    assert cloud.g.predict(1) > 0.024 + 0.01  # the EMA, led by the 50 ms step, and the first run's 100 ms
    assert any("means of the run's 5 steps in 3 buckets" in note for note in cal.notes)
    assert calibration_from_state(read(), None, cloud_before=read()).g_table == [
        (mu, eta) for mu, eta in cloud.g.points()
    ]  # no step in between: the monitor's own curve


def test_compare_with_real_and_cli(tmp_path):
    import typer
    from typer.testing import CliRunner

    from loadgen.simulate.cli import simulate_command

    app = typer.Typer()
    app.command("simulate")(simulate_command)
    app.command("other")(lambda: None)  # two commands, so each is invoked by name
    real = {
        "request_rate": 4.0,
        "num_devices": 2,
        "mean_ttft_ms": 100.0,
        "median_ttft_ms": 100.0,
        "p90_ttft_ms": 100.0,
        "p99_ttft_ms": 100.0,
        "mean_tbt_ms": 50.0,
        "median_tbt_ms": 50.0,
        "p90_tbt_ms": 50.0,
        "p99_tbt_ms": 50.0,
        "mean_accept_length": 2.0,
    }
    (tmp_path / "real.json").write_text(json.dumps(real))
    result = CliRunner().invoke(
        app,
        [
            "simulate",
            "--devices",
            "2",
            "--rates",
            "4",
            "--modes",
            "ushape,hat",
            "-n",
            "6",
            "--max-new-tokens",
            "8",
            "--out",
            str(tmp_path / "out"),
            "--compare-real",
            str(tmp_path / "real.json"),
            "--real-mode",
            "hat",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "TTFT/ushape" in result.output and "rel diff" in result.output
    grid = json.loads((tmp_path / "out" / "simulation.json").read_text())
    assert [r["mode"] for r in grid["runs"]] == ["ushape", "hat"]
    table = compare_with_real(grid, real, mode="hat", echo=False)
    sim_hat = grid["runs"][1]
    assert f"{(sim_hat['mean_ttft_ms'] - 100) / 100:+.1%}" in table
    assert Calibration.load(tmp_path / "out" / "calibration.json").hidden_size == 4096


def test_sim_check_simulates_hat_with_the_draft_budget_where_the_devices_run_it(monkeypatch):
    from loadgen.bench_sim_check import simulated_mode

    monkeypatch.delenv("TOPHAT_DEVICE_DRAFT_BUDGETS", raising=False)
    assert (simulated_mode("hat"), simulated_mode("ushape")) == ("hat-budget", "ushape")  # the devices' default
    monkeypatch.setenv("TOPHAT_DEVICE_DRAFT_BUDGETS", "")  # budgeting off: hat's rounds are all chains
    assert simulated_mode("hat") == "hat"
