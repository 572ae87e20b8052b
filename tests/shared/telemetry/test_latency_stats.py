"""TTFT/TBT/accept-length definitions on hand-computed timelines."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.telemetry import latency_stats as ls
from shared.telemetry.latency_stats import Timeline


def test_speculative_rounds_split_their_gap_over_their_tokens() -> None:
    # Start 1.0; deliveries at 1.5 (1 token), 1.7 (2 tokens), 1.8 (1 token).
    tl = Timeline(1.0, [1.5, 1.7, 1.8], [1, 2, 1])
    assert ls.ttft_s(tl) == pytest.approx(0.5)
    assert ls.tbt_samples_s(tl) == pytest.approx([0.1, 0.1, 0.1])  # 0.2 / 2 twice, then 0.1
    assert ls.mean_tbt_s(tl) == pytest.approx(0.3 / 3)
    assert tl.num_tokens == 4


def test_first_delivery_of_several_tokens_adds_zero_gaps() -> None:
    tl = Timeline(0.0, [0.2, 0.5], [3, 1])
    assert ls.tbt_samples_s(tl) == pytest.approx([0.0, 0.0, 0.3])
    assert ls.mean_tbt_s(tl) == pytest.approx(0.1)


def test_no_tokens() -> None:
    tl = Timeline(2.0)
    assert ls.ttft_s(tl) is None and ls.tbt_samples_s(tl) == [] and ls.mean_tbt_s(tl) is None
    assert tl.num_tokens == 0


def test_one_delivery_of_one_token_has_ttft_but_no_tbt() -> None:
    tl = Timeline(1.0, [1.25], [1])
    assert ls.ttft_s(tl) == pytest.approx(0.25)
    assert ls.tbt_samples_s(tl) == [] and ls.mean_tbt_s(tl) is None


def test_one_delivery_of_several_tokens_has_zero_tbt() -> None:
    tl = Timeline(0.0, [0.4], [3])
    assert ls.tbt_samples_s(tl) == [0.0, 0.0] and ls.mean_tbt_s(tl) == 0.0


def test_deliver_skips_empty_deliveries() -> None:
    tl = Timeline(10.0)
    for t, n in ((10.5, 1), (10.6, 0), (10.8, 3)):
        tl.deliver(t, n)
    assert (tl.times_s, tl.tokens) == ([10.5, 10.8], [1, 3])
    assert ls.tbt_samples_s(tl) == pytest.approx([0.1, 0.1, 0.1])


def test_timeline_rejects_mismatched_or_empty_deliveries() -> None:
    with pytest.raises(ValueError, match="2 delivery times but 1"):
        Timeline(0.0, [0.1, 0.2], [1])
    with pytest.raises(ValueError, match="at least one token"):
        Timeline(0.0, [0.1], [0])


def test_from_token_times_groups_tokens_delivered_together() -> None:
    tl = Timeline.from_token_times([0.3, 0.5, 0.5, 0.5, 0.6], start_s=0.1)
    assert (tl.start_s, tl.times_s, tl.tokens) == (0.1, [0.3, 0.5, 0.6], [1, 3, 1])
    assert ls.ttft_s(tl) == pytest.approx(0.2) and ls.mean_tbt_s(tl) == pytest.approx(0.3 / 4)


@given(st.lists(st.tuples(st.floats(0.0, 1.0), st.integers(1, 6)), min_size=1, max_size=20))
def test_mean_tbt_is_the_mean_of_the_samples(deliveries: list[tuple[float, int]]) -> None:
    times, t = [], 0.0
    for gap, _ in deliveries:
        t += gap
        times.append(t)
    tl = Timeline(0.0, times, [k for _, k in deliveries])
    samples = ls.tbt_samples_s(tl)
    assert len(samples) == tl.num_tokens - 1
    if samples:
        assert ls.mean_tbt_s(tl) == pytest.approx(sum(samples) / len(samples), abs=1e-12)
    else:
        assert ls.mean_tbt_s(tl) is None


def test_a_typical_rounds_speed_ignores_a_stall_that_the_mean_tbt_counts() -> None:
    # prefill's token at 0.3 s, then rounds of 0.1 s (2, 1, 2, 1 tokens), one of them held up 1 s
    steady = Timeline(0.0, [0.3, 0.4, 0.5, 0.6, 0.7], [1, 2, 1, 2, 1])
    stalled = Timeline(0.0, [0.3, 0.4, 1.5, 1.6, 1.7], [1, 2, 1, 2, 1])
    assert ls.typical_tokens_per_s(steady) == pytest.approx(1.5 / 0.1)
    assert ls.typical_tokens_per_s(stalled) == pytest.approx(1.5 / 0.1)
    assert ls.mean_tbt_s(stalled) > 3 * ls.mean_tbt_s(steady)
    slower = Timeline(0.0, [0.3, 0.5, 0.7, 0.9, 1.1], [1, 2, 1, 2, 1])  # every round pays: both see it
    assert ls.typical_tokens_per_s(slower) == pytest.approx(1.5 / 0.2)
    assert ls.typical_tokens_per_s(Timeline(0.0, [0.3], [4])) is None


def test_accept_lengths() -> None:
    assert ls.mean_accept_length([2, 3, 1, 2]) == pytest.approx(2.0)
    assert ls.mean_accept_length([]) is None
    # 10 rounds at 1.5 and 30 rounds at 2.5: (15 + 75) / 40; a request with no rounds adds nothing.
    assert ls.pooled_accept_length([(1.5, 10), (2.5, 30), (9.0, 0)]) == pytest.approx(90 / 40)
    assert ls.pooled_accept_length([]) is None


def test_summary() -> None:
    s = ls.summary([0.1, None, 0.3, 0.2, 0.4])
    assert s["mean"] == pytest.approx(0.25) and s["median"] == pytest.approx(0.25)
    assert s["std"] == pytest.approx(0.1118034, rel=1e-6)
    assert s["p90"] == pytest.approx(0.37) and s["p99"] == pytest.approx(0.397)  # linear interpolation
    assert ls.summary([None]) == dict.fromkeys(ls.SUMMARY_KEYS)


def test_the_engine_result_reports_these_definitions() -> None:
    from shared.specdec.decode_loop import GenerationResult

    # 1 token at 0.4 s (prefill), then rounds of 2 and 3 tokens: span 0.5 s over 5 later tokens.
    result = GenerationResult(list(range(6)), [2, 3], [0.4, 0.6, 0.6, 0.9, 0.9, 0.9])
    assert result.timeline.tokens == [1, 2, 3]
    assert (result.ttft_s, result.tbt_s, result.mean_accept_length) == pytest.approx((0.4, 0.1, 2.5))
    empty = GenerationResult([], [])
    assert (empty.ttft_s, empty.tbt_s, empty.mean_accept_length) == (0.0, 0.0, 0.0)  # the engine's "undefined"
