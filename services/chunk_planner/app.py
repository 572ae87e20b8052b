"""Chunk planner: prefill chunk sizes (HAT §3.3, eq. 3), parallel-draft steps (§3.5, eq. 6) and the draft
budget per round (`POST /draft-budget`, shared/planning/draft_budget.py).

A (hidden-state bytes per token) is the caller's: a device passes `bytes_per_token`
(its hidden size x its wire dtype's bytes); P is the caller's `stages`, else what the verifier
reports with its steps (`last.pipeline_stages` of the monitor's /state/cloud), else this
service's `pipeline_stages` (the launcher sets it to the verifier's). Every answer echoes the A and P
it used. Without A from the caller or `hidden_size` in the settings, the answer is the default
with `source: default:no-bytes-per-token`: the planner never solves eq. 3 for a guessed model.

Each request fetches (monitor_client.py) the state monitor's `GET /state/cloud` (μ and the g(μ)
bucket table) and `GET /state/device/{id}` (β_up, β_down, γ, age) over HTTP,
every fetch bounded by `monitor_timeout_s`, and hands the JSON to the pure
planners in `shared.planning.planners`. When the equations cannot be applied the
answer is the configured default and `source` says why:

    eq3 / eq6                     the equation, from live telemetry
    default:no-monitor            no `state_monitor_url` configured
    default:monitor-unreachable   connection refused, DNS, or the fetch timed out
    default:monitor-error         the monitor answered, but with an error status or not JSON
    default:no-telemetry          unknown device (404) or no g(μ) data yet
    default:stale                 the device's telemetry is older than `stale_after_s`
    default:missing-beta / default:missing-gamma / default:bad-telemetry /
    default:no-bytes-per-token    (see shared.planning.planners)

Edge SD (paper 001): `POST /edge-sd/plan` takes a `shared.edge_sd.plan.PlanRequest` body, fetches the
monitor's `GET /state/edge-sd` (measured passes and verdicts, same bound and failure reasons as above, plus
default:bad-telemetry), runs `plan_round` and keeps the answer as the latest, which `GET /edge-sd/plan`
serves. A bad request or one whose task alone exceeds the memory budget is a 422.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated, Any

import httpx
from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from services.chunk_planner.monitor_client import NO_MONITOR, MonitorClient, Telemetry, reported_stages
from services.chunk_planner.settings import Settings, load_settings
from shared.auth import client as auth_client
from shared.auth import verify as auth
from shared.auth.tls import client_context
from shared.edge_sd.plan import (
    InfeasibleBatchingError,
    PlanRequest,
    PlanRequestError,
    plan_round,
)
from shared.planning.draft_budget import BudgetError, BudgetRequest, budget_from_state
from shared.planning.planners import (
    PlannerInputs,
    hidden_bytes_per_token,
    plan_draft_steps_from_state,
    plan_draft_steps_table_from_state,
    plan_from_state,
)
from shared.telemetry.metrics import PlannerMetrics, metrics_response

log = logging.getLogger(__name__)

DeviceId = Annotated[str, Query(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.\-]+$")]
BytesPerToken = Annotated[int | None, Query(ge=1, le=1 << 24)]  # A: hidden size x wire dtype bytes
Stages = Annotated[int | None, Query(ge=1, le=1024)]  # P


@dataclass(frozen=True)
class ChunkPlan:
    chunk_size: int
    source: str  # "eq3" or "default:<reason>" (module docstring)


@dataclass(frozen=True)
class DraftPlan:
    steps: int
    source: str  # "eq6" or "default:<reason>"


def planner_inputs(settings: Settings, bytes_per_token: int | None = None, stages: int | None = None) -> PlannerInputs:
    """The static half of eq. 3 / eq. 6 (A, P, bounds, defaults): A and P from the caller when given (P also
    from the verifier's telemetry, `reported_stages`), else from settings (A only where `hidden_size` is
    configured; None = unknown)."""
    if bytes_per_token is None and settings.hidden_size > 0:
        bytes_per_token = hidden_bytes_per_token(settings.hidden_size, settings.wire_dtype_bytes)
    return PlannerInputs(
        bytes_per_token=bytes_per_token,
        stages=stages or settings.pipeline_stages,
        min_chunk_size=settings.min_chunk_size,
        max_chunk_size=settings.max_chunk_size,
        default_chunk_size=settings.default_chunk_size,
        stale_after_s=settings.stale_after_s,
        default_draft_steps=settings.default_parallel_draft_steps,
        max_draft_steps=settings.max_parallel_draft_steps,
    )


def plan_chunk_size(
    settings: Settings,
    device_id: str,
    prompt_tokens: int,
    telemetry: Telemetry = NO_MONITOR,
    inputs: PlannerInputs | None = None,
) -> ChunkPlan:
    """Chunk size for one prompt: eq. 3 from `telemetry`, else the default clamped to [min, max] and the prompt."""
    inputs = inputs or planner_inputs(settings)
    if telemetry.failure is not None:
        plan = ChunkPlan(inputs.default_chunk(prompt_tokens), f"default:{telemetry.failure}")
    else:
        plan = ChunkPlan(*plan_from_state(telemetry.cloud, telemetry.device, inputs, prompt_tokens))
    log.debug("chunk plan for %s (%d prompt tokens): %s", device_id, prompt_tokens, plan)
    return plan


def plan_parallel_draft_steps(
    settings: Settings,
    device_id: str,
    draft_len: int,
    telemetry: Telemetry = NO_MONITOR,
    inputs: PlannerInputs | None = None,
) -> DraftPlan:
    """Steps to pre-draft during one verification of `draft_len` rows (k + 1): eq. 6, else the default."""
    inputs = inputs or planner_inputs(settings)
    if telemetry.failure is not None:
        plan = DraftPlan(inputs.default_steps(), f"default:{telemetry.failure}")
    else:
        plan = DraftPlan(*plan_draft_steps_from_state(telemetry.cloud, telemetry.device, inputs, draft_len))
    log.debug("parallel-draft plan for %s (draft_len %d): %s", device_id, draft_len, plan)
    return plan


def _plan_error(code: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "code": code}}, status_code=422)


def create_app(settings: Settings | None = None, monitor_transport: httpx.AsyncBaseTransport | None = None) -> FastAPI:
    """Build the app; `monitor_transport` (tests) replaces the network under the monitor client."""
    settings = settings or load_settings()
    monitor: MonitorClient | None = None
    metrics = PlannerMetrics()
    edge_sd_defaults = settings.edge_sd_defaults()
    latest_edge_sd_plan: dict[str, Any] | None = None
    # Callers are checked with the issuer's public keys, re-read by `trust_refresher` (None, None: open).
    trust, trust_refresher = auth_client.trust_for(settings, client_context(settings.tls_ca))

    async def telemetry(device_id: str) -> Telemetry:
        return NO_MONITOR if monitor is None else await monitor.fetch(device_id)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        nonlocal monitor
        if settings.state_monitor_url:
            monitor = MonitorClient(
                settings.state_monitor_url,
                settings.monitor_timeout_s,
                monitor_transport,
                verify=client_context(settings.tls_ca),
            )
        else:
            log.warning("no state_monitor_url: chunk sizes and draft steps are fixed defaults")
        refreshing = None
        if trust_refresher is not None:
            await trust_refresher.refresh()  # ready with the issuer's keys when it is up (bounded by its timeout)
            refreshing = asyncio.create_task(trust_refresher.run(), name="auth-trust")
        app.state.ready = True
        try:
            yield
        finally:
            app.state.ready = False
            if refreshing is not None:
                refreshing.cancel()
                await asyncio.gather(refreshing, return_exceptions=True)
            if monitor is not None:
                await monitor.aclose()
                monitor = None

    app = FastAPI(title="tophat chunk planner", lifespan=lifespan)
    # Every answer needs a credential (shared/auth/verify.py); a device's only for its own device id. Probes stay open.
    auth.warn_if_open(
        "the chunk planner", settings.authenticated, settings.host, "TOPHAT_CHUNK_PLANNER_AUTH_ISSUER_URL"
    )
    auth.install(app, trust, auth.PLANNER, {"device", "service"})

    def for_caller(request: Request, device_id: str) -> None:
        if not auth.may_act_for(auth.claims_of(request.scope), device_id):
            raise HTTPException(403, "a device credential may ask only for its own device id")

    app.state.ready = False

    @app.exception_handler(RequestValidationError)
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

    @app.get("/chunk-size")
    async def chunk_size(
        device_id: DeviceId,
        prompt_tokens: Annotated[int, Query(ge=1, le=10_000_000)],
        request: Request,
        bytes_per_token: BytesPerToken = None,
        stages: Stages = None,
    ) -> dict[str, Any]:
        for_caller(request, device_id)
        state = await telemetry(device_id)
        inputs = planner_inputs(settings, bytes_per_token, stages or reported_stages(state))
        plan = plan_chunk_size(settings, device_id, prompt_tokens, state, inputs)
        metrics.decision("chunk_size", plan.source)
        return {
            "chunk_size": plan.chunk_size,
            "source": plan.source,
            "bytes_per_token": inputs.bytes_per_token,
            "stages": inputs.stages,
        }

    @app.get("/parallel-draft-steps")
    async def parallel_draft_steps(
        request: Request,
        device_id: DeviceId,
        draft_len: Annotated[int, Query(ge=0, le=4096)],
        bytes_per_token: BytesPerToken = None,
        stages: Stages = None,
        all_lengths: bool = False,
    ) -> dict[str, Any]:
        """λ for `draft_len` rows; with `all_lengths`, also λ for 0..draft_len rows from the same telemetry
        (`steps_by_draft_len`), so a device can plan each round from one answer."""
        for_caller(request, device_id)
        state = await telemetry(device_id)
        inputs = planner_inputs(settings, bytes_per_token, stages or reported_stages(state))
        plan = plan_parallel_draft_steps(settings, device_id, draft_len, state, inputs)
        metrics.decision("parallel_draft_steps", plan.source)
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

    @app.post("/draft-budget")
    async def draft_budget(request: Request) -> JSONResponse:
        """The draft shape for this device's next requests (shared/planning/draft_budget.py): the posted options
        (what each shape did on the device) against its link and the verifier's load."""
        try:
            ask = BudgetRequest.from_json(await request.json())
        except (ValueError, BudgetError) as exc:  # not JSON (json.JSONDecodeError is a ValueError) or invalid
            return _plan_error("invalid_budget_request", str(exc))
        for_caller(request, ask.device_id)
        state = await telemetry(ask.device_id)
        inputs = planner_inputs(settings, ask.bytes_per_token, reported_stages(state))
        detail: dict[str, Any] = {}
        if state.failure is not None:
            shape, source = ask.default, f"default:{state.failure}"
        else:
            shape, source, detail = budget_from_state(
                state.cloud, state.device, inputs, ask.options, ask.default, ask.current
            )
        metrics.decision("draft_budget", source)
        return JSONResponse({"shape": shape, "source": source, **detail})

    @app.post("/edge-sd/plan")
    async def edge_sd_plan(request: Request) -> JSONResponse:
        """Batches, l and shares for the posted tasks from the monitor's Edge SD telemetry; kept as the latest."""
        nonlocal latest_edge_sd_plan
        try:
            plan_request = PlanRequest.from_dict(await request.json())
        except (ValueError, PlanRequestError) as exc:  # not JSON (json.JSONDecodeError is a ValueError) or invalid
            return _plan_error("invalid_plan_request", str(exc))
        measured, failure = (None, "no-monitor") if monitor is None else await monitor.fetch_edge_sd()
        try:
            # CPU-bound (Algorithm 1 for each l): off the event loop, so probes and other plans are answered.
            plan = await asyncio.to_thread(plan_round, plan_request, measured, edge_sd_defaults, failure)
        except InfeasibleBatchingError as exc:
            return _plan_error("infeasible_batching", str(exc))
        answer = plan.as_dict()
        latest_edge_sd_plan = answer
        metrics.decision("edge_sd_plan", answer["sources"]["alpha"])
        log.info(
            "edge-sd plan: %d tasks in %d batches, l=%d, sources %s",
            len(plan_request.tasks),
            len(answer["batches"]),
            answer["spec_len"],
            answer["sources"],
        )
        return JSONResponse(answer)

    @app.get("/edge-sd/plan")
    async def latest_edge_sd() -> dict[str, Any]:
        if latest_edge_sd_plan is None:
            raise HTTPException(404, "no edge-sd plan yet: POST /edge-sd/plan first")
        return latest_edge_sd_plan

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return metrics_response(metrics.registry)

    @app.get("/readyz")
    async def readyz(request: Request) -> JSONResponse:
        ready = bool(request.app.state.ready)
        return JSONResponse({"ready": ready}, status_code=200 if ready else 503)

    return app
