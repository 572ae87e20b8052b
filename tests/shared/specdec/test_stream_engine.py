"""The races of the streamed decode loop (stream_engine.run_stream through token_stream_session), with the
demo model drafting on the device and an in-process scripted token cloud whose verdicts the test releases
by hand: a verdict that arrives while the next chunk is being drafted, a rejection that arrives after
later chunks went up (they must come back stale, their tokens never delivered), and rejections at the
first and the last draft of a chunk.

The target is a rule the test writes, fixed lazily per context (the same context always gets the same
next token): it agrees with whatever the device drafted there, except at the positions a case rejects.
The verdicts are real: a StreamVerifier over one-hot target rows. The delivered tokens must be the rule's
chain from the prompt, whatever the timing.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

import pytest
import torch

from shared.runtime import build_device_model
from shared.specdec.device_session import DraftConfig
from shared.specdec.draft_stream import ChunkVerdict, DraftChunk, StreamVerifier
from shared.specdec.sampling import SamplingParams
from shared.specdec.stream_engine import StreamConfig, StreamTimings
from shared.specdec.stream_session import StreamSession
from shared.specdec.token_stream import token_stream_session

M = 2
PROMPT = [1, 15, 27, 99, 4, 8, 16]
P = len(PROMPT)
MAX_NEW = 10
IDLE_TURNS = 50  # event-loop turns without progress after which the stream is waiting on a verdict


@pytest.fixture(scope="module")
def device_model(demo_checkpoint):
    return build_device_model(demo_checkpoint, M, None)


@dataclass
class Applied:
    """One verdict as the session applied it, with the session's marks after it."""

    chunk: DraftChunk
    verdict: ChunkVerdict
    emitted: list[int]
    seq: list[int]
    final_len: int
    sent_len: int
    epoch: int
    input_len: int
    adapter_len: int
    before: tuple  # (seq, final_len, sent_len, epoch, input length) just before the verdict was applied
    caches_exact: bool  # the input cache then held exactly the KV of seq[:input_len]


@dataclass
class ScriptedTokenCloud:
    """A TokenCloud whose verdicts wait until the test releases them (oldest first)."""

    session: StreamSession
    reject_at: set[int]  # positions whose draft the target rejects (the first time one is drafted there)
    eos: int | None
    vocab: int
    verifier: StreamVerifier = field(default_factory=StreamVerifier)
    target: dict[tuple[int, ...], int] = field(default_factory=dict)  # context -> the target's next token
    pending: deque = field(default_factory=deque)  # (chunk, future) in the order they went up
    sent: list[DraftChunk] = field(default_factory=list)
    verdicts: list[tuple[DraftChunk, ChunkVerdict]] = field(default_factory=list)
    stream: list[int] = field(default_factory=list)  # the current epoch's tokens by position, as sent
    closed: bool = False
    most_pending: int = 0  # chunks in flight at once, at most

    # -- the target rule -----------------------------------------------------------------------------
    def next_token(self, context: tuple[int, ...]) -> int:
        if context not in self.target:
            position = len(context)
            draft = self._draft_at(context)
            if draft is None:  # nothing drafted there: any token but EOS
                token = (sum(context) * 31 + 7) % self.vocab
            elif position in self.reject_at:
                token = (draft + 1) % self.vocab
            else:
                token = draft
            if token == self.eos:
                token = (token + 1) % self.vocab
            self.target[context] = token
        return self.target[context]

    def _draft_at(self, context: tuple[int, ...]) -> int | None:
        """What the device drafted after `context`: sent up already, or still on the device."""
        for tokens in (self.stream, getattr(self.session, "seq", [])):
            if len(tokens) > len(context) and tuple(tokens[: len(context)]) == context:
                return tokens[len(context)]
        return None

    def chain(self, length: int) -> list[int]:
        context = tuple(PROMPT)
        for _ in range(length):
            context += (self.target[context],)
        return list(context[P:])

    # -- TokenCloud ----------------------------------------------------------------------------------
    async def open_token_session(self, session_id: int, params) -> None:
        assert params.is_greedy

    async def token_prefill(self, session_id: int, token_ids) -> int:
        self.stream = list(token_ids)
        return self.next_token(tuple(token_ids))

    async def send_token_chunk(self, session_id: int, chunk: DraftChunk, downlink, top_k) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        self.pending.append((chunk, future))
        self.most_pending = max(self.most_pending, len(self.pending))
        self.sent.append(chunk)
        if chunk.epoch == self.verifier.epoch:  # the cloud's copy of the stream (a stale tail is dropped)
            self.stream = self.stream[: chunk.start_pos] + list(chunk.tokens)
        return future

    async def close(self, session_id: int) -> None:
        self.closed = True

    def release_oldest(self) -> ChunkVerdict:
        """Verify the oldest pending chunk with the target rule and deliver its verdict."""
        chunk, future = self.pending.popleft()
        if self.verifier.is_stale(chunk):
            p_rows = torch.zeros(len(chunk.tokens), self.vocab)  # never looked at
        else:
            stream = self.stream[: chunk.start_pos] + list(chunk.tokens)
            self.stream = stream + self.stream[chunk.end_pos :]
            targets = [self.next_token(tuple(stream[: chunk.start_pos + i + 1])) for i in range(len(chunk.tokens))]
            p_rows = torch.nn.functional.one_hot(torch.tensor(targets), self.vocab).float()  # [n, V]
        verdict = self.verifier.verify(chunk, p_rows, None, greedy=True)
        if verdict.rejected:  # the cloud rolls back: the stream ends at the correction
            position = chunk.start_pos + chunk.num_final + verdict.num_accepted
            self.stream = self.stream[:position] + [verdict.rejection.token]
        self.verdicts.append((chunk, verdict))
        future.set_result(verdict)
        return verdict


