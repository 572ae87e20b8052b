"""Edge SD's shared wireless uplink (paper 001, §II-D 1 and §III-A, eqs. 15, 16, 25-27).

K users upload their input sequences to the small base station (SBS) over one OFDMA uplink of
B_w Hz. User k gets the fraction w_k of the band; its achievable rate is
r_k = w_k B_w log2(1 + p_k g_k / σ²) bits/s, so its upload takes (eq. 15)

    T_k,com = λ I_k / (w_k B_w log2(1 + p_k g_k / σ²))

with I_k its input length in tokens and λ the bits per token (λ = 16 (h1_d + h1_v) for fp16
embeddings of both models, §II-D). Inference starts once every upload is in, so the upload
phase costs T_com = max_k T_k,com (eq. 16). Minimising that max (problem P1, eq. 25) means all
users finish together (eq. 26), which gives the closed form (eq. 27)

    w_k* = (I_k / log2(1 + snr_k)) / Σ_k' (I_k' / log2(1 + snr_k'))

and the common finish time t*_com = Σ_k λ I_k / (B_w log2(1 + snr_k)) (below eq. 26; the paper
prints the SNR there as p_k/g_k σ², a typo for p_k g_k / σ² as in eqs. 15 and 27).

`snr` everywhere here is the *linear* ratio p_k g_k / σ², not dB. Everything is pure: the link
emulation applies `link_shares`' profiles to each user's connection.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from shared.net.links import UNSHAPED, LinkProfile

FP16_BITS = 16  # the paper's λ assumes fp16 embeddings (§II-D)
_SUM_TOLERANCE = 1e-9  # shares are floats: allow Σ w_k a hair above 1 (constraint 24a)


class BandwidthInputError(ValueError):
    """Inputs the uplink model cannot price: empty, mismatched, non-positive or non-finite."""


def _positive_finite(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BandwidthInputError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise BandwidthInputError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def _checked_users(input_lengths: Sequence[float], snrs: Sequence[float]) -> tuple[list[float], list[float]]:
    if len(input_lengths) == 0:
        raise BandwidthInputError("no users: input_lengths is empty")
    if len(input_lengths) != len(snrs):
        raise BandwidthInputError(f"{len(input_lengths)} input lengths but {len(snrs)} SNRs")
    lengths = [_positive_finite(f"input_lengths[{k}]", v) for k, v in enumerate(input_lengths)]
    ratios = [_positive_finite(f"snrs[{k}]", v) for k, v in enumerate(snrs)]
    return lengths, ratios


def _checked_shares(shares: Sequence[float], users: int) -> list[float]:
    if len(shares) != users:
        raise BandwidthInputError(f"{len(shares)} shares for {users} users")
    checked = [_positive_finite(f"shares[{k}]", w) for k, w in enumerate(shares)]
    if any(w > 1 for w in checked) or sum(checked) > 1 + _SUM_TOLERANCE:
        # eqs. 24a / 24e: each w_k in [0, 1] and Σ w_k <= 1 (a zero share never finishes, so > 0 here).
        raise BandwidthInputError(f"shares must each be <= 1 and sum to <= 1, got sum {sum(checked)!r}")
    return checked


def spectral_efficiency(snr: float) -> float:
    """log2(1 + snr): bits/s per Hz of band at linear SNR p g / σ² (the rate factor in eq. 15)."""
    return math.log2(1 + _positive_finite("snr", snr))


def embedding_bits_per_token(draft_hidden: int, verify_hidden: int, bits_per_value: int = FP16_BITS) -> float:
    """λ = 16 (h1_d + h1_v) (§II-D, under eq. 15): bits uploaded per input token."""
    for name, value in (
        ("draft_hidden", draft_hidden),
        ("verify_hidden", verify_hidden),
        ("bits_per_value", bits_per_value),
    ):
        _positive_finite(name, value)
    return float(bits_per_value * (draft_hidden + verify_hidden))


def uplink_split(input_lengths: Sequence[float], snrs: Sequence[float]) -> list[float]:
    """Eq. 27: w_k* ∝ I_k / log2(1 + snr_k), normalised to Σ w_k = 1 (all uploads end together)."""
    lengths, ratios = _checked_users(input_lengths, snrs)
    # Weight = seconds·Hz user k needs per bit of λ: a long prompt or a poor channel gets more band.
    weights = [length / math.log2(1 + snr) for length, snr in zip(lengths, ratios)]
    total = math.fsum(weights)
    return [weight / total for weight in weights]


def uniform_split(users: int) -> list[float]:
    """The paper's baseline (§IV-C): the band divided evenly, w_k = 1/K."""
    if isinstance(users, bool) or not isinstance(users, int) or users <= 0:
        raise BandwidthInputError(f"users must be an int >= 1, got {users!r}")
    return [1.0 / users] * users


