"""The chunk planner's routes: the plans a caller asks for (`plans`: /chunk-size, /parallel-draft-steps,
/draft-budget, /edge-sd/plan) and the probes (`probes`: /healthz, /readyz, /metrics). Each handler takes the
planner's state (state.py) from its app; a device's credential may ask only for its own device id."""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from services.chunk_planner.monitor_client import reported_stages
from services.chunk_planner.plans import plan_chunk_size, plan_parallel_draft_steps, planner_inputs
from services.chunk_planner.state import PlannerState, planner_of
from shared.auth import verify as auth
from shared.edge_sd.plan import InfeasibleBatchingError, plan_round
from shared.edge_sd.plan_inputs import PlanRequest, PlanRequestError
from shared.planning.draft_budget import BudgetError, BudgetRequest, budget_from_state
from shared.planning.monitor_plans import plan_draft_steps_table_from_state
from shared.telemetry.metrics import metrics_response

log = logging.getLogger(__name__)

DeviceId = Annotated[str, Query(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.\-]+$")]
BytesPerToken = Annotated[int | None, Query(ge=1, le=1 << 24)]  # A: hidden size x wire dtype bytes
Stages = Annotated[int | None, Query(ge=1, le=1024)]  # P
Planner = Annotated[PlannerState, Depends(planner_of)]

plans = APIRouter()
probes = APIRouter()


async def on_invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
    detail = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in exc.errors()[:3])
    return JSONResponse(
        {
            "error": {
                "message": detail or "invalid request",
                "type": "invalid_request_error",
                "code": "invalid_request",
            }
        },
        status_code=400,
    )


def plan_error(code: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "code": code}}, status_code=422)


def for_caller(request: Request, device_id: str) -> None:
    if not auth.may_act_for(auth.claims_of(request.scope), device_id):
        raise HTTPException(403, "a device credential may ask only for its own device id")


@plans.get("/chunk-size")
async def chunk_size(
    device_id: DeviceId,
    prompt_tokens: Annotated[int, Query(ge=1, le=10_000_000)],
    request: Request,
    planner: Planner,
    bytes_per_token: BytesPerToken = None,
    stages: Stages = None,
) -> dict[str, Any]:
    for_caller(request, device_id)
    state = await planner.telemetry(device_id)
    inputs = planner_inputs(planner.settings, bytes_per_token, stages or reported_stages(state))
    plan = plan_chunk_size(planner.settings, device_id, prompt_tokens, state, inputs)
    planner.metrics.decision("chunk_size", plan.source)
    return {
        "chunk_size": plan.chunk_size,
        "source": plan.source,
        "bytes_per_token": inputs.bytes_per_token,
        "stages": inputs.stages,
    }


@plans.get("/parallel-draft-steps")
async def parallel_draft_steps(
    request: Request,
    device_id: DeviceId,
    draft_len: Annotated[int, Query(ge=0, le=4096)],
    planner: Planner,
    bytes_per_token: BytesPerToken = None,
    stages: Stages = None,
    all_lengths: bool = False,
) -> dict[str, Any]:
    """λ for `draft_len` rows; with `all_lengths`, also λ for 0..draft_len rows from the same telemetry
    (`steps_by_draft_len`), so a device can plan each round from one answer."""
    for_caller(request, device_id)
    state = await planner.telemetry(device_id)
    inputs = planner_inputs(planner.settings, bytes_per_token, stages or reported_stages(state))
    plan = plan_parallel_draft_steps(planner.settings, device_id, draft_len, state, inputs)
    planner.metrics.decision("parallel_draft_steps", plan.source)
    answer: dict[str, Any] = {
        "steps": plan.steps,
        "source": plan.source,
        "bytes_per_token": inputs.bytes_per_token,
        "stages": inputs.stages,
    }
    if all_lengths:
        answer["steps_by_draft_len"] = (
            [plan.steps] * (draft_len + 1)
            if state.failure is not None
            else plan_draft_steps_table_from_state(state.cloud, state.device, inputs, draft_len)[0]
        )
    return answer


@plans.post("/draft-budget")
async def draft_budget(request: Request, planner: Planner) -> JSONResponse:
    """The draft shape for this device's next requests (shared/planning/draft_budget.py): the posted options
    (what each shape did on the device) against its link and the verifier's load."""
    try:
        ask = BudgetRequest.from_json(await request.json())
    except (ValueError, BudgetError) as exc:  # not JSON (json.JSONDecodeError is a ValueError) or invalid
        return plan_error("invalid_budget_request", str(exc))
    for_caller(request, ask.device_id)
    state = await planner.telemetry(ask.device_id)
    inputs = planner_inputs(planner.settings, ask.bytes_per_token, reported_stages(state))
    detail: dict[str, Any] = {}
    if state.failure is not None:
        shape, source = ask.default, f"default:{state.failure}"
    else:
        shape, source, detail = budget_from_state(
            state.cloud, state.device, inputs, ask.options, ask.default, ask.current
        )
    planner.metrics.decision("draft_budget", source)
    return JSONResponse({"shape": shape, "source": source, **detail})


@plans.post("/edge-sd/plan")
async def edge_sd_plan(request: Request, planner: Planner) -> JSONResponse:
    """Batches, l and shares for the posted tasks from the monitor's Edge SD telemetry; kept as the latest."""
    try:
        plan_request = PlanRequest.from_dict(await request.json())
    except (ValueError, PlanRequestError) as exc:  # not JSON (json.JSONDecodeError is a ValueError) or invalid
        return plan_error("invalid_plan_request", str(exc))
    monitor = planner.monitor
    measured, failure = (None, "no-monitor") if monitor is None else await monitor.fetch_edge_sd()
    try:
        # CPU-bound (Algorithm 1 for each l): off the event loop, so probes and other plans are answered.
        plan = await asyncio.to_thread(plan_round, plan_request, measured, planner.edge_sd_defaults, failure)
    except InfeasibleBatchingError as exc:
        return plan_error("infeasible_batching", str(exc))
    answer = plan.as_dict()
    planner.latest_edge_sd_plan = answer
    planner.metrics.decision("edge_sd_plan", answer["sources"]["alpha"])
    log.info(
        "edge-sd plan: %d tasks in %d batches, l=%d, sources %s",
        len(plan_request.tasks),
        len(answer["batches"]),
        answer["spec_len"],
        answer["sources"],
    )
    return JSONResponse(answer)


@plans.get("/edge-sd/plan")
async def latest_edge_sd(planner: Planner) -> dict[str, Any]:
    if planner.latest_edge_sd_plan is None:
        raise HTTPException(404, "no edge-sd plan yet: POST /edge-sd/plan first")
    return planner.latest_edge_sd_plan


@probes.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@probes.get("/metrics")
async def metrics_endpoint(planner: Planner) -> Response:
    return metrics_response(planner.metrics.registry)


@probes.get("/readyz")
async def readyz(planner: Planner) -> JSONResponse:
    ready = planner.ready
    return JSONResponse({"ready": ready}, status_code=200 if ready else 503)
