"""shared/modes.py's mode table: each mode's row, the sets read from it, and the refusals per missing need."""

from __future__ import annotations

from typing import get_args

import pytest

from shared.modes import (
    KEPT_SESSIONS_MODE,
    MODE_TABLE,
    MODES,
    STREAM_MODES,
    TOKEN_MODES,
    Asked,
    Mode,
    ModeSpec,
    Offered,
    Refusal,
)

# Everything a device agent can offer: no mode is refused for want of it.
FULL = Offered(draft_adapter=True, max_draft=8, edge_server=True)

# (session kind, rounds loop, uplink, keepable, private, verifier runs the whole model)
ROWS = {
    "hat": ("split", "hat", "hidden", True, True, False),
    "hat-async": ("stream", "hat-async", "hidden", False, True, False),
    "cloud": ("none", "cloud", "tokens", False, False, True),
    "token-sd": ("stream", "token-stream", "tokens", False, False, True),
    "picospec": ("stream", "token-stream", "tokens", False, False, True),
    "device": ("local", "local", "none", False, True, False),
    "edge-sd": ("stream", "edge", "tokens", False, False, True),
}


@pytest.mark.parametrize("name", list(ROWS))
def test_each_mode_has_its_row(name):
    spec = MODE_TABLE[name]
    assert spec.name == name
    assert (spec.session, spec.rounds, spec.uplink, spec.keepable, spec.private, spec.verifier_full_model) == ROWS[name]


def test_the_sets_read_from_the_table_are_the_old_literal_sets():
    assert MODES == ("hat", "hat-async", "cloud", "token-sd", "picospec", "device", "edge-sd")
    assert MODES == get_args(Mode)
    assert TOKEN_MODES == {"cloud", "token-sd", "picospec", "edge-sd"}
    assert STREAM_MODES == {"hat-async", "token-sd", "picospec"}
    assert KEPT_SESSIONS_MODE == "hat"


def test_a_request_that_asks_nothing_runs_in_every_mode_on_a_full_device():
    for spec in MODE_TABLE.values():
        assert spec.refusal(Asked(speculative=True), FULL) is None, spec.name


def test_privacy_refuses_exactly_the_token_modes():
    for name, spec in MODE_TABLE.items():
        refusal = spec.refusal(Asked(privacy=True, speculative=True), FULL)
        if name in TOKEN_MODES:
            assert refusal == Refusal(
                "privacy",
                f"mode {name} sends token ids to the cloud; this request asked for privacy (use hat or hat-async)",
            )
        else:
            assert refusal is None, name


def test_keep_and_fork_are_refused_outside_mode_hat_and_name_the_mode():
    for name, spec in MODE_TABLE.items():
        refusal = spec.refusal(Asked(keep_or_fork=True, speculative=True), FULL)
        if name == "hat":
            assert refusal is None
        else:
            assert refusal == Refusal(
                "kept_sessions_unsupported",
                f"keep and fork work in mode hat only, not {name}",
                detail=(("mode", name),),
            )


def test_speculation_without_a_draft_adapter_is_refused_where_the_device_computes():
    no_adapter = Offered(draft_adapter=False, max_draft=8, edge_server=True)
    for name, spec in MODE_TABLE.items():
        refusal = spec.refusal(Asked(speculative=True), no_adapter)
        if name == "cloud":  # SD / PC / PD do not apply: the device computes nothing
            assert refusal is None
        else:
            assert refusal == Refusal("bad_request", "this device runs without a draft adapter (speculative=false)")


@pytest.mark.parametrize("name", ["hat-async", "token-sd", "picospec"])
@pytest.mark.parametrize(
    "asked, offered",
    [
        (Asked(speculative=False), FULL),
        (Asked(speculative=True), Offered(draft_adapter=True, max_draft=0, edge_server=True)),
    ],
)
def test_the_streamed_modes_need_drafting(name, asked, offered):
    assert MODE_TABLE[name].refusal(asked, offered) == Refusal(
        "bad_request", f"mode {name} drafts: it needs speculative=true and a draft adapter"
    )
    assert MODE_TABLE["hat"].refusal(asked, offered) is None  # hat runs undrafted (the U-shape)


@pytest.mark.parametrize(
    "offered",
    [
        Offered(draft_adapter=True, max_draft=8, edge_server=False),
        Offered(draft_adapter=False, max_draft=8, edge_server=True),
    ],
)
def test_edge_sd_needs_an_edge_draft_server_with_a_draft_adapter(offered):
    assert MODE_TABLE["edge-sd"].refusal(Asked(speculative=False), offered) == Refusal(
        "bad_request", "mode edge-sd needs an edge draft server (TOPHAT_DEVICE_EDGE_DRAFT_SERVER) with a draft adapter"
    )


def test_device_mode_needs_the_draft_model():
    assert MODE_TABLE["device"].refusal(Asked(speculative=False), Offered(draft_adapter=False)) == Refusal(
        "bad_request", "mode device generates with the draft model: this device has none"
    )
    assert MODE_TABLE["device"].refusal(Asked(speculative=False), Offered(draft_adapter=True)) is None


def test_refusals_come_in_a_fixed_order():
    # keep/fork first, then privacy, then the device's needs
    both = Asked(privacy=True, keep_or_fork=True, speculative=True)
    assert MODE_TABLE["cloud"].refusal(both, FULL).code == "kept_sessions_unsupported"
    assert MODE_TABLE["token-sd"].refusal(Asked(privacy=True), Offered()).code == "privacy"


def test_a_row_is_checked():
    with pytest.raises(ValueError):
        ModeSpec("x", "split", "nowhere", "hidden", summary="")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ModeSpec("x", "split", "hat", "hidden", summary="", needs_draft_model=True)  # a need without its refusal
    with pytest.raises(ValueError):
        ModeSpec("x", "none", "cloud", "tokens", summary="", needs_draft_model=True, unmet="no")


def test_the_device_agent_maps_every_session_kind_and_rounds_loop():
    from services.device_agent.rounds import ROUNDS, SESSION_TYPES

    for spec in MODE_TABLE.values():
        assert spec.rounds in ROUNDS and spec.session in SESSION_TYPES


def test_bench_and_simulator_read_the_table():
    from loadgen.bench import modes_for
    from loadgen.simulate.modes import parse_mode

    variants = modes_for("specbench")
    full_model = ("TOPHAT_VERIFIER_FULL_MODEL", "true")
    for name in ("cloud", "token-sd", "picospec", "hat", "hat-async"):
        assert (full_model in variants[name].verifier_env) is MODE_TABLE[name].verifier_full_model
    assert parse_mode("cloud").token_upload and parse_mode("cloud-stream").token_upload
    assert not any(parse_mode(name).token_upload for name in ("ushape", "usarathi", "hat", "hat-sd-pd"))
