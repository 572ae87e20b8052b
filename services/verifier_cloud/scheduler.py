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

Without fixed pieces, a prefill is still cut while another session is decoding (sent a verify in the last
DECODING_WINDOW_S): into pieces whose pass the verifier's measured g(mu) (`step_cost`) predicts within
`max_prefill_step_s` (shared/planning/prefill_pieces.py). On a flat curve (a GPU) the whole prompt fits and runs
whole; on a CPU the decoding sessions' rounds wait for one piece instead of the whole prompt.

Token-mode items (token_ids instead of hidden; services/verifier_cloud/token_mode.py)
run the cloud's embeddings and layers [0, m) first, then join the hidden-state
items in the same packed pass of the middle layers, then the head samples.

The scheduler is policy only: it holds the session records (session.py) and
their queues, and `schedule()` says what runs next. It runs no model and holds
no KV (runner.py does, in this process or in each stage worker), and it knows
no wire types: refusals are `EngineError`s (work.py) that the server maps to
error frames. Bounds per device: at most `max_sessions_per_owner` sessions per
connection and `max_queue` queued items per session (more is OVERLOADED), and
`idle()` names sessions without traffic for the idle TTL. Budgets in bytes (KV, queued rows) are checked
before an item reaches `submit` (budgets.py, through session_table.py); a session held by a fork's copy
(`Session.is_held`) is not scheduled.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from services.verifier_cloud.session import Session
from services.verifier_cloud.work import EngineError, ErrorKind, WorkKind
from services.verifier_cloud.work_item import WorkItem
from shared.planning.prefill_pieces import is_decoding, prefill_piece_tokens

log = logging.getLogger("services.verifier_cloud.scheduler")


@dataclass
class SchedulerOutput:
    items: list[WorkItem]

    @property
    def num_tokens(self) -> int:
        return sum(item.num_tokens for item in self.items)


