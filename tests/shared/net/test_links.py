"""Link profiles: HAT's distance groups, hidden-size scaling, spec parsing."""

from __future__ import annotations

import math

import pytest

from shared.net.links import MB, PROFILES, UNSHAPED, LinkProfile, parse_link_spec, scaled_for_hidden


def test_named_profiles_lie_in_the_papers_ranges() -> None:
    for name in ("near", "mid", "far"):
        p = PROFILES[name]
        assert 5 * MB <= p.uplink_bytes_s <= 10 * MB
        assert 10 * MB <= p.downlink_bytes_s <= 15 * MB
        assert 0 < p.latency_s < 0.02 and p.jitter_s <= p.latency_s
    assert PROFILES["near"].uplink_bytes_s > PROFILES["mid"].uplink_bytes_s > PROFILES["far"].uplink_bytes_s
    assert parse_link_spec("slow") == PROFILES["far"]
    assert parse_link_spec("NONE") == UNSHAPED and not parse_link_spec("none").shaped
    assert PROFILES["near"].shaped


def test_scaling_keeps_seconds_per_token_on_the_wire() -> None:
    near = PROFILES["near"]
    small = scaled_for_hidden(near, 256)
    assert small.uplink_bytes_s == pytest.approx(625_000)
    assert small.downlink_bytes_s == pytest.approx(937_500)
    # fp16 row per token: 2*H bytes; time per token must match the 4096-wide model.
    assert 2 * 256 / small.uplink_bytes_s == pytest.approx(2 * 4096 / near.uplink_bytes_s)
    assert (small.latency_s, small.jitter_s) == (near.latency_s, near.jitter_s)
    assert scaled_for_hidden(UNSHAPED, 256) == UNSHAPED
    with pytest.raises(ValueError):
        scaled_for_hidden(near, 0)


def test_parse_explicit_and_override_specs() -> None:
    p = parse_link_spec("up=5MB,down=10MB,lat=5ms,jitter=1ms")
    assert p == LinkProfile(5e6, 10e6, 0.005, 0.001)
    assert parse_link_spec(" up = 40mbit/s , down=2MiB ") == LinkProfile(5e6, 2 * 1024**2, 0.0, 0.0)
    assert parse_link_spec("up=625000").uplink_bytes_s == 625_000
    assert math.isinf(parse_link_spec("lat=3ms").downlink_bytes_s)
    far = parse_link_spec("far,lat=20ms")
    assert far.latency_s == pytest.approx(0.02) and far.uplink_bytes_s == PROFILES["far"].uplink_bytes_s
    assert parse_link_spec("up=1.5e3KB").uplink_bytes_s == pytest.approx(1.5e6)


@pytest.mark.parametrize(
    "spec",
    ["", "moon", "up=5MB,up=6MB", "lat=5", "up=-1MB", "up=5 parsecs", "speed=5MB", "up=0", "lat=1ms,jitter=2ms", "up"],
)
def test_parse_rejects_bad_specs(spec: str) -> None:
    with pytest.raises(ValueError):
        parse_link_spec(spec)


def test_profile_validation_and_describe() -> None:
    with pytest.raises(ValueError):
        LinkProfile(0, 1)
    with pytest.raises(ValueError):
        LinkProfile(1, 1, latency_s=-0.1)
    with pytest.raises(ValueError):
        LinkProfile(1, 1, latency_s=math.inf)
    with pytest.raises(ValueError):
        LinkProfile(math.nan, 1)
    assert scaled_for_hidden(PROFILES["near"], 256).describe() == "up=625.0KB/s down=937.5KB/s lat=2.0ms jitter=0.5ms"
    assert UNSHAPED.describe() == "unshaped"
