"""The main process's end of the stage pipeline: spawn, feed, collect, watch.

`StagePipeline` owns P worker processes (local_stages.py, each running stages.py), or
is given the addresses of P stages started on their own (remote_stages.py),
its two ends of the P+1 TCP hops chaining them (shared/wire/stage_link.py: hop 0
into stage 0, hop P back from the last stage; the hops between stages belong
to the stages), and the bookkeeping of micro-batches in flight.
At most P micro-batches are in flight (one per stage when the pipeline is
full); more would only queue inside the workers and lengthen every reply.

Every wait on a worker is bounded. Startup waits `start_timeout_s` for the
hops to be wired and the handshake; the collector polls the last hop in short slices and, between
slices, checks that every worker process is alive and that no micro-batch has
been in flight longer than `stage_timeout_s`. A refused frame (a stage's
StageFailed, or one the collector itself refuses) counts as a failure too. Any failure marks the
pipeline failed: workers are terminated, in-flight items are answered with
INTERNAL errors, and `healthy` turns False (the server's /readyz turns 503)
until `restart()` has spawned and loaded every stage again (engine.py's
supervisor does that, after the server closed the sessions whose KV was lost).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import time
from collections import deque
from typing import Any

from services.verifier_cloud.local_stages import LocalStages
from services.verifier_cloud.pipeline_results import DoneCallback, FailCallback, PipelineFailed, PipelineStep
from services.verifier_cloud.remote_stages import RemoteStages
from services.verifier_cloud.scheduler import SchedulerOutput
from services.verifier_cloud.stages import (
    STAGE_CODEC,
    Hello,
    MicroBatch,
    Probe,
    SessionsClosed,
    SessionsForked,
    SessionsOpened,
    SessionsRolledBack,
    StageFailed,
    StageItem,
    StageSpec,
    Stop,
    to_numpy,
)
from shared.wire.stage_codec import StageLinkError
from shared.wire.stage_link import LinkReceiver, LinkSender

log = logging.getLogger("services.verifier_cloud.pipeline")

POLL_S = 0.2  # collector slice: how quickly a dead worker or a shutdown is noticed


class StagePipeline:
    def __init__(
        self,
        specs: list[StageSpec],
        start_timeout_s: float,
        stage_timeout_s: float,
        on_done: DoneCallback | None = None,
        on_fail: FailCallback | None = None,
        history: int = 512,
        remote: RemoteStages | None = None,
    ):
        self.specs = specs
        self.remote = remote  # stages started on their own, wired by address: nothing to spawn or reap
        self.num_stages = len(specs)
        self.start_timeout_s, self.stage_timeout_s = start_timeout_s, stage_timeout_s
        # set by whoever feeds the pipeline (engine.py)
        self.on_done: DoneCallback | None = on_done
        self.on_fail: FailCallback | None = on_fail
        self.slots = asyncio.Semaphore(self.num_stages)
        self.in_flight: dict[int, tuple[SchedulerOutput, float]] = {}  # batch_id -> (batch, sent_at)
        self.max_in_flight_seen = 0
        self.recent: deque[PipelineStep] = deque(maxlen=history)
        self.restarts = 0
        self.last_failure: str | None = None  # kept across restarts, for /readyz and logs
        self.stopping = False  # aclose() was called: never restart again
        self._ids = itertools.count(1)
        self._probes: dict[int, asyncio.Future] = {}
        self._spawn()

    def _spawn(self) -> None:
        """Fresh (not yet started) workers, at construction and on every restart; remote stages are reached
        by address instead. The hops themselves are wired in start()."""
        self.workers = LocalStages(self.specs, spawn=self.remote is None)
        self.sender: LinkSender | None = None  # hop 0, into stage 0
        self.receiver: LinkReceiver | None = None  # hop P, from the last stage
        self.failure: str | None = None
        self.started = False
        self._closed = False  # hops closed and workers reaped
        self._stopped = asyncio.Event()

    @property
    def healthy(self) -> bool:
        return self.started and self.failure is None and not self._closed

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        """Spawn the workers and wait (bounded) until every stage has loaded its layers."""
        self.workers.start()
        deadline = time.monotonic() + self.start_timeout_s
        try:
            if self.remote is not None:
                first, last = await self.remote.wire([spec.layers for spec in self.specs], self.start_timeout_s)
            else:
                first, last = await asyncio.to_thread(self.workers.chain, self.specs[0].host, self.start_timeout_s)
        except StageLinkError as exc:
            raise await self._abort(f"wiring the stage hops failed: {self.workers.dead() or exc}") from None
        self.sender = LinkSender(first, STAGE_CODEC, self.specs[0].in_link, "hop 0 (into stage 0)")
        self.receiver = LinkReceiver(
            last, STAGE_CODEC, f"hop {self.num_stages} (back from stage {self.num_stages - 1})"
        )
        self.sender.put(Hello())
        while True:
            message = await asyncio.to_thread(self._poll)
            if isinstance(message, Hello):
                break
            if isinstance(message, StageFailed):
                raise await self._abort(f"stage {message.stage} failed to start: {message.message}")
            if isinstance(message, StageLinkError):
                raise await self._abort(await self.workers.root_cause(self._hop_closed, f"during startup: {message}"))
            dead = self.workers.dead()
            if dead is not None:
                raise await self._abort(f"{dead} during startup")
            if time.monotonic() > deadline:
                raise await self._abort(f"stages not ready after {self.start_timeout_s:.0f}s")
        self.started = True
        log.info(
            "pipeline ready: %s", ", ".join(f"stage {i} layers [{a}, {b}) pid {pid}" for i, a, b, pid in message.stages)
        )

    async def restart(self) -> None:
        """After a failure: reap what is left, spawn every stage afresh and wait until it is ready.

        Every session's KV died with the old workers; the caller closes those sessions (the new
        workers start empty). Raises PipelineFailed if the new workers cannot start either.
        """
        if self.stopping:
            raise PipelineFailed("pipeline is stopping")
        await self._reap(grace_s=0.0)
        self.restarts += 1
        log.warning("restarting the verifier pipeline (restart %d) after: %s", self.restarts, self.failure)
        self._spawn()
        await self.start()

    async def _abort(self, reason: str) -> PipelineFailed:
        self.failure = self.last_failure = reason
        log.error("verifier pipeline: %s", reason)
        await self._reap(grace_s=0.0)
        return PipelineFailed(reason)

    async def aclose(self, timeout_s: float = 5.0) -> None:
        """Stop the workers in order (Stop flows down the chain), then reap anything left."""
        self.stopping = True
        if self.healthy:
            self._send(Stop())
            try:
                async with asyncio.timeout(timeout_s):
                    await self._stopped.wait()
            except TimeoutError:
                log.warning("pipeline did not stop within %.0fs; terminating workers", timeout_s)
        if not self._closed:
            await self._reap(grace_s=timeout_s)
            log.info("pipeline stopped; worker exit codes %s", [p.exitcode for p in self.workers.processes])

    async def _reap(self, grace_s: float) -> None:
        if self._closed:
            return
        self._closed = True

        def reap() -> None:
            self.workers.stop(grace_s)
            if self.sender is not None:
                self.sender.close(timeout_s=1.0)  # the stages are gone: nothing more reaches them
            if self.receiver is not None:
                self.receiver.close()
            self.workers.close_pipes()

        await asyncio.to_thread(reap)

    # -- feeding --------------------------------------------------------------------------
    async def acquire_slot(self) -> None:
        """Wait for one of the P in-flight slots; bounded because the collector fails stuck batches."""
        await self.slots.acquire()

    def release_slot(self) -> None:
        self.slots.release()

    @property
    def free_slots(self) -> int:
        """Micro-batches that could still be sent now (counting a slot the caller already holds)."""
        return self.num_stages - len(self.in_flight)

    def submit(self, batch: SchedulerOutput) -> None:
        """Send a scheduled batch into stage 0 (caller holds a slot). Never blocks: the hop's feeder thread writes.
        Raises StageLinkError if hop 0 is broken (the engine fails the batch; the collector the pipeline)."""
        if any(item.is_token for item in batch.items):  # Settings refuse full_model with P > 1; never silently
            raise RuntimeError("token-mode items cannot run through pipeline stages")
        batch_id = next(self._ids)
        items: list[StageItem] = []
        for i in batch.items:
            assert i.hidden is not None  # not a token item (refused above): it carries hidden states
            items.append(StageItem(i.session_id, i.seq_no, i.kind, i.position, i.num_tokens, to_numpy(i.hidden)))
        self.in_flight[batch_id] = (batch, time.monotonic())
        self.max_in_flight_seen = max(self.max_in_flight_seen, len(self.in_flight))
        assert self.sender is not None  # hop 0 exists once started: the engine feeds only a started pipeline
        try:
            self.sender.put(MicroBatch(batch_id, items))
        except StageLinkError:
            del self.in_flight[batch_id]  # the engine answers it and frees its slot: fail() must not do it again
            raise

    def open_session(self, session_id: int) -> None:
        if self.healthy:
            self._send(SessionsOpened([session_id]))

    def fork_session(self, session_id: int, parent_id: int, length: int | None) -> None:
        if self.healthy:
            self._send(SessionsForked([(session_id, parent_id, length)]))

    def close_session(self, session_id: int) -> None:
        if self.healthy:
            self._send(SessionsClosed([session_id]))

    def roll_back_sessions(self, sessions: list[tuple[int, int]]) -> None:
        """Cut sessions back to these lengths in every stage, in order with all prior traffic."""
        if self.healthy and sessions:
            self._send(SessionsRolledBack(sessions))

    async def probe(self, timeout_s: float = 10.0) -> list[dict[int, int]]:
        """Per stage, {session_id: cached positions}: answered by the workers, in order with all prior traffic."""
        if not self.healthy:
            raise PipelineFailed(self.failure or "pipeline not started")
        probe_id = next(self._ids)
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._probes[probe_id] = future
        assert self.sender is not None  # healthy: started, so hop 0 exists
        self.sender.put(Probe(probe_id))
        try:
            async with asyncio.timeout(timeout_s):
                return await future
        finally:
            self._probes.pop(probe_id, None)

    def _send(self, message: Any) -> None:
        """A control message into stage 0; a broken hop is left to the collector, which fails the pipeline."""
        assert self.sender is not None  # callers send only while healthy: started, so hop 0 exists
        try:
            self.sender.put(message)
        except StageLinkError as exc:
            log.warning("could not send %s: %s", type(message).__name__, exc)

    # -- collecting -----------------------------------------------------------------------
    def _hop_closed(self) -> bool:
        return self.receiver is not None and self.receiver.closed

    def _poll(self) -> Any:
        """The next message back from the last stage, None if none came in a slice, or the StageLinkError
        of a frame refused or a hop broken."""
        if self._closed or self.receiver is None:
            return None
        try:
            return self.receiver.get(timeout=POLL_S)
        except queue.Empty:
            return None
        except StageLinkError as exc:
            return None if self._closed else exc  # closed under us during shutdown: not a failure
        except OSError:  # the socket was closed under us during shutdown
            return None

    async def run(self) -> None:
        """The collector (an owned task): deliver results and watch the workers until Stop or failure."""
        while self.failure is None and not self._closed:
            message = await asyncio.to_thread(self._poll)
            if isinstance(message, MicroBatch):
                self._deliver(message)
            elif isinstance(message, Probe):
                future = self._probes.get(message.probe_id)
                if future is not None and not future.done():
                    future.set_result(message.lengths)
            elif isinstance(message, Stop):
                self._stopped.set()
                return
            elif isinstance(message, StageFailed):
                await self.fail(self.workers.dead() or f"stage {message.stage} failed: {message.message}")
            elif isinstance(message, StageLinkError):
                await self.fail(await self.workers.root_cause(self._hop_closed, str(message)))
            if self.failure is None and (reason := self._watchdog()) is not None:
                await self.fail(reason)

    def _watchdog(self) -> str | None:
        dead = self.workers.dead()
        if dead is not None:
            return dead
        if self.in_flight:
            batch_id, (_, sent_at) = min(self.in_flight.items(), key=lambda kv: kv[1][1])
            if time.monotonic() - sent_at > self.stage_timeout_s:
                return f"micro-batch {batch_id} in flight for more than {self.stage_timeout_s:.0f}s"
        return None

    def _deliver(self, message: MicroBatch) -> None:
        entry = self.in_flight.pop(message.batch_id, None)
        if entry is None:
            log.warning("result for unknown micro-batch %d dropped", message.batch_id)
            return
        batch, sent_at = entry
        self.release_slot()
        step = PipelineStep(
            message.batch_id,
            sum(i.num_tokens for i in message.items if i.error is None),
            message.spans,
            sent_at,
            time.monotonic(),
        )
        self.recent.append(step)
        assert self.on_done is not None  # set by the engine before the pipeline runs
        self.on_done(batch, message.items, step)

    async def fail(self, reason: str) -> None:
        """Give up on the pipeline: answer everything in flight, stop the workers, stay unready."""
        if self.failure is not None:
            return
        self.failure = self.last_failure = reason
        log.error("verifier pipeline failed: %s; the verifier is no longer ready", reason)
        in_flight, self.in_flight = list(self.in_flight.values()), {}
        for batch, _ in in_flight:
            self.release_slot()
            assert self.on_fail is not None  # set by the engine before anything is in flight
            self.on_fail(batch, reason)
        for future in self._probes.values():
            if not future.done():
                future.set_exception(PipelineFailed(reason))
        await self._reap(grace_s=0.0)
