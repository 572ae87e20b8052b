"""The DiSCo overhead tool runs on small sizes and returns its rows (no timing asserted)."""

from __future__ import annotations

import json

from loadgen import disco_overhead


def test_measure_returns_a_row_per_constraint_and_size() -> None:
    rows = disco_overhead.measure(sizes=(50, 200), decisions=300)
    assert [(r["constraint"], r["samples"]) for r in rows] == [
        ("server", 50),
        ("device", 50),
        ("server", 200),
        ("device", 200),
    ]
    for r in rows:
        assert r["decisions"] == 300 and r["build_ms"] >= 0
        assert 0 <= r["decide_p50_us"] <= r["decide_p99_us"] <= r["decide_max_us"]
    device = rows[1]
    assert device["w_tail_s"] > 0  # a device-constrained plan was really built from the TTFTs


def test_the_command_prints_json_or_a_table() -> None:
    from typer.testing import CliRunner

    from tophat.cli import app

    result = CliRunner().invoke(app, ["bench", "disco-overhead", "--sizes", "40", "--decisions", "100", "--json"])
    assert result.exit_code == 0, result.output
    assert [row["samples"] for row in json.loads(result.output)] == [40, 40]
    result = CliRunner().invoke(app, ["bench", "disco-overhead", "--sizes", "40", "--decisions", "100"])
    table = result.output.splitlines()
    assert table[0].split()[:2] == ["constraint", "samples"] and len(table) == 3