class Scheduler:
    def __init__(
        self,
        max_batch_tokens: int,
        max_sessions: int,
        context_length: int,
        server_chunk_tokens: int = 0,
        prefill_pipelining: bool = False,
        max_sessions_per_owner: int | None = None,
        max_queue: int | None = None,
        prefill_sessions_per_step: int = 0,
        max_prefill_step_s: float = 0.0,
        step_cost: Callable[[int], float | None] | None = None,
    ):
        self.max_batch_tokens = max_batch_tokens
        self.max_sessions = max_sessions
        self.max_sessions_per_owner = max_sessions_per_owner  # None: no per-connection bound
        self.max_queue = max_queue  # None: no per-session queue bound
        self.context_length = context_length
        self.server_chunk_tokens = server_chunk_tokens  # > 0: U-Sarathi pieces of long prefills
        self.prefill_pipelining = prefill_pipelining
        self.prefill_sessions_per_step = prefill_sessions_per_step  # 0: no bound
        # > 0 (and no fixed pieces): a prefill's piece while others decode stays within this many seconds of g
        self.max_prefill_step_s = max_prefill_step_s
        self.step_cost = step_cost  # g(mu): predicted seconds of a pass of mu rows (None: not measured yet)
        self.sessions: OrderedDict[int, Session] = OrderedDict()
        self.work_ready = asyncio.Event()  # set while some session may have schedulable work

    # -- sessions ----------------------------------------------------------------
    def open(self, session: Session) -> Session:
        sid = session.session_id
        if sid in self.sessions:
            raise EngineError(ErrorKind.MALFORMED, f"session {sid} is already open", sid)
        if len(self.sessions) >= self.max_sessions:
            raise EngineError(ErrorKind.OVERLOADED, f"verifier holds {self.max_sessions} sessions", sid)
        if self.max_sessions_per_owner is not None and len(self.owned_by(session.owner)) >= self.max_sessions_per_owner:
            raise EngineError(
                ErrorKind.OVERLOADED,
                f"this connection holds {self.max_sessions_per_owner} sessions, the most one device may",
                sid,
            )
        self.sessions[sid] = session
        return session

    def get(self, session_id: int, owner: object, seq_no: int | None = None) -> Session:
        session = self.sessions.get(session_id)
        if session is None or session.owner is not owner:
            raise EngineError(ErrorKind.UNKNOWN_SESSION, f"unknown session {session_id}", session_id, seq_no)
        return session

    def close(self, session_id: int) -> Session | None:
        """Forget the session and its queued work (what is in flight finishes; its replies are dropped)."""
        session = self.sessions.pop(session_id, None)
        if session is not None:
            session.queue.clear()
        return session

    def owned_by(self, owner: object) -> list[int]:
        return [sid for sid, s in self.sessions.items() if s.owner is owner]

    def idle(self, now: float, ttl_s: float) -> list[int]:
        """Sessions with nothing queued or in flight and no traffic for `ttl_s` (time.monotonic())."""
        return [sid for sid, s in self.sessions.items() if s.idle_for(now) >= ttl_s]

    def submit(self, item: WorkItem, owner: object) -> None:
        session = self.get(item.session_id, owner, item.seq_no)
        if self.max_queue is not None and len(session.queue) >= self.max_queue:
            raise EngineError(
                ErrorKind.OVERLOADED,
                f"session {item.session_id} has {self.max_queue} items queued",
                item.session_id,
                item.seq_no,
            )
        session.queue.append(item)
        session.touch()
        if item.kind is not WorkKind.PREFILL:
            session.prefill_since = None  # its prompt is in: a later prefill is a new turn's
            session.decoding_at = session.last_active
        else:
            session.decoding_at = None  # a (new) prompt: not decoding until its next verify
            if session.prefill_since is None:
                session.prefill_since = session.last_active
        self.work_ready.set()

    def wake(self) -> None:
        """Something that kept sessions from running changed (a fork's copy ended): look again."""
        self.work_ready.set()

    # -- one step ----------------------------------------------------------------
    def _schedulable(self, session: Session) -> bool:
        if not session.queue or session.is_held:  # a fork copying its KV (session.py)
            return False
        if not session.in_flight:
            return True
        return (
            self.prefill_pipelining
            and session.queue[0].kind is WorkKind.PREFILL
            and all(kind is WorkKind.PREFILL for kind in session.in_flight)
        )

    def _head_tokens(self, session: Session, decoding: bool) -> int:
        """Tokens the session's head item would put in this step (a piece of it, with server chunking or while
        other sessions are `decoding`)."""
        head = session.queue[0]
        if head.kind is not WorkKind.PREFILL:
            return head.num_tokens
        if self.server_chunk_tokens:
            return min(head.num_tokens, self.server_chunk_tokens)
        if decoding and self.step_cost is not None:  # `decoding` only where pieces are on (_decoding)
            return prefill_piece_tokens(head.num_tokens, self.step_cost, self.max_prefill_step_s)
        return head.num_tokens

    def _decoding(self) -> set[int]:
        """Sessions that sent a verify (or token step) in the last DECODING_WINDOW_S: their rounds would wait
        behind a whole prompt."""
        if not self.max_prefill_step_s > 0 or self.server_chunk_tokens or self.step_cost is None:
            return set()  # no piece depends on it
        now = time.monotonic()
        return {sid for sid, s in self.sessions.items() if is_decoding(s.decoding_at, now, s.is_busy)}

    def _others_decode(self, session: Session, decoding: set[int]) -> bool:
        return bool(decoding) and decoding != {session.session_id}

    def ready_tokens(self, decoding: set[int] | None = None) -> int:
        """Tokens in the head items that `schedule()` could take right now."""
        decoding = self._decoding() if decoding is None else decoding
        return sum(
            self._head_tokens(s, self._others_decode(s, decoding))
            for s in self.sessions.values()
            if self._schedulable(s)
        )

    def _take(self, session: Session, size: int) -> WorkItem:
        """Pop the head item, or detach its next `size`-token piece (the rest stays at the head)."""
        head = session.queue[0]
        # An item that cannot fit the context runs whole, so it is refused before any piece touches the KV.
        if size == head.num_tokens or head.position + head.num_tokens > self.context_length:
            session.dequeued(head)
            return session.queue.popleft()
        return head.split_front(size, lambda piece, out, error: self._piece_done(session, head, error))

    def _piece_done(self, session: Session, rest: WorkItem, error: EngineError | None) -> None:
        """A non-final piece finished: nothing to say, unless it failed; then the item fails (once)."""
        if error is None:
            return
        for index, queued in enumerate(session.queue):
            if queued is rest:
                session.dequeued(rest)
                del session.queue[index]
                break
        else:
            return  # the session was closed meanwhile: nobody to tell
        log.info(
            "session %d: server-side piece of seq %d failed (%s); dropping the rest of the item",
            rest.session_id,
            rest.seq_no,
            error.message,
        )
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
        decoding = self._decoding()
        if parts > 1:
            budget = min(budget, -(-self.ready_tokens(decoding) // parts))
        prefills = self._prefill_turn()
        for session in self.sessions.values():
            if not self._schedulable(session):
                continue
            if prefills is not None and session.queue[0].kind is WorkKind.PREFILL and session not in prefills:
                continue
            size = self._head_tokens(session, self._others_decode(session, decoding))
            if items and size > budget:
                continue
            items.append(self._take(session, size))
            budget -= size
        # Rotate so sessions that just ran go to the back (fairness under a tight budget).
        for item in items:
            session = self.sessions[item.session_id]
            self.sessions.move_to_end(item.session_id)
            session.in_flight.append(item.kind)
            item.session = session
        if not any(self._schedulable(s) for s in self.sessions.values()):
            self.work_ready.clear()
        return SchedulerOutput(items)

    def _prefill_turn(self) -> list[Session] | None:
        """The sessions whose prefill may run this step: the oldest `prefill_sessions_per_step` with a prefill
        ready (None: no bound). Verifies are never held back; a prefill whose next chunk has not arrived yet
        leaves its turn to the next oldest, so the verifier never idles for the order."""
        if not self.prefill_sessions_per_step:
            return None
        ready = [s for s in self.sessions.values() if self._schedulable(s) and s.queue[0].kind is WorkKind.PREFILL]
        ready.sort(key=lambda s: s.prefill_since or s.opened_at)
        return ready[: self.prefill_sessions_per_step]

    def finish_batch(self, batch: SchedulerOutput) -> None:
        """Call on the event loop once `batch` is computed (or failed): its sessions may run again."""
        for item in batch.items:
            if not self.is_current(item):
                continue  # closed while in flight (and perhaps opened again: the new session's slots are its own)
            session = self.sessions[item.session_id]  # is_current: the very session it was scheduled on
            if session.in_flight:
                session.in_flight.pop(0)  # batches finish in the order they were scheduled (FIFO stages)
            session.touch()
            if session.queue:
                self.work_ready.set()

    def is_current(self, item: WorkItem) -> bool:
        """Whether the session `item` was scheduled on is still open: the same session, not only the same id
        (a session closed and opened again under its id gets none of its predecessor's replies)."""
        return item.session is not None and self.sessions.get(item.session_id) is item.session
