"""`tophat privacy`'s capture run: the rows a real verifier captured are the device's layer-m states of the
prompt (and of each verify frame's pending token + drafts), paired with the right tokens; with the rotation
they are those states in the secret basis; the answers stay the unsplit model's."""

from __future__ import annotations

import asyncio

import pytest
import torch

from shared.privacy.hidden_rotation import secret_rotation
from shared.specdec.reference import generate_full
from tophatctl.privacy.command import format_privacy_table
from tophatctl.privacy.harness import Captured, capture_run, cost_row
from tophatctl.privacy.states import hidden_states

M = 2
PROMPTS = [[1, 15, 27, 99, 4, 8, 16, 23, 42, 5, 6, 7, 300, 301], [3, 300, 301, 5, 7, 9, 11, 2, 44, 45, 46]]


@pytest.fixture(scope="module")
def runs(demo_checkpoint):
    expected = [generate_full(demo_checkpoint, p, 8).token_ids for p in PROMPTS]
    plain = asyncio.run(capture_run(demo_checkpoint, M, PROMPTS, expected, 8))
    rotated = asyncio.run(capture_run(demo_checkpoint, M, PROMPTS, expected, 8, rotation="a-secret"))
    return expected, plain, rotated


def test_captured_prompt_rows_are_the_devices_states_with_their_tokens(demo_checkpoint, runs):
    _, plain, _ = runs
    assert [ids.tolist() for _, ids in plain.prompts] == PROMPTS
    for (states, _), prompt in zip(plain.prompts, PROMPTS):
        reference = hidden_states(demo_checkpoint, prompt, M)  # [S, H] fp32
        # the wire carries fp16: the capture is the device's states rounded to it
        assert torch.equal(states, reference.half().float())


def test_verify_frames_pair_the_pending_token_and_the_drafts(demo_checkpoint, runs):
    expected, plain, _ = runs
    assert plain.drafts and all(states.shape[0] == ids.shape[0] for states, ids in plain.drafts)
    assert any(ids.shape[0] > 1 for _, ids in plain.drafts)  # drafts went up with their pending token
    # each row is the layer-m state of its token after the sequence before it: check the first frame of a session
    states, ids = plain.drafts[0]
    context = PROMPTS[0] + [int(ids[0])]
    assert int(ids[0]) == expected[0][0]  # the first pending token is the first generated one
    reference = hidden_states(demo_checkpoint, context, M)[-1]
    assert torch.allclose(states[0], reference, atol=1e-2, rtol=1e-2)  # fp16 wire, the cache's own rounding


def test_the_rotation_hides_the_basis_and_keeps_the_answers(demo_checkpoint, runs):
    _, plain, rotated = runs
    assert all(plain.exact) and all(rotated.exact)
    q = secret_rotation("a-secret", demo_checkpoint.hidden_size)
    for (seen, ids), (clear, clear_ids) in zip(rotated.prompts, plain.prompts):
        assert torch.equal(ids, clear_ids)
        assert not torch.allclose(seen, clear, atol=1e-1)
        assert torch.allclose(seen @ q, clear, atol=2e-2)  # x Q^T Q = x, up to the fp16 wire


def test_the_tables_show_each_row_and_cost(runs):
    _, plain, _ = runs
    results = {
        "results": [
            {
                "m": 2,
                "attack": "linear",
                "defence": "none",
                "attacker": "public",
                "top1": 0.875,
                "top5": 0.99,
                "tokens": 10,
                "train": {"tokens": 100, "steps": 0, "wall_s": 1.0},
            }
        ],
        "costs": [cost_row(2, "none", plain), cost_row(2, "noise:0.3", Captured([], [], [0.1], [0.01], [], [False]))],
        "notes": {"rotation_recovery_error": 1e-8},
    }
    table = format_privacy_table(results)
    assert "0.875" in table and "noise:0.3" in table and "0 %" in table and "1.0e-08" in table
