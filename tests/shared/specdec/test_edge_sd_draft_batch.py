"""Edge SD's batched drafting (shared/edge_sd/draft_batch.py) against each session drafting alone
(`StreamSession.draft_step()` repeated): the same chunks token for token and q for q, through rounds whose
verdicts reject (rollback), and accept everything with a bonus (two positions wait), for every adapter
side input, greedy and seeded sampling, prompts of different lengths and streams with different room.

Two copies of each session: one drafts alone, the other in the batch. The verdict on the lone copy's
chunk (a StreamVerifier over target rows) is applied to both.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shared.edge_sd.draft_batch import draft_batch, draft_pass_sizes, prefill_batch
from shared.model.adapter import AdapterSpec, DraftAdapter
from shared.specdec.device_session import DeviceModel, DraftConfig
from shared.specdec.draft_stream import DraftChunk, StreamVerifier
from shared.specdec.sampling import SamplingParams, logits_to_probs
from shared.specdec.stream_session import StreamSession

M = 2
SPEC_LEN = 4
PROMPTS = [[1, 15, 27, 99, 4], [3, 100, 101, 5, 7, 9, 11, 2, 44, 45, 46], [8, 9], [60, 61, 62]]
MAX_NEW = [30, 7, 30, 2]  # the second runs out of room mid-run; the last has no room to draft at all
SPECS = [AdapterSpec("hat"), AdapterSpec("fusion"), AdapterSpec("feature")]
# "target": the full model's rows (random drafts: rejections); "agree": rows that accept every draft, + a bonus
ROUNDS = ["target", "agree", "target", "agree", "agree", "target"]


def device_model(checkpoint, spec: AdapterSpec) -> DeviceModel:
    return DeviceModel.from_checkpoint(checkpoint, M, DraftAdapter(checkpoint, M, spec).randomize(seed=3))


def full_rows(checkpoint, seq: list[int], start: int, end: int, params: SamplingParams) -> torch.Tensor:
    """The target's distribution after each of seq[start:end]: [end - start, V]."""
    with torch.no_grad():
        logits = checkpoint.model(input_ids=torch.tensor([seq[:end]])).logits[0, start:end].float()
    return logits_to_probs(logits, params)


def params_of(sampled: bool, index: int) -> SamplingParams:
    return SamplingParams(0.9, 1.0, 100 + index) if sampled else SamplingParams()


def new_sessions(model, sampled: bool, max_new=MAX_NEW) -> list[StreamSession]:
    return [
        StreamSession(model, p, params_of(sampled, i), DraftConfig(0.0, 8), n)
        for i, (p, n) in enumerate(zip(PROMPTS, max_new))
    ]


def start(checkpoint, alone: list[StreamSession], batched: list[StreamSession]) -> None:
    for session in alone:
        session.prefill_locally()
    prefill_batch(batched)
    for i, (a, b) in enumerate(zip(alone, batched)):
        row = full_rows(checkpoint, a.prompt_ids, len(a.prompt_ids) - 1, len(a.prompt_ids), a.params)[0]
        first = int(torch.multinomial(row, 1, generator=torch.Generator().manual_seed(i)))
        assert a.start_token_mode(first) == b.start_token_mode(first) == [first]


def draft_alone(session: StreamSession, spec_len: int) -> DraftChunk:
    for _ in range(0 if session.is_finished else min(spec_len, session.draft_room())):
        if session.stopped:
            break
        session.draft_step()
    return session.take_chunk(more=False)[0]


def assert_same_chunk(got: DraftChunk, want: DraftChunk) -> None:
    assert (got.epoch, got.start_pos, got.tokens, got.num_final, got.more) == (
        want.epoch,
        want.start_pos,
        want.tokens,
        want.num_final,
        want.more,
    )
    if want.q_drafted is None:
        assert got.q_drafted is None
    else:
        torch.testing.assert_close(got.q_drafted, want.q_drafted, atol=1e-5, rtol=1e-4)


def assert_same_state(a: StreamSession, b: StreamSession) -> None:
    assert (a.seq, a.final_len, a.sent_len, a.epoch, a.generated, a.stopped) == (
        b.seq,
        b.final_len,
        b.sent_len,
        b.epoch,
        b.generated,
        b.stopped,
    )
    assert a.input_cache.length == b.input_cache.length == a.adapter_cache.length == b.adapter_cache.length
    assert sorted(a.features) == sorted(b.features)
    for position, feature in a.features.items():
        torch.testing.assert_close(b.features[position], feature, atol=1e-5, rtol=1e-4)