class Harness:
    """Runs one token-mode stream; `on_step(harness, fn)` is called before each offloaded device step."""

    def __init__(self, device_model, reject_at: set[int], config: StreamConfig, on_step=None, max_draft: int = 4):
        self.session = StreamSession(device_model, PROMPT, SamplingParams(), DraftConfig(0.0, max_draft), MAX_NEW)
        self.cloud = ScriptedTokenCloud(self.session, reject_at, device_model.eos_token_id, device_model.vocab_size)
        self.config = config
        self.on_step = on_step
        self.applied: list[Applied] = []
        self.steps = 0
        self.progress = 0
        self.timings = StreamTimings()
        apply = self.session.apply

        def recording_apply(chunk, verdict):
            s = self.session
            before = (list(s.seq), s.final_len, s.sent_len, s.epoch, s.input_cache.length)
            emitted = apply(chunk, verdict)
            self.applied.append(
                Applied(
                    chunk,
                    verdict,
                    emitted,
                    list(s.seq),
                    s.final_len,
                    s.sent_len,
                    s.epoch,
                    s.input_cache.length,
                    s.adapter_cache.length,
                    before,
                    caches_match_a_fresh_pass(s),
                )
            )
            self.progress += 1
            return emitted

        self.session.apply = recording_apply

    async def offload(self, fn, *args):
        if self.on_step is not None:
            self.on_step(self, fn)
        self.steps += 1
        self.progress += 1
        return fn(*args)

    async def release_when_idle(self) -> None:
        """The verifier answers only when the device has nothing left to do but wait (maximal pipelining)."""
        idle = 0
        while True:
            seen = self.progress
            await asyncio.sleep(0)
            idle = idle + 1 if seen == self.progress else 0
            if idle >= IDLE_TURNS and self.cloud.pending:
                self.cloud.release_oldest()
                idle = 0

    async def _run(self) -> list[int]:
        releaser = asyncio.ensure_future(self.release_when_idle())
        tokens: list[int] = []
        try:
            async with asyncio.timeout(30):
                async for emitted in token_stream_session(
                    self.session, self.cloud, 1, self.config, self.offload, timings=self.timings
                ):
                    tokens += emitted
        finally:
            releaser.cancel()
        return tokens

    def run(self) -> list[int]:
        tokens = asyncio.run(self._run())
        assert self.cloud.closed
        assert tokens == self.session.generated == self.cloud.chain(MAX_NEW), "a token off the target's chain"
        assert all(a.caches_exact for a in self.applied)
        assert self.session.seq == PROMPT + tokens
        return tokens

    def verdict_of(self, chunk: DraftChunk) -> Applied:
        return next(a for a in self.applied if a.chunk is chunk)


def assert_rolled_back(applied: Applied) -> None:
    """After a rejection: the seq ends at the correction, nothing past it was sent, the caches hold the
    positions before it (the correction itself is not run yet)."""
    position = applied.chunk.start_pos + applied.chunk.num_final + applied.verdict.num_accepted
    assert len(applied.seq) == applied.final_len == position + 1
    assert applied.seq[position] == applied.verdict.rejection.token
    assert applied.sent_len == position
    assert applied.input_len == applied.adapter_len == position
    assert applied.epoch == applied.verdict.epoch


def caches_match_a_fresh_pass(session: StreamSession) -> bool:
    """The input submodel's cache holds exactly the KV of seq's tokens (no row of a dropped draft)."""
    length = session.input_cache.length
    fresh = session.model.input.new_cache()
    session.model.input(torch.tensor(session.seq[:length]), fresh)
    return all(
        torch.allclose(kept.keys[:, :length], expected.keys[:, :length], atol=1e-4)
        and torch.allclose(kept.values[:, :length], expected.values[:, :length], atol=1e-4)
        for kept, expected in zip(session.input_cache.layers, fresh.layers)
    )


PIPELINED = StreamConfig(pipelined=True, group=2, window=4)


def test_all_accepted_pipelined_stream_sends_ahead_and_delivers_the_drafts(device_model):
    harness = Harness(device_model, set(), PIPELINED)
    tokens = harness.run()
    assert len(tokens) == MAX_NEW and harness.session.epoch == 0
    assert not any(a.verdict.rejected or a.verdict.stale for a in harness.applied)
    # the device drafted past in-flight chunks: chunks went up before the previous one's verdict
    assert harness.cloud.most_pending > 1
    continuations = [c for c in harness.cloud.sent if c.num_final == 0]
    assert continuations, "no chunk continued one through the carried row"


