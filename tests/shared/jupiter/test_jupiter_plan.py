"""Jupiter's profile (interpolation, sizes, storage, measurement) and the stored edge plan
(device specs, LAN, partition + sequence table, fingerprint refusal)."""

from __future__ import annotations

import json
import math

import pytest

from shared.jupiter.plan import (
    DEFAULT_MEMORY_BYTES,
    DeviceSpec,
    EdgePlan,
    PlanError,
    build_plan,
    lan_spec,
    load_plan,
    parse_edge_pipeline,
    parse_lan,
)
from shared.jupiter.profile import Profile, ProfileError, load_profile, measure_profile
from shared.jupiter.sequence import equal_sub_sequences

LENGTHS = (1, 8, 32, 128, 512)
PREFIXES = (0, 512, 2048)


def _synthetic_time(s: float, c: float) -> float:
    # a per-call overhead (short parts underuse the device), linear work, causal attention
    return 2e-4 + 2e-5 * s + 2e-9 * s * (c + s / 2)


def synthetic_profile(num_layers: int = 24, **overrides) -> Profile:
    fields = dict(
        model_name="synthetic",
        num_layers=num_layers,
        hidden_size=256,
        layer_weight_bytes=3_000_000,
        kv_bytes_per_token_layer=1024,
        embed_bytes=8_000_000,
        head_bytes=8_000_000,
        draft_bytes=800_000,
        lengths=LENGTHS,
        prefixes=PREFIXES,
        layer_times=tuple(tuple(_synthetic_time(s, c) for c in PREFIXES) for s in LENGTHS),
    )
    fields.update(overrides)
    return Profile(**fields)


# --- profile ----------------------------------------------------------------------------------
def test_layer_time_interpolates_and_extrapolates_linearly():
    profile = synthetic_profile()
    assert profile.layer_time(128, 512) == pytest.approx(_synthetic_time(128, 512))
    # bilinear between grid points: the mean of the four corners at the cell's centre
    corners = [_synthetic_time(s, c) for s in (32, 128) for c in (0, 512)]
    assert profile.layer_time(80, 256) == pytest.approx(sum(corners) / 4)
    # beyond the grid: the outermost segment's line
    slope = (_synthetic_time(512, 0) - _synthetic_time(128, 0)) / 384
    assert profile.layer_time(1024, 0) == pytest.approx(_synthetic_time(512, 0) + 512 * slope)
    c_slope = (_synthetic_time(8, 2048) - _synthetic_time(8, 512)) / 1536
    assert profile.layer_time(8, 4096) == pytest.approx(_synthetic_time(8, 2048) + 2048 * c_slope)
    # numpy arrays broadcast and agree with scalars
    import numpy as np

    many = profile.layer_time(np.array([1, 80, 1024]), np.array([0, 256, 0]))
    assert list(many) == pytest.approx(
        [profile.layer_time(1, 0), profile.layer_time(80, 256), profile.layer_time(1024, 0)]
    )
    assert profile.stage_time(6, 128, 0, 3.0) == pytest.approx(18 * profile.layer_time(128, 0))


def test_stage_memory_counts_weights_kv_and_the_ends():
    profile = synthetic_profile()
    assert profile.stage_memory(4, 1000) == 4 * (3_000_000 + 1000 * 1024)
    assert profile.stage_memory(4, 1000, with_embeddings=True, with_draft=True) == (
        4 * (3_000_000 + 1000 * 1024) + 16_000_000 + 800_000
    )
    assert profile.stage_memory(1, 0, with_head=True) == 3_000_000 + 8_000_000


def test_profile_is_checked():
    with pytest.raises(ProfileError, match="strictly increasing"):
        synthetic_profile(lengths=(1, 8, 8, 128, 512))
    with pytest.raises(ProfileError, match="rows"):
        synthetic_profile(layer_times=((1.0, 1.0, 1.0),))
    with pytest.raises(ProfileError, match="positive"):
        synthetic_profile(layer_times=tuple(tuple(-1.0 for _ in PREFIXES) for _ in LENGTHS))
    with pytest.raises(ProfileError, match="num_layers"):
        synthetic_profile(num_layers=0)


