"""Speculative decoding is lossless: greedy output is token-identical to the
unsplit model for any m, eta, max draft and adapter; sampled output has the
target's distribution."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
import torch

from shared.model.adapter import AdapterSpec, DraftAdapter
from shared.model.split import MiddleSubmodel
from shared.specdec.decode_loop import LocalCloud, generate
from shared.specdec.device_session import DeviceModel, DeviceSession, DraftConfig, SessionError
from shared.specdec.reference import generate_full
from shared.specdec.sampling import SamplingParams
from tests.stat_tools import assert_matches, exact_marginals


def run(
    checkpoint, ids, m, adapter, max_new, params=SamplingParams(), eta=0.6, max_draft=8, chunk_size=None, **options
):
    device = DeviceModel.from_checkpoint(checkpoint, m, adapter)
    session = DeviceSession(device, ids, params, DraftConfig(eta=eta, max_draft=max_draft), max_new)
    result = asyncio.run(generate(session, LocalCloud(MiddleSubmodel(checkpoint, m)), chunk_size=chunk_size, **options))
    result.reused_branches = session.reused_branches
    result.predraft_chances = session.predraft_chances
    return result


@pytest.mark.parametrize(
    "m,eta,max_draft,chunk_size",
    [(1, 0.6, 8, None), (2, 0.0, 4, 5), (3, 1.0, 8, 3), (2, 0.3, 1, None), (4, 0.0, 16, 7), (2, 0.6, 0, None)],
)
@pytest.mark.slow
def test_greedy_hat_equals_full_model(tiny_checkpoint, m, eta, max_draft, chunk_size):
    rng = random.Random(m * 10 + max_draft)
    adapter = DraftAdapter(tiny_checkpoint, m)  # initialised from layer m's attention
    for _ in range(3):
        ids = [rng.randrange(1, tiny_checkpoint.vocab_size) for _ in range(rng.randint(1, 20))]
        expected = generate_full(tiny_checkpoint, ids, 24).token_ids
        got = run(tiny_checkpoint, ids, m, adapter, 24, eta=eta, max_draft=max_draft, chunk_size=chunk_size)
        assert got.token_ids == expected
        if max_draft == 0:
            assert got.mean_accept_length == 1.0


@pytest.mark.parametrize("candidates,steps", [(1, 2), (3, 4), (2, 0)])
def test_greedy_with_parallel_drafting_equals_full_model(tiny_checkpoint, candidates, steps):
    adapter = DraftAdapter(tiny_checkpoint, 3)
    rng = random.Random(candidates)
    reused = chances = 0
    for _ in range(4):
        ids = [rng.randrange(1, tiny_checkpoint.vocab_size) for _ in range(rng.randint(2, 12))]
        expected = generate_full(tiny_checkpoint, ids, 30).token_ids
        got = run(
            tiny_checkpoint,
            ids,
            3,
            adapter,
            30,
            eta=0.5,
            max_draft=4,
            chunk_size=3,
            parallel_candidates=candidates,
            parallel_steps=steps,
        )
        assert got.token_ids == expected
        reused += got.reused_branches
        chances += got.predraft_chances
    assert reused <= chances  # a branch is only adopted when the last draft token was corrected
    if candidates >= 3:
        assert reused > 0  # some corrections hit a pre-drafted candidate


def test_greedy_with_random_adapter_is_still_exact(tiny_checkpoint):
    adapter = DraftAdapter(tiny_checkpoint, 2).randomize(seed=1)
    ids = [5, 9, 13, 2]
    assert (
        run(tiny_checkpoint, ids, 2, adapter, 30, eta=0.0).token_ids
        == generate_full(tiny_checkpoint, ids, 30).token_ids
    )


class MiddleAsDraft(torch.nn.Module):
    """A "draft adapter" that is the cloud's middle itself: the draft is the target."""

    spec = AdapterSpec()  # reads the shallow state only, like HAT's adapter
    draft_vocab = None  # drafts over the whole vocabulary

    def __init__(self, middle: MiddleSubmodel):
        super().__init__()
        self.middle = middle

    def new_cache(self):
        return self.middle.new_cache()

    def forward(self, shallow, cache, side=None, tree=None):
        return self.middle.forward_batch([(cache, shallow)], None if tree is None else [tree])[0]  # [S, H]


