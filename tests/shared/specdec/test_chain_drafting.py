"""A chain draft that stops (eta or EOS) leaves its last token's row out of a feature adapter: nothing drafts from
it and the verdict re-reads the accepted rows from the cloud's deep states (shared/specdec/drafting.py). Greedy
output stays the unsplit model's, and a degraded finish runs that row when it needs it, to the same tokens as a
draft that kept it."""

from __future__ import annotations

import asyncio

import pytest

from shared.model.adapter import AdapterSpec, DraftAdapter
from shared.model.split import MiddleSubmodel
from shared.specdec.decode_loop import LocalCloud, generate
from shared.specdec.device_session import DeviceModel, DeviceSession, DraftConfig
from shared.specdec.reference import generate_full


def _feature_device(checkpoint) -> DeviceModel:
    adapter = DraftAdapter(checkpoint, 2, AdapterSpec("feature", mlp=True)).randomize(0)
    return DeviceModel.from_checkpoint(checkpoint, 2, adapter)


def _recording(session: DeviceSession) -> list:
    drafts, draft = [], session.draft

    def recorded():
        made = draft()
        drafts.append(made)
        return made

    session.draft = recorded
    return drafts


class LostCloud(LocalCloud):
    """Verifies `rounds` drafts, then is gone."""

    def __init__(self, middle, rounds: int):
        super().__init__(middle)
        self.rounds = rounds

    async def verify(self, session_id, commit_len, shallow, layout=None):
        if self.rounds == 0:
            raise ConnectionError("verifier gone")
        self.rounds -= 1
        return await super().verify(session_id, commit_len, shallow, layout)


def test_a_stopped_chain_skips_its_last_adapter_row_and_stays_token_identical(tiny_checkpoint):
    ids = list(range(5, 17))
    expected = generate_full(tiny_checkpoint, ids, 20).token_ids
    session = DeviceSession(_feature_device(tiny_checkpoint), ids, draft_config=DraftConfig(eta=0.3), max_new_tokens=20)
    drafts = _recording(session)
    result = asyncio.run(generate(session, LocalCloud(MiddleSubmodel(tiny_checkpoint, 2)), parallel_candidates=0))
    assert result.token_ids == expected
    stopped = [d for d in drafts if d.tokens and not d.can_continue]
    assert stopped and all(d.last_hidden is None for d in stopped)  # no adapter row after a stopped draft's end


@pytest.mark.parametrize("verified", [0, 2])
def test_a_degraded_finish_runs_the_left_out_row_to_the_same_tokens(tiny_checkpoint, verified):
    ids = list(range(5, 17))
    outputs = []
    # eta 1: every draft stops after one token (its row left out); eta 0 with one token a round: stopped by the
    # budget, so the row is run while drafting. The same greedy drafts, the same cloud answers.
    for config in (DraftConfig(eta=1.0, max_draft=1), DraftConfig(eta=0.0, max_draft=1)):
        session = DeviceSession(_feature_device(tiny_checkpoint), ids, draft_config=config, max_new_tokens=16)
        drafts = _recording(session)
        cloud = LostCloud(MiddleSubmodel(tiny_checkpoint, 2), verified)
        result = asyncio.run(
            generate(session, cloud, parallel_candidates=0, finish_alone_on=lambda e: isinstance(e, ConnectionError))
        )
        assert session.degraded
        assert (drafts[-1].last_hidden is None) == (config.eta == 1.0)
        outputs.append(result.token_ids)
    assert outputs[0] == outputs[1]
