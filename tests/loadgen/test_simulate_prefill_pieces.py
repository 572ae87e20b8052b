"""The simulated verifier cuts a prompt into g-bounded pieces while another session decodes, as the real one
does (services/verifier_cloud/scheduler.py; the same rule, shared/planning/prefill_pieces.py)."""

from __future__ import annotations

import pytest

from loadgen.simulate.calibration import GTable
from loadgen.simulate.cloud import Cloud
from loadgen.simulate.events import EventLoop
from shared.planning.prefill_pieces import DECODING_WINDOW_S

STEEP = GTable([(1, 0.001), (1001, 1.001)])  # 1 ms a row


def decode_and_prompt(max_step_s: float, prompt_at: float) -> tuple[Cloud, list[float]]:
    """Session 1 decodes one row at a time until t = 1 s; session 2's 50-row prompt arrives at `prompt_at`."""
    loop = EventLoop()
    cloud = Cloud(loop, STEEP, max_prefill_step_s=max_step_s)
    answered: list[float] = []

    def step() -> None:
        if loop.now < 1.0:
            cloud.submit(1, 1, step)

    cloud.submit(1, 1, step)
    loop.at(prompt_at, lambda: cloud.submit(2, 50, lambda: answered.append(loop.now), prefill=True))
    loop.run()
    return cloud, answered


def test_a_prompt_runs_in_pieces_beside_a_decoding_session():
    cloud, answered = decode_and_prompt(0.020, 0.1)
    prompt_steps = [s.tokens for s in cloud.steps if s.tokens > 1]
    assert prompt_steps == [21, 21, 11]  # a 20-row piece beside session 1's row in each step
    assert len(answered) == 1  # one answer, after the last piece
    assert max(s.end - s.start for s in cloud.steps) == pytest.approx(0.021)


def test_without_the_bound_the_prompt_runs_whole():
    cloud, answered = decode_and_prompt(0.0, 0.1)
    assert [s.tokens for s in cloud.steps if s.tokens > 1] == [51]
    assert len(answered) == 1


def test_a_prompt_after_the_others_stopped_decoding_runs_whole():
    cloud, _ = decode_and_prompt(0.020, 1.0 + DECODING_WINDOW_S + 0.5)
    assert [s.tokens for s in cloud.steps if s.tokens > 1] == [50]


def test_a_bad_bound_is_refused():
    with pytest.raises(ValueError, match="max_prefill_step_s"):
        Cloud(EventLoop(), STEEP, max_prefill_step_s=-1.0)