def recording_drafts(session: DeviceSession) -> list[int]:
    """The length k of every draft the engine sends for verification."""
    lengths: list[int] = []
    draft = session.draft

    def recorded():
        made = draft()
        lengths.append(len(made.tokens))
        return made

    session.draft = recorded
    return lengths


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=1.0, seed=3)])
def test_self_draft_is_fully_accepted(tiny_checkpoint, params):
    """With a draft equal to the target, every drafted token is accepted: each round makes its
    k drafts plus the target's token final (a broken accept rule or rollback would cut rounds short)."""
    m = 2
    device = DeviceModel.from_checkpoint(tiny_checkpoint, m, MiddleAsDraft(MiddleSubmodel(tiny_checkpoint, m)))
    device.eos_token_id = None  # run the whole budget
    session = DeviceSession(device, [3, 4, 5], params, DraftConfig(eta=0.0, max_draft=3), 40)
    lengths = recording_drafts(session)
    result = asyncio.run(generate(session, LocalCloud(MiddleSubmodel(tiny_checkpoint, m)), chunk_size=2))
    assert result.accept_lengths == [k + 1 for k in lengths]
    assert max(lengths) == 3 and len(result.token_ids) == 40
    if params.is_greedy:
        assert result.token_ids == generate_full(tiny_checkpoint, [3, 4, 5], 40).token_ids


def test_parallel_draft_steps_are_asked_per_round_with_the_rows_sent(demo_checkpoint):
    """Eq. 6's window is the transfer of the k + 1 rows this round sends and gets back: the engine asks
    for λ every round with that count, not once per request with the largest draft."""
    from shared.runtime import load_adapter

    device = DeviceModel.from_checkpoint(demo_checkpoint, 2, load_adapter(demo_checkpoint, 2, None))
    prompt = demo_checkpoint.tokenizer.encode("class Stack:\n    def push(self", add_special_tokens=False)
    session = DeviceSession(device, prompt, SamplingParams(), DraftConfig(eta=0.6, max_draft=6), 40)
    lengths = recording_drafts(session)
    asked: list[int] = []

    def steps_for(rows: int) -> int:
        asked.append(rows)
        return rows % 3

    asyncio.run(
        generate(
            session, LocalCloud(MiddleSubmodel(demo_checkpoint, 2)), parallel_candidates=2, parallel_steps=steps_for
        )
    )
    assert asked == [k + 1 for k in lengths if k > 0]
    assert len(set(asked)) > 1  # drafts of different lengths: one answer per request would be wrong


def test_demo_model_greedy_hat_equals_full_with_trained_adapter(demo_checkpoint):
    from shared.runtime import load_adapter

    adapter = load_adapter(demo_checkpoint, 2, None)
    prompt = demo_checkpoint.tokenizer.encode("import os\n\ndef list_files(path):\n    ", add_special_tokens=False)
    expected = generate_full(demo_checkpoint, prompt, 48).token_ids
    result = run(demo_checkpoint, prompt, 2, adapter, 48, chunk_size=4)
    assert result.token_ids == expected
    assert result.mean_accept_length > 1.0  # the trained adapter drafts something useful