def verdict_rows(checkpoint, session: StreamSession, chunk: DraftChunk, kind: str) -> torch.Tensor:
    rows = full_rows(checkpoint, session.seq, chunk.start_pos, chunk.end_pos, session.params)  # [n, V]
    if kind == "agree":  # the target agrees with every draft: p = q (sampled) or one-hot at the draft (greedy)
        for i, token in enumerate(chunk.drafts):
            position = chunk.start_pos + chunk.num_final + i
            rows[i] = (
                session.q_rows[position]
                if position in session.q_rows
                else torch.nn.functional.one_hot(torch.tensor(token), rows.shape[1]).float()
            )
    return rows


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_batched_drafts_equal_each_session_drafting_alone(tiny_checkpoint, spec, sampled):
    model = device_model(tiny_checkpoint, spec)
    alone, batched = new_sessions(model, sampled), new_sessions(model, sampled)
    start(tiny_checkpoint, alone, batched)
    verifiers = [StreamVerifier() for _ in alone]
    seen = {"rejected": 0, "bonus after drafts": 0, "drafts": 0, "no room": 0, "two waiting": 0}
    for round_index, kind in enumerate(ROUNDS):
        live = [i for i, s in enumerate(alone) if not s.is_finished]
        assert live == [i for i, s in enumerate(batched) if not s.is_finished]
        # after a bonus the last draft and the bonus both wait: two sub-passes before the first draft
        seen["two waiting"] += any(len(batched[i].seq) - batched[i].advanced == 2 for i in live)
        got = draft_batch([batched[i] for i in live], SPEC_LEN)
        for i, chunk in zip(live, got):
            want = draft_alone(alone[i], SPEC_LEN)
            assert_same_chunk(chunk, want)
            assert_same_state(alone[i], batched[i])
            seen["drafts"] += want.num_drafts
            seen["no room"] += want.num_drafts == 0
            rows = verdict_rows(tiny_checkpoint, alone[i], want, kind)
            generator = torch.Generator().manual_seed(1000 * round_index + i)
            verdict = verifiers[i].verify(want, rows, generator, greedy=not sampled, downlink="full")
            seen["rejected"] += verdict.rejected
            seen["bonus after drafts"] += verdict.token is not None and want.num_drafts > 0
            assert alone[i].apply(want, verdict) == batched[i].apply(chunk, verdict)
            assert_same_state(alone[i], batched[i])
    assert all(seen.values()), seen
    assert any(s.is_finished for s in alone)


def test_prefill_batch_equals_prefill_locally(tiny_checkpoint):
    model = device_model(tiny_checkpoint, AdapterSpec("feature"))
    alone, batched = new_sessions(model, False), new_sessions(model, False)
    for session in alone:
        session.prefill_locally()
    prefill_batch(batched)
    for a, b in zip(alone, batched):
        assert a.input_cache.length == b.input_cache.length == a.adapter_cache.length == len(a.prompt_ids)
        assert b.adapter_cache.length == len(a.prompt_ids)
        torch.testing.assert_close(b._prompt_feature, a._prompt_feature, atol=1e-5, rtol=1e-4)
        for cache_a, cache_b in ((a.input_cache, b.input_cache), (a.adapter_cache, b.adapter_cache)):
            for layer in range(len(cache_a._alive())):
                la, lb = cache_a.layer(layer), cache_b.layer(layer)
                torch.testing.assert_close(lb.keys[:, : lb.length], la.keys[:, : la.length], atol=1e-5, rtol=1e-4)
                torch.testing.assert_close(lb.values[:, : lb.length], la.values[:, : la.length], atol=1e-5, rtol=1e-4)


def test_a_session_that_drafts_eos_stops_while_the_others_go_on(tiny_checkpoint):
    model = device_model(tiny_checkpoint, AdapterSpec("fusion"))
    probe = new_sessions(model, False)[:3]
    start(tiny_checkpoint, probe, new_sessions(model, False)[:3])
    eos = draft_alone(probe[0], SPEC_LEN).drafts[1]  # session 0's second draft becomes EOS
    model = dataclasses.replace(model, eos_token_id=eos)
    alone, batched = new_sessions(model, False)[:3], new_sessions(model, False)[:3]
    start(tiny_checkpoint, alone, batched)
    got = draft_batch(batched, SPEC_LEN)
    for session, chunk in zip(alone, got):
        assert_same_chunk(chunk, draft_alone(session, SPEC_LEN))
    assert batched[0].stopped and got[0].drafts[-1] == eos and got[0].num_drafts <= 2
    assert not batched[2].stopped and got[2].num_drafts == SPEC_LEN  # the batch went on without session 0


def test_pass_sizes_are_the_sessions_drafting_at_each_position(tiny_checkpoint):
    model = device_model(tiny_checkpoint, AdapterSpec("hat"))
    sessions = new_sessions(model, False, max_new=[30, 4, 3, 2])  # room for 4, 2, 1 and 0 drafts
    prefill_batch(sessions)
    for session in sessions:
        session.start_token_mode(5)
    sizes = draft_pass_sizes(sessions, SPEC_LEN)
    assert sizes == [3, 2, 1, 1]
    head_batches = []
    output = model.output
    model.output = lambda hidden: head_batches.append(hidden.shape[0]) or output(hidden)
    try:
        chunks = draft_batch(sessions, SPEC_LEN)
    finally:
        model.output = output
    assert head_batches == sizes
    assert [c.num_drafts for c in chunks] == [4, 2, 1, 0] and chunks[3].tokens == (5,)
