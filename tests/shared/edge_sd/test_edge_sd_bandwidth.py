"""Edge SD uplink split (paper 001, eqs. 15, 16, 26, 27): equal finish times, optimality of the max."""

from __future__ import annotations

import math
import random

import pytest

from shared.edge_sd.bandwidth import (
    BandwidthInputError,
    embedding_bits_per_token,
    link_shares,
    optimal_upload_latency,
    uniform_split,
    uplink_split,
    upload_latency,
    upload_times,
    user_rates_bytes_s,
)
from shared.net.links import LinkProfile

BAND_HZ = 25e6  # the paper's Fig. 9 anchor: B_w = 25 MHz
BITS = embedding_bits_per_token(768, 4096)  # λ = 16 (h1_d + h1_v) for a LLaMA-68M / LLaMA-7B pair


def _random_users(rng: random.Random) -> tuple[list[int], list[float]]:
    users = rng.randint(1, 40)
    lengths = [rng.randint(1, 2048) for _ in range(users)]
    snrs = [10 ** rng.uniform(-1, 3) for _ in range(users)]  # -10 dB .. 30 dB, linear
    return lengths, snrs


def test_hand_checked_two_users():
    # snr 3 -> log2(4) = 2 bits/s/Hz; snr 1 -> 1. Weights I/log2: 100/2 = 50 and 100/1 = 100.
    shares = uplink_split([100, 100], [3.0, 1.0])
    assert shares == pytest.approx([1 / 3, 2 / 3])
    times = upload_times([100, 100], [3.0, 1.0], shares, bandwidth_hz=1000.0, bits_per_token=10.0)
    # user 0: 10*100 / (1/3 * 1000 * 2) = 1.5 s; user 1: 1000 / (2/3 * 1000 * 1) = 1.5 s
    assert times == pytest.approx([1.5, 1.5])
    assert optimal_upload_latency([100, 100], [3.0, 1.0], 1000.0, 10.0) == pytest.approx(1.5)
    assert embedding_bits_per_token(768, 4096) == 16 * (768 + 4096)


def test_eq27_every_upload_finishes_together_and_matches_t_star():
    rng = random.Random(27)
    for _ in range(300):
        lengths, snrs = _random_users(rng)
        shares = uplink_split(lengths, snrs)
        assert math.fsum(shares) == pytest.approx(1.0, abs=1e-12)
        assert all(0 < w <= 1 for w in shares)
        times = upload_times(lengths, snrs, shares, BAND_HZ, BITS)
        t_star = optimal_upload_latency(lengths, snrs, BAND_HZ, BITS)
        assert max(times) - min(times) <= 1e-12 * t_star
        assert times == pytest.approx([t_star] * len(times), rel=1e-12)
        assert upload_latency(lengths, snrs, shares, BAND_HZ, BITS) == pytest.approx(t_star, rel=1e-12)


def test_eq27_max_is_never_worse_than_uniform_nor_any_random_feasible_split():
    rng = random.Random(25)
    for _ in range(200):
        lengths, snrs = _random_users(rng)
        best = upload_latency(lengths, snrs, uplink_split(lengths, snrs), BAND_HZ, BITS)
        uniform = upload_latency(lengths, snrs, uniform_split(len(lengths)), BAND_HZ, BITS)
        assert best <= uniform * (1 + 1e-12)
        for _ in range(20):
            raw = [rng.random() + 1e-6 for _ in lengths]
            scale = rng.uniform(0.5, 1.0) / math.fsum(raw)  # feasible: Σ w <= 1 (eq. 24a)
            shares = [w * scale for w in raw]
            assert upload_latency(lengths, snrs, shares, BAND_HZ, BITS) >= best * (1 - 1e-12)