@pytest.mark.slow
def test_sampled_hat_has_the_target_distribution(tiny_llama_dir):
    """Sampled output has the target's distribution, including the tokens that rounds drafted by a
    reused pre-drafted branch decide. With one draft token per round, a branch is adopted when d_1 was
    rejected and the correction (token 1) was a pre-drafted candidate: the branch's draft is then
    verified for token 2, so token 2's marginal is checked, in a run where that happened often."""
    from shared.model.checkpoint import load_checkpoint

    checkpoint = load_checkpoint(tiny_llama_dir, with_tokenizer=False)
    ids = [7, 1, 4]
    # A small nucleus keeps the exact marginals of three tokens cheap to sum.
    params = SamplingParams(temperature=0.5, top_p=0.3)
    # m = 3 of 5 layers: the draft is rejected often enough (both branches of the rule run) and the
    # correction is often one of the 16 pre-drafted candidates.
    adapter = DraftAdapter(checkpoint, 3)
    device = DeviceModel.from_checkpoint(checkpoint, 3, adapter)
    device.eos_token_id = None  # the exact marginals below do not stop at EOS
    cloud = LocalCloud(MiddleSubmodel(checkpoint, 3))
    runs, accepted, reused = 1000, 0, 0
    counts = np.zeros((3, checkpoint.vocab_size))
    for seed in range(runs):
        session = DeviceSession(device, ids, SamplingParams(0.5, 0.3, seed), DraftConfig(eta=0.0, max_draft=1), 4)
        result = asyncio.run(generate(session, cloud, session_id=seed + 1, parallel_candidates=16, parallel_steps=1))
        for position in range(3):
            counts[position, result.token_ids[position]] += 1
        accepted += result.accept_lengths[0] == 2  # d_1 accepted, plus the bonus token
        reused += session.reused_branches  # at most one: only round 1's branches can be adopted here
    for position, probs in enumerate(exact_marginals(checkpoint, ids, params, 3)):
        assert_matches(counts[position], probs)
    assert 0 < accepted < runs, accepted  # the draft is accepted sometimes, rejected sometimes
    assert reused >= runs // 5, reused  # token 2 came from a reused branch's draft in many runs


def test_bad_requests_are_typed_errors(tiny_checkpoint):
    device = DeviceModel.from_checkpoint(tiny_checkpoint, 2, None)
    with pytest.raises(SessionError, match="empty"):
        DeviceSession(device, [])
    with pytest.raises(SessionError, match="out of vocabulary"):
        DeviceSession(device, [tiny_checkpoint.vocab_size + 3])
    with pytest.raises(SessionError, match="context length"):
        DeviceSession(device, [1] * 10, max_new_tokens=10_000)


def test_round_timings_exclude_the_cloud_wait_and_include_the_consumer(tiny_checkpoint):
    """The engine's per-round overhead (the simulator's round_overhead_s) is the time after the
    cloud's answer: it must not contain a slow cloud, and must contain a slow consumer."""
    from shared.specdec.decode_loop import run_session

    class SlowCloud(LocalCloud):
        async def verify(self, session_id, commit_len, shallow):
            await asyncio.sleep(0.2)
            return await super().verify(session_id, commit_len, shallow)

    device = DeviceModel.from_checkpoint(tiny_checkpoint, 2, DraftAdapter(tiny_checkpoint, 2))
    session = DeviceSession(device, list(range(1, 12)), SamplingParams(), DraftConfig(max_draft=4), 4)

    async def consume():
        rounds = 0
        async for _tokens in run_session(session, SlowCloud(MiddleSubmodel(tiny_checkpoint, 2)), 1, [5, 6]):
            rounds += 1
            await asyncio.sleep(0.05)
        return rounds

    rounds = asyncio.run(consume())
    assert len(session.round_overhead_s) == rounds  # the prefill's first token, then one per verification
    assert all(0.05 <= s < 0.2 for s in session.round_overhead_s), session.round_overhead_s
    assert [n for _, n in session.prefill_seconds] == [5, 6] and all(s > 0 for s, _ in session.prefill_seconds)


def test_parallel_drafting_when_the_answer_lands_before_its_callback_runs(tiny_checkpoint):
    """An offload that yields once lets a fast verification finish while pre-drafting is being
    scheduled: `await verifying` then returns before the future's done callbacks have run."""
    from shared.specdec.decode_loop import run_session

    async def yielding_offload(fn, *args):
        await asyncio.sleep(0)
        return fn(*args)

    adapter = DraftAdapter(tiny_checkpoint, 2)
    ids = list(range(3, 15))
    expected = generate_full(tiny_checkpoint, ids, 16).token_ids
    device = DeviceModel.from_checkpoint(tiny_checkpoint, 2, adapter)
    session = DeviceSession(device, ids, SamplingParams(), DraftConfig(eta=0.5, max_draft=4), 16)

    async def consume():
        return [
            t
            async for tokens in run_session(
                session,
                LocalCloud(MiddleSubmodel(tiny_checkpoint, 2)),
                7,
                [12],
                offload=yielding_offload,
                parallel_candidates=2,
                parallel_steps=2,
            )
            for t in tokens
        ]

    assert asyncio.run(consume()) == expected
    assert all(s >= 0 for s in session.round_overhead_s)


