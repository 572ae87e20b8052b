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
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TypeGuard

import httpx

from services.device_agent.cloud_errors import CloudError, CloudUnavailable
from shared.device_speed import slowed, speed_schedule
from shared.edge_sd.bandwidth import embedding_bits_per_token
from shared.edge_sd.batching import InfeasibleBatchingError
from shared.edge_sd.draft_batch import draft_batch, prefill_batch
from shared.edge_sd.plan import EdgeTask, EdgeTelemetry, PlanDefaults, PlanRequest, plan_round
from shared.edge_sd.runtime import ModelShape, split_model_shapes
from shared.specdec.device_session import SessionError
from shared.specdec.draft_stream import ChunkVerdict, DraftChunk
from shared.specdec.stream_session import StreamSession

log = logging.getLogger("services.device_agent.edge_server")

SAMPLES_KEPT = 512  # runtime and verdict samples kept for planning without the planner
PLAN_TIMEOUT_S = 10.0  # a plan is a DP per speculation length: seconds for a large round, not a lookup


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


@dataclass
class RoundRecord:
    """What one round planned and how its stages ran, for /edge-sd/plan and the bench."""

    plan: dict
    started: float
    upload_s: float = 0.0
    # per (step, batch): draft and verify seconds as measured, and when each ended (since the round's start)
    stages: list[dict] = field(default_factory=list)
    inference_s: float = 0.0


class EdgeDraftServer:
    def __init__(self, cloud, draft_shape: ModelShape, target_shape: ModelShape, config: EdgeConfig,
                 offload: Callable[..., Awaitable], http: httpx.AsyncClient | None = None,
                 planner_url: str = "", monitor_url: str = "", timeout_s: float = 1.0, node: str = "edge-0"):
        self.cloud = cloud
        self.draft_shape, self.target_shape = draft_shape, target_shape
        self.config = config
        self.offload = offload
        self.http, self.planner_url, self.monitor_url = http, planner_url.rstrip("/"), monitor_url.rstrip("/")
        self.timeout_s, self.node = timeout_s, node
        self.waiting: list[EdgeRequest] = []
        self._arrived = asyncio.Event()
        self.telemetry = EdgeTelemetry(draft=[], verify=[], verdicts=[])  # kept for planning alone
        self.rounds: list[RoundRecord] = []
        self._posts: set[asyncio.Task] = set()

    # -- requests -------------------------------------------------------------------------------------
    async def generate(self, request: EdgeRequest) -> AsyncIterator[list[int]]:
        """The tokens of one request as its rounds make them final."""
        self.waiting.append(request)
        self._arrived.set()
        try:
            while True:
                item = await request.tokens.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            request.gone = not request.ended

    # -- rounds ---------------------------------------------------------------------------------------
    async def run(self) -> None:
        """Serve rounds for as long as the agent runs (owned by its lifespan)."""
        while True:
            await self._arrived.wait()
            await asyncio.sleep(self.config.window_s)
            requests, self.waiting = self.waiting[: self.config.max_tasks], self.waiting[self.config.max_tasks:]
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
            await self._step(record, step, batches, lambda live: draft_batch([r.session for r in live], spec_len),
                             self._verify)
            step += 1
        record.inference_s = time.perf_counter() - inference_started
        self._report(requests)
        return record

    async def _step(self, record: RoundRecord, step: int, batches: list[list[EdgeRequest]],
                    draft: Callable, verify: Callable) -> None:
        """One decoding step over every batch: draft batch m here while batch m-1 is verified."""
        verifying: list[asyncio.Future] = []
        for index, batch in enumerate(batches):
            live = [r for r in batch if r.live]
            if not live:
                continue
            context = sum(len(r.session.prompt_ids) + len(r.session.generated) for r in live) / len(live)
            started = time.perf_counter()
            work = await self.offload(draft, live)
            entry = {"step": step, "batch": index, "size": len(live), "context": context,
                     "draft_s": time.perf_counter() - started, "draft_end_s": time.perf_counter() - record.started}
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
            answers.append(await self.cloud.send_token_chunk(request.session_id, chunk, self.config.downlink,
                                                             self.config.top_k))
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
            draft_shape=self.draft_shape, target_shape=self.target_shape,
            memory_budget_bytes=config.memory_budget_bytes, bandwidth_hz=config.bandwidth_hz,
            bits_per_token=embedding_bits_per_token(self.draft_shape.hidden, self.target_shape.hidden),  # λ, §II-D
            bandwidth=config.bandwidth, batching=config.batching, spec_len=config.spec_len)

    async def plan(self, requests: Sequence[EdgeRequest]) -> dict:
        """The round's plan from the chunk planner; planned here from this server's samples without it."""
        request = self.plan_request(requests)
        failure = "default:no-planner"
        if self.planner_url and self.http is not None:
            try:
                response = await self.http.post(f"{self.planner_url}/edge-sd/plan", json=request.as_dict(),
                                                timeout=max(self.timeout_s, PLAN_TIMEOUT_S))
                if response.status_code != 200:
                    failure = f"default:planner-error-{response.status_code}"
                elif plan_fits(answer := _json_or_none(response), len(requests)):
                    return answer
                else:
                    log.warning("the chunk planner's edge-sd plan does not fit the round's %d tasks; planning here",
                                len(requests))
                    failure = "default:planner-bad-answer"
            except httpx.HTTPError as exc:
                log.info("edge-sd plan from the chunk planner failed (%s); planning here", exc)
                failure = "default:planner-unreachable"
        try:
            plan = plan_round(request, self.telemetry, PlanDefaults()).as_dict()
        except InfeasibleBatchingError as exc:
            raise SessionError(f"the round cannot be planned: {exc}") from None
        plan["sources"]["planner"] = failure
        return plan

    def _report(self, requests: Sequence[EdgeRequest]) -> None:
        """The round's measured passes and verdicts: kept here, and sent to the state monitor."""
        record = self.rounds[-1]
        draft, verify = self.telemetry.draft, self.telemetry.verify
        for entry in record.stages:
            if "verify_s" not in entry:
                continue
            b = entry["size"]
            # per pass: the step's draft seconds over its passes (eq. 17 is linear, so the mean pass fits)
            passes = self._passes(record, entry["step"])
            draft.append((b, self._draft_pass_flops(record, entry), entry["draft_s"] / passes))
            verify.append((b, self._verify_flops(record, entry), entry["verify_s"]))
        for table in (draft, verify, self.telemetry.verdicts):
            del table[:-SAMPLES_KEPT]
        if self.monitor_url and self.http is not None:
            sample = {"node": self.node, "draft": [list(s) for s in draft[-64:]],
                      "verify": [list(s) for s in verify[-64:]],
                      "verdicts": [list(v) for v in self.telemetry.verdicts[-256:]]}
            task = asyncio.ensure_future(self._post_telemetry(self.http, sample))
            self._posts.add(task)
            task.add_done_callback(self._posts.discard)

    def _passes(self, record: RoundRecord, step: int) -> int:
        return 1 if step == 1 else record.plan["spec_len"]

    def _draft_pass_flops(self, record: RoundRecord, entry: dict) -> float:
        """Per task, the mean pass of the step (eq. 13): the prompt's prefill, or one token on the context."""
        if entry["step"] == 1:
            return self.draft_shape.prefill_flops(max(1, round(entry["context"])))
        return self.draft_shape.decode_flops(entry["context"] + (record.plan["spec_len"] - 1) / 2)

    def _verify_flops(self, record: RoundRecord, entry: dict) -> float:
        """Per task (eq. 14): the prompt's prefill, or the pending token + l drafts on the context."""
        if entry["step"] == 1:
            return self.target_shape.prefill_flops(max(1, round(entry["context"])))
        return self.target_shape.forward_flops(1 + record.plan["spec_len"], entry["context"])

    async def _post_telemetry(self, http: httpx.AsyncClient, sample: dict) -> None:
        try:
            response = await http.post(f"{self.monitor_url}/edge-sd/telemetry", json=sample,
                                            timeout=self.timeout_s)
            response.raise_for_status()
        except httpx.HTTPError as exc:
            log.info("edge-sd telemetry not sent: %s", exc)

    async def aclose(self) -> None:
        for task in self._posts:
            task.cancel()
        await asyncio.gather(*self._posts, return_exceptions=True)


