"""Continuous batching for the verifier (Orca / vLLM style).

Every session has a FIFO of work (prefill chunks, verify steps). Each step the
scheduler takes the head item of every session with work, up to a token
budget, and runs them in one packed forward pass of the middle submodel. A
session never has two items in one step, because its KV appends are ordered.

`schedule()` is pure bookkeeping and `execute()` is the model call, so the
policy can be tested without a model.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from shared.model.kv_cache import SessionKV
from shared.model.split import LayerRange
from shared.wire import ErrorCode, WireError


@dataclass
class WorkItem:
    session_id: int
    seq_no: int
    kind: str  # "prefill" | "verify"
    hidden: torch.Tensor  # [S, H] shallow (or previous-stage) states
    position: int  # prefill: start_pos; verify: commit_len
    is_last: bool = False
    reply: Callable[["WorkItem", torch.Tensor | None, WireError | None], None] | None = None
    enqueued_at: float = field(default_factory=time.perf_counter)

    @property
    def num_tokens(self) -> int:
        return self.hidden.shape[0]


@dataclass
class SessionState:
    session_id: int
    cache: SessionKV
    owner: object  # the connection that opened it
    queue: deque[WorkItem] = field(default_factory=deque)


@dataclass
class SchedulerOutput:
    items: list[WorkItem]

    @property
    def num_tokens(self) -> int:
        return sum(item.num_tokens for item in self.items)


@dataclass
class StepStats:
    batched_tokens: int
    compute_s: float
    num_sessions: int
    num_prefill: int
    num_verify: int


class Scheduler:
    def __init__(self, middle: LayerRange, max_batch_tokens: int, max_sessions: int, context_length: int):
        self.middle = middle
        self.max_batch_tokens = max_batch_tokens
        self.max_sessions = max_sessions
        self.context_length = context_length
        self.sessions: OrderedDict[int, SessionState] = OrderedDict()
        self.work_ready = asyncio.Event()
        self.in_flight: set[int] = set()  # sessions in the batch being computed right now
        self._free_after_step: list[SessionKV] = []

    # -- sessions ----------------------------------------------------------------
    def open(self, session_id: int, owner: object) -> None:
        if session_id in self.sessions:
            raise WireError(ErrorCode.MALFORMED, f"session {session_id} is already open", session_id)
        if len(self.sessions) >= self.max_sessions:
            raise WireError(ErrorCode.OVERLOADED, f"verifier holds {self.max_sessions} sessions", session_id)
        self.sessions[session_id] = SessionState(session_id, self.middle.new_cache(), owner)

    def get(self, session_id: int, owner: object, seq_no: int | None = None) -> SessionState:
        state = self.sessions.get(session_id)
        if state is None or state.owner is not owner:
            raise WireError(ErrorCode.UNKNOWN_SESSION, f"unknown session {session_id}", session_id, seq_no)
        return state

    def close(self, session_id: int) -> None:
        state = self.sessions.pop(session_id, None)
        if state is not None:
            state.queue.clear()
            if session_id in self.in_flight:  # the worker thread is using this cache: free after the step
                self._free_after_step.append(state.cache)
            else:
                state.cache.free()

    def close_owned_by(self, owner: object) -> list[int]:
        closed = [sid for sid, s in self.sessions.items() if s.owner is owner]
        for sid in closed:
            self.close(sid)
        return closed

    def submit(self, item: WorkItem, owner: object) -> None:
        self.get(item.session_id, owner, item.seq_no).queue.append(item)
        self.work_ready.set()

    # -- one step ----------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """The head item of each session with work, oldest sessions first, within the token budget."""
        items: list[WorkItem] = []
        budget = self.max_batch_tokens
        for state in self.sessions.values():
            if not state.queue:
                continue
            head = state.queue[0]
            if items and head.num_tokens > budget:
                continue
            items.append(state.queue.popleft())
            budget -= head.num_tokens
        # Rotate so sessions that just ran go to the back (fairness under a tight budget).
        for item in items:
            if item.session_id in self.sessions:
                self.sessions.move_to_end(item.session_id)
        if not any(s.queue for s in self.sessions.values()):
            self.work_ready.clear()
        self.in_flight = {item.session_id for item in items}
        return SchedulerOutput(items)

    def finish_step(self) -> None:
        """Call on the event loop after execute(): release caches closed mid-step."""
        self.in_flight = set()
        for cache in self._free_after_step:
            cache.free()
        self._free_after_step.clear()

    def _check(self, item: WorkItem, cache: SessionKV) -> WireError | None:
        if item.kind == "prefill" and item.position != cache.length:
            return WireError(ErrorCode.MALFORMED, f"chunk starts at {item.position}, session holds {cache.length}",
                             item.session_id, item.seq_no)
        if item.kind == "verify" and not 0 <= item.position <= cache.length:
            return WireError(ErrorCode.MALFORMED, f"commit_len {item.position} beyond {cache.length} cached positions",
                             item.session_id, item.seq_no)
        base = cache.length if item.kind == "prefill" else item.position
        if base + item.num_tokens > self.context_length:
            return WireError(ErrorCode.BAD_SHAPE, f"session would exceed the context length {self.context_length}",
                             item.session_id, item.seq_no)
        return None

    def execute(self, batch: SchedulerOutput) -> tuple[list[tuple[WorkItem, torch.Tensor | None, WireError | None]], StepStats]:
        """Run one packed forward pass (call in a worker thread)."""
        results: list[tuple[WorkItem, torch.Tensor | None, WireError | None]] = []
        runnable: list[tuple[WorkItem, SessionKV]] = []
        for item in batch.items:
            state = self.sessions.get(item.session_id)
            if state is None:  # closed while queued
                continue
            error = self._check(item, state.cache)
            if error is not None:
                results.append((item, None, error))
                continue
            if item.kind == "verify":
                state.cache.truncate(item.position)
            runnable.append((item, state.cache))
        started = time.perf_counter()
        if runnable:
            dtype = self.middle.dtype
            outputs = self.middle.forward_batch([(cache, item.hidden.to(dtype)) for item, cache in runnable])
            results += [(item, out, None) for (item, _), out in zip(runnable, outputs)]
        compute_s = time.perf_counter() - started
        stats = StepStats(
            batched_tokens=sum(item.num_tokens for item, _ in runnable),
            compute_s=compute_s,
            num_sessions=len(runnable),
            num_prefill=sum(item.kind == "prefill" for item, _ in runnable),
            num_verify=sum(item.kind == "verify" for item, _ in runnable),
        )
        return results, stats
