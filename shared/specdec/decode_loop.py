"""The decode loop, written once against a `Cloud` so it runs in-process (this
module's `LocalCloud`) or over the network (the device agent's client).

    prefill (chunk by chunk) -> first token -> [draft -> verify -> accept]*
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from shared.model.kv_cache import SessionKV
from shared.model.split import LayerRange
from shared.planning.planners import fixed_chunks  # noqa: F401  (callers import it from here too)
from shared.specdec.device_session import DeviceSession, SessionError
from shared.specdec.draft import Branch, Draft
from shared.specdec.session_loop import SessionLoop, ShieldedOffload, driven, inline, release_session
from shared.specdec.verify_layout import VerifyLayout, layout_refusal, roll_back, tree_rows, verify_on
from shared.telemetry import latency_stats
from shared.telemetry.latency_stats import Timeline


class Cloud(Protocol):
    """What the device needs from the verifier (hidden states only, never tokens)."""

    async def open(self, session_id: int) -> None: ...

    async def send_prefill(
        self, session_id: int, start_pos: int, shallow: torch.Tensor, is_last: bool
    ) -> Awaitable[torch.Tensor | None]:
        """Upload one chunk; returns once it is sent, with an awaitable of the cloud's answer
        (the deep state of the last position for the last chunk, else None). Not waiting for
        the answer lets the device compute chunk j+1 while the cloud computes chunk j."""
        ...

    async def verify(
        self, session_id: int, commit_len: int, shallow: torch.Tensor, layout: VerifyLayout | None = None
    ) -> torch.Tensor:
        """Roll back to commit_len (first keeping the last tree's accepted rows, `layout.kept`), run the
        rows (a draft tree when `layout.parents`), answer their deep states. Callers pass `layout` only
        for trees, so a cloud without tree support keeps the three-argument form."""
        ...

    async def send_verify(self, session_id: int, commit_len: int, shallow: torch.Tensor) -> Awaitable[torch.Tensor]:
        """`verify`, returning once the request is sent (so several go up in order without waiting)."""
        ...

    async def close(self, session_id: int) -> None: ...


class UnknownSessionError(KeyError):
    pass


def done_future(value) -> asyncio.Future:
    """An already-resolved future: the answer to a step that needed no waiting, in the Cloud interface's shape."""
    future = asyncio.get_running_loop().create_future()
    future.set_result(value)
    return future


class LocalCloud:
    """The middle submodel in this process, one KV cache per session."""

    def __init__(self, middle: LayerRange):
        self.middle = middle
        self.caches: dict[int, SessionKV] = {}

    def _cache(self, session_id: int) -> SessionKV:
        try:
            return self.caches[session_id]
        except KeyError:
            raise UnknownSessionError(session_id) from None

    async def open(self, session_id):
        self.caches[session_id] = self.middle.new_cache()

    async def send_prefill(self, session_id, start_pos, shallow, is_last):
        cache = self._cache(session_id)
        if start_pos != cache.length:
            raise ValueError(f"chunk starts at {start_pos} but the session holds {cache.length} positions")
        deep = self.middle.forward_batch([(cache, shallow)])[0]  # [S, H]
        return done_future(deep[-1:] if is_last else None)

    async def verify(self, session_id, commit_len, shallow, layout=None):
        cache = self._cache(session_id)
        refusal = layout_refusal(layout, commit_len, shallow.shape[0], cache.length)
        if refusal is not None:
            raise ValueError(refusal)
        roll_back(cache, commit_len, layout)
        tree = tree_rows(commit_len, layout)
        return self.middle.forward_batch([(cache, shallow)], None if tree is None else [tree])[0]  # [k+1, H]

    async def send_verify(self, session_id, commit_len, shallow):
        return done_future(await self.verify(session_id, commit_len, shallow))

    async def close(self, session_id):
        cache = self.caches.pop(session_id, None)
        if cache is not None:
            cache.free()


class HatLoop(SessionLoop):
    """HAT's rounds for one session (a `SessionLoop`): the first step prefills the prompt on the cloud and
    samples the first token; each later step is one round, schedule (draft) -> run (verify, pre-drafting
    from the top candidates while the verification is in flight) -> postprocess (accept).

    `offload(fn, *args)` runs device compute (e.g. `asyncio.to_thread` in the agent, so the event loop keeps
    moving frames). With `overlap_prefill`, chunk j+1 is computed and uploaded while the cloud works on chunk
    j (HAT §3.3); without it, each chunk waits for the cloud's answer to the previous one. With
    `parallel_candidates` > 0 the device pre-drafts `parallel_steps` tokens from each top candidate while a
    verification is in flight (HAT §3.5, parallel drafting); a callable `parallel_steps(rows)` is asked every
    round with the rows that round sends (k + 1: eq. 6's mu_i). A verification that fails with an error
    `finish_alone_on(error)` accepts ends the session on the device alone (DeviceSession.finish_alone:
    degraded output) instead of raising.
    """

    def __init__(
        self,
        session: DeviceSession,
        cloud: Cloud,
        session_id: int,
        chunk_sizes: Sequence[int],
        offload: Callable[..., Awaitable] = inline,
        overlap_prefill: bool = True,
        parallel_candidates: int = 0,
        parallel_steps: int | Callable[[int], int] = 0,
        finish_alone_on: Callable[[BaseException], bool] | None = None,
    ):
        self.session, self.cloud, self.session_id = session, cloud, session_id
        self.chunk_sizes, self.overlap_prefill = chunk_sizes, overlap_prefill
        self.parallel_candidates, self.parallel_steps = parallel_candidates, parallel_steps
        self.finish_alone_on = finish_alone_on
        self.offload = ShieldedOffload(offload)
        self.prefilled = False
        self.alone = False  # the cloud was lost and the session finished on the device
        self.answered_at: float | None = None  # when the last round's verification came back

    @property
    def finished(self) -> bool:
        return self.alone or (self.prefilled and self.session.is_finished)

    async def open(self) -> None:
        await self.cloud.open(self.session_id)

    async def step(self) -> list[int]:
        if not self.prefilled:
            return await self._prefill()
        draft = await self.offload(self.session.draft)  # schedule
        try:
            deep, branches = await self._verify(draft)  # run
        except Exception as exc:  # noqa: BLE001 - only what finish_alone_on accepts is handled
            if self.finish_alone_on is None or not self.finish_alone_on(exc):
                raise
            self.alone = True
            return await self.offload(self.session.finish_alone, draft)
        return await self.offload(self.session.on_verify_result, draft, deep, branches)  # postprocess

    def consumed(self) -> None:
        # The round's own time beyond drafting and the cloud's answer: output head, accept / rollback, thread
        # hops, the consumer of the tokens (the simulator's round_overhead_s).
        if self.answered_at is not None and not self.alone:
            self.session.round_overhead_s.append(time.perf_counter() - self.answered_at)

    async def close(self) -> None:
        await release_session(self.cloud, self.session_id, self.session, self.offload.last)

    async def _prefill(self) -> list[int]:
        deep_last = await prefill_on_cloud(
            self.session, self.cloud, self.session_id, self.chunk_sizes, self.offload, self.overlap_prefill
        )
        self.answered_at = time.perf_counter()
        self.prefilled = True
        return await self.offload(self.session.on_prefill_result, deep_last)

    async def _verify(self, draft: Draft) -> tuple[torch.Tensor, list[Branch]]:
        """The cloud's deep states for the draft's rows [k+1, H], and the branches pre-drafted meanwhile."""
        if self.parallel_candidates <= 0 or not draft.tokens:
            deep = await verify_draft(self.cloud, self.session_id, draft)
            self.answered_at = time.perf_counter()
            return deep, []
        steps = self.parallel_steps
        if callable(steps):
            steps = steps(len(draft.tokens) + 1)
        # Pre-draft only while the verification is in flight: its answer stops the drafting. Pre-drafting is
        # scheduled first, so a cloud that answers within its own first step (LocalCloud, in process) still
        # leaves it the round, as a remote one would; a remote request still goes up before the device's thread
        # starts (the verification's task sends it on its first step).
        verifying: asyncio.Future[tuple[torch.Tensor, float]]
        predrafting = self.offload.start(
            self.session.predraft, draft, self.parallel_candidates, steps, lambda: verifying.done()
        )
        verifying = asyncio.ensure_future(_timed(verify_draft(self.cloud, self.session_id, draft)))
        branches: list[Branch] = []
        try:
            branches = await asyncio.shield(predrafting)
        finally:
            try:
                deep, self.answered_at = await verifying
            except BaseException:
                for branch in branches:
                    branch.free()
                raise
        return deep, branches


async def _timed(answer: Awaitable[torch.Tensor]) -> tuple[torch.Tensor, float]:
    """An answer and when it came (not when its waiter resumed: pre-drafting may still be finishing a step)."""
    value = await answer
    return value, time.perf_counter()


run_session = driven(HatLoop)


async def verify_draft(cloud: Cloud, session_id: int, draft: Draft) -> torch.Tensor:
    """The cloud's deep states for a draft's rows (a tree's layout goes along)."""
    return await verify_on(cloud, session_id, draft.commit_len, draft.shallow, draft.layout)


async def prefill_on_cloud(
    session: DeviceSession,
    cloud: Cloud,
    session_id: int,
    chunk_sizes: Sequence[int],
    offload_step: Callable[..., Awaitable],
    overlap_prefill: bool = True,
) -> torch.Tensor:
    """Upload the prompt chunk by chunk (hidden states); returns the deep state of its last position [1, H]."""
    answers = []
    for index, size in enumerate(chunk_sizes):
        chunk_start = time.perf_counter()
        start, shallow = await offload_step(session.prefill_chunk, size)
        answer = await cloud.send_prefill(session_id, start, shallow, index == len(chunk_sizes) - 1)
        session.prefill_seconds.append((time.perf_counter() - chunk_start, size))
        if overlap_prefill:
            answers.append(answer)
        else:
            answers.append(done_future(await answer))
    deep_last = None
    for answer in answers:
        deep_last = await answer
    if deep_last is None:  # no chunks, or a cloud that answered the last chunk with nothing
        raise SessionError("the prompt's prefill gave no deep state")
    return deep_last


@dataclass
class GenerationResult:
    token_ids: list[int]
    accept_lengths: list[int]  # tokens made final per verification round (accepted drafts + 1)
    token_times_s: list[float] = field(default_factory=list)  # time of each token since the request started
    wall_s: float = 0.0

    @property
    def num_rounds(self) -> int:
        return len(self.accept_lengths)

    # TTFT, TBT and accept length as shared/telemetry/latency_stats.py defines them; 0.0 where undefined.
    @property
    def timeline(self) -> Timeline:
        return Timeline.from_token_times(self.token_times_s)

    @property
    def mean_accept_length(self) -> float:
        return latency_stats.mean_accept_length(self.accept_lengths) or 0.0

    @property
    def ttft_s(self) -> float:
        return latency_stats.ttft_s(self.timeline) or 0.0

    @property
    def tbt_s(self) -> float:
        """Mean time between tokens after the first."""
        return latency_stats.mean_tbt_s(self.timeline) or 0.0


async def generate(
    session: DeviceSession, cloud: Cloud, session_id: int = 1, chunk_size: int | None = None, **options
) -> GenerationResult:
    started = time.perf_counter()
    times: list[float] = []
    tokens: list[int] = []
    chunks = fixed_chunks(len(session.prompt_ids), chunk_size)
    async for emitted in run_session(session, cloud, session_id, chunks, **options):
        now = time.perf_counter() - started
        tokens.extend(emitted)
        times.extend([now] * len(emitted))
    return GenerationResult(tokens, list(session.accept_lengths), times, time.perf_counter() - started)
