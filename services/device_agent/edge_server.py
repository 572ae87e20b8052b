"""Edge SD's draft server (paper 001): a device agent at the small base station drafting for many users.

Requests (`mode: edge-sd`) wait for the next round. A round takes every request that arrived within
`edge_window_s` of the first (at most `edge_max_tasks`), asks the chunk planner for its plan (eq. 27
uplink shares, Algorithm 1 batches, speculation length l by eq. 7; planned here from the agent's own
samples when the planner cannot be reached), emulates the shared uplink (each user's prompt takes its
share's upload time; inference starts when the slowest is in, eq. 16) and then runs the batches as the
paper's two-stage pipeline:

    step 1:  draft model's prefill of batch m (here)  |  target's prefill of batch m (verifier) -> token 1
    step n:  l drafts for every task of batch m, one packed pass per position (here)
             | the verifier checks the batch's chunks in one packed step (token mode) -> accepted + 1

While batch m is verified, batch m+1 is drafted (`pipeline`); as in the paper's eqs. 20-22, step n+1
starts once every batch of step n is back. Verification is the verifier's token mode, so greedy
output is the target's and sampled output has its distribution (shared/specdec/draft_stream.py).

Step 1 differs from the paper's in one way: the first token is the target's (its prefill samples it), as
in every other mode here, instead of a first verification of l drafts made on the draft model's prefill.

The plans, and the samples they are made from without the planner, are edge_planning.py's.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import httpx

from services.device_agent.cloud_errors import CloudError, CloudUnavailable
from services.device_agent.edge_planning import EdgePlanning, RoundRecord
from shared.edge_sd.bandwidth import embedding_bits_per_token
from shared.edge_sd.draft_batch import draft_batch, prefill_batch
from shared.edge_sd.plan import EdgeTask, PlanRequest
from shared.edge_sd.runtime import ModelShape, split_model_shapes
from shared.planning.device_speed import slowed, speed_schedule
from shared.specdec.device_session import SessionError
from shared.specdec.draft_stream import ChunkVerdict, DraftChunk
from shared.specdec.session_loop import SessionLoop, drive
from shared.specdec.stream_session import StreamSession

log = logging.getLogger("services.device_agent.edge_server")


@dataclass(frozen=True)
class EdgeConfig:
    """The draft server's knobs (device-agent settings `edge_*`)."""

    window_s: float = 0.05
    max_tasks: int = 32
    memory_budget_bytes: int = 2 << 30
    bandwidth_hz: float = 20e6
    bandwidth: str = "eq27"  # or "uniform"
    batching: str = "dp"  # or "max"
    spec_len: int | None = None  # None: eq. 7 over 1..l_max
    pipeline: bool = True
    downlink: str = "full"
    top_k: int = 10


@dataclass
class EdgeRequest:
    """One user's task: its session, where its tokens go, and how its uplink is."""

    session: StreamSession
    session_id: int
    snr_db: float | None
    tokens: asyncio.Queue = field(default_factory=asyncio.Queue)  # list[int] | BaseException | None (done)
    gone: bool = False  # the client went away
    ended: bool = False  # finished, failed or dropped: no more work

    @property
    def live(self) -> bool:
        return not (self.gone or self.ended or self.session.is_finished)

    def end(self, error: BaseException | None = None) -> None:
        if not self.ended:
            self.ended = True
            self.tokens.put_nowait(error)


