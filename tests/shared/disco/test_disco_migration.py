"""DiSCo's migration rules (shared/disco/migration.py) against hand-computed values."""

from __future__ import annotations

import math

import pytest

from shared.disco.cost import CostModel
from shared.disco.migration import buffer_tokens, expected_remaining, migration_saving, migration_target

# Decode: cloud 6e-7 $/token, device 0.4 J * 1e-7 $/J = 4e-8; device prefill 10 J * 1e-7 = 1e-6 $/token.
COST = CostModel(device_prompt_j=10.0, device_decode_j=0.4, exchange_rate=1e-7, hat_device_share=0.5)


def test_target_is_the_cheaper_decoder_only() -> None:
    assert migration_target(COST, "cloud", "device") == "device"
    assert migration_target(COST, "device", "cloud") is None
    assert migration_target(COST, "hat", "device") == "device"  # hat decodes at 3.2e-7
    assert migration_target(COST, "cloud", "hat") == "hat"
    assert migration_target(COST, "cloud", "cloud") is None


def test_saving_by_hand_and_its_sign_flips_with_remaining_tokens() -> None:
    # (6e-7 - 4e-8) * remaining - 1e-6 * 100 resume tokens: break-even at 178.57 tokens.
    assert migration_saving(COST, "cloud", "device", 300, 100) == pytest.approx(5.6e-7 * 300 - 1e-4)
    assert migration_saving(COST, "cloud", "device", 300, 100) > 0
    assert migration_saving(COST, "cloud", "device", 178, 100) < 0
    assert migration_saving(COST, "cloud", "device", 179, 100) > 0
    assert migration_saving(COST, "cloud", "device", 0, 100) == pytest.approx(-1e-4)


def test_saving_towards_a_costlier_decoder_is_never_positive() -> None:
    # Cloud prefill 1.5e-7 * 10 = 1.5e-6 overhead; decoding there costs 5.6e-7 more per token.
    assert migration_saving(COST, "device", "cloud", 1000, 10) == pytest.approx(-5.6e-7 * 1000 - 1.5e-6)


def test_saving_refuses_bad_remaining() -> None:
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError):
            migration_saving(COST, "cloud", "device", bad, 10)


@pytest.mark.parametrize(
    "generated, max_new, mean, expected",
    [
        (10, 128, None, 118.0),
        (10, 128, 50.0, 40.0),
        (60, 128, 50.0, 1.0),
        (0, 20, 50.0, 20.0),
        (128, 128, 50.0, 0.0),
        (130, 128, None, 0.0),
        (127, 128, 500.0, 1.0),
        (5, 128, math.nan, 123.0),
    ],
)
def test_expected_remaining(generated: int, max_new: int, mean: float | None, expected: float) -> None:
    assert expected_remaining(generated, max_new, mean) == expected


@pytest.mark.parametrize(
    "rate, seconds, expected",
    [
        (4.5, 2.0, 9),
        (4.0, 0.3, 2),
        (0.1, 30.0, 3),
        (5.0, 0.01, 1),
        (0.0, 5.0, 1),
        (5.0, 0.0, 1),
        (4.0, 1.26, 6),
    ],
)
def test_buffer_tokens_eq5(rate: float, seconds: float, expected: int) -> None:
    assert buffer_tokens(rate, seconds) == expected


@pytest.mark.parametrize("rate, seconds", [(-1.0, 1.0), (4.0, -0.1), (math.nan, 1.0), (4.0, math.inf)])
def test_buffer_tokens_refuses_bad_input(rate: float, seconds: float) -> None:
    with pytest.raises(ValueError):
        buffer_tokens(rate, seconds)
