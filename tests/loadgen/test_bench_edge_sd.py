"""The Edge SD bench's pure parts: the trace (the paper's channel), eq. 20 on measured stage times, the
aggregation into the results JSON and the table."""

from __future__ import annotations

import math

import numpy as np
import pytest

from loadgen.bench_edge_sd import (
    EDGE_SD_MODES,
    EdgeSDBenchConfig,
    Sample,
    build_edge_sd_results,
    format_edge_sd_table,
    predicted_inference_s,
    sequential_inference_s,
    summarise_round,
    trace,
    user_snrs_db,
)
from loadgen.edge_sd_timeline import pipeline_timeline


def test_snrs_follow_the_cell_model():
    snrs = np.array(user_snrs_db(20000, np.random.default_rng(0)))
    # 23 dBm - 30 dB - 20 log10(d) + fading + 106 dBm: at the cell edge with median fading ~45 dB
    edge = 10 * math.log10(0.2e3) - 30 - 20 * math.log10(400) + 106 + 10 * math.log10(math.log(2))
    assert np.median(snrs) > edge  # most users are nearer than the edge
    assert np.percentile(snrs, 5) < edge < np.percentile(snrs, 95)
    assert snrs.max() <= 10 * math.log10(0.2e3) - 30 - 20 + 106 + 10 * math.log10(20)  # d >= 10 m, fading < 20


def test_the_trace_is_seeded_and_in_range():
    cfg = EdgeSDBenchConfig(tasks=6, min_input=5, max_input=9, min_output=2, max_output=3)
    a, b = trace(cfg, 3, np.random.default_rng(4)), trace(cfg, 3, np.random.default_rng(4))
    assert a == b and len(a) == 3 and all(len(r) == 6 for r in a)
    assert all(5 <= t.input_tokens <= 9 and 2 <= t.output_tokens <= 3 for r in a for t in r)
    assert trace(cfg, 3, np.random.default_rng(5)) != a


def stages():
    # 2 batches; batch 0 runs 3 steps, batch 1 two
    rows = [(1, 0, 0.10, 0.30), (1, 1, 0.05, 0.20), (2, 0, 0.02, 0.08), (2, 1, 0.02, 0.06), (3, 0, 0.02, 0.08)]
    return [{"step": s, "batch": b, "size": 2, "draft_s": d, "verify_s": v} for s, b, d, v in rows]


def test_eq20_on_measured_stages_is_the_timeline_of_those_times():
    expected = pipeline_timeline(
        [[0.10, 0.05], [0.02, 0.02], [0.02, 0.0]], [[0.30, 0.20], [0.08, 0.06], [0.08, 0.0]], [3, 2]
    ).inference_latency
    assert predicted_inference_s(stages()) == pytest.approx(expected)
    # step 1: draft 0.10, verify 0.30 -> 0.40; batch 1 drafted by 0.15, verified 0.40 -> 0.60
    # step 2: 0.62 -> 0.70; batch 1 drafted 0.64, verified 0.70 -> 0.76; step 3: 0.78 -> 0.86
    assert predicted_inference_s(stages()) == pytest.approx(0.86)
    assert sequential_inference_s(stages()) == pytest.approx(
        sum(d + v for *_, d, v in [(0, 0, s["draft_s"], s["verify_s"]) for s in stages()])
    )
    assert predicted_inference_s(stages()[:-1] + [{"step": 3, "batch": 0, "draft_s": 0.1}]) is None  # unfinished


def test_results_aggregate_per_mode_and_say_whether_answers_matched():
    cfg = EdgeSDBenchConfig(modes=("edge-sd", "no-pipeline"))
    samples = [
        Sample("edge-sd", 1, 0, 100, 1000, 10, "a"),
        Sample("edge-sd", 1, 1, 200, 3000, 10, "b"),
        Sample("no-pipeline", 1, 0, 150, 2000, 10, "a"),
        Sample("no-pipeline", 1, 1, 250, 4000, 10, "b"),
    ]
    record = {
        "plan": {
            "batches": [[0], [1]],
            "spec_len": 3,
            "shares": [0.4, 0.6],
            "sources": {"shares": "eq27"},
            "predicted": {"inference_s": 0.9},
        },
        "upload_s": 0.05,
        "inference_s": 0.88,
        "stages": stages(),
    }
    rounds = [{"mode": "edge-sd", "round": 1, **summarise_round(record)}]
    results = build_edge_sd_results(samples, rounds, cfg)
    by_mode = {e["mode"]: e for e in results["results"]}
    assert by_mode["edge-sd"]["mean_e2el_ms"] == 2000 and by_mode["edge-sd"]["mean_ttft_ms"] == 150
    assert by_mode["edge-sd"]["mean_round_latency_ms"] == 3000
    assert by_mode["no-pipeline"]["mean_e2el_ms"] == 3000
    assert results["answers_identical_across_modes"] is True
    assert by_mode["edge-sd"]["rounds"][0]["predicted_inference_ms"] == pytest.approx(860)
    assert summarise_round(record, pipelined=False)["predicted_inference_ms"] == pytest.approx(930)
    table = format_edge_sd_table(results)
    assert "+33.3%" in table  # edge-sd's E2EL 2000 vs no-pipeline's 3000
    samples.append(Sample("no-pipeline", 2, 0, 1, 1, 1, "different"))
    samples.append(Sample("edge-sd", 2, 0, 1, 1, 1, "other"))
    assert build_edge_sd_results(samples, rounds, cfg)["answers_identical_across_modes"] is False


def test_every_mode_has_its_settings():
    from loadgen.bench_edge_sd import MODE_SETTINGS

    assert set(MODE_SETTINGS) == set(EDGE_SD_MODES)