class EdgeDraftServer:
    def __init__(
        self,
        cloud,
        draft_shape: ModelShape,
        target_shape: ModelShape,
        config: EdgeConfig,
        offload: Callable[..., Awaitable],
        http: httpx.AsyncClient | None = None,
        planner_url: str = "",
        monitor_url: str = "",
        timeout_s: float = 1.0,
        node: str = "edge-0",
    ):
        self.cloud = cloud
        self.draft_shape, self.target_shape = draft_shape, target_shape
        self.config = config
        self.offload = offload
        self.planning = EdgePlanning(draft_shape, target_shape, http, planner_url, monitor_url, timeout_s, node)
        self.waiting: list[EdgeRequest] = []
        self._arrived = asyncio.Event()
        self.telemetry = self.planning.telemetry  # the samples rounds are planned from without the planner
        self.rounds: list[RoundRecord] = []

    # -- requests -------------------------------------------------------------------------------------
    def generate(self, request: EdgeRequest) -> AsyncGenerator[list[int], None]:
        """The tokens of one request as its rounds make them final (`EdgeLoop`, driven)."""
        return drive(EdgeLoop(self, request))

    def enqueue(self, request: EdgeRequest) -> None:
        self.waiting.append(request)
        self._arrived.set()

    # -- rounds ---------------------------------------------------------------------------------------
    async def run(self) -> None:
        """Serve rounds for as long as the agent runs (owned by its lifespan)."""
        while True:
            await self._arrived.wait()
            await asyncio.sleep(self.config.window_s)
            requests, self.waiting = self.waiting[: self.config.max_tasks], self.waiting[self.config.max_tasks :]
            if not self.waiting:
                self._arrived.clear()
            requests = [r for r in requests if not r.gone]
            if not requests:
                continue
            try:
                await self.serve_round(requests)
            except (CloudError, CloudUnavailable, SessionError) as exc:
                log.warning("edge round of %d tasks failed: %s", len(requests), exc)
                for request in requests:
                    request.end(exc)
            except Exception as exc:  # noqa: BLE001 - a failed round fails its requests, never the server
                log.exception("edge round of %d tasks failed", len(requests))
                for request in requests:
                    request.end(SessionError(f"the edge round failed: {exc}"))
            finally:
                for request in requests:
                    await self._release(request)

    async def serve_round(self, requests: Sequence[EdgeRequest]) -> RoundRecord:
        plan = await self.plan(requests)
        record = RoundRecord(plan, time.perf_counter())
        self.rounds = [*self.rounds[-31:], record]
        # The shared uplink: each prompt arrives after its share's upload time; inference waits for all (eq. 16).
        record.upload_s = max(plan["upload_s"])
        await asyncio.sleep(record.upload_s)
        batches = [[requests[i] for i in batch] for batch in plan["batches"]]
        inference_started = time.perf_counter()
        await self._step(record, 1, batches, self._prefill_drafts, self._prefill_target)
        step = 2
        spec_len = plan["spec_len"]
        while any(r.live for batch in batches for r in batch):
            await self._step(
                record, step, batches, lambda live: draft_batch([r.session for r in live], spec_len), self._verify
            )
            step += 1
        record.inference_s = time.perf_counter() - inference_started
        self.planning.report(record)
        return record

    async def _step(
        self, record: RoundRecord, step: int, batches: list[list[EdgeRequest]], draft: Callable, verify: Callable
    ) -> None:
        """One decoding step over every batch: draft batch m here while batch m-1 is verified."""
        verifying: list[asyncio.Future] = []
        for index, batch in enumerate(batches):
            live = [r for r in batch if r.live]
            if not live:
                continue
            context = sum(len(r.session.prompt_ids) + len(r.session.generated) for r in live) / len(live)
            started = time.perf_counter()
            work = await self.offload(draft, live)
            entry = {
                "step": step,
                "batch": index,
                "size": len(live),
                "context": context,
                "draft_s": time.perf_counter() - started,
                "draft_end_s": time.perf_counter() - record.started,
            }
            record.stages.append(entry)
            job = asyncio.ensure_future(self._timed_verify(record, entry, verify, live, work))
            if self.config.pipeline:
                verifying.append(job)
            else:
                await job
        if verifying:  # the step's barrier (eq. 21): step n+1 starts when all of step n is back
            await asyncio.gather(*verifying)
        # T^v of each batch as eq. 20 means it: the verifier's time on it, not its wait behind the batch before
        # (a batch sent while the one before is still verified queues at the verifier)
        previous_end = -math.inf
        for entry in (e for e in record.stages if e["step"] == step and "verify_end_s" in e):
            entry["verify_s"] = entry["verify_end_s"] - max(entry["verify_start_s"], previous_end)
            previous_end = max(previous_end, entry["verify_end_s"])

    async def _timed_verify(self, record: RoundRecord, entry: dict, verify: Callable, live, work) -> None:
        entry["verify_start_s"] = time.perf_counter() - record.started
        await verify(live, work)
        entry["verify_end_s"] = time.perf_counter() - record.started

    # -- the stages -----------------------------------------------------------------------------------
    def _prefill_drafts(self, live: list[EdgeRequest]) -> None:
        prefill_batch([r.session for r in live])

    async def _prefill_target(self, live: list[EdgeRequest], _work) -> None:
        async def one(request: EdgeRequest) -> int:
            await self.cloud.open_token_session(request.session_id, request.session.params)
            return await self.cloud.token_prefill(request.session_id, request.session.prompt_ids)

        results = await asyncio.gather(*(one(r) for r in live), return_exceptions=True)
        for request, result in zip(live, results):
            if isinstance(result, BaseException):
                request.end(result)
            else:
                self._deliver(request, request.session.start_token_mode(result))

    async def _verify(self, live: list[EdgeRequest], chunks: Sequence[DraftChunk]) -> None:
        answers = []
        for request, chunk in zip(live, chunks):
            answers.append(
                await self.cloud.send_token_chunk(request.session_id, chunk, self.config.downlink, self.config.top_k)
            )
        verdicts = await asyncio.gather(*answers, return_exceptions=True)
        for request, chunk, verdict in zip(live, chunks, verdicts):
            if isinstance(verdict, BaseException):
                request.end(verdict)
                continue
            self._apply(request, chunk, verdict)

    def _apply(self, request: EdgeRequest, chunk: DraftChunk, verdict: ChunkVerdict) -> None:
        self._deliver(request, request.session.apply(chunk, verdict))
        self.telemetry.verdicts.append((chunk.num_drafts, verdict.num_accepted))

    def _deliver(self, request: EdgeRequest, tokens: list[int]) -> None:
        if tokens and not request.gone:
            request.tokens.put_nowait(tokens)
        if request.session.is_finished:
            request.end()

    async def _release(self, request: EdgeRequest) -> None:
        request.end()
        request.session.free()
        await self.cloud.close(request.session_id)  # bounded: the client times out its requests

    # -- planning -------------------------------------------------------------------------------------
    def plan_request(self, requests: Sequence[EdgeRequest]) -> PlanRequest:
        config = self.config
        return PlanRequest(
            tasks=tuple(EdgeTask(len(r.session.prompt_ids), r.session.max_new_tokens, r.snr_db) for r in requests),
            draft_shape=self.draft_shape,
            target_shape=self.target_shape,
            memory_budget_bytes=config.memory_budget_bytes,
            bandwidth_hz=config.bandwidth_hz,
            bits_per_token=embedding_bits_per_token(self.draft_shape.hidden, self.target_shape.hidden),  # λ, §II-D
            bandwidth=config.bandwidth,
            batching=config.batching,
            spec_len=config.spec_len,
        )

    async def plan(self, requests: Sequence[EdgeRequest]) -> dict:
        """The round's plan from the chunk planner; planned here from this server's samples without it."""
        return await self.planning.plan(self.plan_request(requests))

    async def aclose(self) -> None:
        await self.planning.aclose()


