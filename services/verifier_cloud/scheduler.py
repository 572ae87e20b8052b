"""Continuous batching for the verifier (Orca / vLLM style).

Every session has a FIFO of work (prefill chunks, verify steps). Each step the
scheduler takes the head item of every session with work, up to a token
budget, and runs them in one packed forward pass of the middle submodel. A
session never has two items in one step, because its KV appends are ordered.

With P pipeline stages (services/verifier_cloud/pipeline.py) up to P batches
(micro-batches) are in flight at once. A session with an item in flight is
not scheduled again until that item's result is back (`finish_batch`): its
next item may depend on the reply (a verify's commit_len), and an error in
one item must not be followed by work that assumed it succeeded. The one
exception is `prefill_pipelining` (on with P > 1): a session whose items in
flight are all prefill chunks may send its next prefill chunk into a later
micro-batch, so chunk j+1 enters stage 0 while chunk j is in stage 1 — what
HAT's eq. 3 assumes when it divides g by P. Stages are FIFO, so every stage
still appends a session's chunks in order; if chunk j fails, chunk j+1 fails
its position check in the same stage, so no stage is left with a gap.

Server-side chunking (HAT's U-Sarathi baseline, `server_chunk_tokens` > 0): a
prefill item longer than the chunk is taken `server_chunk_tokens` at a time, one
piece per step, so other sessions' verify steps run in the steps between its
pieces instead of waiting behind the whole prompt (Sarathi's point). The pieces
share the item's seq_no; only the last one replies (ChunkAck / DeepHidden /
TokenResult); an error in any piece is the item's error and drops the rest.

Token-mode items (token_ids instead of hidden; services/verifier_cloud/token_mode.py)
run the cloud's embeddings and layers [0, m) first, then join the hidden-state
items in the same packed pass of the middle layers, then the head samples.

`schedule()` is pure bookkeeping and `execute()` is the model call, so the
policy can be tested without a model. With P > 1 the scheduler holds no KV
(`middle=None`): every stage worker keeps its own caches.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from services.verifier_cloud.token_mode import TokenModel, TokenSession
from shared.model.kv_cache import KVCacheError, SessionKV
from shared.model.split import LayerRange
from shared.wire import ErrorCode, WireError

log = logging.getLogger("services.verifier_cloud.scheduler")

# (item, output, error) -> None. Output: deep states [S, H]; for token items, the sampled ids [1] (or None).
Reply = Callable[["WorkItem", torch.Tensor | None, WireError | None], None]


@dataclass(eq=False)
class WorkItem:
    session_id: int
    seq_no: int
    kind: str  # "prefill" | "verify" (a token step is a "verify": roll back to position, append, answer)
    hidden: torch.Tensor | None  # [S, H] shallow (or previous-stage) states; None for token items
    position: int  # prefill: start_pos; verify: commit_len
    is_last: bool = False  # prefill: reply with the last deep state (token items: sample the next token)
    reply: Reply | None = None
    enqueued_at: float = field(default_factory=time.perf_counter)
    token_ids: torch.Tensor | None = None  # [S] int64: token mode (the cloud embeds them itself)

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0] if self.token_ids is not None else self.hidden.shape[0]

    @property
    def is_token(self) -> bool:
        return self.token_ids is not None

    def split_front(self, size: int, reply: Reply) -> "WorkItem":
        """Detach the first `size` positions as a piece of their own; this item keeps the rest."""
        piece = WorkItem(self.session_id, self.seq_no, self.kind,
                         None if self.hidden is None else self.hidden[:size], self.position, False, reply,
                         self.enqueued_at, None if self.token_ids is None else self.token_ids[:size])
        if self.hidden is not None:
            self.hidden = self.hidden[size:]
        if self.token_ids is not None:
            self.token_ids = self.token_ids[size:]
        self.position += size
        return piece


@dataclass
class SessionState:
    session_id: int
    cache: SessionKV | None  # None when the KV lives in pipeline stage workers
    owner: object  # the connection that opened it
    queue: deque[WorkItem] = field(default_factory=deque)
    privacy: bool = True  # opened with privacy on: token messages are refused
    token: TokenSession | None = None  # set for token-mode sessions (OpenTokenSession)


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
    num_token: int = 0  # of those, token-mode items
    items: tuple[tuple[int, str, int], ...] = ()  # (session_id, kind, tokens) of every item that ran


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
    def __init__(self, middle: LayerRange | None, max_batch_tokens: int, max_sessions: int, context_length: int,
                 server_chunk_tokens: int = 0, token_model: TokenModel | None = None,
                 prefill_pipelining: bool = False):
        self.middle = middle  # None: KV and compute live in pipeline stage workers
        self.max_batch_tokens = max_batch_tokens
        self.max_sessions = max_sessions
        self.context_length = context_length
        self.server_chunk_tokens = server_chunk_tokens  # > 0: U-Sarathi pieces of long prefills
        if token_model is not None and middle is None:
            raise ValueError("token mode needs the in-process middle submodel (pipeline_stages == 1)")
        self.token_model = token_model
        self.sessions: OrderedDict[int, SessionState] = OrderedDict()
        self.work_ready = asyncio.Event()  # set while some session may have schedulable work
        self.prefill_pipelining = prefill_pipelining
        # session -> kinds of its items in batches being computed right now, oldest first
        self.in_flight: dict[int, list[str]] = {}
        self._free_after_step: dict[int, list[SessionKV]] = {}
        # Called after a session opens / closes, e.g. to mirror it into pipeline stages.
        self.on_open: Callable[[int], None] | None = None
        self.on_close: Callable[[int], None] | None = None

    # -- sessions ----------------------------------------------------------------
    def open(self, session_id: int, owner: object, privacy: bool = True, token: TokenSession | None = None) -> None:
        if session_id in self.sessions:
            raise WireError(ErrorCode.MALFORMED, f"session {session_id} is already open", session_id)
        if len(self.sessions) >= self.max_sessions:
            raise WireError(ErrorCode.OVERLOADED, f"verifier holds {self.max_sessions} sessions", session_id)
        cache = self.middle.new_cache() if self.middle is not None else None
        self.sessions[session_id] = SessionState(session_id, cache, owner, privacy=privacy and token is None,
                                                 token=token)
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
        caches = [c for c in (state.cache, state.token.lower if state.token else None) if c is not None]
        if session_id in self.in_flight:  # the worker thread is using these caches: free after the step
            self._free_after_step.setdefault(session_id, []).extend(caches)
        else:
            for cache in caches:
                cache.free()
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
        if not state.queue:
            return False
        flying = self.in_flight.get(state.session_id)
        if not flying:
            return True
        return (self.prefill_pipelining and state.queue[0].kind == "prefill"
                and all(kind == "prefill" for kind in flying))

    def _head_tokens(self, state: SessionState) -> int:
        """Tokens the session's head item would put in this step (a piece of it, with server chunking)."""
        head = state.queue[0]
        if self.server_chunk_tokens and head.kind == "prefill":
            return min(head.num_tokens, self.server_chunk_tokens)
        return head.num_tokens

    def ready_tokens(self) -> int:
        """Tokens in the head items that `schedule()` could take right now."""
        return sum(self._head_tokens(s) for s in self.sessions.values() if self._schedulable(s))

    def _take(self, state: SessionState) -> WorkItem:
        """Pop the head item, or detach its next server-side piece (the rest stays at the head)."""
        head = state.queue[0]
        size = self._head_tokens(state)
        # An item that cannot fit the context runs whole, so it is refused before any piece touches the KV.
        if size == head.num_tokens or head.position + head.num_tokens > self.context_length:
            return state.queue.popleft()
        return head.split_front(size, lambda piece, out, error: self._piece_done(state, head, error))

    def _piece_done(self, state: SessionState, rest: WorkItem, error: WireError | None) -> None:
        """A non-final piece finished: nothing to say, unless it failed; then the item fails (once)."""
        if error is None:
            return
        for index, queued in enumerate(state.queue):
            if queued is rest:
                del state.queue[index]
                break
        else:
            return  # the session was closed meanwhile: nobody to tell
        log.info("session %d: server-side piece of seq %d failed (%s); dropping the rest of the item",
                 rest.session_id, rest.seq_no, error.message)
        if rest.reply is not None:
            rest.reply(rest, None, error)

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
            size = self._head_tokens(state)
            if items and size > budget:
                continue
            items.append(self._take(state))
            budget -= size
        # Rotate so sessions that just ran go to the back (fairness under a tight budget).
        for item in items:
            if item.session_id in self.sessions:
                self.sessions.move_to_end(item.session_id)
            self.in_flight.setdefault(item.session_id, []).append(item.kind)
        if not any(self._schedulable(s) for s in self.sessions.values()):
            self.work_ready.clear()
        return SchedulerOutput(items)

    def finish_batch(self, batch: SchedulerOutput) -> None:
        """Call on the event loop once `batch` is computed: its sessions may run again;
        caches of sessions closed while in flight are released."""
        for item in batch.items:
            flying = self.in_flight.get(item.session_id)
            if flying:
                flying.pop(0)  # batches finish in the order they were scheduled (FIFO stages)
            if not flying:
                self.in_flight.pop(item.session_id, None)
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
        runnable: list[tuple[WorkItem, SessionState]] = []
        for item in batch.items:
            state = self.sessions.get(item.session_id)
            if state is None or state.cache is None or state.cache.is_freed:  # closed while queued
                continue
            error = self._check(item, state.cache)
            if error is not None:
                results.append((item, None, error))
                continue
            if item.kind == "verify":
                state.cache.truncate(item.position)
                if state.token is not None:
                    state.token.lower.truncate(item.position)
            runnable.append((item, state))
        started = time.perf_counter()
        if runnable:
            try:
                outputs = self._forward(runnable)
            except (RuntimeError, ValueError, KVCacheError) as exc:
                log.exception("a batch of %d item(s) failed", len(runnable))
                error_of = lambda item: WireError(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}",  # noqa: E731
                                                  item.session_id, item.seq_no)
                results += [(item, None, error_of(item)) for item, _ in runnable]
            else:
                results += [(item, out, None) for (item, _), out in zip(runnable, outputs)]
        compute_s = time.perf_counter() - started
        stats = StepStats(
            batched_tokens=sum(item.num_tokens for item, _ in runnable),
            compute_s=compute_s,
            num_sessions=len(runnable),
            num_prefill=sum(item.kind == "prefill" for item, _ in runnable),
            num_verify=sum(item.kind == "verify" for item, _ in runnable),
            num_token=sum(item.is_token for item, _ in runnable),
            items=tuple((item.session_id, item.kind, item.num_tokens) for item, _ in runnable),
        )
        return results, stats

    def _forward(self, runnable: list[tuple[WorkItem, SessionState]]) -> list[torch.Tensor | None]:
        """Token items through embeddings + layers [0, m), then everything through one middle pass,
        then token items through the head: deep states for hidden items, sampled ids [1] for token items."""
        dtype = self.middle.dtype
        inputs: list[torch.Tensor | None] = [None if item.is_token else item.hidden.to(dtype) for item, _ in runnable]
        token_rows = [i for i, (item, _) in enumerate(runnable) if item.is_token]
        if token_rows:
            if self.token_model is None:  # the server never queues token items without a token model
                raise RuntimeError("token item without a token model")
            shallow = self.token_model.shallow([(runnable[i][1].token.lower, runnable[i][0].token_ids)
                                                for i in token_rows])
            for i, states in zip(token_rows, shallow):
                inputs[i] = states
        outputs: list[torch.Tensor | None] = list(
            self.middle.forward_batch([(state.cache, x) for (_, state), x in zip(runnable, inputs)]))
        for i in token_rows:
            item, state = runnable[i]
            outputs[i] = (torch.tensor([self.token_model.next_token(state.token, outputs[i][-1:])])
                          if item.is_last else None)
        return outputs
