"""The verifier's engine loops: take what the scheduler chose, run it, hand results back.

P = 1 (`InProcessEngine`): one packed pass at a time through the in-process
`ModelRunner`, in a worker thread. P > 1 (`PipelineEngine`): up to P
micro-batches in flight through the stage workers (pipeline.py), each of which
runs its own `ModelRunner`. Either way a result reaches its item's `reply`
only while the session it was scheduled on is still open (the same session:
an id closed and opened again is another one), and nothing that goes wrong in
one step stops the loop: the step's items get INTERNAL errors, the loop logs
and goes on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import torch

from services.verifier_cloud.pipeline import StagePipeline
from services.verifier_cloud.pipeline_results import PipelineFailed, PipelineStep
from services.verifier_cloud.runner import ItemResult, ModelRunner, RunItem
from services.verifier_cloud.scheduler import Scheduler, SchedulerOutput
from services.verifier_cloud.stages import StageItem
from services.verifier_cloud.work import EngineError, ErrorKind, WorkKind
from services.verifier_cloud.work_item import WorkItem
from shared.net.backoff import Backoff

log = logging.getLogger("services.verifier_cloud.engine")

RETRY_PAUSE_S = 0.05  # after an unexpected failure of a step: keeps a persistent fault from spinning
RESTART_BACKOFF = Backoff(initial_s=1.0, max_s=30.0)  # between failed pipeline restarts


@dataclass
class StepStats:
    batched_tokens: int
    compute_s: float
    num_sessions: int
    num_prefill: int
    num_verify: int
    num_token: int = 0  # of those, token-mode items
    items: tuple[tuple[int, str, int], ...] = ()  # (session_id, kind, tokens) of every item that ran

    @classmethod
    def of(cls, ran: Sequence[WorkItem], batched_tokens: int, compute_s: float) -> "StepStats":
        return cls(
            batched_tokens,
            compute_s,
            len(ran),
            sum(i.kind is WorkKind.PREFILL for i in ran),
            sum(i.kind is WorkKind.VERIFY for i in ran),
            sum(i.is_token for i in ran),
            tuple((i.session_id, i.kind.value, i.num_tokens) for i in ran),
        )


# (stats, overhead_s or None) -> None: one verifier_step record per (micro-)batch
RecordStep = Callable[[StepStats, float | None], None]


def internal_error(exc: BaseException, what: str) -> EngineError:
    return EngineError(ErrorKind.INTERNAL, f"{what}: {type(exc).__name__}: {exc}")


def deliver(scheduler: Scheduler, batch: SchedulerOutput, results: Sequence[ItemResult]) -> None:
    """Hand each result to its item's reply (sessions closed meanwhile get none); never raises."""
    for item, result in zip(batch.items, results):
        if item.reply is None or not scheduler.is_current(item):
            continue
        try:
            item.reply(item, result.output, result.error)
        except Exception:  # noqa: BLE001 - one broken reply must not cost the batch's other replies
            log.exception("session %d: reply to seq %d failed", item.session_id, item.seq_no)


async def run_steps(scheduler: Scheduler, step: Callable[[], Awaitable[None]], what: str) -> None:
    """An engine's loop: a step whenever work is ready, until cancelled, whatever a step does."""
    while True:
        await scheduler.work_ready.wait()
        try:
            await step()
        except Exception:  # noqa: BLE001 - the loop is the verifier's heartbeat: log and go on
            log.exception("%s step failed; the engine goes on", what)
            await asyncio.sleep(RETRY_PAUSE_S)


class InProcessEngine:
    """P = 1: one packed forward pass at a time, in a worker thread of this process."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, record_step: RecordStep, history: int = 1024):
        self.scheduler = scheduler
        self.runner = runner
        self.record_step = record_step
        self.recent_steps: deque[StepStats] = deque(maxlen=history)  # what each packed pass ran (introspection)

    def execute(self, batch: SchedulerOutput) -> tuple[list[ItemResult], StepStats]:
        """Run one batch through the runner (worker thread): one result per item, and the step's stats."""
        started = time.perf_counter()
        results = self.runner.run(
            [
                RunItem(
                    i.session_id, i.kind, i.position, i.hidden, i.token_ids, i.is_last, i.draft, i.layout, i.session
                )
                for i in batch.items
            ]
        )
        compute_s = time.perf_counter() - started
        ran = [item for item, result in zip(batch.items, results) if result.error is None]
        return results, StepStats.of(ran, sum(i.num_tokens for i in ran), compute_s)

    async def step(self) -> None:
        started = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch.items:
            return
        try:
            results, stats = await asyncio.to_thread(self.execute, batch)
        except Exception as exc:  # noqa: BLE001 - runner.run never raises; this is anything else on the way
            log.exception("a step of %d item(s) failed outside the runner", len(batch.items))
            results, stats = [ItemResult(None, internal_error(exc, "verifier step failed"))] * len(batch.items), None
        finally:
            self.scheduler.finish_batch(batch)
        deliver(self.scheduler, batch, results)
        if stats is not None:
            self.recent_steps.append(stats)
            self.record_step(stats, max(time.perf_counter() - started - stats.compute_s, 0.0))

    async def run(self) -> None:
        """The engine task: runs until cancelled, whatever a step does."""
        await run_steps(self.scheduler, self.step, "engine")


