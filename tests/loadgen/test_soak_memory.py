"""The soak's memory rule as a pure function of RSS samples: a steady climb after the warm-up fails and names the
service, noise and a single spike do not, a small process's small growth does not, a restart does."""

from __future__ import annotations

import os

import pytest

from loadgen.soak import SoakReport
from loadgen.soak_memory import RssLimit, ServiceMemory, rss_growth_kib, rss_kib

MIB = 1024
BASE = 500 * MIB  # a 500 MiB service (KiB)


def memory(name: str, samples: list[int], pid: int = 100, end_pid: int | None = None) -> ServiceMemory:
    m = ServiceMemory(name, pid, start_kib=samples[0], baseline_kib=samples[0], samples=list(samples))
    if end_pid is not None and end_pid != pid:
        m.lost, m.end_pid = True, end_pid
    return m


def test_growth_is_the_last_third_against_the_first_third_by_median():
    assert rss_growth_kib([]) is None and rss_growth_kib([BASE]) is None
    assert rss_growth_kib([BASE, BASE + 10]) == 10
    climb = [BASE + i * MIB for i in range(30)]
    assert rss_growth_kib(climb) == pytest.approx(20 * MIB)  # medians of 0..9 and 20..29
    spike = [BASE] * 29 + [BASE + 400 * MIB]  # one late sample high: not a trend
    assert rss_growth_kib(spike) == 0
    noisy = [BASE + (5 * MIB if i % 2 else -5 * MIB) for i in range(30)]
    assert abs(rss_growth_kib(noisy)) <= 10 * MIB


def test_a_steady_climb_over_both_bounds_fails_naming_the_service():
    limit = RssLimit(max_growth_pct=5.0, min_growth_mib=8.0)
    leak = memory("verifier-cloud", [BASE + i * 2 * MIB for i in range(30)])  # +40 MiB = +8%
    reason = leak.failure(limit)
    assert reason is not None and reason.startswith("verifier-cloud grew 40.0 MiB (+8.0%)")
    flat = memory("device-agent-0", [BASE + (i % 3) * MIB for i in range(30)])
    assert flat.failure(limit) is None


def test_both_bounds_must_be_passed():
    redis = memory("redis", [10 * MIB + i * 100 for i in range(30)])  # +2 MiB = +20%: under the MiB floor
    assert redis.failure(RssLimit(5.0, 8.0)) is None
    assert redis.failure(RssLimit(5.0, 1.0)) is not None
    big = memory("verifier-cloud", [8000 * MIB + i * 4 * MIB for i in range(30)])  # +80 MiB = +1%: under 5%
    assert big.failure(RssLimit(5.0, 8.0)) is None
    assert big.failure(RssLimit(0.5, 8.0)) is not None


def test_a_restarted_or_vanished_service_fails():
    assert "was restarted (pid 100 -> 200)" in memory("token-streamer", [BASE] * 5, end_pid=200).failure(RssLimit())
    gone = memory("chunk-planner", [BASE] * 5)
    gone.sample(None)
    assert "chunk-planner is gone" in gone.failure(RssLimit())


def test_sampling_a_live_process_records_it_and_its_peak():
    m = ServiceMemory("this", os.getpid(), rss_kib(os.getpid()))
    m.sample(os.getpid())
    m.sample(os.getpid())
    assert len(m.samples) == 2 and m.peak_kib == max(m.samples) and not m.lost


def test_the_end_reading_counts_toward_the_peak_unless_the_service_was_restarted():
    m = ServiceMemory("this", 1, 900, samples=[1000, 1004], peak_kib=1004)
    m.finish(1008)  # read after the last sample, and higher
    assert m.end_kib == 1008 and m.peak_kib == 1008 >= max(m.start_kib, m.end_kib)
    restarted = ServiceMemory("that", 1, 900, samples=[1000], peak_kib=1000, lost=True, end_pid=2)
    restarted.finish(5000)  # another process's RSS
    assert restarted.end_kib == 5000 and restarted.peak_kib == 1000


def test_a_memory_failure_fails_the_report_and_is_printed():
    report = SoakReport(
        duration_s=60,
        rate=1,
        warmup_requests=1,
        warmup_failed=0,
        memory=[memory("verifier-cloud", [BASE + i * 4 * MIB for i in range(30)]), memory("redis", [10 * MIB] * 30)],
    )
    text = report.format()
    assert not report.ok and report.memory_failures == [report.memory[0].failure(report.rss_limit)]
    assert "FAIL: verifier-cloud grew" in text and "PASS" not in text
    assert "redis" in text and "FAIL: redis" not in text


def test_limits_are_checked():
    with pytest.raises(ValueError):
        RssLimit(max_growth_pct=-1)