def test_uniform_split_leaves_unequal_finish_times_when_inputs_differ():
    lengths, snrs = [50, 400, 1000], [100.0, 100.0, 100.0]
    times = upload_times(lengths, snrs, uniform_split(3), BAND_HZ, BITS)
    assert times[0] < times[1] < times[2]
    uniform_max = max(times)
    best = optimal_upload_latency(lengths, snrs, BAND_HZ, BITS)
    # Same channel for all: the uniform max is the longest prompt's time at 1/K of the band,
    # the optimum is the total data over the whole band: 3*1000/1450 of it.
    assert best == pytest.approx(uniform_max * (50 + 400 + 1000) / (3 * 1000))
    # Equal inputs but different channels: the uniform split is unequal too; eq. 27 gives the poor channel more.
    shares = uplink_split([100, 100], [1.0, 1000.0])
    assert shares[0] > shares[1]
    uneven = upload_times([100, 100], [1.0, 1000.0], uniform_split(2), BAND_HZ, BITS)
    assert uneven[0] > uneven[1]


def test_uniform_split_shape():
    assert uniform_split(4) == [0.25] * 4
    with pytest.raises(BandwidthInputError):
        uniform_split(0)


def test_link_shares_give_each_user_its_rate_and_keep_the_template():
    lengths, snrs = [100, 300], [3.0, 15.0]
    shares = uplink_split(lengths, snrs)
    template = LinkProfile(uplink_bytes_s=1e9, downlink_bytes_s=5e6, latency_s=0.002, jitter_s=0.001)
    profiles = link_shares(shares, snrs, BAND_HZ, template)
    rates = user_rates_bytes_s(shares, snrs, BAND_HZ)
    for profile, rate, share, snr in zip(profiles, rates, shares, snrs):
        assert profile.uplink_bytes_s == pytest.approx(share * BAND_HZ * math.log2(1 + snr) / 8)
        assert profile.uplink_bytes_s == rate
        assert (profile.downlink_bytes_s, profile.latency_s, profile.jitter_s) == (5e6, 0.002, 0.001)
    # Bytes on the wire / applied rate = the same finish time for every user (eq. 27 through the emulation).
    finish = [BITS / 8 * length / profile.uplink_bytes_s for length, profile in zip(lengths, profiles)]
    assert finish[0] == pytest.approx(finish[1], rel=1e-12)
    assert finish[0] == pytest.approx(optimal_upload_latency(lengths, snrs, BAND_HZ, BITS), rel=1e-12)
    default = link_shares(shares, snrs, BAND_HZ)
    assert math.isinf(default[0].downlink_bytes_s) and default[0].latency_s == 0


@pytest.mark.parametrize(
    ("lengths", "snrs"),
    [
        ([], []),
        ([10, 20], [1.0]),
        ([0, 20], [1.0, 1.0]),
        ([-5], [1.0]),
        ([10], [0.0]),
        ([10], [-1.0]),
        ([math.inf], [1.0]),
        ([10], [math.nan]),
        ([10], [math.inf]),
        ([True], [1.0]),
        (["10"], [1.0]),
    ],
)
def test_bad_users_are_typed_errors(lengths, snrs):
    with pytest.raises(BandwidthInputError):
        uplink_split(lengths, snrs)
    with pytest.raises(BandwidthInputError):
        optimal_upload_latency(lengths, snrs, BAND_HZ, BITS)


@pytest.mark.parametrize(
    ("shares", "band", "bits"),
    [
        ([0.5, 0.0], BAND_HZ, BITS),
        ([0.7, 0.7], BAND_HZ, BITS),
        ([0.5], BAND_HZ, BITS),
        ([0.5, 0.5], 0.0, BITS),
        ([0.5, 0.5], math.inf, BITS),
        ([0.5, 0.5], BAND_HZ, -1.0),
        ([0.5, math.nan], BAND_HZ, BITS),
    ],
)
def test_bad_shares_or_band_are_typed_errors(shares, band, bits):
    with pytest.raises(BandwidthInputError):
        upload_times([10, 20], [1.0, 2.0], shares, band, bits)
    if len(shares) == 2 and band == BAND_HZ and bits == BITS:
        with pytest.raises(BandwidthInputError):
            link_shares(shares, [1.0, 2.0], band)
