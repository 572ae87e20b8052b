"""The decode loop, written once against a `Cloud` so it runs in-process (this
module's `LocalCloud`) or over the network (the device agent's client).

    prefill (chunk by chunk) -> first token -> [draft -> verify -> accept]*
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from shared.model.kv_cache import SessionKV
from shared.model.split import LayerRange
from shared.planning.planners import fixed_chunks  # noqa: F401  (callers import it from here too)
from shared.specdec.device_session import DeviceSession, SessionError
from shared.specdec.draft import Draft
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


async def _inline(fn, *args):
    return fn(*args)


async def run_session(
    session: DeviceSession,
    cloud: Cloud,
    session_id: int,
    chunk_sizes: Sequence[int],
    offload: Callable[..., Awaitable] = _inline,
    overlap_prefill: bool = True,
    parallel_candidates: int = 0,
    parallel_steps: int | Callable[[int], int] = 0,
    finish_alone_on: Callable[[BaseException], bool] | None = None,
) -> AsyncGenerator[list[int], None]:
    """Yield the tokens each round makes final, until the session finishes.

    `offload(fn, *args)` runs device compute (e.g. `asyncio.to_thread` in the agent,
    so the event loop keeps moving frames). With `overlap_prefill`, chunk j+1 is
    computed and uploaded while the cloud works on chunk j (HAT §3.3); without it,
    each chunk waits for the cloud's answer to the previous one. With
    `parallel_candidates` > 0 the device pre-drafts `parallel_steps` tokens from each
    top candidate while a verification is in flight (HAT §3.5, parallel drafting); a callable
    `parallel_steps(rows)` is asked every round with the rows that round sends (k + 1: eq. 6's μ_i).
    A verification that fails with an error `finish_alone_on(error)` accepts ends the session on the
    device alone (DeviceSession.finish_alone: degraded output) instead of raising.
    """
    clock = time.perf_counter
    offload_step = ShieldedOffload(offload)
    try:
        # Inside the try: a request cancelled while OpenSession is in flight still closes the cloud's
        # session (the frame may already have opened it) and frees the device's KV.
        await cloud.open(session_id)
        deep_last = await prefill_on_cloud(session, cloud, session_id, chunk_sizes, offload_step, overlap_prefill)
        answered_at = clock()
        yield await offload_step(session.on_prefill_result, deep_last)
        # The round's own time beyond drafting and the cloud's answer: output head, accept /
        # rollback, thread hops, the consumer of this generator (the simulator's round_overhead_s).
        session.round_overhead_s.append(clock() - answered_at)
        while not session.is_finished:
            draft = await offload_step(session.draft)
            branches = []
            try:
                if parallel_candidates > 0 and draft.tokens:
                    # Pre-draft only while the verification is in flight: its answer stops the drafting.
                    answered = threading.Event()
                    answer_time: list[float] = []
                    verifying = asyncio.ensure_future(verify_draft(cloud, session_id, draft))

                    def on_answer(
                        _: object, times: list[float] = answer_time, event: threading.Event = answered
                    ) -> None:  # this round's, bound now
                        times.append(clock())
                        event.set()

                    verifying.add_done_callback(on_answer)
                    steps = parallel_steps(len(draft.tokens) + 1) if callable(parallel_steps) else parallel_steps
                    try:
                        branches = await offload_step(
                            session.predraft, draft, parallel_candidates, steps, answered.is_set
                        )
                    finally:
                        deep = await verifying
                    # The done callback runs via call_soon: when the answer came while the last
                    # pre-draft step was finishing, `await verifying` can return before it has run.
                    answered_at = answer_time[0] if answer_time else clock()
                else:
                    deep = await verify_draft(cloud, session_id, draft)
                    answered_at = clock()
            except Exception as exc:  # noqa: BLE001 - only what finish_alone_on accepts is handled
                if finish_alone_on is None or not finish_alone_on(exc):
                    raise
                for branch in branches:
                    branch.free()
                yield await offload_step(session.finish_alone, draft)
                return
            yield await offload_step(session.on_verify_result, draft, deep, branches)
            session.round_overhead_s.append(clock() - answered_at)
    finally:
        await release_session(cloud, session_id, session, offload_step.last)


async def verify_draft(cloud: Cloud, session_id: int, draft: Draft) -> torch.Tensor:
    """The cloud's deep states for a draft's rows (a tree's layout goes along)."""
    return await verify_on(cloud, session_id, draft.commit_len, draft.shallow, draft.layout)


class ShieldedOffload:
    """`offload(fn, *args)` for device steps, shielded: a cancelled request stops waiting at once, but the
    step (a worker thread that cannot be interrupted) keeps its handle in `last`, so the release frees the
    device KV only after it is done."""

    def __init__(self, offload: Callable[..., Awaitable]):
        self.offload = offload
        self.last: asyncio.Future | None = None  # the offloaded step running now (or the last one)

    async def __call__(self, fn, *args):
        self.last = asyncio.ensure_future(self.offload(fn, *args))
        return await asyncio.shield(self.last)


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


async def release_session(cloud, session_id: int, session: DeviceSession, step: asyncio.Future | None) -> None:
    """Free the device's KV once `step` (its last offloaded step) is done, and close the cloud's session;
    shielded, so a cancelled request still releases both."""
    release = asyncio.ensure_future(_release(cloud, session_id, session, step))
    try:
        await asyncio.shield(release)
    except asyncio.CancelledError:
        # Cancelled again while releasing (a client that went away under a level-triggered cancel scope):
        # the release finishes on its own, owned by _RELEASES until it is done.
        _RELEASES.add(release)
        release.add_done_callback(_RELEASES.discard)
        raise


# Releases that outlived their cancelled request: kept here so they are owned until they finish.
_RELEASES: set[asyncio.Future] = set()


async def _release(cloud: Cloud, session_id: int, session: DeviceSession, step: asyncio.Future | None) -> None:
    """Free the device's KV once its last offloaded step is done with it, and close the cloud's session."""
    try:
        if step is not None and not step.done():
            await asyncio.wait([step])  # a worker-thread step ends on its own; its KV is freed after it
    finally:
        session.free()
    await cloud.close(session_id)  # bounded: the cloud client times out its requests


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