def edge_draft_server(settings, checkpoint, cloud, http: httpx.AsyncClient) -> EdgeDraftServer:
    """The draft server a device agent runs with `edge_draft_server` (its settings' edge_* knobs)."""
    draft_shape, target_shape = split_model_shapes(
        checkpoint.num_layers, checkpoint.hidden_size, checkpoint.config.intermediate_size, settings.split_layers
    )
    edge = EdgeConfig(
        window_s=settings.edge_window_s,
        max_tasks=settings.edge_max_tasks,
        memory_budget_bytes=settings.edge_memory_budget_bytes,
        bandwidth_hz=settings.edge_bandwidth_mhz * 1e6,
        bandwidth=settings.edge_bandwidth,
        batching=settings.edge_batching,
        spec_len=settings.edge_spec_len or None,
        pipeline=settings.edge_pipeline,
        downlink=settings.downlink,
        top_k=settings.top_k,
    )
    # The SBS's own speed (the paper's SBS GPU is far slower per FLOP than the MBS's, Table II's c1): its
    # draft passes take `speed`'s slowdown x their compute here (shared/planning/device_speed.py).
    offload = partial(slowed, slowdown=speed_schedule(settings.speed).slowdown_for(0))
    return EdgeDraftServer(
        cloud,
        draft_shape,
        target_shape,
        edge,
        offload,
        http,
        settings.chunk_planner_url,
        settings.state_monitor_url,
        settings.planner_timeout_s,
        settings.device_id,
    )


class EdgeLoop(SessionLoop):
    """edge-sd's rounds for one request: the edge server batches it with others' (`run`); each step takes what
    one of its rounds made final."""

    def __init__(self, server: EdgeDraftServer, request: EdgeRequest):
        self.server, self.request = server, request
        self.done = False

    @property
    def finished(self) -> bool:
        return self.done

    async def open(self) -> None:
        self.server.enqueue(self.request)

    async def step(self) -> list[int] | None:
        item = await self.request.tokens.get()  # the server's rounds are bounded; it ends every request it drops
        if isinstance(item, BaseException):
            raise item
        self.done = item is None
        return item

    async def close(self) -> None:
        self.request.gone = not self.request.ended