def test_profile_round_trip_and_bad_files(tmp_path):
    profile = synthetic_profile()
    path = profile.save(tmp_path / "p.json")
    assert load_profile(path) == profile
    text = path.read_text()
    (tmp_path / "cut.json").write_text(text[: len(text) // 2])
    with pytest.raises(ProfileError, match="truncated"):
        load_profile(tmp_path / "cut.json")
    body = json.loads(text)
    (tmp_path / "v9.json").write_text(json.dumps({**body, "version": 9}))
    with pytest.raises(ProfileError, match="version"):
        load_profile(tmp_path / "v9.json")
    del body["layer_times"]
    (tmp_path / "missing.json").write_text(json.dumps(body))
    with pytest.raises(ProfileError, match="layer_times"):
        load_profile(tmp_path / "missing.json")
    (tmp_path / "wrong.json").write_text(json.dumps({**json.loads(text), "num_layers": "many"}))
    with pytest.raises(ProfileError, match="num_layers"):
        load_profile(tmp_path / "wrong.json")
    with pytest.raises(ProfileError, match="cannot read"):
        load_profile(tmp_path / "absent.json")


def test_measure_profile_times_real_layers_after_a_real_prefix(tiny_llama_dir, monkeypatch):
    from shared.model.split import LayerRange

    seen = []
    original = LayerRange.forward_batch

    def spy(self, items):
        seen.append([(cache.length, hidden.shape[0]) for cache, hidden in items])
        return original(self, items)

    monkeypatch.setattr(LayerRange, "forward_batch", spy)
    profile = measure_profile(tiny_llama_dir, lengths=(1, 8), prefixes=(0, 4), repeats=2)
    # the tiny model: H=64, I=128, 4 heads of 16 (2 KV heads), 5 layers, vocab 211, fp32
    hidden, inter, kv_dim = 64, 128, 2 * 16
    layer_params = 2 * hidden * hidden + 2 * hidden * kv_dim + 3 * hidden * inter + 2 * hidden
    assert profile.num_layers == 5 and profile.hidden_size == 64
    assert profile.layer_weight_bytes == 4 * layer_params
    assert profile.kv_bytes_per_token_layer == 2 * kv_dim * 4
    assert profile.embed_bytes == 4 * 211 * hidden and profile.head_bytes == 4 * (211 * hidden + hidden)
    assert len(profile.layer_times) == 2 and all(len(row) == 2 and min(row) > 0 for row in profile.layer_times)
    # every timed pass of S new tokens ran on a cache already holding the prefix c
    timed = [call[0] for call in seen if call[0][1] in (1, 8) and call[0][0] in (0, 4)]
    for s in (1, 8):
        for c in (0, 4):
            assert timed.count((c, s)) >= 2


# --- devices and LAN ----------------------------------------------------------------------------
def test_parse_edge_pipeline():
    devices = parse_edge_pipeline("orin;xavier;xavier:512MiB")
    assert [(d.name, d.slowdown) for d in devices] == [("orin", 1.0), ("xavier", 3.0), ("xavier", 3.0)]
    assert devices[0].memory_bytes == DEFAULT_MEMORY_BYTES and devices[2].memory_bytes == 512 * 1024**2
    assert parse_edge_pipeline("2.5:1GB; orin")[0] == DeviceSpec("2.5", 2.5, 10**9)
    for bad, reason in [
        ("orin", "at least 2"),
        ("orin;;xavier", "at least 2"),
        ("orin;quantum", "quantum"),
        ("orin;cycle", "time-varying"),
        ("orin;xavier:12parsecs", "memory budget"),
        ("orin;0.5", ">= 1"),
    ]:
        with pytest.raises(ValueError, match=reason):
            parse_edge_pipeline(bad)


def test_parse_lan():
    assert parse_lan("100mbit,lat=1ms") == (12_500_000.0, 0.001)
    assert parse_lan("up=10MB,down=5MB,lat=2ms") == (5_000_000.0, 0.002)
    assert parse_lan(lan_spec(12_500_000.0, 0.001)) == (12_500_000.0, 0.001)
    assert parse_lan(lan_spec(math.inf, 0.0)) == (math.inf, 0.0)
    with pytest.raises(ValueError):
        parse_lan("100 furlongs")


# --- plans ------------------------------------------------------------------------------------
HETEROGENEOUS = "orin;xavier;xavier"


def _plan(kind="jupiter", spec=HETEROGENEOUS, profile=None, max_len=1024, **kwargs):
    return build_plan(
        profile or synthetic_profile(),
        parse_edge_pipeline(spec),
        12_500_000.0,
        0.001,
        draft_layers=2,
        max_len=max_len,
        kind=kind,
        **kwargs,
    )


def test_jupiter_plan_beats_the_equal_split_on_heterogeneous_devices():
    jupiter, equal, serial = _plan("jupiter"), _plan("equal"), _plan("serial")
    assert jupiter.stage_layers[0][0] == 0 and jupiter.stage_layers[-1][1] == 24
    assert equal.stage_layers == ((0, 8), (8, 16), (16, 24))
    # the fast orin gets more layers than either xavier
    counts = [b - a for a, b in jupiter.stage_layers]
    assert counts[0] > max(counts[1:])
    assert jupiter.predicted_bottleneck_s < equal.predicted_bottleneck_s
    assert jupiter.l_min == 128  # per-token time within 10 % of S=512's from S=128 on
    for (length, ours), (_, eq), (_, ser) in zip(jupiter.predicted_ttft, equal.predicted_ttft, serial.predicted_ttft):
        assert ours < ser, length
        if length >= 2 * jupiter.l_min:
            assert ours < eq, length
        else:  # too short to cut into parts of l_min: one part, on the better partition
            assert jupiter.chunk_sizes(length) == [length]


def test_chunk_sizes_follow_the_kind():
    jupiter, equal, serial = _plan("jupiter"), _plan("equal"), _plan("serial")
    for length in (1, 7, 100, 1024, 3000):
        for plan in (jupiter, equal, serial):
            assert sum(plan.chunk_sizes(length)) == length
    assert equal.chunk_sizes(100) == equal_sub_sequences(100, 3)
    assert serial.chunk_sizes(700) == [700]
    parts = jupiter.chunk_sizes(1024)
    assert len(parts) > 1 and min(parts) >= jupiter.l_min


def test_memory_budgets_shape_the_partition():
    roomy = _plan()
    # the last xavier may hold 3 layers (+ the head) and KV for 1024 positions, and no more
    budget = 3 * (3_000_000 + 1024 * 1024) + 8_000_000
    tight = _plan(spec=f"orin;xavier;xavier:{budget}")
    assert (
        tight.stage_layers[-1][1] - tight.stage_layers[-1][0]
        <= 3
        < roomy.stage_layers[-1][1] - roomy.stage_layers[-1][0]
    )
    with pytest.raises(PlanError, match="memory"):
        _plan(spec="orin:1MiB;xavier;xavier")
    with pytest.raises(PlanError, match="memory"):
        _plan("equal", spec=f"orin;xavier;xavier:{budget}")


def test_device_zero_keeps_the_drafters_layers():
    plan = build_plan(
        synthetic_profile(), parse_edge_pipeline("10;orin;orin"), 12_500_000.0, 0.001, draft_layers=4, max_len=256
    )
    assert plan.stage_layers[0][1] >= 4


def test_plan_round_trip_and_refusals(tmp_path):
    plan = _plan()
    path = plan.save(tmp_path / "plan.json")
    loaded = load_plan(path, num_layers=24, hidden_size=256)
    assert loaded == plan and loaded.chunk_sizes(999) == plan.chunk_sizes(999)
    with pytest.raises(PlanError, match="24 layers"):
        load_plan(path, num_layers=8, hidden_size=256)
    with pytest.raises(PlanError, match="hidden 256"):
        loaded.check_model(24, 512)
    text = path.read_text()
    (tmp_path / "cut.json").write_text(text[:-100])
    with pytest.raises(PlanError, match="truncated"):
        load_plan(tmp_path / "cut.json")
    body = json.loads(text)
    body["stage_layers"] = [[0, 10], [11, 20], [20, 24]]
    (tmp_path / "gap.json").write_text(json.dumps(body))
    with pytest.raises(PlanError, match="cover"):
        load_plan(tmp_path / "gap.json")
    body = json.loads(text)
    body["sequence_table"][99] = [50, 49]
    (tmp_path / "sum.json").write_text(json.dumps(body))
    with pytest.raises(PlanError, match="length 100"):
        load_plan(tmp_path / "sum.json")
    (tmp_path / "v2.json").write_text(json.dumps({**json.loads(text), "version": 2}))
    with pytest.raises(PlanError, match="version"):
        load_plan(tmp_path / "v2.json")


def test_edge_plan_rejects_a_first_stage_smaller_than_the_draft():
    body = _plan().to_json()
    body["draft_layers"] = body["stage_layers"][0][1] + 1
    with pytest.raises(PlanError, match="draft"):
        EdgePlan.from_json(body)


# --- the CLI ------------------------------------------------------------------------------------
def test_tophat_profile_and_plan_commands(tmp_path, tiny_llama_dir):
    from typer.testing import CliRunner

    from tophat.cli import app

    runner = CliRunner()
    profile_path = tmp_path / "profile.json"
    result = runner.invoke(
        app,
        [
            "profile",
            "--model",
            str(tiny_llama_dir),
            "--lengths",
            "1,8",
            "--prefixes",
            "0,4",
            "--repeats",
            "1",
            "--out",
            str(profile_path),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "l_min" in result.output and load_profile(profile_path).num_layers == 5

    synthetic_profile().save(profile_path)
    plan_path = tmp_path / "plan.json"
    result = runner.invoke(
        app,
        [
            "plan",
            "--edge-pipeline",
            HETEROGENEOUS,
            "--profile",
            str(profile_path),
            "--lan",
            "100mbit,lat=1ms",
            "--max-len",
            "512",
            "--out",
            str(plan_path),
        ],
    )
    assert result.exit_code == 0, result.output
    plan = load_plan(plan_path, num_layers=24, hidden_size=256)
    assert plan.kind == "jupiter" and plan.max_len == 512
    assert "equal" in result.output and "serial" in result.output and str(plan.chunk_sizes(512)) in result.output

    result = runner.invoke(app, ["plan", "--edge-pipeline", "orin", "--profile", str(profile_path)])
    assert result.exit_code == 2 and "at least 2 devices" in result.output
    result = runner.invoke(app, ["plan", "--edge-pipeline", HETEROGENEOUS, "--profile", str(tmp_path / "none.json")])
    assert result.exit_code == 2 and "cannot read profile" in result.output
