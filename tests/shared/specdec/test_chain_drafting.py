"""A chain draft that stops (eta or EOS) leaves its last token's row out of a feature adapter: nothing drafts from
it and the verdict re-reads the accepted rows from the cloud's deep states (shared/specdec/drafting.py). Greedy
output stays the unsplit model's, and a degraded finish runs that row when it needs it, to the same tokens as a
draft that kept it."""

from __future__ import annotations

import asyncio
from dataclasses import replace

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


class ShrinkThenLose(LocalCloud):
    """Verifies every draft; at round `shrink_at` the session's policy drops to no drafts before the verdict (a
    trial's restore does this), so a branch adopted then is cut to the budget; the next verification is lost."""

    def __init__(self, middle, session: DeviceSession, shrink_at: int | None):
        super().__init__(middle)
        self.session, self.shrink_at, self.rounds = session, shrink_at, 0

    async def verify(self, session_id, commit_len, shallow, layout=None):
        if self.shrink_at is not None and self.rounds > self.shrink_at:
            raise ConnectionError("verifier gone")
        answer = await super().verify(session_id, commit_len, shallow, layout)
        if self.rounds == self.shrink_at:
            self.session.draft_config = replace(self.session.draft_config, max_draft=0)
        self.rounds += 1
        return answer


def test_a_degraded_finish_after_a_branch_cut_to_the_budget_drafts_on(demo_checkpoint):
    from shared.runtime import load_adapter

    device = DeviceModel.from_checkpoint(demo_checkpoint, 2, load_adapter(demo_checkpoint, 2, None))
    prompt = demo_checkpoint.tokenizer.encode("def fibonacci(n):\n    ", add_special_tokens=False)

    def run(shrink_at):
        # eta 1: one draft a round; a rejected one whose correction was pre-drafted adopts that branch
        session = DeviceSession(device, prompt, draft_config=DraftConfig(eta=1.0, max_draft=2), max_new_tokens=24)
        adopted, on_result = [], session.on_verify_result

        def recorded(*args):
            before = session.reused_branches
            emitted = on_result(*args)
            adopted.append(session.reused_branches > before)
            return emitted

        session.on_verify_result = recorded
        drafts = _recording(session)
        cloud = ShrinkThenLose(MiddleSubmodel(demo_checkpoint, 2), session, shrink_at)
        lost = lambda e: isinstance(e, ConnectionError)  # noqa: E731
        result = asyncio.run(generate(session, cloud, parallel_candidates=3, parallel_steps=2, finish_alone_on=lost))
        return session, result, adopted, drafts

    _, _, adopted, _ = run(None)
    assert any(adopted[:-1])
    session, result, _, drafts = run(adopted.index(True))
    # the adopted branch was cut to no drafts and its verification lost: the device finished alone from it
    assert session.degraded and drafts[-1].tokens == [] and drafts[-1].last_hidden is None
    assert len(result.token_ids) == 24
