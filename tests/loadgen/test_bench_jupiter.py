"""loadgen/bench_jupiter.py's pure half: per-bucket aggregation, the lossless check across modes, the tables."""

from loadgen.bench_jupiter import (
    JupiterBenchConfig,
    Sample,
    build_jupiter_results,
    format_jupiter_table,
    format_outline_answers,
)

CFG = JupiterBenchConfig(model="demo", buckets=(64, 256), outline_questions=("Q1?", "Q2?"))
PLANS = {
    m: {
        "kind": m,
        "stage_layers": [[0, 4], [4, 6], [6, 8]],
        "predicted_bottleneck_ms": 10.0,
        "sub_sequences": {64: [64], 256: [130, 126]},
        "predicted_ttft_ms": {"64": 95.0, "256": 310.0},
    }
    for m in ("serial", "equal-split", "jupiter")
}


def sample(mode, bucket, ttft, e2el, text="same", tokens=8, stats=None):
    return Sample(mode, bucket, bucket, ttft, e2el, tokens, text, stats or {})


def samples(jupiter_text="same"):
    out = []
    for mode, scale in (("serial", 3.0), ("equal-split", 2.0), ("jupiter", 1.0)):
        for bucket in CFG.buckets:
            out += [
                sample(mode, bucket, 100 * scale, 400 * scale, jupiter_text if mode == "jupiter" else "same"),
                sample(mode, bucket, 120 * scale, 440 * scale, "same"),
            ]
    out += [
        sample("jupiter-sequential", None, 50, 2000, "one long answer", 100),
        sample("jupiter-sequential", None, 50, 1800, "another answer", 90),
        sample("jupiter-outline", None, 300, 1000, "1. a\n2. b", 110, {"outline": {"used": True, "points": 2}}),
        sample("jupiter-outline", None, 300, 900, "plain", 80, {"outline": {"used": False, "reason": "math"}}),
    ]
    return out


def test_results_average_each_mode_and_bucket_and_pair_outline_runs_with_their_questions():
    results = build_jupiter_results(samples(), PLANS, CFG)
    rows = {(e["mode"], e["bucket"]): e for e in results["results"]}
    assert rows[("serial", 64)]["mean_ttft_ms"] == 330 and rows[("jupiter", 256)]["mean_e2el_ms"] == 420
    assert rows[("jupiter", 256)]["sub_sequences"] == [130, 126]
    assert rows[("jupiter-outline", None)]["mean_e2el_ms"] == 950
    assert [o["question"] for o in results["outline"]] == ["Q1?", "Q2?", "Q1?", "Q2?"]
    assert results["outline"][2]["outline"] == {"used": True, "points": 2}
    assert results["answers_identical_across_modes"] is True


def test_a_mode_whose_answer_differs_is_reported_as_not_lossless():
    results = build_jupiter_results(samples(jupiter_text="different"), PLANS, CFG)
    assert results["answers_identical_across_modes"] is False


def test_tables_show_ratios_against_jupiter_and_the_answers_side_by_side():
    results = build_jupiter_results(samples(), PLANS, CFG)
    table = format_jupiter_table(results)
    assert "3.00x" in table and "2.00x" in table  # serial / jupiter and equal / jupiter, both metrics
    assert "[130, 126]" in table and "prefill ms by length 64: 95, 256: 310" in table
    assert "outline: E2EL 950 ms" in table and "sequential 1900 ms" in table
    answers = format_outline_answers(results)
    assert answers.index("Q: Q1?") < answers.index("one long answer") < answers.index("1. a")