class LaggyCloud(LocalCloud):
    """The in-process cloud with an emulated network: each verification's answer lands `lag_s` late."""

    def __init__(self, middle, lag_s: float):
        super().__init__(middle)
        self.lag_s = lag_s

    async def verify(self, session_id, commit_len, shallow):
        deep = await super().verify(session_id, commit_len, shallow)
        await asyncio.sleep(self.lag_s)
        return deep


@pytest.mark.slow
def test_seeded_sampling_is_the_same_text_whatever_the_cloud_latency(demo_checkpoint):
    """Pre-drafting runs only while a verification is in flight, so how much of it happens depends on
    the cloud's timing; the text must not. Drafts are drawn from a stream keyed by (round start,
    position), so an adopted pre-drafted branch (completed by the next draft() if cut short) is the
    very draft the session would have made after the correction: the text also equals parallel
    drafting off."""
    from shared.runtime import load_adapter

    adapter = load_adapter(demo_checkpoint, 2, None)
    device = DeviceModel.from_checkpoint(demo_checkpoint, 2, adapter)
    prompt = demo_checkpoint.tokenizer.encode("def fibonacci(n):\n    ", add_special_tokens=False)

    def sampled(lag_s: float, candidates: int) -> tuple[list[int], int]:
        session = DeviceSession(
            device, prompt, SamplingParams(0.8, 0.95, seed=1234), DraftConfig(eta=0.3, max_draft=6), 48
        )
        cloud = LaggyCloud(MiddleSubmodel(demo_checkpoint, 2), lag_s)
        result = asyncio.run(
            generate(session, cloud, offload=asyncio.to_thread, parallel_candidates=candidates, parallel_steps=2)
        )
        return result.token_ids, session.reused_branches

    slow, slow_reused = sampled(0.03, 3)
    fast, _ = sampled(0.0, 3)
    off, _ = sampled(0.0, 0)
    assert slow_reused > 0  # pre-drafted branches were adopted: the case that used to diverge
    assert fast == slow
    assert off == slow


def test_unseeded_sessions_do_not_repeat(tiny_checkpoint):
    """A fresh torch.Generator has a fixed seed: without a seed of its own every session sampled the same text."""
    device = DeviceModel.from_checkpoint(tiny_checkpoint, 2, None)
    seeds = {DeviceSession(device, [1, 2], SamplingParams(temperature=1.0)).generator.initial_seed() for _ in range(3)}
    assert len(seeds) == 3
    seeded = DeviceSession(device, [1, 2], SamplingParams(temperature=1.0, seed=5)).generator.initial_seed()
    assert seeded == 5


def test_a_request_cancelled_while_its_session_opens_frees_both_sides(tiny_llama_dir):
    """The client can go away while OpenSession is in flight: the cloud session that the open created and the
    device's own KV must both be freed, not left for the verifier's idle TTL."""
    from shared.model.checkpoint import load_checkpoint
    from shared.specdec.decode_loop import run_session

    checkpoint = load_checkpoint(tiny_llama_dir, with_tokenizer=False)
    device = DeviceModel.from_checkpoint(checkpoint, 2, None)
    session = DeviceSession(device, [1, 2, 3, 4], SamplingParams(), DraftConfig(), 8)

    class SlowToAnswerCloud(LocalCloud):
        async def open(self, session_id):
            await super().open(session_id)  # the verifier has the session; its answer is still on the way
            await asyncio.sleep(30)

    cloud = SlowToAnswerCloud(MiddleSubmodel(checkpoint, 2))

    async def consume():
        async for _ in run_session(session, cloud, 7, [4]):
            pass

    async def main():
        task = asyncio.create_task(consume())
        await asyncio.sleep(0.1)
        assert 7 in cloud.caches
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert cloud.caches == {}
    assert session.input_cache.is_freed
