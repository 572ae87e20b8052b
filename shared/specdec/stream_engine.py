"""The decode loop of a streamed draft: synchronous (token-sd) or asynchronous (picospec, hat-async).

    schedule: apply the verdicts that came back (in order) -> draft one token, or send a chunk, or wait

Synchronous: draft until eta / the draft cap / EOS, send the draft (`more` False), wait for
its verdict: vanilla collaborative speculative decoding (PicoSpec Fig. 1c).

Asynchronous (PicoSpec §3.2): after sending a chunk the device drafts on at once, assuming the
chunk is accepted, while at most `window` drafts are unverified and each draft is confident
(q >= eta, HAT eq. 5; a draft below it ends the run like a synchronous draft, so the device drafts
ahead only where drafting ahead is likely to pay). Fast verification: drafts go
up in groups of `group` as they are drafted, so the verifier starts on a known prefix before
the rest exists. Latency-aware truncation: when no chunk is in flight (the verifier would sit
idle), whatever is drafted goes up at once, short of a group. A rejection's verdict carries a
new epoch: the chunks drafted on the rejected token come back `stale` and are dropped, and
the session has already rolled back (stream_session.py).

`send(chunk, shallow)` uploads a chunk and returns an awaitable of its verdict; token mode
gets the verdict from the cloud, hat-async computes it on the device from the deep states
(`StreamSession.verify_locally`, through `offload`).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from shared.specdec.decode_loop import Cloud, ShieldedOffload, prefill_on_cloud, release_session
from shared.specdec.draft_stream import ChunkVerdict, DraftChunk
from shared.specdec.separate_rejection import DEFAULT_TOP_K, Downlink
from shared.specdec.stream_session import StreamSession

# Uploads a chunk (and its shallow states in hidden mode); returns an awaitable of the verdict, or of the
# deep states [n, H] the device judges itself.
SendChunk = Callable[[DraftChunk, torch.Tensor | None], Awaitable[Awaitable[ChunkVerdict | torch.Tensor]]]


@dataclass(frozen=True)
class StreamConfig:
    pipelined: bool  # draft past an in-flight verification (picospec, hat-async)
    group: int = 2  # drafts per chunk when pipelined (fast verification)
    window: int = 8  # most unverified drafts when pipelined
    # Most chunks in flight (0: no limit but the window). hat-async keeps 1: the cloud cannot tell a stale
    # hidden-state chunk from a live one, so every chunk sent behind a rejected one costs a cloud pass, while
    # token mode's stale chunks are answered unseen. With 1, the device drafts ahead while a verification is
    # in flight and sends what it drafted the moment the verdict lets it (nothing, after a rejection).
    depth: int = 0
    # A pipelined run stops drafting ahead at a draft below eta. Off: only the window bounds it (PicoSpec as
    # published, whose truncation is about latency only): drafting past a likely rejection costs nothing when
    # the device would idle anyway and stale token chunks cost the cloud nothing.
    eta_gate: bool = True
    # Parallel drafting (HAT §3.5) while a run's last chunk is verified and the device has nothing else to
    # do: `branches` top candidates for its last draft, `branch_steps` drafts each (0: off).
    branches: int = 0
    branch_steps: int = 2
    # Latency-aware truncation: with no chunk in flight, send what is drafted at once, short of a group. Pays
    # where a verification is cheap next to drafting (PicoSpec's large target on a GPU); where a cloud pass
    # costs several draft steps, every extra chunk is an extra pass (hat-async turns it off).
    idle_send: bool = True

    def __post_init__(self):
        if self.group < 1 or self.window < 1 or self.depth < 0:
            raise ValueError(f"group ({self.group}) and window ({self.window}) must be >= 1, depth ({self.depth}) >= 0")


@dataclass
class StreamTimings:
    """Counts of one stream, for the bench and the tests."""

    chunks: int = 0
    stale_chunks: int = 0


def stream_config(
    mode: str, group: int, window: int, max_draft: int, eta_gate: bool = True, branches: int = 2, branch_steps: int = 2
) -> StreamConfig:
    """The configuration each streamed mode runs with. token-sd: one chunk per round. picospec: PicoSpec's
    pipeline (small groups, truncation when the verifier idles, any number of chunks in flight).
    hat-async: HAT's rounds (a run of up to `max_draft` drafts ends at eta, with parallel-draft branches
    while it is verified) plus drafting ahead past a full-length run while it is verified; one chunk in
    flight and no truncation, because a hidden-state chunk costs a cloud pass even when stale."""
    if mode == "token-sd":
        return StreamConfig(pipelined=False)
    if mode == "picospec":
        return StreamConfig(pipelined=True, group=group, window=window, eta_gate=eta_gate)
    if mode == "hat-async":
        return StreamConfig(
            pipelined=True,
            group=max_draft,
            window=max(window, 2 * max_draft),
            depth=1,
            eta_gate=eta_gate,
            branches=branches,
            branch_steps=branch_steps,
            idle_send=False,
        )
    raise ValueError(f"{mode!r} is not a streamed mode")


async def _inline(fn, *args):
    return fn(*args)


async def run_stream(
    session: StreamSession,
    send: SendChunk,
    config: StreamConfig,
    offload: Callable[..., Awaitable] = _inline,
    timings: StreamTimings | None = None,
) -> AsyncGenerator[list[int], None]:
    """Yield the tokens each verdict makes final, until the session finishes."""
    timings = timings if timings is not None else StreamTimings()
    max_draft = session.draft_config.max_draft
    eta = session.draft_config.eta
    in_flight: deque[tuple[DraftChunk, asyncio.Future]] = deque()
    round_drafts = 0  # synchronous mode: drafts in the round being built
    low_confidence = False

    async def ship(more: bool) -> None:
        if session.hidden_mode and not more:
            await offload(session.advance_to_end)  # the last draft's row gives the bonus position
        chunk, shallow = session.take_chunk(more)
        in_flight.append((chunk, asyncio.ensure_future(await send(chunk, shallow))))
        timings.chunks += 1

    try:
        while not session.is_finished:
            # 1. verdicts, in the order the chunks went up
            if in_flight and in_flight[0][1].done():
                chunk, answer = in_flight.popleft()
                verdict = answer.result()
                if not isinstance(verdict, ChunkVerdict):  # hidden mode: deep states; the device judges
                    verdict = await offload(session.verify_locally, chunk, verdict)
                timings.stale_chunks += verdict.stale
                emitted = session.apply(chunk, verdict)
                if verdict.rejected or verdict.token is not None:
                    round_drafts, low_confidence = 0, False
                if emitted:
                    yield emitted
                continue
            # 2. draft, send or wait
            room = session.draft_room()
            if config.pipelined:
                can_send = session.sendable > 0 and (not config.depth or len(in_flight) < config.depth)
                unsent_drafts = session.sendable - (session.sent_len < session.final_len)
                if can_send and (session.stopped or room == 0 or low_confidence):
                    # EOS or the budget, or a draft below eta (HAT eq. 5): drafting on is likely wasted, so this
                    # chunk ends the run and asks for the bonus; drafting resumes from the verdict
                    await ship(more=False)
                    continue
                idle = config.idle_send and unsent_drafts and not in_flight
                if can_send and (unsent_drafts >= config.group or idle):
                    await ship(more=True)  # a full group, or the verifier is idle (truncation)
                    continue
                if room > 0 and session.speculative < config.window and not low_confidence:
                    drafted = await offload(session.draft_step)
                    low_confidence = config.eta_gate and drafted.confidence < eta
                    continue
                if can_send and (config.idle_send or in_flight or room == 0 or session.speculative >= config.window):
                    await ship(more=room > 0)
                    continue
                if session.hidden_mode and not in_flight and session.advanced < len(session.seq):
                    await offload(session.advance_to_end)  # the window is full of drafts not yet run
                    continue
            else:
                if not in_flight and room > 0 and round_drafts < max_draft and not low_confidence:
                    drafted = await offload(session.draft_step)
                    round_drafts += 1
                    low_confidence = drafted.confidence < eta
                    continue
                if not in_flight and session.sendable > 0:
                    await ship(more=False)
                    continue
            if not in_flight:
                raise RuntimeError("stream stalled: nothing to draft, send or wait for")
            if config.pipelined and config.branches and not session.branches:
                await offload(session.predraft, config.branches, config.branch_steps, in_flight[0][1].done)
                if in_flight[0][1].done():
                    continue
            await asyncio.wait([in_flight[0][1]])
    finally:
        # Verdicts still coming (the session ended on EOS or the budget, or was cancelled): let their
        # requests finish on their own (each is bounded by the cloud client's timeout); retrieve errors.
        for _, answer in in_flight:
            answer.add_done_callback(_retrieve)
            if not answer.done() and isinstance(answer, asyncio.Task):
                answer.cancel()


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


class TokenCloud(Protocol):
    """What token mode needs from the verifier (token ids on the wire: no privacy)."""

    async def open_token_session(self, session_id: int, params) -> None: ...

    async def token_prefill(self, session_id: int, token_ids: Sequence[int]) -> int: ...

    async def send_token_chunk(
        self, session_id: int, chunk: DraftChunk, downlink: Downlink, top_k: int
    ) -> Awaitable[ChunkVerdict]: ...

    async def close(self, session_id: int) -> None: ...


async def token_stream_session(
    session: StreamSession,
    cloud: TokenCloud,
    session_id: int,
    config: StreamConfig,
    offload: Callable[..., Awaitable] = _inline,
    downlink: Downlink = "full",
    top_k: int = DEFAULT_TOP_K,
    timings: StreamTimings | None = None,
) -> AsyncGenerator[list[int], None]:
    """Token mode (token-sd, picospec): the device drafts alone; the cloud, holding the whole target,
    prefills the prompt's ids, samples the first token and verifies every chunk."""
    offload_step = ShieldedOffload(offload)
    try:
        await cloud.open_token_session(session_id, session.params)
        first = asyncio.ensure_future(cloud.token_prefill(session_id, session.prompt_ids))
        try:
            await offload_step(session.prefill_locally)  # the draft model's prefill, beside the cloud's
        finally:
            if not first.done():
                await asyncio.wait([first])
        yield session.start_token_mode(first.result())

        async def send(chunk: DraftChunk, shallow) -> Awaitable[ChunkVerdict]:
            return await cloud.send_token_chunk(session_id, chunk, downlink, top_k)

        async for tokens in run_stream(session, send, config, offload_step, timings):
            yield tokens
    finally:
        await release_session(cloud, session_id, session, offload_step.last)


