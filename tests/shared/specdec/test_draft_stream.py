"""The streamed draft's accept rule (draft_stream.StreamVerifier) with the device's correction
(separate_rejection.correction_token), on toy distributions over a vocabulary of 8.

Sampled, downlink "full": the tokens a stream makes final follow the target, >= 30,000 trials,
chi-square at alpha 1e-4, including a draft cut into two chunks (the second continues the first
through the carried row) and a rejection in the first chunk that turns the second stale.
Greedy: the argmax chain. Epochs and malformed chunks. Top-K downlink: what its docstring promises.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shared.specdec.draft_stream import ChunkVerdict, DraftChunk, StreamProtocolError, StreamVerifier
from shared.specdec.separate_rejection import correction_distribution, correction_token, make_payload
from tests.stat_tools import assert_samples_follow

VOCAB = 8
TRIALS = 30_000
FIRST = 3  # the final token at position 0 (the pending token the stream starts from)
LAST_POS = 4  # each trial makes positions 1..LAST_POS final


def random_dist(generator: torch.Generator) -> torch.Tensor:
    # bounded away from 0, so every joint cell of two positions expects well over 5 counts
    probs = torch.rand(VOCAB, generator=generator) + 0.3
    return probs / probs.sum()


def one_hot(token: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(token), VOCAB).float()


def sampled_chunk(
    epoch: int, start: int, tokens: list[int], num_final: int, q_table: list[list[float]], more: bool
) -> DraftChunk:
    # q_table: [LAST_POS + 2][V] the draft's (context-independent) row at each position, as lists (cheap to index)
    q_drafted = torch.tensor([q_table[start + num_final + i][t] for i, t in enumerate(tokens[num_final:])])
    return DraftChunk(epoch, start, tuple(tokens), num_final, q_drafted, more)


def run_trial(
    p: torch.Tensor, q: torch.Tensor, drafts: np.ndarray, generator: torch.Generator, counters: dict[str, int]
) -> list[int]:
    """One stream: chunk A = (FIRST, d1, d2) more, chunk B = (d3, d4) continuing it, both sent before A's
    verdict (pipelined); after a rejection B must come back stale and the device drafts afresh from the
    correction up to LAST_POS. Returns the final tokens at positions 0..LAST_POS (and a bonus past it)."""
    # p, q: [LAST_POS + 2, V], row j = the distribution of the token at position j (context-independent toy)
    # drafts: [attempts, LAST_POS + 2] fresh draws from q[j] for each attempt at drafting position j
    verifier = StreamVerifier()
    final = [FIRST]
    q_table = q.tolist()
    chunk_a = sampled_chunk(0, 0, [FIRST, int(drafts[0, 1]), int(drafts[0, 2])], 1, q_table, more=True)
    chunk_b = sampled_chunk(0, 3, [int(drafts[0, 3]), int(drafts[0, 4])], 0, q_table, more=False)

    def settle(chunk: DraftChunk, verdict: ChunkVerdict) -> None:
        final.extend(chunk.drafts[: verdict.num_accepted])
        if verdict.rejected:
            position = chunk.start_pos + chunk.num_final + verdict.num_accepted
            final.append(correction_token(verdict.rejection, q[position], generator))
        elif verdict.token is not None:
            final.append(verdict.token)

    verdict_a = verifier.verify(chunk_a, p[1:4], generator, greedy=False, downlink="full")
    settle(chunk_a, verdict_a)
    assert verifier.epoch == int(verdict_a.rejected)
    verdict_b = verifier.verify(chunk_b, p[4:6], generator, greedy=False, downlink="full")
    if verdict_a.rejected:
        counters["a_rejected"] += 1
        assert verdict_b.stale and verdict_b.num_accepted == 0 and verdict_b.token is None
        assert verdict_b.epoch == verifier.epoch == 1
    else:
        assert not verdict_b.stale and verifier.epoch == int(verdict_b.rejected)
        counters["b_rejected_first"] += verdict_b.rejected and verdict_b.num_accepted == 0
        settle(chunk_b, verdict_b)
    attempt = 1
    while len(final) <= LAST_POS:  # the device drafts afresh from the correction, one chunk, no more
        start = len(final) - 1
        tokens = [final[-1]] + [int(drafts[attempt, j]) for j in range(start + 1, LAST_POS + 1)]
        chunk = sampled_chunk(verifier.epoch, start, tokens, 1, q_table, more=False)
        settle(
            chunk,
            verifier.verify(chunk, p[start + 1 : start + len(tokens) + 1], generator, greedy=False, downlink="full"),
        )
        attempt += 1
    return final


@pytest.mark.parametrize("case", ["draft_equals_target", "random_draft"])
@pytest.mark.slow
def test_two_chunk_stream_with_full_downlink_emits_the_target_distribution(case):
    generator = torch.Generator().manual_seed(5)
    p = torch.stack([random_dist(generator) for _ in range(LAST_POS + 2)])  # [6, V]
    q = (
        p.clone()
        if case == "draft_equals_target"
        else torch.stack([random_dist(generator) for _ in range(LAST_POS + 2)])
    )
    # drafts: [T, attempts, positions]; a stream makes at least one position final per chunk, so 6 attempts do
    drafts = (
        torch.stack(
            [torch.multinomial(q[j], TRIALS * 6, replacement=True, generator=generator) for j in range(LAST_POS + 2)],
            -1,
        )
        .reshape(TRIALS, 6, LAST_POS + 2)
        .numpy()
    )
    counters = {"a_rejected": 0, "b_rejected_first": 0}
    streams = [run_trial(p, q, drafts[t], generator, counters) for t in range(TRIALS)]
    tokens = np.array([s[: LAST_POS + 1] for s in streams])  # [T, LAST_POS + 1]
    assert (tokens[:, 0] == FIRST).all()
    for position in range(1, LAST_POS + 1):
        assert_samples_follow(tokens[:, position], p[position])
    # Across the chunk boundary: position 3 (B's first draft, verified with A's carried row) is independent
    # of position 2 (A's last draft) and follows p[3].
    assert_samples_follow(tokens[:, 2] * VOCAB + tokens[:, 3], torch.outer(p[2], p[3]).flatten())
    if case == "draft_equals_target":
        assert counters == {"a_rejected": 0, "b_rejected_first": 0}
        assert all(len(s) == LAST_POS + 2 for s in streams)  # every stream ends on B's bonus
    else:
        assert counters["a_rejected"] > TRIALS // 10  # B went stale in these streams
        assert counters["b_rejected_first"] > TRIALS // 50  # the carried row rejected B's first draft


# -- greedy -------------------------------------------------------------------------------------------
def argmax_rows(tokens: list[int], generator: torch.Generator) -> torch.Tensor:
    """Random rows whose argmax is tokens[i] (never one-hot: greedy must read the argmax, not a 1)."""
    rows = torch.rand(len(tokens), VOCAB, generator=generator)  # [n, V]
    rows[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.5
    return rows / rows.sum(-1, keepdim=True)


def test_greedy_accepts_exactly_the_prefix_that_agrees_with_the_argmax():
    generator = torch.Generator().manual_seed(0)
    for trial in range(300):
        verifier = StreamVerifier()
        drafts = torch.randint(0, VOCAB, (4,), generator=generator).tolist()
        # the target's argmax agrees with each draft with probability 1/2
        targets = [d if torch.rand(1, generator=generator) < 0.5 else (d + 1) % VOCAB for d in drafts]
        carried = trial % 2 == 1  # odd trials: a continuation chunk, its first draft verified by the carried row
        if carried:
            first_rows = argmax_rows([targets[0]], generator)  # [1, V]
            verifier.verify(DraftChunk(0, 0, (1,), 1, None, True), first_rows, None, greedy=True)
            chunk = DraftChunk(0, 1, tuple(drafts), 0, None, False)
            rows = argmax_rows(targets[1:] + [6], generator)  # [4, V]
        else:
            chunk = DraftChunk(0, 0, (7, *drafts), 1, None, False)
            rows = argmax_rows(targets + [6], generator)  # [5, V]
        expected = next((i for i, (d, t) in enumerate(zip(drafts, targets)) if d != t), len(drafts))
        verdict = verifier.verify(chunk, rows, None, greedy=True)
        assert verdict.num_accepted == expected, (drafts, targets, carried)
        if expected < len(drafts):
            payload = verdict.rejection
            assert (payload.kind, payload.token, payload.position) == ("token", targets[expected], expected)
            assert verdict.token is None and verdict.epoch == verifier.epoch == 1
        else:
            assert verdict.token == 6 and verdict.rejection is None and verdict.epoch == 0


@pytest.mark.parametrize("rejected_at", [0, 2])
def test_greedy_rejection_at_the_first_and_last_draft(rejected_at):
    drafts = [4, 5, 6]
    targets = list(drafts)
    targets[rejected_at] = 1
    verifier = StreamVerifier()
    rows = argmax_rows(targets + [0], torch.Generator().manual_seed(1))  # [4, V]
    verdict = verifier.verify(DraftChunk(0, 10, (2, *drafts), 1, None, True), rows, None, greedy=True)
    assert verdict.num_accepted == rejected_at and verdict.token is None and not verdict.stale
    payload = verdict.rejection
    assert (payload.kind, payload.token, payload.position, payload.vocab_size) == ("token", 1, rejected_at, VOCAB)
    assert payload.values is None and payload.indices is None  # greedy sends the correction alone
    assert correction_token(payload, torch.zeros(VOCAB), None) == 1  # the device's correction is the argmax
    assert verifier.epoch == verdict.epoch == 1 and verifier.carried_row is None


@pytest.mark.parametrize("more", [False, True])
def test_greedy_all_accepted_gives_the_bonus_or_carries_the_row(more):
    rows = argmax_rows([4, 5, 6], torch.Generator().manual_seed(2))  # [3, V]
    verifier = StreamVerifier()
    verdict = verifier.verify(DraftChunk(0, 0, (2, 4, 5), 1, None, more), rows, None, greedy=True)
    assert verdict.num_accepted == 2 and verdict.rejection is None and verdict.epoch == verifier.epoch == 0
    if more:
        assert verdict.token is None
        assert torch.equal(verifier.carried_row, rows[-1])
        # the carried row verifies the next chunk's first draft: 6 is its argmax
        follow = verifier.verify(
            DraftChunk(0, 3, (6, 0), 0, None, False), argmax_rows([0, 3], torch.Generator()), None, greedy=True
        )
        assert (follow.num_accepted, follow.token, verifier.carried_row) == (2, 3, None)
    else:
        assert verdict.token == 6 and verifier.carried_row is None


# -- epochs and malformed chunks ---------------------------------------------------------------------
def test_a_rejection_bumps_the_epoch_and_older_chunks_come_back_stale_changing_nothing():
    generator = torch.Generator().manual_seed(3)
    verifier = StreamVerifier()
    rejected = verifier.verify(
        DraftChunk(0, 0, (2, 4, 5), 1, None, True), argmax_rows([4, 1, 0], generator), None, greedy=True
    )
    assert (rejected.num_accepted, rejected.epoch, verifier.epoch) == (1, 1, 1)
    # the device's next chunk in the new epoch, fully accepted, promising more: a carried row
    rows = argmax_rows([6, 7], generator)
    accepted = verifier.verify(DraftChunk(1, 2, (1, 6), 1, None, True), rows, None, greedy=True)
    assert (accepted.num_accepted, accepted.token, accepted.epoch) == (1, None, 1)
    # a chunk of epoch 0 drafted on the rejected 5 arrives late: stale, whatever it holds (even bad rows)
    for p_rows in (argmax_rows([3, 3], generator), torch.zeros(5)):
        stale = verifier.verify(DraftChunk(0, 3, (5, 3), 0, None, False), p_rows, None, greedy=True)
        assert stale == ChunkVerdict(1, 0, stale=True)
        assert verifier.epoch == 1 and torch.equal(verifier.carried_row, rows[-1])
    # a sampled stale chunk spends no randomness either
    p_rows = argmax_rows([3, 3], generator)
    state = generator.get_state()
    verifier.verify(DraftChunk(0, 3, (5, 3), 0, torch.tensor([0.5, 0.5]), False), p_rows, generator, greedy=False)
    assert torch.equal(generator.get_state(), state)


def test_malformed_chunks_raise_and_leave_the_stream_as_it_was():
    generator = torch.Generator().manual_seed(4)
    verifier = StreamVerifier()
    with pytest.raises(StreamProtocolError):  # a continuation with nothing to continue
        verifier.verify(DraftChunk(0, 1, (4, 5), 0, None, False), argmax_rows([5, 0], generator), None, greedy=True)
    verifier.verify(DraftChunk(0, 0, (2, 4), 1, None, True), argmax_rows([4, 5], generator), None, greedy=True)
    carried = verifier.carried_row.clone()
    bad = [torch.rand(2, VOCAB), torch.rand(4, VOCAB), torch.rand(3), torch.rand(1, 3, VOCAB)]
    for p_rows in bad:  # the chunk has 3 tokens: p_rows must be [3, V]
        with pytest.raises(StreamProtocolError):
            verifier.verify(DraftChunk(0, 2, (5, 1, 2), 0, None, False), p_rows, None, greedy=True)
    with pytest.raises(StreamProtocolError):  # sampled verification without q
        verifier.verify(DraftChunk(0, 2, (5, 1, 2), 0, None, False), torch.rand(3, VOCAB), generator, greedy=False)
    with pytest.raises(StreamProtocolError):  # a draft outside the vocabulary
        verifier.verify(DraftChunk(0, 2, (5, VOCAB), 0, None, False), torch.rand(2, VOCAB), None, greedy=True)
    assert verifier.epoch == 0 and torch.equal(verifier.carried_row, carried)
    # after a rejection the carried row is gone: a continuation of the new epoch has nothing to continue
    verifier.verify(DraftChunk(0, 2, (6,), 0, None, True), argmax_rows([0], generator), None, greedy=True)
    assert verifier.epoch == 1 and verifier.carried_row is None
    with pytest.raises(StreamProtocolError):
        verifier.verify(DraftChunk(1, 3, (4,), 0, None, False), argmax_rows([0], generator), None, greedy=True)
    for tokens, num_final, q in [((), 1, None), ((1, 2), 2, None), ((1, 2, 3), 1, torch.ones(3))]:
        with pytest.raises(StreamProtocolError):
            DraftChunk(0, 0, tokens, num_final, q, False)


# -- top-K downlink -----------------------------------------------------------------------------------
def rejected_topk_verdict(p_row: torch.Tensor, top_k: int) -> ChunkVerdict:
    """A sampled chunk whose only draft (token 0, q(0) = 1, p(0) = 0) is surely rejected."""
    p = p_row.clone()
    p_rows = torch.stack([p, torch.full((VOCAB,), 1 / VOCAB)])  # [2, V]
    verdict = StreamVerifier().verify(
        DraftChunk(0, 0, (5, 0), 1, torch.tensor([1.0]), False),
        p_rows,
        torch.Generator().manual_seed(0),
        greedy=False,
        downlink="topk",
        top_k=top_k,
    )
    assert verdict.num_accepted == 0 and verdict.epoch == 1
    return verdict


def test_topk_payload_holds_the_k_largest_target_probabilities():
    p = torch.tensor([0.0, 0.3, 0.05, 0.2, 0.1, 0.15, 0.12, 0.08])
    payload = rejected_topk_verdict(p, 3).rejection
    assert (payload.kind, payload.position, payload.vocab_size) == ("topk", 0, VOCAB)
    assert payload.values.dtype == torch.float32 and payload.indices.dtype == torch.int32
    assert payload.values.tolist() == pytest.approx([0.3, 0.2, 0.15])
    assert payload.indices.tolist() == [1, 3, 5]
    assert rejected_topk_verdict(p, 50).rejection.values.shape == (VOCAB,)  # K is capped at the vocabulary


def test_topk_correction_stays_in_the_top_k_and_is_the_exact_residual_restricted_to_it():
    generator = torch.Generator().manual_seed(6)
    p = torch.tensor([0.0, 0.3, 0.05, 0.2, 0.1, 0.15, 0.12, 0.08])
    q = torch.tensor([0.3, 0.1, 0.1, 0.15, 0.05, 0.2, 0.05, 0.05])
    payload = rejected_topk_verdict(p, 4).rejection
    support = set(payload.indices.tolist())  # {1, 3, 5, 6}
    assert {correction_token(payload, q, generator) for _ in range(500)} <= support  # the device's own draws
    distribution = correction_distribution(payload, q)  # [V]: what correction_token samples from
    samples = torch.multinomial(distribution, TRIALS, replacement=True, generator=generator).numpy()
    # exact residual max(0, p - q) = [0, .2, 0, .05, .05, 0, .07, .03]; inside the top-K it is kept up to a
    # constant (the top-K values are not renormalised), outside it is lost
    exact = (p - q).clamp_min(0)
    restricted = torch.zeros(VOCAB)
    restricted[list(support)] = exact[list(support)]
    assert_samples_follow(samples, restricted / restricted.sum())
    assert torch.allclose(distribution, restricted / restricted.sum())
    # and the full downlink of the same row gives the exact residual
    full = make_payload(p, 0, "full")
    assert torch.allclose(correction_distribution(full, q), exact / exact.sum())


def test_topk_correction_falls_back_to_the_normalised_top_k_when_the_residual_has_no_mass_there():
    p = torch.tensor([0.0, 0.3, 0.3, 0.1, 0.1, 0.1, 0.05, 0.05])
    q = torch.tensor([0.05, 0.4, 0.4, 0.05, 0.05, 0.05, 0.0, 0.0])  # q >= p on the top-2: residual lies outside
    payload = rejected_topk_verdict(p, 2).rejection
    assert correction_distribution(payload, q).tolist() == pytest.approx([0, 0.5, 0.5, 0, 0, 0, 0, 0])
    generator = torch.Generator().manual_seed(8)
    assert {correction_token(payload, q, generator) for _ in range(200)} == {1, 2}
