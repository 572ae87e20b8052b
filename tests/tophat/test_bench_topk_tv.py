"""loadgen/bench_topk_tv.py on the committed demo model: report shape and the TV's range and trend in K."""

from __future__ import annotations

import json


def test_topk_tv_report_on_the_demo_model(tmp_path):
    from typer.testing import CliRunner

    from tophat.cli import app

    out = tmp_path / "topk-tv.json"
    result = CliRunner().invoke(
        app,
        [
            "bench",
            "topk-tv",
            "--model",
            "demo",
            "--prompts",
            "1",
            "--positions",
            "4",
            "--temperatures",
            "1.0",
            "--ks",
            "1,5,50",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())

    assert report["model"] == "demo" and report["prompts"] == 1 and report["positions_per_prompt"] == 4
    rows = report["results"]
    assert [(r["temperature"], r["k"]) for r in rows] == [(1.0, 1), (1.0, 5), (1.0, 50)]
    for r in rows:
        assert 1 <= r["positions"] <= 4
        for key in ("mean_tv", "p90_tv", "max_tv", "rejection_weighted_tv", "token_tv", "mean_rejection_probability"):
            assert 0.0 <= r[key] <= 1.0 + 1e-6, (key, r)
        assert r["mean_tv"] <= r["max_tv"] + 1e-9
        assert r["token_tv"] <= r["mean_rejection_probability"] + 1e-9  # P(rejection) x a TV <= P(rejection)
        assert r["bytes_per_rejection"] == 8 * r["k"]  # K float32 values + K int32 indices
        assert r["full_row_bytes"] == 4 * report["vocab_size"]
    means = [r["mean_tv"] for r in rows]
    assert all(later <= earlier + 1e-6 for earlier, later in zip(means, means[1:])), means
