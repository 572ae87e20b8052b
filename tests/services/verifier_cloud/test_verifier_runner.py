"""The verifier's ModelRunner on the tiny checkpoint: check -> rollback -> forward, and fault isolation.

A fault is injected into the layer range's packed forward: it appends every
session's positions (as a real pass would, layer by layer) and then raises for
the batch that holds the poisoned session. The runner must fail that item
alone, restore its KV to the pre-step length and give every other item the
result an unfaulted runner gives.
"""

from __future__ import annotations

import pytest
import torch

from services.verifier_cloud.runner import ModelRunner, RunItem
from services.verifier_cloud.token_mode import TokenModel
from services.verifier_cloud.work import ErrorKind, WorkKind
from shared.model.checkpoint import load_checkpoint
from shared.model.split import MiddleSubmodel
from shared.specdec.sampling import SamplingParams

M = 2
PREFILL, VERIFY = WorkKind.PREFILL, WorkKind.VERIFY


@pytest.fixture(scope="module")
def checkpoint(tiny_llama_dir):
    return load_checkpoint(tiny_llama_dir, with_tokenizer=False)


def new_runner(checkpoint, token_model=None) -> ModelRunner:
    return ModelRunner(MiddleSubmodel(checkpoint, M), checkpoint.config.max_position_embeddings, token_model)


def poison(runner: ModelRunner, session_id: int, exc: type[Exception] = IndexError) -> list[int]:
    """Make every packed pass that holds `session_id` append its KV and then raise; returns pass sizes."""
    original, passes = runner.layers.forward_packed, []

    def faulty(hidden, caches, lengths):
        passes.append(len(caches))
        out = original(hidden, caches, lengths)  # the KV is appended before the fault, as a mid-pass fault would
        if any(cache is runner.sessions[session_id].middle for cache in caches):
            raise exc(f"injected fault in session {session_id}'s rows")
        return out

    runner.layers.forward_packed = faulty
    return passes


def test_a_fault_in_one_item_fails_it_alone_and_the_rest_are_exact(checkpoint):
    torch.manual_seed(0)
    hidden = checkpoint.hidden_size
    prompts = {sid: torch.randn(3 + sid, hidden) for sid in range(1, 6)}
    drafts = {sid: torch.randn(2, hidden) for sid in prompts}
    reference, faulty = new_runner(checkpoint), new_runner(checkpoint)
    for runner in (reference, faulty):
        for sid, prompt in prompts.items():
            runner.open(sid)
            assert runner.run([RunItem(sid, PREFILL, 0, prompt)])[0].error is None
    passes = poison(faulty, 3)
    batch = [RunItem(sid, VERIFY, prompts[sid].shape[0], drafts[sid]) for sid in prompts]
    expected = reference.run(batch)
    got = faulty.run(batch)
    assert got[2].output is None and got[2].error.kind is ErrorKind.INTERNAL
    assert "IndexError" in got[2].error.message
    for sid in (1, 2, 4, 5):
        assert got[sid - 1].error is None
        assert torch.allclose(got[sid - 1].output, expected[sid - 1].output, atol=1e-5)
    # The failed session is back at its pre-step length; the others appended their drafts once.
    assert faulty.lengths() == {1: 6, 2: 7, 3: 6, 4: 9, 5: 10}
    assert passes[0] == 5 and len(passes) <= 1 + 2 * 3  # bisection: a handful of passes, not one per item
    # The failed session still works once the fault is gone.
    faulty.layers.forward_packed = reference.layers.forward_packed
    again = faulty.run([RunItem(3, VERIFY, 6, drafts[3])])[0]
    assert again.error is None and torch.allclose(again.output, expected[2].output, atol=1e-5)


def test_a_fault_alone_in_its_batch_is_an_internal_error_not_an_exception(checkpoint):
    runner = new_runner(checkpoint)
    runner.open(1)
    poison(runner, 1, exc=KeyError)
    result = runner.run([RunItem(1, PREFILL, 0, torch.randn(4, checkpoint.hidden_size))])[0]
    assert result.error.kind is ErrorKind.INTERNAL and runner.lengths() == {1: 0}


def test_a_token_session_is_restored_with_its_sampler(checkpoint):
    """Token mode: both caches and the sampler's state roll back, so the retry draws what it would have."""
    reference, faulty = (new_runner(checkpoint, TokenModel(checkpoint, M)) for _ in range(2))
    params = SamplingParams(temperature=0.8, seed=7)
    items = [
        RunItem(1, PREFILL, 0, None, torch.tensor([5, 6, 7]), is_last=True),
        RunItem(2, PREFILL, 0, None, torch.tensor([9, 8]), is_last=True),
    ]
    for runner in (reference, faulty):
        runner.open(1, params)
        runner.open(2, params)
    expected = reference.run(items)
    original = faulty.token_model.next_token

    def fails_for_session_2(session, deep_last):
        token = original(session, deep_last)  # session 1 draws from its generator before session 2 fails
        if session is faulty.sessions[2].token:
            raise RuntimeError("injected sampler fault")
        return token

    faulty.token_model.next_token = fails_for_session_2
    got = faulty.run(items)
    assert got[0].error is None and torch.equal(got[0].output, expected[0].output)
    assert got[1].error.kind is ErrorKind.INTERNAL
    assert faulty.sessions[2].token.lower.length == faulty.sessions[2].middle.length == 0


