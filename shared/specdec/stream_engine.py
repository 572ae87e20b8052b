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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch

from shared.specdec.draft_stream import ChunkVerdict, DraftChunk
from shared.specdec.session_loop import SessionLoop, driven, inline
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


class StreamLoop(SessionLoop):
    """The streamed step (a `SessionLoop` over a prefilled session): postprocess a verdict that came back, else
    schedule one action (draft a token, send a chunk, advance the caches, or wait for the oldest verdict,
    pre-drafting branches meanwhile) and run it. `send(chunk, shallow)` is the mode's upload."""

    def __init__(
        self,
        session: StreamSession,
        send: SendChunk,
        config: StreamConfig,
        offload: Callable[..., Awaitable] = inline,
        timings: StreamTimings | None = None,
    ):
        self.session, self.send, self.config, self.offload = session, send, config, offload
        self.timings = timings if timings is not None else StreamTimings()
        self.in_flight: deque[tuple[DraftChunk, asyncio.Future]] = deque()
        self.round_drafts = 0  # synchronous mode: drafts in the round being built
        self.low_confidence = False  # the last draft was below eta: this run ends with it

    @property
    def finished(self) -> bool:
        return self.session.is_finished

    async def step(self) -> list[int] | None:
        if self.in_flight and self.in_flight[0][1].done():
            return await self._apply_verdict()
        action, more = self._schedule()
        if action == SHIP:
            await self._ship(more)
        elif action == DRAFT:
            await self._draft()
        elif action == ADVANCE:
            await self.offload(self.session.advance_to_end)  # the window is full of drafts not yet run
        else:
            await self._wait()
        return None

    async def close(self) -> None:
        # Verdicts still coming (the session ended on EOS or the budget, or was cancelled): let their
        # requests finish on their own (each is bounded by the cloud client's timeout); retrieve errors.
        for _, answer in self.in_flight:
            answer.add_done_callback(_retrieve)
            if not answer.done() and isinstance(answer, asyncio.Task):
                answer.cancel()

    def _schedule(self) -> tuple[str, bool]:
        """What this step does: (SHIP, more), DRAFT, ADVANCE or WAIT."""
        room = self.session.draft_room()
        action = self._pipelined_action(room) if self.config.pipelined else self._round_action(room)
        if action is not None:
            return action
        if not self.in_flight:
            raise RuntimeError("stream stalled: nothing to draft, send or wait for")
        return WAIT, False

    def _pipelined_action(self, room: int) -> tuple[str, bool] | None:
        session, config, in_flight = self.session, self.config, self.in_flight
        can_send = session.sendable > 0 and (not config.depth or len(in_flight) < config.depth)
        unsent_drafts = session.sendable - (session.sent_len < session.final_len)
        if can_send and (session.stopped or room == 0 or self.low_confidence):
            # EOS or the budget, or a draft below eta (HAT eq. 5): drafting on is likely wasted, so this chunk
            # ends the run and asks for the bonus; drafting resumes from the verdict
            return SHIP, False
        idle = config.idle_send and unsent_drafts and not in_flight
        if can_send and (unsent_drafts >= config.group or idle):
            return SHIP, True  # a full group, or the verifier is idle (truncation)
        if room > 0 and session.speculative < config.window and not self.low_confidence:
            return DRAFT, False
        if can_send and (config.idle_send or in_flight or room == 0 or session.speculative >= config.window):
            return SHIP, room > 0
        if session.hidden_mode and not in_flight and session.advanced < len(session.seq):
            return ADVANCE, False
        return None

    def _round_action(self, room: int) -> tuple[str, bool] | None:
        """Synchronous: draft the round until eta / the draft cap / EOS, send it, wait for its verdict."""
        if self.in_flight:
            return None
        max_draft = self.session.draft_config.max_draft
        if room > 0 and self.round_drafts < max_draft and not self.low_confidence:
            return DRAFT, False
        if self.session.sendable > 0:
            return SHIP, False
        return None

    async def _apply_verdict(self) -> list[int] | None:
        session = self.session
        chunk, answer = self.in_flight.popleft()
        verdict = answer.result()
        if not isinstance(verdict, ChunkVerdict):  # hidden mode: deep states; the device judges
            verdict = await self.offload(session.verify_locally, chunk, verdict)
        self.timings.stale_chunks += verdict.stale
        emitted = session.apply(chunk, verdict)
        if verdict.rejected or verdict.token is not None:
            self.round_drafts, self.low_confidence = 0, False
        return emitted or None

    async def _draft(self) -> None:
        drafted = await self.offload(self.session.draft_step)
        self.round_drafts += 1
        gated = self.config.eta_gate or not self.config.pipelined
        self.low_confidence = gated and drafted.confidence < self.session.draft_config.eta

    async def _ship(self, more: bool) -> None:
        if self.session.hidden_mode and not more:
            await self.offload(self.session.advance_to_end)  # the last draft's row gives the bonus position
        chunk, shallow = self.session.take_chunk(more)
        self.in_flight.append((chunk, asyncio.ensure_future(await self.send(chunk, shallow))))
        self.timings.chunks += 1

    async def _wait(self) -> None:
        """Wait for the oldest verdict; a pipelined run with nothing else to do pre-drafts branches meanwhile."""
        oldest = self.in_flight[0][1]
        config = self.config
        if config.pipelined and config.branches and not self.session.branches:
            await self.offload(self.session.predraft, config.branches, config.branch_steps, oldest.done)
            if oldest.done():
                return
        await asyncio.wait([oldest])


SHIP, DRAFT, ADVANCE, WAIT = "ship", "draft", "advance", "wait"  # what a stream step does


run_stream = driven(StreamLoop)


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()
