"""The chunk planner's two equations for one caller: the chunk size of a prompt (HAT §3.3, eq. 3) and the steps
to pre-draft during a verification (§3.5, eq. 6), each from the telemetry fetched for it or, when there is none
usable, the configured default with `source` saying why (app.py's docstring lists the reasons)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from services.chunk_planner.monitor_client import NO_MONITOR, Telemetry
from services.chunk_planner.settings import Settings
from shared.planning.monitor_plans import PlannerInputs, plan_draft_steps_from_state, plan_from_state
from shared.planning.planners import hidden_bytes_per_token

log = logging.getLogger(__name__)


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