class PipelineEngine:
    """P > 1: keep up to P micro-batches in flight through the stage workers; results come back
    through `_done` (the pipeline's collector calls it on the event loop)."""

    def __init__(self, scheduler: Scheduler, pipeline: StagePipeline, record_step: RecordStep):
        self.scheduler = scheduler
        self.pipeline = pipeline
        self.record_step = record_step
        self.recent_steps: deque[StepStats] = deque(maxlen=0)  # per-stage spans live in pipeline.recent
        pipeline.on_done, pipeline.on_fail = self._done, self._failed

    async def step(self) -> None:
        pipeline = self.pipeline
        await pipeline.acquire_slot()
        # Scheduled only now, so it holds everything that arrived meanwhile; spread over the free slots.
        batch = self.scheduler.schedule(parts=pipeline.free_slots)
        if not batch.items:
            pipeline.release_slot()
            return
        if pipeline.failure is not None:
            pipeline.release_slot()
            self._failed(batch, pipeline.failure)
            return
        try:
            pipeline.submit(batch)
        except Exception as exc:  # noqa: BLE001 - e.g. a queue closed under us: fail the batch, not the loop
            pipeline.release_slot()
            log.exception("could not send a micro-batch of %d item(s)", len(batch.items))
            self._answer(batch, internal_error(exc, "verifier pipeline"))

    async def run(self) -> None:
        await run_steps(self.scheduler, self.step, "pipeline engine")

    async def supervise(self, on_lost: Callable[[str], None]) -> None:
        """The pipeline's collector, and its restart whenever the workers fail, until the pipeline stops.

        `on_lost(reason)` runs once per failure, before the restart: every session's KV died with
        the workers, so the server tells each device and closes its sessions.
        """
        pipeline = self.pipeline
        while True:
            try:
                await pipeline.run()
            except Exception as exc:  # noqa: BLE001 - a broken collector is a failed pipeline: restart it
                log.exception("pipeline collector failed")
                await pipeline.fail(f"collector: {type(exc).__name__}: {exc}")
            if pipeline.failure is None or pipeline.stopping:
                return
            on_lost(pipeline.failure)
            for delay in RESTART_BACKOFF.delays():
                try:
                    await pipeline.restart()
                    break
                except PipelineFailed as exc:
                    if pipeline.stopping:
                        return
                    log.error("pipeline restart failed (%s); next try in %.0fs", exc, delay)
                    await asyncio.sleep(delay)
            log.info("pipeline restarted; the verifier is ready again")

    def _done(self, batch: SchedulerOutput, items: list[StageItem], step: PipelineStep) -> None:
        """The last stage's items, in batch order: reply to each device, emit one verifier_step.

        Telemetry compute_s is the *sum* of the stages' compute for this micro-batch: the delay
        the batch itself spends in the middle layers, which is what HAT's g(mu) predicts (eq. 6 adds
        it to a verify's round trip; eq. 3 divides it by P for the pipelined chunk rate).
        """
        self.scheduler.finish_batch(batch)
        results = [
            ItemResult(None, EngineError(ErrorKind(item.error[0]), item.error[1]))
            if item.error is not None
            else ItemResult(torch.from_numpy(item.hidden))
            for item in items
        ]
        # An item that failed INTERNAL in stage k was appended by stages 0..k-1 (and restored in k):
        # cut it back everywhere to its position, the length all stages had before it.
        self.pipeline.roll_back_sessions(
            [
                (work.session_id, work.position)
                for work, result in zip(batch.items, results)
                if result.error is not None
                and result.error.kind is ErrorKind.INTERNAL
                and self.scheduler.is_current(work)
            ]
        )
        deliver(self.scheduler, batch, results)
        ran = [work for work, result in zip(batch.items, results) if result.error is None]
        self.record_step(StepStats.of(ran, step.batched_tokens, step.compute_s), None)

    def _failed(self, batch: SchedulerOutput, reason: str) -> None:
        self._answer(batch, EngineError(ErrorKind.INTERNAL, f"verifier pipeline failed: {reason}"))

    def _answer(self, batch: SchedulerOutput, error: EngineError) -> None:
        self.scheduler.finish_batch(batch)
        deliver(self.scheduler, batch, [ItemResult(None, error)] * len(batch.items))
