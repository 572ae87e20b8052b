"""The device's draft budget starts from its adapter's held-out evaluation (adapter_report.json beside the adapter):
the accept length and rows of each shape it measured, so a shape that pays is predicted near what it does and gets
its trial (services/device_agent/wiring.py)."""

from __future__ import annotations

import json
import logging
import shutil
from types import SimpleNamespace

from services.device_agent import settings as device_settings
from services.device_agent.wiring import adapter_priors, budget_tracker
from shared.model.adapter import ADAPTER_REPORT_FILENAME as ADAPTER_REPORT
from tests.conftest import REPO_ROOT

SMOLLM2 = REPO_ROOT / "models" / "smollm2"


def settings(**overrides) -> device_settings.Settings:
    # the planner's URL only turns budgeting on: nothing here calls it
    return device_settings.Settings(
        **{"model_dir": str(SMOLLM2), "chunk_planner_url": "http://127.0.0.1:9", **overrides}
    )


def test_the_budget_starts_from_the_adapters_report() -> None:
    report = json.loads((SMOLLM2 / ADAPTER_REPORT).read_text())
    tracker = budget_tracker(settings(), SimpleNamespace(path=SMOLLM2))
    assert tracker is not None
    options = {o.name: o for o in tracker.options()}
    tree = report["held_out"]["trees"]["16"]
    assert (options["tree16"].accept, options["tree16"].rows) == (tree["mean_accept_length"], tree["mean_rows"])
    assert options["chain"].accept == report["held_out"]["mean_accept_length"]
    assert budget_tracker(settings(chunk_planner_url=""), SimpleNamespace(path=SMOLLM2)) is None  # nobody chooses


def test_no_report_an_untrained_adapter_or_an_unreadable_report_keeps_the_default_priors(tmp_path, caplog) -> None:
    shapes = settings().budget_shapes()
    checkpoint = SimpleNamespace(path=tmp_path)
    assert adapter_priors(settings(), checkpoint, shapes) == {}  # no report beside the adapter
    assert adapter_priors(settings(adapter="random"), SimpleNamespace(path=SMOLLM2), shapes) == {}
    shutil.copy(SMOLLM2 / ADAPTER_REPORT, tmp_path / ADAPTER_REPORT)
    own = tmp_path / "mine.safetensors"  # an adapter named by path: the report beside it
    assert set(adapter_priors(settings(adapter=str(own)), checkpoint, shapes)) == {"chain", "tree16"}
    (tmp_path / ADAPTER_REPORT).write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="services.device_agent"):
        assert adapter_priors(settings(), checkpoint, shapes) == {}
    assert "unreadable" in caplog.text
