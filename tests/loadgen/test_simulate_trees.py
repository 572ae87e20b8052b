"""Tree rounds in `tophat simulate`: measured (rows, tokens) draws, rows charged at the verifier and on the
link, drafting at the measured tree/chain ratio, no pre-drafting around trees, and the budget's tree option."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest

from loadgen.simulate.budget import budget_options, chain_figures, choose_shape, tree_draft_s
from loadgen.simulate.calibration import Calibration, DeviceProfile, GTable
from loadgen.simulate.gpu_profile import (
    DEFAULT_ADAPTER_REPORT,
    GpuProfileError,
    gpu_calibration,
    load_adapter_accept,
    load_full_accept_rate,
    load_gpu_profile,
)
from loadgen.simulate.modes import parse_mode
from loadgen.simulate.run import SimConfig, run_simulation
from loadgen.simulate.session import SimRequest
from loadgen.simulate.trees import DEFAULT_TREES_BENCH, draft_ratio_from_bench, tree_joint_from_report, with_trees

IDEAL = DeviceProfile("d", 0.002, 0.0, math.inf, math.inf, 0.0)  # links cost nothing: only compute is timed


def tree_cal(joint, ratio=1.5, **kw) -> Calibration:
    kw.setdefault("devices", [IDEAL])
    return Calibration(
        accept_dist=[0.5, 0.5],
        tree_nodes=16,
        tree_joint=joint,
        tree_draft_ratio=ratio,
        session_open_rtt=False,
        **kw,
    )


def run(cal, mode, requests, **config):
    config = SimConfig(devices=1, stages=1, heterogeneous=False, **config)
    return run_simulation(cal, mode, math.inf, config, requests=requests)


def test_calibration_checks_and_normalises_tree_rounds():
    cal = tree_cal([[5, 2, 1.0], [17, 4, 3.0]])
    assert cal.has_trees and cal.tree_shape == "tree16"
    assert cal.tree_joint == [[5, 2, 0.25], [17, 4, 0.75]]
    assert cal.tree_means() == pytest.approx((3.5, 14.0))
    with pytest.raises(ValueError, match="tokens <= rows"):
        tree_cal([[3, 4, 1.0]])  # a round cannot yield more tokens than rows it sent
    with pytest.raises(ValueError, match="together"):
        Calibration(tree_joint=[[5, 2, 1.0]], tree_draft_ratio=1.5)  # no node count
    with pytest.raises(ValueError, match="together"):
        tree_cal([[5, 2, 1.0]], ratio=-1.0)
    assert not Calibration().has_trees
    assert Calibration.from_dict(tree_cal([[9, 3, 1.0]]).to_dict()).tree_joint == [[9, 3, 1.0]]


def test_tree_figures_read_from_the_report_and_the_bench():
    report = {"held_out": {"trees": {"16": {"by_rows": {"5": {"1": 3, "2": 1}, "17": {"4": 6}}}}}}
    assert sorted(tree_joint_from_report(report, 16)) == [[5.0, 1.0, 3.0], [5.0, 2.0, 1.0], [17.0, 4.0, 6.0]]
    with pytest.raises(GpuProfileError, match="held_out.trees.32.by_rows"):
        tree_joint_from_report(report, 32)
    bench = {"budgets": {"0": {"draft_ms_per_round": 10.0}, "16": {"draft_ms_per_round": 15.5}}}
    assert draft_ratio_from_bench(bench, 16) == pytest.approx(1.55)
    with pytest.raises(GpuProfileError, match="budgets.0 and budgets.8"):
        draft_ratio_from_bench(bench, 8)


def test_tree_draws_follow_the_measured_rounds():
    joint = [[5, 1, 0.2], [9, 2, 0.3], [17, 5, 0.5]]
    cal = tree_cal(joint)
    sim = run(cal, "hat-tree", [SimRequest(0, 0.0, 16, 2000)])  # one session: a step is one round's rows
    rounds = sim.processes[0].rounds[:-1]  # the last round is cut to the tokens left
    counts = Counter(rounds)
    assert set(counts) == {1, 2, 5}
    n = len(rounds)
    for _, tokens, p in joint:
        assert counts[tokens] / n == pytest.approx(p, abs=0.04)
    # each decode step verified one tree's rows, drawn with its tokens
    decode_rows = [step.tokens for step in sim.cloud.steps[1:-1]]  # after the prompt's step, before the cut round
    assert [{1: 5, 2: 9, 5: 17}[L] for L in rounds] == decode_rows


def test_a_tree_round_charges_its_rows_and_the_measured_drafting():
    cal = tree_cal([[9, 3, 1.0]], ratio=1.6, g_table=[(1, 0.001), (100, 0.100)])  # 1 ms a row
    sim = run(cal, "hat-tree", [SimRequest(0, 0.0, 4, 10)])  # prefill token, then rounds of 3, 3, 3
    decode = [step for step in sim.cloud.steps if step.tokens != 4]
    assert [step.tokens for step in decode] == [9, 9, 9]
    assert [step.compute_s for step in decode] == pytest.approx([0.009] * 3)
    expected = 1.6 * 0.002 * chain_figures(cal)[1]
    assert tree_draft_s(cal, 0.002) == pytest.approx(expected)
    prefill = 4 * IDEAL.prefill_token_s
    assert sim.devices[0].compute.busy_s == pytest.approx(prefill + 3 * expected)
    assert sim.records[0].accept_length == pytest.approx(3.0)


def test_no_predrafting_around_trees():
    cal = tree_cal([[5, 1, 1.0]], pd_hit_rate=1.0)  # every chain round would adopt a pre-drafted branch
    sim = run(cal, "hat-tree", [SimRequest(0, 0.0, 8, 20)])
    busy = sim.devices[0].compute.busy_s
    assert busy == pytest.approx(19 * tree_draft_s(cal, 0.002))  # 19 rounds of 1 token, each drafted in full


def test_tree_mode_parses_and_needs_measured_trees():
    mode = parse_mode("hat-tree")
    assert mode.tree_rounds and mode.speculative and mode.parallel_drafting and not mode.draft_budget
    with pytest.raises(ValueError, match="budget offers its tree"):
        parse_mode("hat-sd-pc-pd-tree-budget")
    with pytest.raises(ValueError, match="needs measured trees"):
        run(Calibration(session_open_rtt=False, devices=[IDEAL]), "hat-tree", [SimRequest(0, 0.0, 4, 4)])


def test_budget_offers_the_tree_and_falls_back_when_rows_cost_more():
    cal = tree_cal([[17, 3, 1.0]], ratio=1.5)
    names = [o.name for o in budget_options(cal, 0.004)]
    assert names == ["none", "chain", "tree16"]
    assert [o.name for o in budget_options(Calibration(), 0.004)] == ["none", "chain"]
    tree = budget_options(cal, 0.004)[2]
    assert (tree.accept, tree.rows) == (3.0, 17.0) and tree.draft_s == pytest.approx(tree_draft_s(cal, 0.004))
    far = DeviceProfile("far", 0.004, 0.0, math.inf, math.inf, 0.050)
    flat = GTable([(1, 0.010), (4096, 0.011)])
    assert choose_shape(cal, far, 0.004, 4, flat) == "tree16"  # long round trips, rows nearly free: most tokens
    steep = GTable([(1, 0.010), (10, 0.100)])
    assert choose_shape(cal, far, 0.004, 30, steep) == "none"  # every row costs 30 sessions' compute
    near = DeviceProfile("near", 0.004, 0.0, 1e5, 1e5, 0.001)  # rows cost ~12 ms each on the link
    assert choose_shape(cal, near, 0.004, 1, flat) != "tree16"


def test_budget_mode_runs_tree_rounds():
    cal = tree_cal([[17, 3, 1.0]], ratio=1.5, devices=[DeviceProfile("far", 0.004, 0.0, math.inf, math.inf, 0.050)])
    sim = run(cal, "hat-budget", [SimRequest(i, 0.0, 8, 16) for i in range(2)])
    shapes = sim.results["budget_rounds"]
    assert shapes.get("tree16", 0) > 0 and set(shapes) <= {"none", "chain", "tree16"}
    assert any(step.tokens == 17 or step.tokens == 34 for step in sim.cloud.steps)


def test_committed_adapter_report_and_trees_bench_feed_the_gpu_calibration():
    report = json.loads(DEFAULT_ADAPTER_REPORT.read_text())
    trees = report["held_out"]["trees"]["16"]
    cal = gpu_calibration(load_gpu_profile("h100"), load_adapter_accept(), full_accept_rate=load_full_accept_rate())
    assert cal.full_accept_rate == report["held_out"]["full_accept_rate"]
    cal = with_trees(cal, DEFAULT_ADAPTER_REPORT)
    tokens, rows = cal.tree_means()
    assert tokens == pytest.approx(trees["mean_accept_length"], abs=2e-3)
    assert rows == pytest.approx(trees["mean_rows"], abs=2e-3)
    bench = json.loads(DEFAULT_TREES_BENCH.read_text())["budgets"]
    assert cal.tree_draft_ratio == pytest.approx(bench["16"]["draft_ms_per_round"] / bench["0"]["draft_ms_per_round"])
    # the chain's rows with the measured full-accept rate: what the adapter's chain rounds sent
    assert chain_figures(cal)[1] == pytest.approx(report["held_out"]["mean_rows"], rel=0.05)
