"""The verifier cloud: continuous batching over P pipeline stages, as the real scheduler does.

Mirrors services/verifier_cloud/scheduler.py (the policy) + engine.py (the loops) so simulated and real batches
form the same way:

* each session has a FIFO of work items (prefill chunks, verify steps); a batch takes the
  head item of every session that has no item in flight, oldest sessions first, within
  `max_batch_tokens` (the first item always fits), and rotates them to the back;
* a batch is formed whenever work is ready and one of the P micro-batch slots is free,
  taking about 1/(free slots) of the ready tokens so the rest fills the next slot;
* a micro-batch of mu tokens holds each stage for (g(mu) + step overhead)/P in turn (the
  overhead is the real step's wall time beyond compute, from telemetry; stage s+1 starts when
  stage s is done with it and stage s+1 is done with the previous micro-batch), so up to
  P micro-batches are in flight and the throughput rises with P.

While another session is decoding (sent a verify or decode step in the last DECODING_WINDOW_S), a prefill item
is taken in pieces whose g(mu) stays within `max_prefill_step_s`, one piece per micro-batch, as the real
scheduler does (shared/planning/prefill_pieces.py); the item's `done()` runs after its last piece.

HAT's eq. 3 assumes a session's chunk j+1 enters the pipeline right behind chunk j, and the
real verifier does that with P > 1 (`prefill_pipelining`); `chunk_pipelining=True` (the
calibration's default) models it: a session whose items in flight are all prefill chunks may
send its next prefill chunk into a later micro-batch (stages are FIFO, so chunks still run
in order). False: one item per session in flight, so each chunk pays the whole g(mu).

Work submitted at the same instant joins the same batch: scheduling is deferred to a
zero-delay event, like the real server's wake-up after `work_ready` is set.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from loadgen.simulate.calibration import GTable
from loadgen.simulate.events import EventLoop
from shared.planning.prefill_pieces import is_decoding, prefill_piece_tokens


@dataclass
class Item:
    session_id: int
    tokens: int
    done: Callable[[], None]
    prefill: bool = False


@dataclass
class Step:
    """One micro-batch: when it entered stage 0, its tokens, its whole-pass compute g(mu)."""

    start: float
    end: float
    tokens: int
    sessions: int
    compute_s: float


class Cloud:
    def __init__(
        self,
        loop: EventLoop,
        g: GTable,
        stages: int = 1,
        max_batch_tokens: int = 4096,
        compute_scale: float = 1.0,
        alpha: float = 0.8,
        chunk_pipelining: bool = False,
        step_overhead_s: float = 0.0,
        max_prefill_step_s: float = 0.0,
    ) -> None:
        if stages < 1 or max_batch_tokens < 1 or not compute_scale > 0 or not step_overhead_s >= 0:
            raise ValueError("need stages >= 1, max_batch_tokens >= 1, compute_scale > 0, step_overhead_s >= 0")
        if not max_prefill_step_s >= 0:
            raise ValueError("need max_prefill_step_s >= 0 (0 = prompts run whole)")
        self.step_overhead_s = step_overhead_s
        self.max_prefill_step_s = max_prefill_step_s
        self.loop, self.g, self.stages = loop, g, stages
        self.max_batch_tokens, self.compute_scale, self.alpha = max_batch_tokens, compute_scale, alpha
        self.chunk_pipelining = chunk_pipelining
        self.queues: OrderedDict[int, deque[Item]] = OrderedDict()
        self.busy: dict[int, list[bool]] = {}  # session -> prefill? of each of its items in flight
        self.decoding_at: dict[int, float] = {}  # session -> when it last submitted a verify or decode step
        self.stage_free = [0.0] * stages  # when each stage finishes its last micro-batch
        self.in_flight = 0
        self.max_in_flight = 0
        self.steps: list[Step] = []
        self.mu_ema: float | None = None  # eq. 1, what the state monitor would report
        self._kick_pending = False

    # -- sessions ------------------------------------------------------------------------
    def submit(self, session_id: int, tokens: int, done: Callable[[], None], prefill: bool = False) -> None:
        """Queue `tokens` of work for a session; `done()` runs when its micro-batch leaves the last stage."""
        if tokens < 1:
            raise ValueError("a work item needs at least one token")
        self.queues.setdefault(session_id, deque()).append(Item(session_id, tokens, done, prefill))
        if prefill:
            self.decoding_at.pop(session_id, None)  # a (new) prompt: not decoding until its next step
        else:
            self.decoding_at[session_id] = self.loop.now
        self._kick()

    def close(self, session_id: int) -> None:
        self.decoding_at.pop(session_id, None)
        queue = self.queues.get(session_id)
        if queue is not None and not queue and session_id not in self.busy:
            del self.queues[session_id]

    def g_of(self, mu: float) -> float:
        """Whole-pass compute of a micro-batch of `mu` tokens in this deployment (scaled in cloud mode)."""
        return self.g(mu) * self.compute_scale

    # -- scheduling ----------------------------------------------------------------------
    def _kick(self) -> None:
        if not self._kick_pending:
            self._kick_pending = True
            self.loop.after(0.0, self._schedule)

    def _schedulable(self, sid: int, queue: deque[Item]) -> bool:
        if not queue:
            return False
        flying = self.busy.get(sid)
        if not flying:
            return True
        return self.chunk_pipelining and queue[0].prefill and all(flying)

    def _ready(self) -> list[int]:
        return [sid for sid, q in self.queues.items() if self._schedulable(sid, q)]

    def _decoding(self) -> set[int]:
        now = self.loop.now
        return {
            sid
            for sid, at in self.decoding_at.items()
            if is_decoding(at, now, bool(self.queues.get(sid)) or sid in self.busy)
        }

    def _head_tokens(self, sid: int, decoding: set[int]) -> int:
        """Tokens the session's head item puts in this micro-batch: a piece of a prefill while others decode."""
        head = self.queues[sid][0]
        if head.prefill and self.max_prefill_step_s > 0 and decoding - {sid}:
            return prefill_piece_tokens(head.tokens, self.g_of, self.max_prefill_step_s)
        return head.tokens

    def _take(self, sid: int, size: int) -> Item:
        queue = self.queues[sid]
        head = queue[0]
        if size == head.tokens:
            return queue.popleft()
        head.tokens -= size  # the rest stays at the head; only the last piece answers
        return Item(sid, size, lambda: None, prefill=True)

    def _schedule(self) -> None:
        self._kick_pending = False
        while self.in_flight < self.stages:
            ready = self._ready()
            if not ready:
                return
            parts = self.stages - self.in_flight
            budget = self.max_batch_tokens
            decoding = self._decoding()
            sizes = {sid: self._head_tokens(sid, decoding) for sid in ready}
            if parts > 1:
                budget = min(budget, -(-sum(sizes.values()) // parts))
            batch: list[Item] = []
            for sid in ready:
                if batch and sizes[sid] > budget:
                    continue
                batch.append(self._take(sid, sizes[sid]))
                budget -= sizes[sid]
            for item in batch:
                self.queues.move_to_end(item.session_id)
                self.busy.setdefault(item.session_id, []).append(item.prefill)
            self._launch(batch)

    def _launch(self, batch: list[Item]) -> None:
        mu = sum(item.tokens for item in batch)
        compute = self.g_of(mu)
        per_stage = (compute + self.step_overhead_s) / self.stages
        t = self.loop.now
        start = max(t, self.stage_free[0])
        for s in range(self.stages):
            begin = max(t, self.stage_free[s])
            t = begin + per_stage
            self.stage_free[s] = t
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self.steps.append(Step(start, t, mu, len(batch), compute))
        self.loop.at(t, self._finish, batch, mu)

    def _finish(self, batch: list[Item], mu: int) -> None:
        self.in_flight -= 1
        self.mu_ema = mu if self.mu_ema is None else self.alpha * self.mu_ema + (1 - self.alpha) * mu
        for item in batch:
            flying = self.busy[item.session_id]
            flying.pop(0)  # stages are FIFO: a session's oldest item finishes first
            if not flying:
                del self.busy[item.session_id]
        for item in batch:
            item.done()
        self._kick()

    def for_session(self, session_id: int) -> Cloud:
        """The verifier that serves this session (one here; see ReplicatedCloud)."""
        return self

    def last_sessions(self) -> int:
        """Sessions in the last step (what the state monitor reports as the cloud's num_sessions)."""
        return self.steps[-1].sessions if self.steps else 1

    # -- stats ---------------------------------------------------------------------------
    def summary(self) -> dict[str, float | int | None]:
        """Per-step load and compute (HAT Fig. 8 reports the per-GPU delay: g(mu)/P)."""
        return summarize([self])


class ReplicatedCloud:
    """`replicas` verifiers side by side (a server's GPUs each serving a replica of the middle layers): a
    session is pinned to the replica with the fewest open sessions when it first submits (its KV cache
    lives there) and stays there; each replica batches its own sessions over its own P stages."""

    def __init__(self, replicas: list[Cloud]) -> None:
        if not replicas:
            raise ValueError("need at least one replica")
        self.replicas = replicas
        self.pinned: dict[int, Cloud] = {}
        self.open = [0] * len(replicas)

    def for_session(self, session_id: int) -> Cloud:
        if session_id not in self.pinned:
            index = min(range(len(self.replicas)), key=lambda i: (self.open[i], i))
            self.open[index] += 1
            self.pinned[session_id] = self.replicas[index]
        return self.pinned[session_id]

    def submit(self, session_id: int, tokens: int, done: Callable[[], None], prefill: bool = False) -> None:
        self.for_session(session_id).submit(session_id, tokens, done, prefill)

    def close(self, session_id: int) -> None:
        cloud = self.pinned.pop(session_id, None)
        if cloud is not None:
            self.open[self.replicas.index(cloud)] -= 1
            cloud.close(session_id)

    def summary(self) -> dict[str, float | int | None]:
        return summarize(self.replicas)


def summarize(clouds: list[Cloud]) -> dict[str, float | int | None]:
    """Per-step load and compute over every replica's steps; busy_fraction is the replicas' mean."""
    steps = [s for c in clouds for s in c.steps]
    n = len(steps)
    if n == 0:
        return {
            "steps": 0,
            "mean_batched_tokens": None,
            "mean_stage_ms": None,
            "std_stage_ms": None,
            "max_in_flight": 0,
            "busy_fraction": None,
            "replicas": len(clouds),
        }
    stage_ms = [s.compute_s / c.stages * 1e3 for c in clouds for s in c.steps]
    mean = sum(stage_ms) / n
    busy = []
    for c in clouds:
        if c.steps:
            span = max(s.end for s in c.steps) - min(s.start for s in c.steps)
            busy.append(sum(s.compute_s for s in c.steps) / c.stages / span if span > 0 else None)
    known = [b for b in busy if b is not None]
    return {
        "steps": n,
        "mean_batched_tokens": sum(s.tokens for s in steps) / n,
        "mean_stage_ms": mean,
        "std_stage_ms": math.sqrt(sum((x - mean) ** 2 for x in stage_ms) / n),
        "max_in_flight": max(c.max_in_flight for c in clouds),
        "busy_fraction": sum(known) / len(known) if known else None,
        "replicas": len(clouds),
    }
