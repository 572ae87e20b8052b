"""`tophat bench`'s mode table, its --rtt-ms link specs and the results JSON it writes (loadgen/bench.py)."""

from __future__ import annotations

import json

import pytest

from loadgen.bench import (
    BenchVariant,
    counterbalanced,
    format_table,
    link_with_rtt,
    mesh_turns,
    modes_for,
    plot_modes,
    pooled,
    save_table,
)
from loadgen.metrics import RequestRecord, build_results
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


def _record(index: int, tbt_s: float) -> RequestRecord:
    """A finished request whose four tokens came tbt_s apart, the first 0.1 s after it was sent."""
    times = [0.1 + i * tbt_s for i in range(4)]
    return RequestRecord(
        index, 0.0, 4, send_s=0.0, end_s=times[-1], chunk_times_s=times, chunk_tokens=[1] * 4, completion_tokens=4
    )


def test_repeats_alternate_their_order():
    a, b, c = (BenchVariant(name) for name in "abc")
    orders = [[mode.name for mode in order] for order in counterbalanced([a, b, c], 3)]
    assert orders == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]]


def test_meshes_take_turns_repeat_by_repeat_and_one_mesh_keeps_its_repeats():
    a, b, c = (BenchVariant(name, verifier_env=env) for name, env in zip("abc", [(), (), (("X", "1"),)]))
    turns = [
        (group[0].name, [(r, [m.name for m in order]) for r, order in runs])
        for group, runs in mesh_turns([[a, b], [c]], 3)
    ]
    assert turns == [
        ("a", [(0, ["a", "b"])]),
        ("c", [(0, ["c"])]),
        ("c", [(1, ["c"])]),
        ("a", [(1, ["b", "a"])]),
        ("a", [(2, ["a", "b"])]),
        ("c", [(2, ["c"])]),
    ]
    alone = [(r, [m.name for m in order]) for _, runs in mesh_turns([[a, b]], 2) for r, order in runs]
    assert alone == [(0, ["a", "b"]), (1, ["b", "a"])]


def test_every_mode_has_a_variant_that_computes_prompts_whole():
    modes = modes_for("specbench")
    whole = ("TOPHAT_VERIFIER_MAX_PREFILL_STEP_MS", "0")
    assert modes["ushape+whole"].verifier_env == (whole,)
    assert modes["cloud+whole"].verifier_env == (*modes["cloud"].verifier_env, whole)
    assert modes["hat+whole"].request_options == modes["hat"].request_options
    assert whole not in modes["ushape"].verifier_env


def test_a_pooled_row_measures_every_repeats_requests():
    fast = [_record(i, 0.01) for i in range(3)]
    slow = [_record(i, 0.03) for i in range(3)]
    first = {"workload": "specbench", **build_results(fast)}
    second = build_results(slow)
    row = pooled([(first, fast), (second, slow)])
    assert row["repeats"] == 2 and row["workload"] == "specbench"
    assert row["completed"] == 6
    assert row["repeat_tbt_ms"] == pytest.approx([10.0, 30.0])
    assert row["mean_tbt_ms"] == pytest.approx(20.0)  # every token gap of both repeats
    assert pooled([(first, fast)]) is first


def test_the_table_shows_each_repeats_ratio():
    results = {
        ("ushape", 1.0): {**build_results([_record(0, 0.02)]), "repeat_tbt_ms": [20.0, 40.0]},
        ("hat", 1.0): {**build_results([_record(0, 0.01)]), "repeat_tbt_ms": [10.0, 60.0]},
    }
    table = format_table(results, "ushape", "t")
    assert "hat @ 1: TBT/base per repeat 0.50x 1.50x" in table


@pytest.mark.parametrize("repeats", [1, 2])
def test_plots_read_every_repeats_requests(tmp_path, repeats):
    """With --repeats each run's requests.csv is under rate-R/repeat-N/; the plot pools them as the table does."""
    header = "ok,ttft_ms,decode_sla_ms\n"
    for mode in ("ushape", "hat"):
        rate_dir = tmp_path / "specbench" / mode / "rate-1"
        dirs = [rate_dir / f"repeat-{n}" for n in range(repeats)] if repeats > 1 else [rate_dir]
        for run_dir in dirs:
            run_dir.mkdir(parents=True)
            (run_dir / "requests.csv").write_text(header + "True,120.5,300\nFalse,,\nTrue,98.0,nan\n")
    (written,) = plot_modes(tmp_path, "specbench", {("ushape", 1.0): {}, ("hat", 1.0): {}}, "bench-specbench")
    assert written.name == "bench-specbench-rate-1.png" and written.stat().st_size > 0