async def hat_async_session(
    session: StreamSession,
    cloud: Cloud,
    session_id: int,
    chunk_sizes: Sequence[int],
    config: StreamConfig,
    offload: Callable[..., Awaitable] = _inline,
    overlap_prefill: bool = True,
    timings: StreamTimings | None = None,
) -> AsyncGenerator[list[int], None]:
    """hat-async: HAT's privacy mode (hidden states only, the device samples and judges) with the
    asynchronous pipeline: the device drafts on past an in-flight verification."""
    offload_step = ShieldedOffload(offload)
    try:
        await cloud.open(session_id)
        deep_last = await prefill_on_cloud(session, cloud, session_id, chunk_sizes, offload_step, overlap_prefill)
        first = await offload_step(session.on_prefill_result, deep_last)
        session.start_hidden_mode()
        yield first

        async def send(chunk: DraftChunk, shallow: torch.Tensor | None) -> Awaitable[torch.Tensor]:
            assert shallow is not None  # hidden mode: take_chunk gives every chunk its shallow rows
            # the cloud keeps chunk.start_pos positions (a rejected tail is cut), then appends the chunk
            return await cloud.send_verify(session_id, chunk.start_pos, shallow)

        async for tokens in run_stream(session, send, config, offload_step, timings):
            yield tokens
    finally:
        await release_session(cloud, session_id, session, offload_step.last)