def edge_draft_server(settings, checkpoint, cloud, http: httpx.AsyncClient) -> EdgeDraftServer:
    """The draft server a device agent runs with `edge_draft_server` (its settings' edge_* knobs)."""
    draft_shape, target_shape = split_model_shapes(checkpoint.num_layers, checkpoint.hidden_size,
                                                   checkpoint.config.intermediate_size, settings.split_layers)
    edge = EdgeConfig(window_s=settings.edge_window_s, max_tasks=settings.edge_max_tasks,
                      memory_budget_bytes=settings.edge_memory_budget_bytes,
                      bandwidth_hz=settings.edge_bandwidth_mhz * 1e6, bandwidth=settings.edge_bandwidth,
                      batching=settings.edge_batching,
                      spec_len=settings.edge_spec_len or None, pipeline=settings.edge_pipeline,
                      downlink=settings.downlink, top_k=settings.top_k)
    # The SBS's own speed (the paper's SBS GPU is far slower per FLOP than the MBS's, Table II's c1): its
    # draft passes take `speed`'s slowdown x their compute here (shared/device_speed.py).
    offload = partial(slowed, slowdown=speed_schedule(settings.speed).slowdown_for(0))
    return EdgeDraftServer(cloud, draft_shape, target_shape, edge, offload, http,
                           settings.chunk_planner_url, settings.state_monitor_url, settings.planner_timeout_s,
                           settings.device_id)


def _json_or_none(response: httpx.Response) -> object:
    try:
        return response.json()
    except ValueError:  # not JSON (or NaN / Infinity, which JSON does not have)
        return None


def plan_fits(plan: object, tasks: int) -> TypeGuard[dict]:
    """A plan this server can run: every task in exactly one batch, l >= 1, an upload time per task."""
    if not isinstance(plan, dict):
        return False
    batches, spec_len, uploads = plan.get("batches"), plan.get("spec_len"), plan.get("upload_s")
    if not (isinstance(batches, list) and all(isinstance(b, list) and b for b in batches)):
        return False
    members = [i for b in batches for i in b]
    return (all(isinstance(i, int) and not isinstance(i, bool) for i in members)
            and sorted(members) == list(range(tasks))
            and isinstance(spec_len, int) and not isinstance(spec_len, bool) and 1 <= spec_len <= 64
            and isinstance(uploads, list) and len(uploads) == tasks
            and all(isinstance(u, (int, float)) and 0 <= u < 3600 for u in uploads)
            and isinstance(plan.get("sources"), dict))
