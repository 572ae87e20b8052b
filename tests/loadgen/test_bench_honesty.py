"""The benchmark harness reports what happened: a mode slowed by a known delay shows
that delay in its TTFT (and not in its TBT), measured by the same harness in one run
on a real mesh."""

from __future__ import annotations

import pytest

from loadgen.bench import BenchVariant, run_modes
from tests.conftest import DEMO_MODEL_DIR

# end-to-end: real processes, meshes or long statistical runs (make test-fast leaves these out)
# timing: races and fits of real processes' speeds, so make test runs it alone (after the rest)
pytestmark = [pytest.mark.slow, pytest.mark.timing]

ADDED_MS = 300.0


def test_harness_measures_a_known_added_delay(tmp_path):
    modes = {
        "hat": BenchVariant("hat", {}),
        "hat+delay": BenchVariant("hat+delay", {"added_delay_ms": ADDED_MS}),
    }
    results = run_modes(
        modes,
        workload="specbench",
        rates=[2.0],
        num_requests=6,
        max_new_tokens=8,
        seed=3,
        out=tmp_path,
        devices=1,
        link="none",
        model_dir=str(DEMO_MODEL_DIR),
    )
    fast, slow = results[("hat", 2.0)], results[("hat+delay", 2.0)]
    assert fast["completed"] == slow["completed"] == 6 and fast["failed"] == slow["failed"] == 0
    measured = slow["median_ttft_ms"] - fast["median_ttft_ms"]
    assert abs(measured - ADDED_MS) <= 0.25 * ADDED_MS, measured
    # The delay sits before the first token only: per-token times stay comparable.
    assert slow["mean_tbt_ms"] < 2.0 * fast["mean_tbt_ms"] + 5.0
    assert (tmp_path / "specbench" / "hat+delay" / "rate-2" / "results.json").is_file()