@pytest.mark.parametrize("reject", [False, True])
def test_a_verdict_that_arrives_while_the_next_chunk_is_drafted(device_model, reject):
    """Chunk 1's verdict lands during a draft step; it is applied after that step, in order."""
    first_draft = P + 1  # chunk 1 = (first token, its first draft)
    marks = {}

    def on_step(harness, fn):
        cloud = harness.cloud
        if fn.__name__ == "draft_step" and cloud.pending and cloud.pending[0][0] is cloud.sent[0] and not marks:
            marks["before"] = (list(harness.session.seq), harness.session.final_len)
            cloud.release_oldest()  # the verdict arrives now; the device is busy drafting

    harness = Harness(device_model, {first_draft} if reject else set(), PIPELINED, on_step)
    harness.run()
    chunk1 = harness.cloud.sent[0]
    assert (chunk1.start_pos, chunk1.num_final, chunk1.more) == (P, 1, True) and len(chunk1.tokens) == 2
    seq_before, final_before = marks["before"]
    assert final_before == P + 1 and len(seq_before) == P + 2  # the step about to run drafts past chunk 1
    applied = harness.verdict_of(chunk1)
    assert harness.applied[0] is applied
    if reject:
        assert applied.verdict.num_accepted == 0 and applied.emitted == [applied.verdict.rejection.token]
        assert_rolled_back(applied)
        # the draft made on the rejected token while the verdict arrived was dropped before it went up
        assert applied.before[0][P + 2 :] and len(applied.seq) == P + 2
        assert all(c.epoch == 1 for c in harness.cloud.sent[1:]) and harness.timings.stale_chunks == 0
    else:
        assert applied.verdict.num_accepted == 1 and applied.emitted == [chunk1.tokens[1]]
        assert applied.final_len == P + 2 and applied.epoch == 0
        assert len(applied.seq) == P + 3  # the draft made while the verdict arrived is kept


def test_an_interrupt_after_later_chunks_went_up_turns_them_stale(device_model):
    """Chunk 1's draft is rejected, but its verdict comes back only after chunks 2 and 3 were sent."""
    harness = Harness(device_model, {P + 1}, PIPELINED)
    tokens = harness.run()
    sent = harness.cloud.sent
    chunk1 = sent[0]
    stale_sent = [c for c in sent if c.epoch == 0 and c is not chunk1]
    assert len(stale_sent) >= 2  # went up before the interrupt came down
    first = harness.applied[0]
    assert first.chunk is chunk1 and first.verdict.rejected and first.verdict.num_accepted == 0
    assert_rolled_back(first)
    stale = [a for a in harness.applied if a.chunk in stale_sent]
    assert len(stale) == len(stale_sent) == harness.timings.stale_chunks
    for a in stale:
        assert a.verdict.stale and a.emitted == []
        assert a.before == (a.seq, a.final_len, a.sent_len, a.epoch, a.input_len)  # nothing changed
        assert a.epoch == 1 and a.final_len == first.final_len
    # the stale drafts (on the rejected token) never reached the output: the rule's chain is all there is
    assert tokens[1] == first.verdict.rejection.token != chunk1.tokens[1]
    assert harness.session.epoch == 1


@pytest.mark.parametrize("where", ["first", "last"])
@pytest.mark.parametrize("pipelined", [False, True])
def test_a_rejection_at_the_first_and_the_last_draft_of_a_chunk(device_model, where, pipelined):
    if pipelined:
        # chunks: (t0, d1) more, (d2, d3) continuing it: reject its first draft (verified through the
        # carried row of chunk 1) or its last
        config, reject, index = PIPELINED, P + 2 if where == "first" else P + 3, 1
    else:
        # token-sd: one chunk (t0, d1..d4), no more
        config, reject, index = StreamConfig(pipelined=False), P + 1 if where == "first" else P + 4, 0
    harness = Harness(device_model, {reject}, config)
    harness.run()
    chunk = harness.cloud.sent[index]
    drafts_start = chunk.start_pos + chunk.num_final
    assert chunk.num_drafts >= 2 and drafts_start <= reject < chunk.end_pos
    assert reject == (drafts_start if where == "first" else chunk.end_pos - 1)
    if pipelined:
        assert chunk.num_final == 0 and chunk.more
    else:
        assert chunk.num_final == 1 and not chunk.more and chunk.num_drafts == 4
    applied = harness.verdict_of(chunk)
    assert applied.verdict.rejected and applied.verdict.num_accepted == reject - drafts_start
    assert applied.emitted == list(chunk.drafts[: reject - drafts_start]) + [applied.verdict.rejection.token]
    assert_rolled_back(applied)
    assert [a.verdict.rejected for a in harness.applied].count(True) == harness.session.epoch == 1
    assert all(a.verdict.stale for a in harness.applied if a.chunk.epoch == 0 and a.chunk.start_pos > reject)
