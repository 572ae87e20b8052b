"""`tophat bench serve`, `ablation`, `disco` and `jupiter` options (loadgen/bench_command.py), without a mesh."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadgen.bench_command import ModeBench, disco_bench_options, parse_buckets, split_list

OPTIONS = dict(
    workload="specbench",
    rates=None,
    modes="ushape,hat",
    link=None,
    rtt_ms="",
    ablation=False,
    baseline="",
    devices=2,
    num_requests=4,
    max_new_tokens=8,
    seed=0,
    out=Path("out"),
)


def test_defaults_are_the_documented_ones():
    bench = ModeBench.from_options(**OPTIONS)
    assert bench.rates == (0.5, 1.0, 2.0) and bench.link == "none" and bench.runs == ((None, "none"),)
    assert bench.workloads == ("specbench",) and bench.modes == ("ushape", "hat")


def test_each_rtt_is_a_run_with_half_of_it_as_one_way_latency():
    bench = ModeBench.from_options(**{**OPTIONS, "link": "mid,lat=3ms", "rtt_ms": "20,50"})
    assert bench.runs == ((20.0, "mid,lat=10ms"), (50.0, "mid,lat=25ms"))


def test_the_ablation_runs_both_workloads_whatever_the_modes():
    bench = ModeBench.from_options(**{**OPTIONS, "ablation": True, "modes": "not-a-mode"})
    assert bench.workloads == ("specbench", "cnndm")


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"modes": "ushape,warp"}, "unknown modes"),
        ({"rates": "1,-2"}, "--rates"),
        ({"rtt_ms": "fast"}, "--rtt-ms"),
        ({"rtt_ms": "-5"}, "--rtt-ms"),
        ({"dtype": "int3"}, "--dtype"),
    ],
)
def test_a_bad_option_is_a_value_error_naming_it(bad, message):
    with pytest.raises(ValueError, match=message):
        ModeBench.from_options(**{**OPTIONS, **bad})


def test_edge_and_disco_options():
    assert parse_buckets("orin;xavier", "64, 256") == [64, 256]
    with pytest.raises(ValueError, match="--buckets"):
        parse_buckets("orin;xavier", "0")
    assert disco_bench_options(None, None, "0.5", "server", "")["rate"] == 2.0
    assert disco_bench_options(1.5, None, "0.5", "server", "")["rate"] == 1.5
    with pytest.raises(ValueError, match="--rate"):
        disco_bench_options(0.0, None, "0.5", "server", "")
    assert split_list(" a, ,b ") == ["a", "b"]


def test_the_dtype_reaches_every_mesh_the_bench_starts(monkeypatch):
    import tophatctl.mesh
    from loadgen.bench import modes_for, run_modes

    started = []

    class NoMesh:
        def __init__(self, config):
            started.append(config)
            raise RuntimeError("no mesh in this test")

    monkeypatch.setattr(tophatctl.mesh, "Mesh", NoMesh)
    bench = ModeBench.from_options(**{**OPTIONS, "dtype": "int4"})
    assert bench.dtype == "int4" and ModeBench.from_options(**OPTIONS).dtype == "auto"
    with pytest.raises(RuntimeError, match="no mesh"):
        run_modes(
            {"hat": modes_for("specbench")["hat"]},
            workload="specbench",
            rates=[1.0],
            num_requests=1,
            max_new_tokens=1,
            seed=0,
            out=Path("out"),
            devices=1,
            link="none",
            model_dir="models/demo",
            dtype=bench.dtype,
        )
    assert [config.dtype for config in started] == ["int4"]