def upload_times(
    input_lengths: Sequence[float],
    snrs: Sequence[float],
    shares: Sequence[float],
    bandwidth_hz: float,
    bits_per_token: float,
) -> list[float]:
    """Eq. 15 per user, in seconds: T_k,com = λ I_k / (w_k B_w log2(1 + snr_k))."""
    lengths, ratios = _checked_users(input_lengths, snrs)
    checked_shares = _checked_shares(shares, len(lengths))
    band = _positive_finite("bandwidth_hz", bandwidth_hz)
    bits = _positive_finite("bits_per_token", bits_per_token)
    return [
        bits * length / (share * band * math.log2(1 + snr))
        for length, snr, share in zip(lengths, ratios, checked_shares)
    ]


def upload_latency(
    input_lengths: Sequence[float],
    snrs: Sequence[float],
    shares: Sequence[float],
    bandwidth_hz: float,
    bits_per_token: float,
) -> float:
    """Eq. 16: T_com = max_k T_k,com — inference waits for the last upload."""
    return max(upload_times(input_lengths, snrs, shares, bandwidth_hz, bits_per_token))


def optimal_upload_latency(
    input_lengths: Sequence[float], snrs: Sequence[float], bandwidth_hz: float, bits_per_token: float
) -> float:
    """t*_com (solution of eq. 26) = Σ_k λ I_k / (B_w log2(1 + snr_k)): T_com under the eq. 27 split."""
    lengths, ratios = _checked_users(input_lengths, snrs)
    band = _positive_finite("bandwidth_hz", bandwidth_hz)
    bits = _positive_finite("bits_per_token", bits_per_token)
    return math.fsum(bits * length / (band * math.log2(1 + snr)) for length, snr in zip(lengths, ratios))


def user_rates_bytes_s(shares: Sequence[float], snrs: Sequence[float], bandwidth_hz: float) -> list[float]:
    """r_k / 8 in bytes/s, r_k = w_k B_w log2(1 + snr_k) bits/s (the rate in eq. 15)."""
    if len(shares) == 0:
        raise BandwidthInputError("no users: shares is empty")
    if len(shares) != len(snrs):
        raise BandwidthInputError(f"{len(shares)} shares but {len(snrs)} SNRs")
    checked_shares = _checked_shares(shares, len(shares))
    ratios = [_positive_finite(f"snrs[{k}]", v) for k, v in enumerate(snrs)]
    band = _positive_finite("bandwidth_hz", bandwidth_hz)
    return [share * band * math.log2(1 + snr) / 8 for share, snr in zip(checked_shares, ratios)]


def link_shares(
    shares: Sequence[float],
    snrs: Sequence[float],
    bandwidth_hz: float,
    template: LinkProfile = UNSHAPED,
) -> list[LinkProfile]:
    """One LinkProfile per user: `template` with its uplink set to that user's share of the band.

    The uplink is user k's achievable rate w_k B_w log2(1 + snr_k) / 8 bytes/s — the band fraction
    times the user's own spectral efficiency, so with eq. 27's shares every rate is proportional to
    I_k and all uploads end together. Downlink, latency and jitter come from `template` unchanged
    (the paper treats the downlink as negligible, §II-D 1).
    """
    rates = user_rates_bytes_s(shares, snrs, bandwidth_hz)
    return [dataclasses.replace(template, uplink_bytes_s=rate) for rate in rates]
