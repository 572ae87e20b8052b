"""Continuous batching for the verifier (Orca / vLLM style).

Every session has a FIFO of work (prefill chunks, verify steps). Each step the
scheduler takes the head item of every session with work, up to a token
budget, and runs them in one packed forward pass of the middle submodel. A
session never has two items in one step, because its KV appends are ordered.

With P pipeline stages (services/verifier_cloud/pipeline.py) up to P batches
(micro-batches) are in flight at once. A session with an item in flight is
not scheduled again until that item's result is back (`finish_batch`): its
next item may depend on the reply (a verify's commit_len), and an error in
one item must not be followed by work that assumed it succeeded.

`schedule()` is pure bookkeeping and `execute()` is the model call, so the
policy can be tested without a model. With P > 1 the scheduler holds no KV
(`middle=None`): every stage worker keeps its own caches.
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
    cache: SessionKV | None  # None when the KV lives in pipeline stage workers
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


def check_item(kind: str, position: int, num_tokens: int, cache_length: int, context_length: int,
               session_id: int, seq_no: int) -> WireError | None:
    """Why an item cannot run against a cache of `cache_length` positions (None: it can).

    Shared by the in-process path and every pipeline stage, so both refuse
    exactly the same requests with exactly the same errors.
    """
    if kind == "prefill" and position != cache_length:
        return WireError(ErrorCode.MALFORMED, f"chunk starts at {position}, session holds {cache_length}",
                         session_id, seq_no)
    if kind == "verify" and not 0 <= position <= cache_length:
        return WireError(ErrorCode.MALFORMED, f"commit_len {position} beyond {cache_length} cached positions",
                         session_id, seq_no)
    base = cache_length if kind == "prefill" else position
    if base + num_tokens > context_length:
        return WireError(ErrorCode.BAD_SHAPE, f"session would exceed the context length {context_length}",
                         session_id, seq_no)
    return None


class Scheduler:
    def __init__(self, middle: LayerRange | None, max_batch_tokens: int, max_sessions: int, context_length: int):
        self.middle = middle  # None: KV and compute live in pipeline stage workers
        self.max_batch_tokens = max_batch_tokens
        self.max_sessions = max_sessions
        self.context_length = context_length
        self.sessions: OrderedDict[int, SessionState] = OrderedDict()
        self.work_ready = asyncio.Event()  # set while some session may have schedulable work
        self.in_flight: set[int] = set()  # sessions with an item in a batch being computed right now
        self._free_after_step: dict[int, list[SessionKV]] = {}
        # Called after a session opens / closes, e.g. to mirror it into pipeline stages.
        self.on_open: Callable[[int], None] | None = None
        self.on_close: Callable[[int], None] | None = None

    # -- sessions ----------------------------------------------------------------
    def open(self, session_id: int, owner: object) -> None:
        if session_id in self.sessions:
            raise WireError(ErrorCode.MALFORMED, f"session {session_id} is already open", session_id)
        if len(self.sessions) >= self.max_sessions:
            raise WireError(ErrorCode.OVERLOADED, f"verifier holds {self.max_sessions} sessions", session_id)
        cache = self.middle.new_cache() if self.middle is not None else None
        self.sessions[session_id] = SessionState(session_id, cache, owner)
        if self.on_open is not None:
            self.on_open(session_id)

    def get(self, session_id: int, owner: object, seq_no: int | None = None) -> SessionState:
        state = self.sessions.get(session_id)
        if state is None or state.owner is not owner:
            raise WireError(ErrorCode.UNKNOWN_SESSION, f"unknown session {session_id}", session_id, seq_no)
        return state

    def close(self, session_id: int) -> None:
        state = self.sessions.pop(session_id, None)
        if state is None:
            return
        state.queue.clear()
        if state.cache is not None:
            if session_id in self.in_flight:  # the worker thread is using this cache: free after the step
                self._free_after_step.setdefault(session_id, []).append(state.cache)
            else:
                state.cache.free()
        if self.on_close is not None:
            self.on_close(session_id)

    def close_owned_by(self, owner: object) -> list[int]:
        closed = [sid for sid, s in self.sessions.items() if s.owner is owner]
        for sid in closed:
            self.close(sid)
        return closed

    def submit(self, item: WorkItem, owner: object) -> None:
        self.get(item.session_id, owner, item.seq_no).queue.append(item)
        self.work_ready.set()

    # -- one step ----------------------------------------------------------------
    def _schedulable(self, state: SessionState) -> bool:
        return bool(state.queue) and state.session_id not in self.in_flight

    def ready_tokens(self) -> int:
        """Tokens in the head items that `schedule()` could take right now."""
        return sum(s.queue[0].num_tokens for s in self.sessions.values() if self._schedulable(s))

    def schedule(self, parts: int = 1) -> SchedulerOutput:
        """The head item of each idle session with work, oldest sessions first, within the token budget.

        Sessions with an item still in flight are skipped (see the module docstring). With
        `parts` > 1 (free pipeline slots) this batch takes only about 1/parts of the ready tokens,
        so the rest fills the next slot right behind it: stage 0 then starts on the second
        micro-batch while stage 1 runs the first, instead of all sessions moving in lock-step
        through one micro-batch while the other stages idle. (On hardware with a large fixed
        cost per forward pass, tiny micro-batches cost more than they overlap; this CPU/GPU
        trade-off is the same one HAT makes with its pipeline length.)
        """
        items: list[WorkItem] = []
        budget = self.max_batch_tokens
        if parts > 1:
            budget = min(budget, -(-self.ready_tokens() // parts))
        for state in self.sessions.values():
            if not self._schedulable(state):
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
        self.in_flight.update(item.session_id for item in items)
        if not any(self._schedulable(s) for s in self.sessions.values()):
            self.work_ready.clear()
        return SchedulerOutput(items)

    def finish_batch(self, batch: SchedulerOutput) -> None:
        """Call on the event loop once `batch` is computed: its sessions may run again;
        caches of sessions closed while in flight are released."""
        for item in batch.items:
            self.in_flight.discard(item.session_id)
            for cache in self._free_after_step.pop(item.session_id, ()):
                cache.free()
            state = self.sessions.get(item.session_id)
            if state is not None and state.queue:
                self.work_ready.set()

    def _check(self, item: WorkItem, cache: SessionKV) -> WireError | None:
        return check_item(item.kind, item.position, item.num_tokens, cache.length, self.context_length,
                          item.session_id, item.seq_no)

    def execute(self, batch: SchedulerOutput) -> tuple[list[tuple[WorkItem, torch.Tensor | None, WireError | None]], StepStats]:
        """Run one packed forward pass in-process (P = 1; call in a worker thread)."""
        if self.middle is None:
            raise RuntimeError("execute() needs the in-process middle submodel (pipeline_stages == 1)")
        results: list[tuple[WorkItem, torch.Tensor | None, WireError | None]] = []
        runnable: list[tuple[WorkItem, SessionKV]] = []
        for item in batch.items:
            state = self.sessions.get(item.session_id)
            if state is None or state.cache is None:  # closed while queued
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
