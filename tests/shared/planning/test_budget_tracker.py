"""What a device measures of its draft shapes (shared/planning/budget_tracker.py): priors, EMAs, trials, k."""

from __future__ import annotations

import json
import math

from shared.planning.budget_tracker import BudgetTracker, predicted_rates, priors_from_adapter_report
from shared.planning.draft_budget import (
    SLOWDOWN_RANGE,
    TRIAL_SHARE,
    BudgetOption,
    DraftShape,
    LinkLoad,
    choose_budget,
)
from tests.conftest import REPO_ROOT


def test_each_drafting_shape_is_handed_out_once_for_its_trial() -> None:
    tracker = BudgetTracker([DraftShape.parse(n, 8) for n in ("none", "chain", "tree16")])
    near = {"none": 10.0, "chain": 11.0, "tree16": 12.0}
    assert [tracker.next_trial(near) for _ in range(3)] == ["chain", "tree16", None]  # no drafts needs no trial


def test_only_shapes_predicted_near_the_best_get_a_trial() -> None:
    tracker = BudgetTracker([DraftShape.parse(n, 8) for n in ("none", "chain", "tree8", "tree16")])
    assert tracker.next_trial(None) is None and tracker.next_trial({}) is None and not tracker.tried
    busy = {"none": 40.0, "chain": 0.85 * 40.0, "tree8": TRIAL_SHARE * 40.0 - 0.01}  # tree16: no prediction
    assert [tracker.next_trial(busy) for _ in range(2)] == ["chain", None]
    idle = {"none": 10.0, "chain": 11.0, "tree8": 12.0, "tree16": 11.5}  # later, the load gone: tried then
    assert [tracker.next_trial(idle) for _ in range(3)] == ["tree8", "tree16", None]


def test_predicted_rates_keep_finite_rates_of_known_shapes_only() -> None:
    shapes = {"none": 1, "chain": 1}
    raw = {"none": 3, "chain": math.inf, "tree8": 4.0, 5: 1.0}
    assert predicted_rates(raw, shapes) == {"none": 3.0}
    assert predicted_rates({"none": -1.0, "chain": True}, shapes) == {}
    assert predicted_rates([1.0], shapes) == predicted_rates(None, shapes) == {}


def test_the_tracker_offers_priors_then_what_it_measured() -> None:
    tracker = BudgetTracker([DraftShape.parse(n, 8) for n in ("none", "chain", "tree16")])
    before = {o.name: o for o in tracker.options()}
    assert before["none"] == BudgetOption("none", 1.0, 1.0, 0.0)
    assert before["tree16"].accept > before["chain"].accept > 1.0
    tracker.observe("chain", [1, 2, 1, 2], rows_per_round=3.0, draft_s_per_round=0.04)
    tracker.observe("unknown", [5], 3.0, 0.1)  # not a shape of this device: ignored
    tracker.observe("tree16", [], 17.0, 0.1)  # no rounds: says nothing
    after = {o.name: o for o in tracker.options()}
    assert after["chain"] == BudgetOption("chain", 1.5, 3.0, 0.04)
    # the chain's seconds per step (0.04 / 2 steps), times the chain's 2 steps and one more level
    assert math.isclose(after["tree16"].draft_s, 0.02 * 3)
    tracker.observe("tree16", [2], 17.0, 0.5)  # a measured tree does not change the chains' seconds per step
    assert math.isclose({o.name: o for o in tracker.options()}["tree16"].draft_s, 0.5)
    tracker.observe("chain", [3], 5.0, 0.08)
    assert math.isclose(tracker.options()[1].accept, 0.8 * 1.5 + 0.2 * 3)


def test_an_adapters_evaluation_gives_the_priors_of_the_shapes_it_measured() -> None:
    shapes = [DraftShape.parse(n, 8) for n in ("none", "chain", "tree16", "tree32")]
    report = json.loads((REPO_ROOT / "models" / "smollm2" / "adapter_report.json").read_text())
    priors = priors_from_adapter_report(report, shapes)
    held_out = report["held_out"]
    assert set(priors) == {"chain", "tree16"}  # no drafts needs none; tree32 was not evaluated
    assert priors["chain"] == (held_out["mean_accept_length"], held_out["mean_rows"])
    assert priors["tree16"] == (held_out["trees"]["16"]["mean_accept_length"], held_out["trees"]["16"]["mean_rows"])
    broken = {"held_out": {"mean_accept_length": float("nan"), "mean_rows": 2.6, "trees": {"16": {"mean_rows": 9}}}}
    assert priors_from_adapter_report(broken, shapes) == {} and priors_from_adapter_report([], shapes) == {}
    tracker = BudgetTracker(shapes, priors)
    assert {o.name: (o.accept, o.rows) for o in tracker.options()}["tree16"] == priors["tree16"]


