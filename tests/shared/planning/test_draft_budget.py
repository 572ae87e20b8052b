"""The draft budget per round (shared/planning/draft_budget.py): the policy, the planner's POST /draft-budget from a
live state monitor, and the device's per-shape measurements."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from services.chunk_planner.settings import load_settings
from shared.planning.draft_budget import (
    MAX_ROWS,
    BudgetError,
    BudgetOption,
    BudgetRequest,
    DraftShape,
    LinkLoad,
    budget_from_state,
    choose_budget,
    round_seconds,
)
from shared.planning.monitor_plans import PlannerInputs
from tests.conftest import REPO_ROOT
from tests.services.chunk_planner.test_chunk_planner import monitor, planner_settings, post, running

# Near what bench_trees measured on SmolLM2 (accept length, rows, draft seconds per round)
OPTIONS = [
    BudgetOption("none", 1.0, 1.0, 0.0),
    BudgetOption("chain", 1.42, 2.6, 0.03),
    BudgetOption("tree16", 1.98, 17.0, 0.05),
    BudgetOption("tree32", 2.03, 33.0, 0.06),
]


def cpu_like_g(rows: float) -> float:
    """A verifier that reads its weights once per step (60 ms) and then pays per row (0.5 ms)."""
    return 0.06 + 0.0005 * rows


def link(sessions: float, rtt_s: float = 0.05) -> LinkLoad:
    return LinkLoad(rtt_s, 1152, 2.5e6, 5e6, sessions)


def test_round_seconds_adds_the_link_the_drafting_and_the_shared_batch() -> None:
    option = BudgetOption("tree16", 2.0, 17.0, 0.08)
    # the round trip already carries the root's row each way: only the 16 drafted rows are added
    expected = 0.05 + 0.08 + 16 * 1152 * (1 / 2.5e6 + 1 / 5e6) + cpu_like_g(4 * 17)
    assert math.isclose(round_seconds(option, link(4), cpu_like_g), expected)
    no_drafts = BudgetOption("none", 1.0, 1.0, 0.0)
    assert math.isclose(round_seconds(no_drafts, link(4), cpu_like_g), 0.05 + cpu_like_g(4))


def test_the_budget_falls_as_the_verifiers_load_rises() -> None:
    chosen = [choose_budget(OPTIONS, link(s), cpu_like_g)[0] for s in (1, 2, 4, 8, 16, 32)]
    rows = {o.name: o.rows for o in OPTIONS}
    assert chosen[0] in ("tree16", "tree32")  # idle: the widest tree that pays
    assert chosen[-1] == "none"  # saturated: every extra row costs every session
    assert [rows[c] for c in chosen] == sorted((rows[c] for c in chosen), reverse=True)


def test_a_flat_cloud_and_a_long_round_trip_favour_trees() -> None:
    flat = lambda rows: 0.02  # noqa: E731 (a GPU far from its compute bound)
    assert choose_budget(OPTIONS, link(1, rtt_s=0.2), flat)[0].startswith("tree")


def test_ties_go_to_fewer_rows() -> None:
    same = [BudgetOption("a", 2.0, 9.0, 0.0), BudgetOption("b", 2.0, 3.0, 0.0)]
    free_link = LinkLoad(0.05, 1, 1e30, 1e30, 1)  # transfers cost nothing: both rounds take the same time
    assert choose_budget(same, free_link, lambda rows: 0.0)[0] == "b"
    assert choose_budget(same[::-1], free_link, lambda rows: 0.0)[0] == "b"


def test_the_current_shape_is_kept_through_near_ties() -> None:
    pair = [BudgetOption("chain", 1.40, 2.0, 0.0), BudgetOption("none", 1.0, 1.0, 0.0)]
    free_link = LinkLoad(0.0, 1, 1e30, 1e30, 1)
    flat = lambda rows: 0.1  # noqa: E731
    assert choose_budget(pair, free_link, flat)[0] == "chain"  # 14 tokens/s against 10
    near = [BudgetOption("chain", 1.04, 2.0, 0.0), pair[1]]  # 4 % faster: not worth a switch
    assert choose_budget(near, free_link, flat, current="none")[0] == "none"
    assert choose_budget(near, free_link, flat, current=None)[0] == "chain"
    assert choose_budget(pair, free_link, flat, current="none")[0] == "chain"  # 40 % faster: switch
    assert choose_budget(near, free_link, flat, current="tree9")[0] == "chain"  # not an option: ignored


@pytest.mark.parametrize(
    "bad",
    [
        lambda: BudgetOption("x", 0.5, 1, 0),
        lambda: BudgetOption("x", 1, math.nan, 0),
        lambda: BudgetOption("x", 1, 1, -1),
        lambda: LinkLoad(0.05, 1152, 0, 1, 1),
        lambda: LinkLoad(0.05, 1152, 1, 1, 0.5),
        lambda: choose_budget([], link(1), cpu_like_g),
        lambda: DraftShape.parse("tree0", 8),
        lambda: DraftShape.parse("tree1024", 8),
        lambda: BudgetOption("x", 1, 1025, 0),
        lambda: BudgetOption("x", 1e308, 1, 0),
        lambda: DraftShape.parse("bush", 8),
    ],
)
def test_bad_figures_are_refused(bad) -> None:
    with pytest.raises(BudgetError):
        bad()


def test_shapes_parse_to_draft_settings() -> None:
    assert DraftShape.parse("none", 8) == DraftShape("none", 0)
    assert DraftShape.parse("chain", 6) == DraftShape("chain", 6)
    assert DraftShape.parse("tree16", 6) == DraftShape("tree16", 6, 16)


def budget_body(**overrides) -> dict:
    body = BudgetRequest("jetson-1", 1152, "chain", OPTIONS).to_json()
    return {**body, **overrides}


@pytest.mark.parametrize(
    "body",
    [
        [],
        {"device_id": "", "default": "chain", "options": []},
        budget_body(options=[]),
        budget_body(default="tree99"),
        budget_body(options=[{"name": "a", "accept": "2", "rows": 1, "draft_s": 0}]),
        budget_body(options=[{"name": "a", "accept": 2, "rows": 1, "draft_s": 0}] * 2, default="a"),
        budget_body(bytes_per_token=True),
        budget_body(device_id="../admin"),
        budget_body(current="tree99"),
        budget_body(options=[{"name": "x" * 33, "accept": 2, "rows": 1, "draft_s": 0}]),
        budget_body(options=[{"name": "chain", "accept": 0.1, "rows": 1, "draft_s": 0}]),
    ],
)
def test_bad_requests_are_refused(body) -> None:
    with pytest.raises(BudgetError):
        BudgetRequest.from_json(body)


def test_from_state_needs_the_device_link_and_the_cloud_curve() -> None:
    inputs = PlannerInputs(bytes_per_token=1152)
    assert budget_from_state(None, None, inputs, OPTIONS, "chain")[:2] == ("chain", "default:no-telemetry")
    cloud = {"mu": 8, "last": {"num_sessions": 1}, "g": {"buckets": [{"bucket": 6, "mu": 8, "eta": 0.07}]}}
    fresh = {"last_update": 1.0, "age_s": 0.1, "beta_up": 2.5e6, "beta_down": 5e6}
    assert budget_from_state(cloud, fresh, inputs, OPTIONS, "chain")[:2] == ("chain", "default:missing-rtt")
    shape, source, detail = budget_from_state(cloud, {**fresh, "rtt_s": 0.05}, inputs, OPTIONS, "chain")
    assert source == "budget" and detail["sessions"] == 1 and set(detail["tokens_per_s"]) == {o.name for o in OPTIONS}


def steps(rows_per_step: list[int], per_row_s: float) -> list[dict]:
    return [
        {"kind": "verifier_step", "batched_tokens": m, "compute_s": 0.06 + per_row_s * m, "num_sessions": s}
        for m, s in rows_per_step
    ]


async def test_the_planner_lowers_the_budget_when_the_verifier_gets_busy() -> None:
    device = [
        {"kind": "device_transfer", "device_id": "jetson-1", "direction": "up", "bytes": 8192, "seconds": 0.004},
        {"kind": "device_transfer", "device_id": "jetson-1", "direction": "down", "bytes": 8192, "seconds": 0.002},
        {"kind": "device_rtt", "device_id": "jetson-1", "rtt_s": 0.05},
    ]
    async with monitor() as (mon, transport):
        async with running(planner_settings(), transport) as planner:
            await post(mon, device)
            curve = [(m, 1) for m in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)]
            idle = [{**r, "num_sessions": 1} for r in steps(curve, 0.0005)]
            await post(mon, idle)
            answer = (await planner.post("/draft-budget", json=budget_body())).json()
            assert answer["source"] == "budget" and answer["shape"] in ("tree16", "tree32"), answer
            await post(mon, [{**idle[-1], "num_sessions": 32}])
            busy = (await planner.post("/draft-budget", json=budget_body())).json()
            assert busy["source"] == "budget" and busy["sessions"] == 32 and busy["shape"] == "none", busy
            refused = await planner.post("/draft-budget", json=budget_body(default="tree99"))
            assert refused.status_code == 422 and refused.json()["error"]["code"] == "invalid_budget_request"
            garbage = await planner.post("/draft-budget", content=b"{not json")
            assert garbage.status_code == 422


async def test_without_a_monitor_the_planner_keeps_the_devices_shape() -> None:
    async with running(load_settings({})) as planner:
        answer = (await planner.post("/draft-budget", json=budget_body(default="tree16"))).json()
        assert answer == {"shape": "tree16", "source": "default:no-monitor"}


def test_the_bench_table_chooses_per_load_from_measured_points() -> None:
    from loadgen.bench_budget import LOADS, budget_table

    figures = {o.name: {"accept": o.accept, "rows": o.rows, "draft_s": o.draft_s} for o in OPTIONS}
    points = [(mu, cpu_like_g(mu)) for mu in (1, 4, 16, 64, 256, 1024)]
    table = budget_table(figures, points, link(1))
    assert [row["sessions"] for row in table] == list(LOADS)
    assert table[0]["chosen"].startswith("tree") and table[-1]["chosen"] == "none"
    rows = [figures[row["chosen"]]["rows"] for row in table]
    assert rows == sorted(rows, reverse=True)


def test_an_absurd_load_still_gives_a_json_answer() -> None:
    inputs = PlannerInputs(bytes_per_token=1152)
    cloud = {
        "mu": 8,
        "last": {"num_sessions": 1e300},
        "g": {"buckets": [{"bucket": 6, "mu": 8, "eta": 0.07}, {"bucket": 8, "mu": 16, "eta": 0.08}]},
    }
    fresh = {"last_update": 1.0, "age_s": 0.1, "beta_up": 2.5e6, "beta_down": 5e6, "rtt_s": 0.05}
    big = [BudgetOption("none", 1.0, 1.0, 0.0), BudgetOption("wide", 2.0, 1024.0, 0.0)]
    shape, source, detail = budget_from_state(cloud, fresh, inputs, big, "wide")
    assert (shape, source) == ("none", "budget")
    json.dumps(detail, allow_nan=False)  # what the planner's JSONResponse must encode


def test_the_row_limit_is_the_wires_and_the_planner_and_the_streamer_start_without_torch():
    """MAX_ROWS is the wire's tree limit written out, so that neither service loads torch (~2 s of each one's
    start-up in every mesh) for the one constant."""
    from shared.wire import schema as wire

    assert MAX_ROWS == wire.MAX_TREE_ROWS
    code = "import sys, services.chunk_planner.__main__, services.token_streamer.__main__;print('torch' in sys.modules)"
    loaded = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert loaded.returncode == 0 and loaded.stdout.strip() == "False", loaded.stderr[-2000:]


def test_a_shape_measured_slower_than_modelled_is_charged_for_it() -> None:
    pair = [BudgetOption("chain", 1.40, 2.0, 0.0), BudgetOption("none", 1.0, 1.0, 0.0)]
    free_link = LinkLoad(0.0, 1, 1e30, 1e30, 1)
    flat = lambda rows: 0.1  # noqa: E731
    assert choose_budget(pair, free_link, flat)[0] == "chain"  # modelled: 14 tokens/s against 10
    slow_chain = [BudgetOption("chain", 1.40, 2.0, 0.0, slowdown=1.6), pair[1]]
    shape, rates = choose_budget(slow_chain, free_link, flat)
    assert shape == "none" and math.isclose(rates["chain"], 14.0 / 1.6)


def test_slowdown_travels_in_the_request_and_defaults_to_one() -> None:
    ask = BudgetRequest("jetson-1", 1152, "chain", [BudgetOption("chain", 1.5, 3.0, 0.02, slowdown=1.25)])
    assert BudgetRequest.from_json(json.loads(json.dumps(ask.to_json()))) == ask
    body = ask.to_json()
    del body["options"][0]["slowdown"]  # a device from before slowdowns
    assert BudgetRequest.from_json(body).options[0].slowdown == 1.0
    for bad in (0.0, "fast", float("nan"), 100.0):
        body["options"][0]["slowdown"] = bad
        with pytest.raises(BudgetError):
            BudgetRequest.from_json(body)


def test_the_planner_answers_the_round_models_rates_beside_its_choice() -> None:
    inputs = PlannerInputs(bytes_per_token=1152)
    cloud = {"mu": 8, "last": {"num_sessions": 1}, "g": {"buckets": [{"bucket": 6, "mu": 8, "eta": 0.07}]}}
    device = {"last_update": 1.0, "age_s": 0.1, "beta_up": 2.5e6, "beta_down": 5e6, "rtt_s": 0.05}
    slowed = [BudgetOption(o.name, o.accept, o.rows, o.draft_s, slowdown=2.0) for o in OPTIONS]
    _, _, detail = budget_from_state(cloud, device, inputs, slowed, "chain")
    for name, modelled in detail["modelled_tokens_per_s"].items():
        assert math.isclose(detail["tokens_per_s"][name], modelled / 2.0, rel_tol=1e-3)
