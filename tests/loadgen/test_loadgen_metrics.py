"""Load-generator metrics on hand-made traces (no network, no clocks)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from loadgen import metrics as m
from loadgen.metrics import RequestRecord
from tophatctl.chunk_tokens import apportion


def trace(
    arrival: float = 1.0,
    chunks: tuple[tuple[float, int], ...] = ((1.5, 1), (1.7, 2), (1.8, 1)),
    end: float = 1.85,
    prompt: int = 256,
    **kw,
) -> RequestRecord:
    """A finished request: content chunks as (time, tokens), counts already reconciled."""
    return RequestRecord(
        index=kw.pop("index", 0),
        arrival_s=arrival,
        max_tokens=128,
        prompt_tokens=prompt,
        send_s=arrival,
        end_s=end,
        chunk_times_s=[t for t, _ in chunks],
        chunk_texts=["x" * k for _, k in chunks],
        chunk_tokens=[k for _, k in chunks],
        completion_tokens=sum(k for _, k in chunks),
        **kw,
    )


def failed(arrival: float = 0.0, end: float = 0.3) -> RequestRecord:
    return RequestRecord(
        index=9, arrival_s=arrival, max_tokens=128, prompt_tokens=100, send_s=arrival, end_s=end, error="HTTP 503: busy"
    )


def test_per_request_definitions() -> None:
    r = trace()
    assert m.ttft_s(r) == pytest.approx(0.5)
    assert m.e2e_s(r) == pytest.approx(0.85)
    assert m.output_tokens(r) == 4
    assert m.tpot_s(r) == pytest.approx(0.35 / 3)
    # A 2-token chunk 0.2 s after the first counts as two gaps of 0.1 (the streamer's convention).
    assert m.tbt_samples_s(r) == pytest.approx([0.1, 0.1, 0.1])
    assert m.prefill_sla_s(r) == pytest.approx(0.5 * 128 / 256)
    assert m.decode_sla_s(r) == pytest.approx(10 * 0.35 / 3)


def test_first_chunk_with_several_tokens_adds_zero_gaps() -> None:
    r = trace(chunks=((1.2, 3), (1.5, 1)))
    assert m.tbt_samples_s(r) == pytest.approx([0.0, 0.0, 0.3])
    assert sum(m.tbt_samples_s(r)) == pytest.approx(r.chunk_times_s[-1] - r.chunk_times_s[0])


def test_ttft_counts_client_side_queueing_from_arrival() -> None:
    r = trace(arrival=1.0)
    r.send_s = 1.4  # waited 0.4 s for a concurrency slot
    assert m.ttft_s(r) == pytest.approx(0.5)


def test_single_token_output_has_no_tpot_or_decode_sla() -> None:
    r = trace(chunks=((1.3, 1),), end=1.31)
    assert m.tpot_s(r) is None and m.decode_sla_s(r) is None and m.tbt_samples_s(r) == []


def test_failed_requests_have_no_latency() -> None:
    r = failed()
    assert (m.ttft_s(r), m.e2e_s(r), m.tpot_s(r), m.tbt_samples_s(r)) == (None, None, None, [])


def test_summarize_ms() -> None:
    stats = m.summarize_ms([0.001 * x for x in range(1, 101)], "ttft")
    assert stats["mean_ttft_ms"] == pytest.approx(50.5)
    assert stats["median_ttft_ms"] == pytest.approx(50.5)
    assert stats["p90_ttft_ms"] == pytest.approx(90.1)
    assert stats["p99_ttft_ms"] == pytest.approx(99.01)
    assert stats["std_ttft_ms"] == pytest.approx(np.std(np.arange(1, 101)))
    assert set(m.summarize_ms([None], "tbt").values()) == {None}


def test_compliance_curve_counts_failures_as_violations() -> None:
    records = [
        trace(index=i, arrival=0.0, chunks=((t, 1), (t + 0.1, 1)), end=t + 0.1, prompt=128)
        for i, t in enumerate((0.1, 0.2, 0.3))
    ] + [failed()]
    thresholds = np.array([0.0, 0.1, 0.15, 0.2, 0.3, 10.0])
    curve = m.compliance_curve(records, m.prefill_sla_s, thresholds)
    assert curve.tolist() == pytest.approx([0, 0.25, 0.25, 0.5, 0.75, 0.75])
    grid = m.threshold_grid(records, m.prefill_sla_s, points=11)
    assert grid[0] == 0 and grid[-1] == pytest.approx(0.3 * 1.05)


def test_goodput_counts_requests_meeting_every_slo() -> None:
    fast = trace(index=0, arrival=0.0, chunks=((0.1, 1), (0.12, 1)), end=0.12)  # ttft 100 ms, tpot 20 ms
    slow_start = trace(index=1, arrival=0.0, chunks=((0.9, 1), (0.91, 1)), end=0.91)  # ttft 900 ms
    slow_decode = trace(index=2, arrival=0.0, chunks=((0.1, 1), (0.5, 1)), end=0.5)  # tpot 400 ms
    one_token = trace(index=3, arrival=0.0, chunks=((0.2, 1),), end=2.0)  # no tpot: not a violation
    records = [fast, slow_start, slow_decode, one_token, failed(end=2.0)]
    assert m.run_duration_s(records) == pytest.approx(2.0)
    assert m.goodput_rps(records, 2.0, {"ttft": 500, "tpot": 50}) == pytest.approx(2 / 2.0)
    assert m.goodput_rps(records, 2.0, {"ttft": 500}) == pytest.approx(3 / 2.0)
    assert m.goodput_rps(records, 2.0, {}) is None
    with pytest.raises(ValueError):
        m.goodput_rps(records, 2.0, {"itl": 5})


def test_mean_accept_length_is_weighted_by_rounds() -> None:
    a = trace(index=0, accept_length=3.0, num_rounds=10)
    b = trace(index=1, accept_length=1.0, num_rounds=30)
    assert m.mean_accept_length([a, b, failed()]) == pytest.approx((30 + 30) / 40)
    assert m.mean_accept_length([failed()]) is None


def test_reconcile_splits_the_server_count_over_chunks() -> None:
    r = RequestRecord(
        index=0,
        arrival_s=0.0,
        max_tokens=8,
        chunk_times_s=[0.1, 0.2, 0.3],
        chunk_texts=["a", "bbbb", "cc"],
        completion_tokens=7,
    )
    m.reconcile_tokens(r)  # by characters: weights 1/4/2, one token per chunk first
    assert r.chunk_tokens == [1, 4, 2]
    m.reconcile_tokens(r, count=lambda text: 1)  # a tokenizer that sees one token per chunk
    assert sum(r.chunk_tokens) == 7 and min(r.chunk_tokens) >= 1
    r.completion_tokens = None  # no usage: trust the tokenizer, or one token per chunk
    m.reconcile_tokens(r, count=lambda text: len(text))
    assert r.chunk_tokens == [1, 4, 2]
    m.reconcile_tokens(r)
    assert r.chunk_tokens == [1, 1, 1]


def test_reconcile_prefers_server_rounds_that_match_the_chunks() -> None:
    r = RequestRecord(
        index=0,
        arrival_s=0.0,
        max_tokens=8,
        chunk_times_s=[0.1, 0.2, 0.3],
        chunk_texts=["a", "b", "c"],
        completion_tokens=6,
        server_rounds=[1, 3, 2],
    )
    m.reconcile_tokens(r)
    assert r.chunk_tokens == [1, 3, 2]
    r.server_rounds = [1, 5]  # some text was held back and merged: counts do not line up, estimate instead
    m.reconcile_tokens(r)
    assert r.chunk_tokens == [2, 2, 2]


@given(weights=st.lists(st.floats(0, 100), min_size=1, max_size=30), total=st.integers(0, 500))
def test_apportion_sums_exactly_and_gives_every_chunk_a_token(weights: list[float], total: int) -> None:
    counts = apportion(weights, total)
    assert len(counts) == len(weights) and min(counts) >= 1
    assert sum(counts) == max(total, len(weights))


def test_build_results_has_the_vllm_style_keys() -> None:
    records = [
        trace(
            index=i,
            arrival=0.5 * i,
            chunks=((0.5 * i + 0.2, 1), (0.5 * i + 0.3, 2)),
            end=0.5 * i + 0.3,
            accept_length=2.0,
            num_rounds=1,
        )
        for i in range(4)
    ] + [failed()]
    res = m.build_results(records, slos_ms={"ttft": 250}, sla_thresholds_ms={"prefill": 100.0})
    assert res["completed"] == 4 and res["failed"] == 1
    assert res["duration"] == pytest.approx(1.8)
    assert res["total_output_tokens"] == 12
    assert res["request_throughput"] == pytest.approx(4 / 1.8)
    assert res["output_throughput"] == pytest.approx(12 / 1.8)
    for name in ("ttft", "tbt", "tpot", "e2el"):
        for stat in ("mean", "median", "std", "p90", "p99"):
            assert f"{stat}_{name}_ms" in res
    assert res["mean_ttft_ms"] == pytest.approx(200)
    assert res["mean_tbt_ms"] == pytest.approx(50)  # one 2-token chunk 100 ms after the first
    assert res["mean_accept_length"] == pytest.approx(2.0)
    assert res["goodput"] == pytest.approx(4 / 1.8)
    prefill = res["sla_compliance"]["prefill"]
    assert len(prefill["thresholds_ms"]) == len(prefill["fraction"]) == 101
    assert prefill["fraction"][-1] == pytest.approx(0.8)  # the failed request never complies
    assert prefill["compliance"] == pytest.approx(0.8)  # 200 ms * 128/256 = 100 ms <= 100 ms
    assert res["errors"] == {"HTTP 503: busy": 1}


def test_request_row_holds_the_raw_trace() -> None:
    row = m.request_row(trace())
    assert row["ttft_ms"] == pytest.approx(500) and row["output_tokens"] == 4
    assert row["chunk_times_ms"] == "1500.000 1700.000 1800.000" and row["chunk_tokens"] == "1 2 1"
    assert m.request_row(failed())["error"] == "HTTP 503: busy"
