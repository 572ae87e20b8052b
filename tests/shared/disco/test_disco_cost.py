"""DiSCo's unified cost (shared/disco/cost.py) against hand-computed dollars."""

from __future__ import annotations

import math

import pytest

from shared.disco.cost import CostLedger, CostModel, parse_device_energy


def test_defaults_are_gpt4o_mini_prices_and_grid_electricity() -> None:
    cost = CostModel()
    assert cost.server_prompt == 0.15e-6 and cost.server_decode == 0.60e-6
    assert cost.device_prompt() == pytest.approx(4.17e-8 * 0.02)
    assert cost.device_decode() == pytest.approx(4.17e-8 * 0.4)
    assert cost.constraint() == "server"  # a joule is far cheaper than a cloud token


def test_constraint_follows_algorithm_1() -> None:
    # Device $/token = lambda * J: lambda = 1e-5 gives prompt 2e-7 and decode 4e-6; the cheaper
    # device price (2e-7) is below the dearer server price (6e-7) -> server-constrained.
    assert CostModel(exchange_rate=1e-5).constraint() == "server"
    # lambda = 1e-4: device prices 2e-6 and 4e-5, both above 6e-7 -> device-constrained.
    assert CostModel(exchange_rate=1e-4).constraint() == "device"
    # Equal is not "greater": min(device) == max(server) stays server-constrained.
    assert (
        CostModel(
            server_prompt=1.0, server_decode=2.0, device_prompt_j=2.0, device_decode_j=3.0, exchange_rate=1.0
        ).constraint()
        == "server"
    )


def test_prices_per_endpoint_and_hat_split() -> None:
    cost = CostModel(
        server_prompt=1.0,
        server_decode=4.0,
        device_prompt_j=10.0,
        device_decode_j=20.0,
        exchange_rate=0.01,
        hat_device_share=0.25,
    )
    assert cost.prefill_cost("device", 3) == pytest.approx(0.3)  # 3 * 10 J * 0.01 $/J
    assert cost.prefill_cost("cloud", 3) == pytest.approx(3.0)
    assert cost.prefill_cost("hat", 4) == pytest.approx(4 * (1.0 * 0.75 + 0.1 * 0.25))
    assert cost.decode_price("device") == pytest.approx(0.2)
    assert cost.decode_price("hat") == pytest.approx(4.0 * 0.75 + 0.2 * 0.25)
    assert cost.decode_cost("cloud", 5) == pytest.approx(20.0)
    assert cost.decode_cost("device", 0) == 0.0


@pytest.mark.parametrize(
    "bad",
    [
        {"server_prompt": -1e-6},
        {"server_decode": math.nan},
        {"device_prompt_j": math.inf},
        {"device_decode_j": -0.1},
        {"exchange_rate": -1.0},
        {"hat_device_share": 1.5},
        {"hat_device_share": -0.1},
        {"server_prompt": "0.1"},
    ],
)
def test_invalid_cost_model_is_refused(bad: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        CostModel(**bad)


def test_bad_endpoint_and_negative_tokens_are_refused() -> None:
    cost = CostModel()
    with pytest.raises(ValueError, match="endpoint"):
        cost.prefill_cost("gpu", 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=">= 0"):
        cost.decode_cost("cloud", -1)


def test_with_device_energy_replaces_joules_and_validates() -> None:
    cost = CostModel().with_device_energy(0.05, 0.9)
    assert (cost.device_prompt_j, cost.device_decode_j) == (0.05, 0.9)
    assert cost.server_decode == CostModel().server_decode
    with pytest.raises(ValueError):
        CostModel().with_device_energy(-1.0, 0.9)


def test_parse_device_energy() -> None:
    assert parse_device_energy("") == {}
    assert parse_device_energy("  ") == {}
    assert parse_device_energy("orin:0.02,0.4;xavier:0.05,0.9") == {"orin": (0.02, 0.4), "xavier": (0.05, 0.9)}
    assert parse_device_energy(" orin : 0.02 , 0.4 ; ") == {"orin": (0.02, 0.4)}


@pytest.mark.parametrize(
    "spec, message",
    [
        ("orin", "class:prompt_J,decode_J"),
        (":0.1,0.2", "class:prompt_J,decode_J"),
        ("orin:0.1", "two numbers"),
        ("orin:0.1,0.2,0.3", "two numbers"),
        ("orin:a,b", "not numbers"),
        ("orin:-0.1,0.2", "finite and >= 0"),
        ("orin:nan,0.2", "finite and >= 0"),
        ("orin:0.1,0.2;orin:0.3,0.4", "twice"),
    ],
)
def test_parse_device_energy_rejects_bad_specs(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_device_energy(spec)


def test_ledger_sums_a_race_and_a_hat_request() -> None:
    cost = CostModel(
        server_prompt=1.0,
        server_decode=4.0,
        device_prompt_j=10.0,
        device_decode_j=20.0,
        exchange_rate=0.01,
        hat_device_share=0.25,
    )
    ledger = CostLedger(cost)
    ledger.prefill("device", 100)  # the race's loser still spent its prefill: 100 * 0.1 = 10 $
    ledger.prefill("cloud", 100)  # 100 $
    ledger.decode("cloud", 10)  # 40 $
    ledger.decode("hat", 2)  # server 2 * 4 * 0.75 = 6 $, device 2 * 0.2 * 0.25 = 0.1 $
    assert ledger.device == pytest.approx(10.1)
    assert ledger.server == pytest.approx(146.0)
    assert ledger.total == pytest.approx(156.1)
    d = ledger.as_dict()
    assert d["total"] == pytest.approx(156.1) and d["device"] == pytest.approx(10.1)
    assert d["tokens"] == {
        "device": {"prefill": 100, "decode": 0},
        "cloud": {"prefill": 100, "decode": 10},
        "hat": {"prefill": 0, "decode": 2},
    }
    d["tokens"]["cloud"]["decode"] = 99  # as_dict is a copy
    assert ledger.tokens["cloud"]["decode"] == 10


def test_empty_ledger_costs_nothing() -> None:
    ledger = CostLedger(CostModel())
    assert ledger.total == 0.0 and ledger.as_dict()["tokens"]["device"] == {"prefill": 0, "decode": 0}