def test_an_idle_verifier_on_a_long_round_trip_tries_the_tree() -> None:
    """One device, a 50 ms round trip and a verify pass flat in its rows (a GPU with CUDA graphs): a measured
    chain, and tree16 never run. With the log-shaped prior and 8 levels of drafting, the tree was predicted at half
    the chain's speed and never got its trial, though measured it is the fastest shape."""
    shapes = [DraftShape.parse(n, 8) for n in ("none", "chain", "tree16")]
    link, flat = LinkLoad(0.0506, 1152, 1054687.5, 1757812.5, 1.0), lambda rows: 0.002
    measured_tree = BudgetOption("tree16", 2.77, 12.61, 0.024)  # the adapter's trees, drafting 1.6x the chain's
    report = {
        "held_out": {
            "mean_accept_length": 1.91,
            "mean_rows": 2.61,
            "trees": {"16": {"mean_accept_length": 2.77, "mean_rows": 12.61}},
        }
    }
    for priors in ({}, priors_from_adapter_report(report, shapes)):
        tracker = BudgetTracker(shapes, priors)
        for _ in range(5):
            tracker.observe("chain", [2, 2, 1, 2], 2.5, 0.015)
        options = tracker.options()
        _, predicted = choose_budget(options, link, flat)
        trial = tracker.next_trial(predicted, running="chain")
        assert (trial == "tree16") == bool(priors)
    chain = {o.name: o for o in options}["chain"]
    assert choose_budget([chain, measured_tree], link, flat)[0] == "tree16"  # what the trial then finds


def test_the_tracker_learns_each_shapes_slowdown_and_lends_it_to_untried_drafting_shapes() -> None:
    tracker = BudgetTracker([DraftShape.parse(n, 8) for n in ("none", "chain", "tree16")])
    assert {o.name: o.slowdown for o in tracker.options()} == {"none": 1.0, "chain": 1.0, "tree16": 1.0}
    tracker.observe_speed("chain", 20.0, 10.0)  # ran at half the modelled speed
    tracker.observe_speed("none", 10.0, 10.0)
    tracker.observe_speed("chain", 20.0, -1.0)  # says nothing
    tracker.observe_speed("tree99", 20.0, 1.0)  # not a shape of this device
    tracker.observe_speed("none", 1000.0, 1.0)  # clamped
    slowdowns = {o.name: o.slowdown for o in tracker.options()}
    assert slowdowns["chain"] == 2.0 and slowdowns["tree16"] == 2.0  # the drafting shapes' mean
    assert 1.0 < slowdowns["none"] <= SLOWDOWN_RANGE[1]


def test_hat_async_pays_only_while_it_measures_no_slower_than_the_chain():
    """hat-async's k is its requests' speed against the chain's round model; it pays while that k is no larger than
    HAT's chain rounds' own; unknown until both are measured, and bad figures say nothing."""
    tracker = BudgetTracker([DraftShape.parse(n, 8) for n in ("none", "chain")])
    assert tracker.async_pays() is None
    tracker.observe_async_speed(10.0, 8.0)  # k 1.25
    assert tracker.async_pays() is None  # the chain's k is not measured yet
    tracker.observe_speed("chain", 10.0, 10.0)  # k 1.0
    assert tracker.async_pays() is False
    tracker.observe_async_speed(10.0, float("nan"))
    tracker.observe_async_speed(-1.0, 5.0)
    assert tracker.async_slowdown.count == 1
    for _ in range(20):
        tracker.observe_async_speed(10.0, 12.0)  # k 0.83: faster than the chain's rounds now
    assert tracker.async_pays() is True
    assert BudgetTracker([DraftShape.parse("none", 8)]).async_pays() is None  # no chain to compare with