def test_an_item_failing_in_a_later_stage_is_rolled_back_in_every_stage(checkpoint):
    """Stage 1 fails session 2's item after stage 0 appended it; SessionsRolledBack brings stage 0 back in step."""
    from services.verifier_cloud.stages import MicroBatch, SessionsOpened, SessionsRolledBack, StageItem, StageWorker

    context = checkpoint.config.max_position_embeddings
    stages = [
        StageWorker(0, MiddleSubmodel(checkpoint, M, stage=(2, 4)), context),
        StageWorker(1, MiddleSubmodel(checkpoint, M, stage=(4, 5)), context),
    ]
    for stage in stages:
        stage.handle(SessionsOpened([1, 2]))
    poison(stages[1].runner, 2)
    hidden = checkpoint.hidden_size
    batch = MicroBatch(1, [StageItem(sid, 1, PREFILL, 0, 3, torch.randn(3, hidden).numpy()) for sid in (1, 2)])
    for stage in stages:
        stage.handle(batch)
    assert batch.items[0].error is None and batch.items[1].error[0] == ErrorKind.INTERNAL
    assert [stage.runner.lengths() for stage in stages] == [{1: 3, 2: 3}, {1: 3, 2: 0}]
    for stage in stages:
        stage.handle(SessionsRolledBack([(2, batch.items[1].position)]))
    assert [stage.runner.lengths() for stage in stages] == [{1: 3, 2: 0}, {1: 3, 2: 0}]


def test_the_pipeline_engine_rolls_back_items_that_failed_internally():
    from services.verifier_cloud.engine import PipelineEngine
    from services.verifier_cloud.pipeline_results import PipelineStep
    from services.verifier_cloud.scheduler import Scheduler, WorkItem
    from services.verifier_cloud.session import Session
    from services.verifier_cloud.stages import StageItem

    class FakePipeline:
        on_done = on_fail = None
        rolled_back: list = []

        def roll_back_sessions(self, sessions):
            self.rolled_back.extend(sessions)

    sched, owner, pipeline = Scheduler(64, 4, 512), object(), FakePipeline()
    engine = PipelineEngine(sched, pipeline, lambda stats, overhead: None)
    replies = []
    for sid in (1, 2, 3):
        sched.open(Session(sid, owner))
        sched.submit(
            WorkItem(
                sid,
                5,
                "verify",
                torch.zeros(2, 4),
                7,
                reply=lambda item, out, err: replies.append((item.session_id, err)),
            ),
            owner,
        )
    batch = sched.schedule()
    items = [
        StageItem(1, 5, VERIFY, 7, 2, torch.zeros(2, 4).numpy()),
        StageItem(2, 5, VERIFY, 7, 2, None, (int(ErrorKind.INTERNAL), "stage 1: IndexError")),
        StageItem(3, 5, VERIFY, 7, 2, None, (int(ErrorKind.MALFORMED), "stage 0: commit_len beyond")),
    ]
    engine._done(batch, items, PipelineStep(1, 2, [], 0.0, 0.0))
    assert pipeline.rolled_back == [(2, 7)]  # a refused item (3) appended nowhere: nothing to undo
    assert [(sid, err.kind if err else None) for sid, err in replies] == [
        (1, None),
        (2, ErrorKind.INTERNAL),
        (3, ErrorKind.MALFORMED),
    ]


def test_a_fork_or_rollback_with_a_negative_length_changes_nothing(checkpoint):
    """Stage messages carry plain ints: a negative length must be a typed refusal, not a cache cut from the end."""
    from services.verifier_cloud.work import EngineError

    runner = new_runner(checkpoint)
    runner.open(1)
    assert runner.run([RunItem(1, PREFILL, 0, torch.randn(5, checkpoint.hidden_size))])[0].error is None
    with pytest.raises(EngineError) as refused:
        runner.fork(2, 1, -1)
    assert refused.value.kind is ErrorKind.BAD_SHAPE and 2 not in runner.lengths()
    runner.roll_back(1, -3)
    assert runner.lengths()[1] == 0
    runner.fork(3, 1)  # an empty parent still forks
    assert runner.lengths()[3] == 0
