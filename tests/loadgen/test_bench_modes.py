"""`tophat bench`'s mode table, its --rtt-ms link specs and the results JSON it writes (loadgen/bench.py)."""

from __future__ import annotations

import json

import pytest

from loadgen.bench import link_with_rtt, modes_for, save_table
from shared.net.links import parse_link_spec


def test_the_stream_modes_are_bench_modes_and_token_modes_get_the_full_model():
    modes = modes_for("specbench")
    for name in ("cloud", "token-sd", "picospec", "hat", "hat-async"):
        assert name in modes
    full_model = ("TOPHAT_VERIFIER_FULL_MODEL", "true")
    assert all(full_model in modes[m].verifier_env for m in ("cloud", "token-sd", "picospec"))
    assert full_model not in modes["hat-async"].verifier_env  # privacy mode: the middle layers only
    assert modes["picospec"].request_options == {"mode": "picospec"}


@pytest.mark.parametrize("link, rtt, latency_s", [("none", 100, 0.05), ("mid", 20, 0.01), ("far,lat=1ms", 50, 0.025)])
def test_a_round_trip_sets_half_of_it_as_the_one_way_latency(link, rtt, latency_s):
    spec = link_with_rtt(link, rtt)
    profile = parse_link_spec(spec)
    assert profile.latency_s == pytest.approx(latency_s)
    if link == "mid":  # the named profile's bandwidths stay
        assert profile.uplink_bytes_s == parse_link_spec("mid").uplink_bytes_s
    assert link_with_rtt(link, None) == link
    with pytest.raises(ValueError):
        link_with_rtt(link, -1)


def test_saved_results_name_their_mode(tmp_path):
    results = {("picospec", 0.25): {"completed": 3, "mean_tbt_ms": 10.0, "per_request": [1, 2]}}
    save_table(tmp_path, "bench-x", "table", results)
    saved = json.loads((tmp_path / "bench-x.json").read_text())
    assert saved == {"picospec@0.25": {"mode": "picospec", "completed": 3, "mean_tbt_ms": 10.0}}
