"""The soak on a real demo mesh, for a few seconds: its report's shape, and that failed requests are counted
(and fail the soak) rather than lost."""

from __future__ import annotations

import os

import pytest

from loadgen.soak import SoakReport, mesh_processes, rss_kib, soak
from tests.conftest import DEMO_MODEL_DIR

# end-to-end: real processes, meshes or long statistical runs (make test-fast leaves these out)
pytestmark = pytest.mark.slow

SERVICES = {"state-monitor", "chunk-planner", "verifier-cloud", "device-agent-0", "token-streamer", "redis"}


@pytest.fixture(scope="module")
def mesh(default_demo_mesh):
    return default_demo_mesh  # conftest: shared with test_disconnect


def test_rss_is_read_from_proc_and_a_gone_process_has_none():
    assert rss_kib(os.getpid()) > 1024  # this interpreter holds more than a MiB
    assert rss_kib(2**22 + 12345) is None  # above the kernel's pid_max limit: no such process


async def test_a_short_soak_reports_every_service_and_no_failure(mesh):
    report = await soak(
        mesh.config.streamer_url,
        lambda: mesh_processes(mesh),
        model_dir=str(DEMO_MODEL_DIR),
        duration_s=3.0,
        rate=2.0,
        warmup_requests=1,
        max_new_tokens=8,
        sample_every_s=0.5,
    )
    text = report.format()
    assert report.ok and report.failed == 0 and report.warmup_failed == 0, text
    assert report.requests >= 1 and report.completed == report.requests, text
    assert {m.name for m in report.memory} == SERVICES, text
    for m in report.memory:
        assert m.start_kib and m.end_kib and m.peak_kib >= max(m.start_kib, m.end_kib), text
        assert m.end_pid == m.pid and m.growth_pct is not None, text
        assert m.name in text
    assert "failed: 0 (goal 0)" in text and "PASS" in text


async def test_failed_requests_are_counted_and_fail_the_soak(mesh):
    """Every request carries a temperature the streamer refuses (400): each one is a failure in the report."""
    report = await soak(
        mesh.config.streamer_url,
        lambda: mesh_processes(mesh),
        model_dir=str(DEMO_MODEL_DIR),
        duration_s=2.0,
        rate=3.0,
        warmup_requests=2,
        max_new_tokens=8,
        extra_body={"temperature": -1.0},
    )
    text = report.format()
    assert report.warmup_failed == 2 and report.requests >= 1 and report.failed == report.requests, text
    assert report.completed == 0 and not report.ok, text
    assert sum(report.errors.values()) == report.requests + 2 and "400" in next(iter(report.errors)), text
    assert f"failed: {report.failed} (goal 0)" in text and "FAIL" in text


def test_an_empty_report_is_not_a_pass_when_the_warm_up_failed():
    assert not SoakReport(duration_s=1, rate=1, warmup_requests=1, warmup_failed=1).ok
    assert SoakReport(duration_s=1, rate=1, warmup_requests=1, warmup_failed=0).ok
