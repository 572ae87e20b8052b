"""StreamSession (the device side of a streamed draft): its marks after drafts, bonuses and rollbacks, and
parallel-drafting branches. The demo model with its draft adapter; verdicts built by hand."""

from __future__ import annotations

import pytest

from shared.runtime import build_device_model
from shared.specdec.device_session import DraftConfig
from shared.specdec.draft_stream import ChunkVerdict
from shared.specdec.sampling import SamplingParams
from shared.specdec.separate_rejection import RejectionPayload
from shared.specdec.stream_session import StreamSession

PROMPT = [1, 15, 27, 99, 4, 8, 16]


@pytest.fixture(scope="module")
def device_model(demo_checkpoint):
    return build_device_model(demo_checkpoint, 2, None)


def token_session(device_model) -> StreamSession:
    session = StreamSession(device_model, PROMPT, SamplingParams(), DraftConfig(0.0, 8), 32)
    session.prefill_locally()
    session.start_token_mode(5)
    return session


def assert_one_token_waits(session: StreamSession) -> None:
    """The invariant every draft starts from: all but the last token ran through the device's layers."""
    assert session.advanced == len(session.seq) - 1 == session.input_cache.length == session.adapter_cache.length


def test_after_a_bonus_the_next_draft_runs_both_waiting_tokens_first(device_model):
    session = token_session(device_model)
    for _ in range(2):
        session.draft_step()
        assert_one_token_waits(session)
    chunk, _ = session.take_chunk(more=False)
    emitted = session.apply(chunk, ChunkVerdict(0, 2, token=77))  # all accepted, bonus 77
    assert emitted == list(chunk.drafts) + [77] and session.seq[-1] == 77
    # the last draft and the bonus both wait now; a draft runs them both, then predicts after the bonus
    assert session.advanced == len(session.seq) - 2
    session.draft_step()
    assert_one_token_waits(session)
    assert session.seq[-2] == 77


def test_a_rejection_rolls_back_to_the_correction(device_model):
    session = token_session(device_model)
    for _ in range(4):
        session.draft_step()
    chunk, _ = session.take_chunk(more=True)
    rejected_at = chunk.start_pos + 1 + 2
    verdict = ChunkVerdict(1, 2, rejection=RejectionPayload(2, "token", 0, token=123))
    assert session.apply(chunk, verdict) == list(chunk.drafts[:2]) + [123]
    assert session.seq[rejected_at] == 123 and len(session.seq) == rejected_at + 1
    assert session.final_len == session.sent_len + 1 == rejected_at + 1 and session.epoch == 1
    assert_one_token_waits(session)


@pytest.mark.parametrize("correct_to_branch", [True, False])
def test_a_rejection_of_the_last_draft_adopts_the_matching_branch(device_model, correct_to_branch):
    session = token_session(device_model)
    for _ in range(3):
        session.draft_step()
    chunk, _ = session.take_chunk(more=False)
    last = len(session.seq) - 1
    assert session.predraft(2, 3) == 2
    branch = session.branches[0]
    assert branch.position == last and branch.candidate != session.seq[last]
    assert len(branch.line["seq"]) == last + 1 + 3  # the candidate and three drafts after it
    correction = (
        branch.candidate
        if correct_to_branch
        else next(
            t
            for t in range(device_model.vocab_size)
            if t not in {b.candidate for b in session.branches} | {chunk.drafts[-1]}
        )
    )
    verdict = ChunkVerdict(1, 2, rejection=RejectionPayload(2, "token", 0, token=correction))
    emitted = session.apply(chunk, verdict)
    assert emitted == list(chunk.drafts[:2]) + [correction]
    assert not session.branches  # the others freed
    if correct_to_branch:
        assert session.reused_branches == 1 and session.seq == branch.line["seq"]
        assert session.final_len == last + 1 and session.sent_len == last  # the correction is final, unsent
        assert session.speculative == 3 and session.input_cache is branch.line["input_cache"]
    else:
        assert session.reused_branches == 0 and len(session.seq) == last + 1
    assert_one_token_waits(session)
